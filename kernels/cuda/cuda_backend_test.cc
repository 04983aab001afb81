// The CUDA backend against the CPU backend, op by op and for whole training steps of a small MLP
// and CNN composed from the ops. Every test that needs a device GTEST_SKIP()s without one; the
// error-mapping tests run everywhere.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/device.h"
#include "kernels/optimizer.h"
#include "spec/optimizer_spec.h"

namespace tessera::kernels {
namespace {

using ::testing::HasSubstr;

// --- Error mapping (no device needed) ------------------------------------------------------------

TEST(CudaStatusTest, MapsCudaErrorsWithTheCallAndTheLibraryMessage) {
  EXPECT_TRUE(cuda::CudaStatus(cudaSuccess, "cudaMalloc(p)").ok());
  const absl::Status oom = cuda::CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc(p)");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(oom.message()), HasSubstr("cudaMalloc(p)"));
  EXPECT_THAT(std::string(oom.message()), HasSubstr("cudaErrorMemoryAllocation"));
  const absl::Status bad = cuda::CudaStatus(cudaErrorInvalidValue, "cudaMemcpyAsync(a, b)");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cudaMemcpyAsync(a, b)"));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cudaErrorInvalidValue"));
}

TEST(CudaStatusTest, MapsCublasAndCudnnErrors) {
  EXPECT_TRUE(cuda::CublasStatus(CUBLAS_STATUS_SUCCESS, "cublasSgemm").ok());
  const absl::Status blas = cuda::CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "cublasCreate(&h)");
  EXPECT_EQ(blas.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(blas.message()), HasSubstr("cublasCreate(&h)"));
  EXPECT_THAT(std::string(blas.message()), HasSubstr("CUBLAS_STATUS_ALLOC_FAILED"));

  EXPECT_TRUE(cuda::CudnnStatus(CUDNN_STATUS_SUCCESS, "cudnnCreate").ok());
  const absl::Status dnn = cuda::CudnnStatus(CUDNN_STATUS_BAD_PARAM, "cudnnPoolingForward(...)");
  EXPECT_EQ(dnn.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(dnn.message()), HasSubstr("cudnnPoolingForward(...)"));
  EXPECT_THAT(std::string(dnn.message()), HasSubstr("BAD_PARAM"));
}

TEST(CreateCudaBackendTest, RefusesWithoutADeviceAndChecksTheIndex) {
  BackendOptions options;
  options.device = DeviceChoice::kCuda;
  if (CudaDeviceCount() == 0) {
    const auto backend = CreateCudaBackend(options);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(backend.status().message()), HasSubstr("no usable CUDA device"));
    return;
  }
  const auto backend = CreateCudaBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Name(), "cuda:0");
  EXPECT_TRUE((*backend)->IsCuda());
  options.cuda_device = CudaDeviceCount();
  const auto bad = CreateCudaBackend(options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("cuda_device"));
}

// --- CUDA against CPU ----------------------------------------------------------------------------

// The same values on both backends.
struct Pair {
  Tensor cpu;
  Tensor gpu;
};

class CudaVsCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << CudaUnavailableReason();
    BackendOptions options;
    options.device = DeviceChoice::kCpu;
    auto cpu = CreateCpuBackend(options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    options.device = DeviceChoice::kCuda;
    auto gpu = CreateCudaBackend(options);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
  }

  std::vector<float> Normal(int64_t n, float stddev = 1.0f) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }

  // Both tensors hold `values` (float, int32 or int64 by the element type).
  template <typename T>
  Pair Upload(const Shape& shape, const std::vector<T>& values, DType dtype) {
    EXPECT_EQ(static_cast<int64_t>(values.size()), NumElements(shape));
    Pair p;
    auto c = cpu_->Allocate(shape, dtype);
    auto g = gpu_->Allocate(shape, dtype);
    EXPECT_TRUE(c.ok() && g.ok());
    p.cpu = *c;
    p.gpu = *g;
    EXPECT_TRUE(cpu_->CopyToDevice(values.data(), p.cpu).ok());
    EXPECT_TRUE(gpu_->CopyToDevice(values.data(), p.gpu).ok());
    return p;
  }
  Pair UploadF(const Shape& shape, const std::vector<float>& values) {
    return Upload(shape, values, DType::kFloat32);
  }
  Pair RandomF(const Shape& shape, float stddev = 1.0f) {
    return UploadF(shape, Normal(NumElements(shape), stddev));
  }
  // An output on both backends, pre-filled with different values so that an element neither
  // backend writes shows up as a mismatch.
  Pair Output(const Shape& shape) {
    Pair p;
    auto c = cpu_->Allocate(shape, DType::kFloat32);
    auto g = gpu_->Allocate(shape, DType::kFloat32);
    EXPECT_TRUE(c.ok() && g.ok());
    p.cpu = *c;
    p.gpu = *g;
    EXPECT_TRUE(cpu_->Fill(p.cpu, -7.0f).ok());
    EXPECT_TRUE(gpu_->Fill(p.gpu, 7.0f).ok());
    return p;
  }

  static std::vector<float> Host(Backend& b, const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.num_elements()));
    const absl::Status s = b.CopyToHost(t, v.data());
    EXPECT_TRUE(s.ok()) << s;
    return v;
  }

  // |cpu - gpu| <= atol + rtol * |cpu| for every element.
  void ExpectClose(const Pair& p, double atol, double rtol, const std::string& what) {
    const std::vector<float> c = Host(*cpu_, p.cpu);
    const std::vector<float> g = Host(*gpu_, p.gpu);
    ASSERT_EQ(c.size(), g.size()) << what;
    int bad = 0;
    double worst = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      const double err = std::fabs(static_cast<double>(c[i]) - g[i]);
      worst = std::max(worst, err);
      if (!(err <= atol + rtol * std::fabs(c[i]))) {
        if (++bad <= 5) {
          ADD_FAILURE() << what << "[" << i << "]: cpu " << c[i] << " vs cuda " << g[i];
        }
      }
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << c.size()
                      << " elements differ; largest difference " << worst;
  }

  std::mt19937 rng_{20261129};
  std::unique_ptr<Backend> cpu_;
  std::unique_ptr<Backend> gpu_;
};

constexpr double kAtol = 1e-4;
constexpr double kRtol = 1e-4;

TEST_F(CudaVsCpuTest, CopiesFillsAndViewsRoundTrip) {
  // More uploads than staging buffers, each from a host vector reused at once.
  std::vector<float> host(1000);
  std::vector<Tensor> tensors;
  for (int i = 0; i < 9; ++i) {
    for (size_t j = 0; j < host.size(); ++j) host[j] = static_cast<float>(i * 1000 + j);
    auto t = gpu_->Allocate({10, 100});
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(gpu_->CopyToDevice(host.data(), *t).ok());
    tensors.push_back(*t);
  }
  for (int i = 0; i < 9; ++i) {
    const std::vector<float> back = Host(*gpu_, tensors[i]);
    for (size_t j = 0; j < back.size(); j += 97) {
      ASSERT_EQ(back[j], static_cast<float>(i * 1000 + j)) << "tensor " << i << " element " << j;
    }
  }
  ASSERT_TRUE(gpu_->Fill(tensors[0], 2.5f).ok());
  ASSERT_TRUE(gpu_->CopyDeviceToDevice(tensors[0].LeadingRows(3), tensors[1].LeadingRows(3)).ok());
  const std::vector<float> mixed = Host(*gpu_, tensors[1]);
  EXPECT_EQ(mixed[0], 2.5f);
  EXPECT_EQ(mixed[299], 2.5f);
  EXPECT_EQ(mixed[300], 1300.0f);
  EXPECT_EQ(gpu_->CopyDeviceToDevice(tensors[0], tensors[1].LeadingRows(2)).code(),
            absl::StatusCode::kInvalidArgument);

  auto ids = gpu_->Allocate({3}, DType::kInt64);
  ASSERT_TRUE(ids.ok());
  const std::vector<int64_t> id_values = {int64_t{1} << 40, -3, 7};
  ASSERT_TRUE(gpu_->CopyToDevice(id_values.data(), *ids).ok());
  std::vector<int64_t> id_back(3);
  ASSERT_TRUE(gpu_->CopyToHost(*ids, id_back.data()).ok());
  EXPECT_EQ(id_back, id_values);
}

TEST_F(CudaVsCpuTest, AllocationBeyondTheDeviceIsResourceExhausted) {
  const auto huge = gpu_->Allocate({int64_t{1} << 38});  // 1 TiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("cudaMallocAsync"));
  // The backend still works afterwards.
  auto t = gpu_->Allocate({4});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(gpu_->Fill(*t, 1.0f).ok());
  EXPECT_EQ(Host(*gpu_, *t)[3], 1.0f);
}

struct DenseCase {
  Shape x_shape;  // [n, ...]
  int64_t out;
};

TEST_F(CudaVsCpuTest, DenseForwardAndBackward) {
  const DenseCase cases[] = {
      {{1, 1}, 1}, {{7, 13}, 5}, {{64, 784}, 256}, {{5, 3, 4, 4}, 9}, {{33, 100}, 10}};
  for (const DenseCase& c : cases) {
    const std::string what = absl::StrCat("x ", ShapeString(c.x_shape), " out ", c.out);
    const int64_t n = c.x_shape[0];
    const int64_t in = NumElements(c.x_shape) / n;
    Pair x = RandomF(c.x_shape);
    Pair w = RandomF({c.out, in}, 0.1f);
    Pair b = RandomF({c.out});
    Pair y = Output({n, c.out});
    ASSERT_TRUE(cpu_->DenseForward(x.cpu, w.cpu, b.cpu, y.cpu).ok());
    ASSERT_TRUE(gpu_->DenseForward(x.gpu, w.gpu, b.gpu, y.gpu).ok());
    ExpectClose(y, kAtol, kRtol, what + " y");

    Pair dy = RandomF({n, c.out});
    Pair dx = Output(c.x_shape);
    Pair dw = Output({c.out, in});
    Pair db = Output({c.out});
    ASSERT_TRUE(cpu_->DenseBackward(x.cpu, w.cpu, dy.cpu, &dx.cpu, dw.cpu, db.cpu, false).ok());
    ASSERT_TRUE(gpu_->DenseBackward(x.gpu, w.gpu, dy.gpu, &dx.gpu, dw.gpu, db.gpu, false).ok());
    ExpectClose(dx, kAtol, kRtol, what + " dx");
    ExpectClose(dw, kAtol, kRtol, what + " dw");
    ExpectClose(db, kAtol, kRtol, what + " db");

    // Without dx, the other gradients are the same.
    Pair dw2 = Output({c.out, in});
    Pair db2 = Output({c.out});
    ASSERT_TRUE(gpu_->DenseBackward(x.gpu, w.gpu, dy.gpu, nullptr, dw2.gpu, db2.gpu, false).ok());
    ASSERT_TRUE(cpu_->DenseBackward(x.cpu, w.cpu, dy.cpu, nullptr, dw2.cpu, db2.cpu, false).ok());
    ExpectClose(dw2, kAtol, kRtol, what + " dw (no dx)");

    // Accumulating adds a second micro-batch's weight gradients to the first's.
    ASSERT_TRUE(cpu_->DenseBackward(x.cpu, w.cpu, dy.cpu, nullptr, dw.cpu, db.cpu, true).ok());
    ASSERT_TRUE(gpu_->DenseBackward(x.gpu, w.gpu, dy.gpu, nullptr, dw.gpu, db.gpu, true).ok());
    ExpectClose(dw, kAtol, kRtol, what + " dw (accumulated)");
    ExpectClose(db, kAtol, kRtol, what + " db (accumulated)");
  }
}

Conv2DGeometry Conv(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t kh, int64_t kw,
                    int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  Conv2DGeometry g;
  g.n = n;
  g.c = c;
  g.h = h;
  g.w = w;
  g.k = k;
  g.kh = kh;
  g.kw = kw;
  g.stride_h = sh;
  g.stride_w = sw;
  g.pad_h = ph;
  g.pad_w = pw;
  g.oh = (h + 2 * ph - kh) / sh + 1;
  g.ow = (w + 2 * pw - kw) / sw + 1;
  return g;
}

TEST_F(CudaVsCpuTest, Conv2DForwardAndBackwardWithStrideAndPadding) {
  const Conv2DGeometry cases[] = {
      Conv(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1),    Conv(3, 2, 9, 7, 5, 3, 3, 2, 2, 1, 1),
      Conv(2, 4, 12, 10, 3, 5, 5, 1, 1, 2, 2),  Conv(1, 3, 11, 13, 2, 3, 5, 2, 1, 0, 2),
      Conv(4, 1, 28, 28, 8, 5, 5, 1, 1, 2, 2),  Conv(2, 6, 7, 7, 4, 1, 1, 1, 1, 0, 0),
      Conv(2, 8, 14, 14, 16, 5, 5, 1, 1, 2, 2), Conv(1, 2, 6, 9, 3, 4, 2, 3, 2, 1, 0),
  };
  for (const Conv2DGeometry& g : cases) {
    const std::string what =
        absl::StrCat("x ", ShapeString({g.n, g.c, g.h, g.w}), " k ", g.k, " ", g.kh, "x", g.kw,
                     " stride ", g.stride_h, ",", g.stride_w, " pad ", g.pad_h, ",", g.pad_w);
    Pair x = RandomF({g.n, g.c, g.h, g.w});
    Pair w = RandomF({g.k, g.c, g.kh, g.kw}, 0.2f);
    Pair b = RandomF({g.k});
    Pair y = Output({g.n, g.k, g.oh, g.ow});
    ASSERT_TRUE(cpu_->Conv2DForward(g, x.cpu, w.cpu, b.cpu, y.cpu).ok());
    const absl::Status fwd = gpu_->Conv2DForward(g, x.gpu, w.gpu, b.gpu, y.gpu);
    ASSERT_TRUE(fwd.ok()) << what << ": " << fwd;
    ExpectClose(y, kAtol, kRtol, what + " y");

    Pair dy = RandomF({g.n, g.k, g.oh, g.ow});
    Pair dx = Output({g.n, g.c, g.h, g.w});
    Pair dw = Output({g.k, g.c, g.kh, g.kw});
    Pair db = Output({g.k});
    ASSERT_TRUE(cpu_->Conv2DBackward(g, x.cpu, w.cpu, dy.cpu, &dx.cpu, dw.cpu, db.cpu).ok());
    const absl::Status bwd = gpu_->Conv2DBackward(g, x.gpu, w.gpu, dy.gpu, &dx.gpu, dw.gpu, db.gpu);
    ASSERT_TRUE(bwd.ok()) << what << ": " << bwd;
    ExpectClose(dx, kAtol, kRtol, what + " dx");
    ExpectClose(dw, 1e-3, kRtol, what + " dw");
    ExpectClose(db, 1e-3, kRtol, what + " db");

    Pair dw2 = Output({g.k, g.c, g.kh, g.kw});
    Pair db2 = Output({g.k});
    ASSERT_TRUE(cpu_->Conv2DBackward(g, x.cpu, w.cpu, dy.cpu, nullptr, dw2.cpu, db2.cpu).ok());
    ASSERT_TRUE(gpu_->Conv2DBackward(g, x.gpu, w.gpu, dy.gpu, nullptr, dw2.gpu, db2.gpu).ok());
    ExpectClose(dw2, 1e-3, kRtol, what + " dw (no dx)");
  }
}

Pool2DGeometry Pool(PoolKind kind, int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh,
                    int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  Pool2DGeometry g;
  g.kind = kind;
  g.n = n;
  g.c = c;
  g.h = h;
  g.w = w;
  g.kh = kh;
  g.kw = kw;
  g.stride_h = sh;
  g.stride_w = sw;
  g.pad_h = ph;
  g.pad_w = pw;
  g.oh = (h + 2 * ph - kh) / sh + 1;
  g.ow = (w + 2 * pw - kw) / sw + 1;
  return g;
}

TEST_F(CudaVsCpuTest, PoolingForwardAndBackward) {
  const Pool2DGeometry cases[] = {
      Pool(PoolKind::kMax, 2, 3, 8, 8, 2, 2, 2, 2, 0, 0),
      Pool(PoolKind::kMax, 2, 2, 9, 7, 3, 3, 2, 2, 1, 1),
      Pool(PoolKind::kMax, 3, 4, 28, 28, 2, 2, 2, 2, 0, 0),
      Pool(PoolKind::kAvg, 2, 3, 8, 8, 2, 2, 2, 2, 0, 0),
      Pool(PoolKind::kAvg, 2, 2, 7, 9, 3, 3, 1, 1, 1, 1),
      Pool(PoolKind::kAvg, 1, 3, 11, 10, 3, 2, 2, 3, 1, 1),
  };
  for (const Pool2DGeometry& g : cases) {
    const std::string what = absl::StrCat(
        g.kind == PoolKind::kMax ? "max" : "avg", " x ", ShapeString({g.n, g.c, g.h, g.w}), " ",
        g.kh, "x", g.kw, " stride ", g.stride_h, ",", g.stride_w, " pad ", g.pad_h, ",", g.pad_w);
    Pair x = RandomF({g.n, g.c, g.h, g.w});  // continuous values: no ties within a window
    Pair y = Output({g.n, g.c, g.oh, g.ow});
    auto cws = cpu_->PoolWorkspace(g);
    auto gws = gpu_->PoolWorkspace(g);
    ASSERT_TRUE(cws.ok() && gws.ok());
    ASSERT_TRUE(cpu_->Pool2DForward(g, x.cpu, y.cpu, *cws, true).ok());
    const absl::Status fwd = gpu_->Pool2DForward(g, x.gpu, y.gpu, *gws, true);
    ASSERT_TRUE(fwd.ok()) << what << ": " << fwd;
    ExpectClose(y, 1e-6, 1e-6, what + " y");

    Pair dy = RandomF({g.n, g.c, g.oh, g.ow});
    Pair dx = Output({g.n, g.c, g.h, g.w});
    ASSERT_TRUE(cpu_->Pool2DBackward(g, x.cpu, y.cpu, dy.cpu, *cws, dx.cpu).ok());
    const absl::Status bwd = gpu_->Pool2DBackward(g, x.gpu, y.gpu, dy.gpu, *gws, dx.gpu);
    ASSERT_TRUE(bwd.ok()) << what << ": " << bwd;
    ExpectClose(dx, 1e-5, 1e-5, what + " dx");
  }
}

TEST_F(CudaVsCpuTest, ActivationsForwardAndBackward) {
  for (Activation kind : {Activation::kRelu, Activation::kTanh, Activation::kSigmoid}) {
    const std::string what = absl::StrCat("activation ", static_cast<int>(kind));
    for (const Shape& shape : {Shape{37, 11}, Shape{4, 3, 5, 5}}) {
      Pair x = RandomF(shape, 2.0f);
      Pair y = Output(shape);
      ASSERT_TRUE(cpu_->ActivationForward(kind, x.cpu, y.cpu).ok());
      ASSERT_TRUE(gpu_->ActivationForward(kind, x.gpu, y.gpu).ok());
      ExpectClose(y, 1e-6, 1e-5, what + " y");
      Pair dy = RandomF(shape);
      Pair dx = Output(shape);
      ASSERT_TRUE(cpu_->ActivationBackward(kind, x.cpu, y.cpu, dy.cpu, dx.cpu).ok());
      ASSERT_TRUE(gpu_->ActivationBackward(kind, x.gpu, y.gpu, dy.gpu, dx.gpu).ok());
      ExpectClose(dx, 1e-6, 1e-5, what + " dx");

      // In place (y aliases x), as the model runs activations.
      ASSERT_TRUE(cpu_->ActivationForward(kind, x.cpu, x.cpu).ok());
      ASSERT_TRUE(gpu_->ActivationForward(kind, x.gpu, x.gpu).ok());
      ExpectClose(x, 1e-6, 1e-5, what + " in place");
    }
  }
}

TEST_F(CudaVsCpuTest, DropoutMasksAreIdenticalAcrossBackends) {
  const int64_t n = 10007;
  const float rate = 0.4f;
  const uint64_t seed = 0x1234567890abcdefULL;
  Pair x = RandomF({n});
  Pair mask = Output({n});
  Pair y = Output({n});
  ASSERT_TRUE(cpu_->DropoutForward(rate, seed, x.cpu, mask.cpu, y.cpu).ok());
  ASSERT_TRUE(gpu_->DropoutForward(rate, seed, x.gpu, mask.gpu, y.gpu).ok());
  ExpectClose(mask, 0, 0, "mask");
  ExpectClose(y, 0, 0, "y");
  const std::vector<float> m = Host(*gpu_, mask.gpu);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = DropoutUniform(seed, static_cast<uint64_t>(i)) >= rate;
    ASSERT_EQ(m[i], keep ? 1.0f / (1.0f - rate) : 0.0f) << i;
    kept += keep;
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - rate, 0.03);

  Pair dy = RandomF({n});
  Pair dx = Output({n});
  ASSERT_TRUE(cpu_->DropoutBackward(dy.cpu, mask.cpu, dx.cpu).ok());
  ASSERT_TRUE(gpu_->DropoutBackward(dy.gpu, mask.gpu, dx.gpu).ok());
  ExpectClose(dx, 0, 0, "dx");
}

TEST_F(CudaVsCpuTest, BatchNormTrainingInferenceAndBackward) {
  struct Case {
    int64_t n, c, spatial;
  };
  for (const Case& k : {Case{8, 5, 1}, Case{4, 3, 36}, Case{16, 7, 9}}) {
    const std::string what = absl::StrCat("batch norm n ", k.n, " c ", k.c, " spatial ", k.spatial);
    BatchNormGeometry g;
    g.n = k.n;
    g.c = k.c;
    g.spatial = k.spatial;
    g.epsilon = 1e-5f;
    g.momentum = 0.1f;
    const Shape shape = k.spatial == 1 ? Shape{k.n, k.c} : Shape{k.n, k.c, k.spatial, 1};
    std::vector<float> xv = Normal(k.n * k.c * k.spatial, 2.0f);
    for (float& v : xv) v += 1.5f;
    Pair x = UploadF(shape, xv);
    Pair gamma = RandomF({k.c});
    Pair beta = RandomF({k.c});
    Pair moving_mean = UploadF({k.c}, std::vector<float>(k.c, 0.5f));
    Pair moving_var = UploadF({k.c}, std::vector<float>(k.c, 2.0f));
    Pair save_mean = Output({k.c});
    Pair save_var = Output({k.c});
    Pair y = Output(shape);
    ASSERT_TRUE(cpu_->BatchNormForwardTraining(g, x.cpu, gamma.cpu, beta.cpu, y.cpu,
                                               moving_mean.cpu, moving_var.cpu, save_mean.cpu,
                                               save_var.cpu)
                    .ok());
    const absl::Status fwd =
        gpu_->BatchNormForwardTraining(g, x.gpu, gamma.gpu, beta.gpu, y.gpu, moving_mean.gpu,
                                       moving_var.gpu, save_mean.gpu, save_var.gpu);
    ASSERT_TRUE(fwd.ok()) << what << ": " << fwd;
    ExpectClose(y, 1e-4, 1e-4, what + " y");
    ExpectClose(moving_mean, 1e-5, 1e-5, what + " moving_mean");
    ExpectClose(moving_var, 1e-4, 1e-4, what + " moving_var (unbiased)");

    Pair dy = RandomF(shape);
    Pair dx = Output(shape);
    Pair dgamma = Output({k.c});
    Pair dbeta = Output({k.c});
    ASSERT_TRUE(cpu_->BatchNormBackward(g, x.cpu, gamma.cpu, save_mean.cpu, save_var.cpu, dy.cpu,
                                        dx.cpu, dgamma.cpu, dbeta.cpu)
                    .ok());
    const absl::Status bwd = gpu_->BatchNormBackward(
        g, x.gpu, gamma.gpu, save_mean.gpu, save_var.gpu, dy.gpu, dx.gpu, dgamma.gpu, dbeta.gpu);
    ASSERT_TRUE(bwd.ok()) << what << ": " << bwd;
    ExpectClose(dx, 1e-4, 1e-3, what + " dx");
    ExpectClose(dgamma, 1e-4, 1e-4, what + " dgamma");
    ExpectClose(dbeta, 1e-4, 1e-4, what + " dbeta");

    Pair yi = Output(shape);
    ASSERT_TRUE(cpu_->BatchNormForwardInference(g, x.cpu, gamma.cpu, beta.cpu, moving_mean.cpu,
                                                moving_var.cpu, yi.cpu)
                    .ok());
    ASSERT_TRUE(gpu_->BatchNormForwardInference(g, x.gpu, gamma.gpu, beta.gpu, moving_mean.gpu,
                                                moving_var.gpu, yi.gpu)
                    .ok());
    ExpectClose(yi, 1e-4, 1e-4, what + " inference y");
  }
}

TEST_F(CudaVsCpuTest, EmbeddingBagGatherAndScatterAdd) {
  const int64_t rows = 10;
  // Bags: {3, 1, 3}, {}, {0, 9, 9, 2}, {5}; repeated ids within and across bags.
  const std::vector<int64_t> ids = {3, 1, 3, 0, 9, 9, 2, 5};
  const std::vector<int64_t> offsets = {0, 3, 3, 7, 8};
  const int64_t bags = 4;
  for (int64_t dim : {int64_t{7}, int64_t{70}, int64_t{300}}) {
    for (Combiner combiner : {Combiner::kSum, Combiner::kMean}) {
      for (bool weighted : {false, true}) {
        const std::string what =
            absl::StrCat("dim ", dim, combiner == Combiner::kSum ? " sum" : " mean",
                         weighted ? " weighted" : "");
        Pair table = RandomF({rows, dim});
        Pair id = Upload({static_cast<int64_t>(ids.size())}, ids, DType::kInt64);
        Pair off = Upload({bags + 1}, offsets, DType::kInt64);
        Pair values = RandomF({static_cast<int64_t>(ids.size())});
        Pair out = Output({bags, dim});
        ASSERT_TRUE(cpu_->EmbeddingBagForward(combiner, table.cpu, id.cpu, off.cpu,
                                              weighted ? &values.cpu : nullptr, out.cpu)
                        .ok());
        ASSERT_TRUE(gpu_->EmbeddingBagForward(combiner, table.gpu, id.gpu, off.gpu,
                                              weighted ? &values.gpu : nullptr, out.gpu)
                        .ok());
        ExpectClose(out, 1e-5, 1e-5, what + " out");

        Pair dout = RandomF({bags, dim});
        Pair dtable = Output({rows, dim});
        ASSERT_TRUE(cpu_->EmbeddingBagBackward(combiner, id.cpu, off.cpu,
                                               weighted ? &values.cpu : nullptr, dout.cpu,
                                               dtable.cpu)
                        .ok());
        ASSERT_TRUE(gpu_->EmbeddingBagBackward(combiner, id.gpu, off.gpu,
                                               weighted ? &values.gpu : nullptr, dout.gpu,
                                               dtable.gpu)
                        .ok());
        ExpectClose(dtable, 1e-5, 1e-5, what + " dtable");
      }
    }
  }
}

// The multi-input model's ops: a strided column copy (and add), and DLRM's dot interaction with
// its gradient, for a few vector counts and widths (one vector, no pairs, included).
TEST_F(CudaVsCpuTest, CopyColumnsAndDotInteraction) {
  for (bool accumulate : {false, true}) {
    Pair src = RandomF({33, 12});
    Pair dst = RandomF({33, 40});
    ASSERT_TRUE(cpu_->CopyColumns(src.cpu, 4, dst.cpu, 17, 8, accumulate).ok());
    ASSERT_TRUE(gpu_->CopyColumns(src.gpu, 4, dst.gpu, 17, 8, accumulate).ok());
    ExpectClose(dst, 1e-6, 1e-6, accumulate ? "add columns" : "copy columns");
  }
  struct Case {
    int64_t n, m, d, offset;
  };
  for (const Case& c : {Case{5, 1, 4, 2}, Case{37, 27, 16, 16}, Case{9, 4, 3, 2}}) {
    const std::string what = absl::StrCat("n ", c.n, " m ", c.m, " d ", c.d);
    const int64_t cols = c.offset + c.m * (c.m - 1) / 2;
    Pair x = RandomF({c.n, c.m, c.d});
    Pair y = RandomF({c.n, cols});
    ASSERT_TRUE(cpu_->DotInteractionForward(x.cpu, y.cpu, c.offset).ok());
    ASSERT_TRUE(gpu_->DotInteractionForward(x.gpu, y.gpu, c.offset).ok());
    ExpectClose(y, 1e-4, 1e-4, what + " y");
    Pair dy = RandomF({c.n, cols});
    Pair dx = Output({c.n, c.m, c.d});
    ASSERT_TRUE(cpu_->DotInteractionBackward(x.cpu, dy.cpu, c.offset, dx.cpu).ok());
    ASSERT_TRUE(gpu_->DotInteractionBackward(x.gpu, dy.gpu, c.offset, dx.gpu).ok());
    ExpectClose(dx, 1e-4, 1e-4, what + " dx");
  }
}

TEST_F(CudaVsCpuTest, LossesValuesGradientsAndAccuracy) {
  struct Case {
    LossKind kind;
    int64_t n, k;
  };
  const Case cases[] = {
      {LossKind::kSoftmaxCrossEntropy, 37, 10}, {LossKind::kSoftmaxCrossEntropy, 5, 100},
      {LossKind::kSoftmaxCrossEntropy, 64, 3},  {LossKind::kSigmoidCrossEntropy, 9, 5},
      {LossKind::kSigmoidCrossEntropy, 40, 1},  {LossKind::kMeanSquaredError, 6, 4},
      {LossKind::kMeanSquaredError, 50, 1},     {LossKind::kMeanSquaredError, 3, 40}};
  for (const Case& c : cases) {
    const std::string what =
        absl::StrCat("loss ", static_cast<int>(c.kind), " n ", c.n, " k ", c.k);
    const std::vector<float> logit_values = Normal(c.n * c.k, 2.0f);
    Pair logits = UploadF({c.n, c.k}, logit_values);
    Pair labels;
    if (c.kind == LossKind::kSoftmaxCrossEntropy) {
      std::uniform_int_distribution<int32_t> cls(0, static_cast<int32_t>(c.k - 1));
      std::vector<int32_t> l(static_cast<size_t>(c.n));
      for (int64_t i = 0; i < c.n; ++i) {
        const float* row = logit_values.data() + i * c.k;
        // Every other row is predicted right: its label is the arg-max.
        l[i] =
            i % 2 == 0 ? static_cast<int32_t>(std::max_element(row, row + c.k) - row) : cls(rng_);
      }
      l[1] = -1;  // out of range: wrong, zero loss and gradient, on both backends
      labels = Upload({c.n}, l, DType::kInt32);
    } else if (c.kind == LossKind::kSigmoidCrossEntropy) {
      std::bernoulli_distribution coin(0.5);
      std::vector<float> t(static_cast<size_t>(c.n * c.k));
      for (float& v : t) v = coin(rng_) ? 1.0f : 0.0f;
      labels = UploadF({c.n, c.k}, t);
    } else {
      labels = RandomF({c.n, c.k});
    }
    Pair dlogits = Output({c.n, c.k});
    Pair metrics = Output({2});
    ASSERT_TRUE(
        cpu_->LossForwardBackward(c.kind, logits.cpu, labels.cpu, &dlogits.cpu, metrics.cpu).ok());
    const absl::Status s =
        gpu_->LossForwardBackward(c.kind, logits.gpu, labels.gpu, &dlogits.gpu, metrics.gpu);
    ASSERT_TRUE(s.ok()) << what << ": " << s;
    ExpectClose(dlogits, 1e-6, 1e-4, what + " dlogits");
    ExpectClose(metrics, 1e-6, 1e-5, what + " metrics");
    const std::vector<float> m = Host(*gpu_, metrics.gpu);
    EXPECT_GT(m[0], 0.0f) << what;
    EXPECT_EQ(m[1], std::floor(m[1])) << what;

    Pair metrics2 = Output({2});
    ASSERT_TRUE(
        cpu_->LossForwardBackward(c.kind, logits.cpu, labels.cpu, nullptr, metrics2.cpu).ok());
    ASSERT_TRUE(
        gpu_->LossForwardBackward(c.kind, logits.gpu, labels.gpu, nullptr, metrics2.gpu).ok());
    ExpectClose(metrics2, 1e-6, 1e-5, what + " metrics (no gradient)");
  }
}

TEST_F(CudaVsCpuTest, SoftmaxAccuracyCountsTheFirstArgMax) {
  // Rows 0 and 1 tie between classes 1 and 3: the first maximum (1) is the prediction.
  const std::vector<float> logits = {0, 5, 1, 5, 0, 5, 1, 5, 9, 0, 0, 0};
  const std::vector<int32_t> labels = {1, 3, 0};
  Pair l = UploadF({3, 4}, logits);
  Pair y = Upload({3}, labels, DType::kInt32);
  Pair metrics = Output({2});
  ASSERT_TRUE(
      gpu_->LossForwardBackward(LossKind::kSoftmaxCrossEntropy, l.gpu, y.gpu, nullptr, metrics.gpu)
          .ok());
  ASSERT_TRUE(
      cpu_->LossForwardBackward(LossKind::kSoftmaxCrossEntropy, l.cpu, y.cpu, nullptr, metrics.cpu)
          .ok());
  EXPECT_EQ(Host(*gpu_, metrics.gpu)[1], 2.0f);
  ExpectClose(metrics, 1e-6, 1e-5, "metrics");
}

TEST_F(CudaVsCpuTest, AxpyScaleAndSquaredNorm) {
  const int64_t n = 100003;
  Pair x = RandomF({n});
  Pair y = RandomF({n});
  ASSERT_TRUE(cpu_->Axpy(-0.75f, x.cpu, y.cpu).ok());
  ASSERT_TRUE(gpu_->Axpy(-0.75f, x.gpu, y.gpu).ok());
  ExpectClose(y, 1e-6, 1e-6, "axpy");
  ASSERT_TRUE(cpu_->Scale(3.0f, y.cpu).ok());
  ASSERT_TRUE(gpu_->Scale(3.0f, y.gpu).ok());
  ExpectClose(y, 1e-6, 1e-6, "scale");
  const auto c = cpu_->SquaredNorm(y.cpu);
  const auto g = gpu_->SquaredNorm(y.gpu);
  ASSERT_TRUE(c.ok() && g.ok());
  EXPECT_NEAR(*g, *c, 1e-9 * *c);
  EXPECT_GT(*g, 0.0);

  Pair empty = RandomF({0});
  const auto zero = gpu_->SquaredNorm(empty.gpu);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(*zero, 0.0);
}

TEST_F(CudaVsCpuTest, OptimizerUpdatesMatch) {
  const int64_t n = 4099;
  for (v1::OptimizerKind kind : {v1::OPTIMIZER_KIND_SGD, v1::OPTIMIZER_KIND_MOMENTUM,
                                 v1::OPTIMIZER_KIND_ADAM, v1::OPTIMIZER_KIND_ADAGRAD}) {
    v1::OptimizerConfig config;
    config.set_kind(kind);
    config.set_learning_rate(0.01f);
    if (kind == v1::OPTIMIZER_KIND_MOMENTUM) config.set_momentum(0.9f);
    const absl::Status valid = spec::ValidateOptimizer(config, /*sparse=*/false);
    ASSERT_TRUE(valid.ok()) << valid;
    const OptimizerParams params = MakeOptimizerParams(config);
    const std::string what = absl::StrCat("optimizer ", static_cast<int>(kind));
    Pair w = RandomF({n});
    std::vector<Pair> slots;
    for (int s = 0; s < NumSlots(kind); ++s) {
      slots.push_back(UploadF({n}, std::vector<float>(n, SlotInitialValue(params, s))));
    }
    std::vector<Tensor> cpu_slots, gpu_slots;
    for (const Pair& p : slots) {
      cpu_slots.push_back(p.cpu);
      gpu_slots.push_back(p.gpu);
    }
    for (int64_t t = 1; t <= 3; ++t) {
      Pair grad = RandomF({n});
      ASSERT_TRUE(cpu_->ApplyUpdate(params, 0.01f, t, 0.5f, grad.cpu, w.cpu, cpu_slots).ok());
      const absl::Status s = gpu_->ApplyUpdate(params, 0.01f, t, 0.5f, grad.gpu, w.gpu, gpu_slots);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
    }
    ExpectClose(w, 1e-6, 1e-5, what + " w");
    for (size_t s = 0; s < slots.size(); ++s) {
      ExpectClose(slots[s], 1e-6, 1e-5, absl::StrCat(what, " slot ", s));
    }
  }
}

// --- Whole steps ---------------------------------------------------------------------------------

// One layer of a small sequential model composed directly from the backend's ops.
struct StepLayer {
  enum Kind { kDense, kConv, kPool, kAct, kDropout } kind;
  Conv2DGeometry conv;  // kConv
  Pool2DGeometry pool;  // kPool
  Activation act = Activation::kRelu;
  int64_t units = 0;  // kDense
  float rate = 0;     // kDropout
};

StepLayer MakeLayer(StepLayer::Kind kind) {
  StepLayer l;
  l.kind = kind;
  return l;
}

struct StepOutput {
  std::vector<float> metrics;
  std::vector<std::vector<float>> grads;  // per parameter, in layer order (kernel, bias)
  std::vector<float> dinput;
};

// Forward, softmax cross-entropy and backward of `layers` on `b`, from the given host
// parameters and batch; returns the metrics and every gradient.
absl::StatusOr<StepOutput> RunStep(Backend& b, const std::vector<StepLayer>& layers,
                                   const std::vector<std::vector<float>>& params,
                                   const Shape& input_shape, const std::vector<float>& input,
                                   const std::vector<int32_t>& labels) {
  auto upload = [&b](const Shape& s, const void* data, DType dtype) -> absl::StatusOr<Tensor> {
    TESSERA_ASSIGN_OR_RETURN(Tensor t, b.Allocate(s, dtype));
    TESSERA_RETURN_IF_ERROR(b.CopyToDevice(data, t));
    return t;
  };
  std::vector<Tensor> acts;  // acts[i] is the input of layer i
  std::vector<Tensor> weights, grads, masks, workspaces;
  TESSERA_ASSIGN_OR_RETURN(Tensor x, upload(input_shape, input.data(), DType::kFloat32));
  acts.push_back(x);
  size_t p = 0;
  for (const StepLayer& l : layers) {
    const Tensor& in = acts.back();
    const int64_t n = in.dim(0);
    Tensor out;
    switch (l.kind) {
      case StepLayer::kDense: {
        const int64_t fan_in = in.num_elements() / n;
        TESSERA_ASSIGN_OR_RETURN(Tensor w,
                                 upload({l.units, fan_in}, params[p].data(), DType::kFloat32));
        TESSERA_ASSIGN_OR_RETURN(Tensor bias,
                                 upload({l.units}, params[p + 1].data(), DType::kFloat32));
        p += 2;
        TESSERA_ASSIGN_OR_RETURN(out, b.Allocate({n, l.units}));
        TESSERA_RETURN_IF_ERROR(b.DenseForward(in, w, bias, out));
        weights.push_back(w);
        weights.push_back(bias);
        break;
      }
      case StepLayer::kConv: {
        const Conv2DGeometry& g = l.conv;
        TESSERA_ASSIGN_OR_RETURN(Tensor w,
                                 upload({g.k, g.c, g.kh, g.kw}, params[p].data(), DType::kFloat32));
        TESSERA_ASSIGN_OR_RETURN(Tensor bias, upload({g.k}, params[p + 1].data(), DType::kFloat32));
        p += 2;
        TESSERA_ASSIGN_OR_RETURN(out, b.Allocate({g.n, g.k, g.oh, g.ow}));
        TESSERA_RETURN_IF_ERROR(b.Conv2DForward(g, in, w, bias, out));
        weights.push_back(w);
        weights.push_back(bias);
        break;
      }
      case StepLayer::kPool: {
        const Pool2DGeometry& g = l.pool;
        TESSERA_ASSIGN_OR_RETURN(Tensor ws, b.PoolWorkspace(g));
        TESSERA_ASSIGN_OR_RETURN(out, b.Allocate({g.n, g.c, g.oh, g.ow}));
        TESSERA_RETURN_IF_ERROR(b.Pool2DForward(g, in, out, ws, true));
        workspaces.push_back(ws);
        break;
      }
      case StepLayer::kAct: {
        TESSERA_ASSIGN_OR_RETURN(out, b.Allocate(in.shape()));
        TESSERA_RETURN_IF_ERROR(b.ActivationForward(l.act, in, out));
        break;
      }
      case StepLayer::kDropout: {
        TESSERA_ASSIGN_OR_RETURN(Tensor mask, b.Allocate(in.shape()));
        TESSERA_ASSIGN_OR_RETURN(out, b.Allocate(in.shape()));
        TESSERA_RETURN_IF_ERROR(b.DropoutForward(l.rate, 99, in, mask, out));
        masks.push_back(mask);
        break;
      }
    }
    acts.push_back(out);
  }
  const Tensor& logits = acts.back();
  TESSERA_ASSIGN_OR_RETURN(
      Tensor label_t, upload({static_cast<int64_t>(labels.size())}, labels.data(), DType::kInt32));
  TESSERA_ASSIGN_OR_RETURN(Tensor metrics, b.Allocate({2}));
  TESSERA_ASSIGN_OR_RETURN(Tensor dy, b.Allocate(logits.shape()));
  TESSERA_RETURN_IF_ERROR(
      b.LossForwardBackward(LossKind::kSoftmaxCrossEntropy, logits, label_t, &dy, metrics));

  StepOutput result;
  result.grads.resize(weights.size());
  size_t wi = weights.size();
  size_t mi = masks.size();
  size_t pi = workspaces.size();
  for (size_t i = layers.size(); i-- > 0;) {
    const StepLayer& l = layers[i];
    const Tensor& in = acts[i];
    const Tensor& out = acts[i + 1];
    TESSERA_ASSIGN_OR_RETURN(Tensor dx, b.Allocate(in.shape()));
    switch (l.kind) {
      case StepLayer::kDense:
      case StepLayer::kConv: {
        wi -= 2;
        TESSERA_ASSIGN_OR_RETURN(Tensor dw, b.Allocate(weights[wi].shape()));
        TESSERA_ASSIGN_OR_RETURN(Tensor db, b.Allocate(weights[wi + 1].shape()));
        if (l.kind == StepLayer::kDense) {
          TESSERA_RETURN_IF_ERROR(b.DenseBackward(in, weights[wi], dy, &dx, dw, db, false));
        } else {
          TESSERA_RETURN_IF_ERROR(b.Conv2DBackward(l.conv, in, weights[wi], dy, &dx, dw, db));
        }
        result.grads[wi].resize(static_cast<size_t>(dw.num_elements()));
        result.grads[wi + 1].resize(static_cast<size_t>(db.num_elements()));
        TESSERA_RETURN_IF_ERROR(b.CopyToHost(dw, result.grads[wi].data()));
        TESSERA_RETURN_IF_ERROR(b.CopyToHost(db, result.grads[wi + 1].data()));
        break;
      }
      case StepLayer::kPool:
        --pi;
        TESSERA_RETURN_IF_ERROR(b.Pool2DBackward(l.pool, in, out, dy, workspaces[pi], dx));
        break;
      case StepLayer::kAct:
        TESSERA_RETURN_IF_ERROR(b.ActivationBackward(l.act, in, out, dy, dx));
        break;
      case StepLayer::kDropout:
        --mi;
        TESSERA_RETURN_IF_ERROR(b.DropoutBackward(dy, masks[mi], dx));
        break;
    }
    dy = dx;
  }
  result.dinput.resize(static_cast<size_t>(dy.num_elements()));
  TESSERA_RETURN_IF_ERROR(b.CopyToHost(dy, result.dinput.data()));
  result.metrics.resize(2);
  TESSERA_RETURN_IF_ERROR(b.CopyToHost(metrics, result.metrics.data()));
  return result;
}

void ExpectVectorsClose(const std::vector<float>& c, const std::vector<float>& g, double atol,
                        double rtol, const std::string& what) {
  ASSERT_EQ(c.size(), g.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    if (!(std::fabs(static_cast<double>(c[i]) - g[i]) <= atol + rtol * std::fabs(c[i]))) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: cpu " << c[i] << " vs cuda " << g[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << c.size() << " differ";
}

class CudaStepTest : public CudaVsCpuTest {
 protected:
  // Random parameters for `layers` (He-scaled kernels, small biases).
  std::vector<std::vector<float>> Params(const std::vector<StepLayer>& layers, int64_t in) {
    std::vector<std::vector<float>> params;
    for (const StepLayer& l : layers) {
      if (l.kind == StepLayer::kDense) {
        params.push_back(Normal(l.units * in, std::sqrt(2.0f / static_cast<float>(in))));
        params.push_back(Normal(l.units, 0.1f));
        in = l.units;
      } else if (l.kind == StepLayer::kConv) {
        const int64_t fan_in = l.conv.c * l.conv.kh * l.conv.kw;
        params.push_back(Normal(l.conv.k * fan_in, std::sqrt(2.0f / static_cast<float>(fan_in))));
        params.push_back(Normal(l.conv.k, 0.1f));
        in = l.conv.k * l.conv.oh * l.conv.ow;
      } else if (l.kind == StepLayer::kPool) {
        in = l.pool.c * l.pool.oh * l.pool.ow;
      }
    }
    return params;
  }

  void CompareStep(const std::vector<StepLayer>& layers, const Shape& input_shape, int64_t classes,
                   double atol, double rtol) {
    const int64_t n = input_shape[0];
    const std::vector<std::vector<float>> params = Params(layers, NumElements(input_shape) / n);
    const std::vector<float> input = Normal(NumElements(input_shape));
    std::uniform_int_distribution<int32_t> cls(0, static_cast<int32_t>(classes - 1));
    std::vector<int32_t> labels(static_cast<size_t>(n));
    for (int32_t& v : labels) v = cls(rng_);
    auto c = RunStep(*cpu_, layers, params, input_shape, input, labels);
    ASSERT_TRUE(c.ok()) << c.status();
    auto g = RunStep(*gpu_, layers, params, input_shape, input, labels);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_NEAR(g->metrics[0], c->metrics[0], 1e-5 * std::fabs(c->metrics[0]) + 1e-6) << "loss";
    EXPECT_EQ(g->metrics[1], c->metrics[1]) << "correct";
    ASSERT_EQ(g->grads.size(), c->grads.size());
    for (size_t i = 0; i < c->grads.size(); ++i) {
      ExpectVectorsClose(c->grads[i], g->grads[i], atol, rtol, absl::StrCat("grad ", i));
    }
    ExpectVectorsClose(c->dinput, g->dinput, atol, rtol, "d input");
  }
};

TEST_F(CudaStepTest, MlpStepMatchesCpu) {
  // 784-256-128-100-10 with ReLU, batch 64: the Fashion-MNIST MLP example.
  const int64_t n = 64;
  std::vector<StepLayer> layers;
  for (int64_t units : {256, 128, 100}) {
    StepLayer d = MakeLayer(StepLayer::kDense);
    d.units = units;
    layers.push_back(d);
    StepLayer a = MakeLayer(StepLayer::kAct);
    a.act = Activation::kRelu;
    layers.push_back(a);
  }
  StepLayer out = MakeLayer(StepLayer::kDense);
  out.units = 10;
  layers.push_back(out);
  CompareStep(layers, {n, 784}, 10, 1e-5, 1e-3);
}

TEST_F(CudaStepTest, CnnStepMatchesCpu) {
  // conv 5x5x8 (pad 2) - tanh - max pool 2 - conv 3x3x16 (stride 2, pad 1) - ReLU - avg pool 2
  // (pad 1) - dense 32 - sigmoid - dropout 0.25 - dense 10, batch 8 of 1x28x28.
  const int64_t n = 8;
  std::vector<StepLayer> layers;
  StepLayer c1 = MakeLayer(StepLayer::kConv);
  c1.conv = Conv(n, 1, 28, 28, 8, 5, 5, 1, 1, 2, 2);
  layers.push_back(c1);
  StepLayer a1 = MakeLayer(StepLayer::kAct);
  a1.act = Activation::kTanh;
  layers.push_back(a1);
  StepLayer p1 = MakeLayer(StepLayer::kPool);
  p1.pool = Pool(PoolKind::kMax, n, 8, 28, 28, 2, 2, 2, 2, 0, 0);
  layers.push_back(p1);
  StepLayer c2 = MakeLayer(StepLayer::kConv);
  c2.conv = Conv(n, 8, 14, 14, 16, 3, 3, 2, 2, 1, 1);
  layers.push_back(c2);
  StepLayer a2 = MakeLayer(StepLayer::kAct);
  a2.act = Activation::kRelu;
  layers.push_back(a2);
  StepLayer p2 = MakeLayer(StepLayer::kPool);
  p2.pool = Pool(PoolKind::kAvg, n, 16, c2.conv.oh, c2.conv.ow, 2, 2, 2, 2, 1, 1);
  layers.push_back(p2);
  StepLayer d1 = MakeLayer(StepLayer::kDense);
  d1.units = 32;
  layers.push_back(d1);
  StepLayer a3 = MakeLayer(StepLayer::kAct);
  a3.act = Activation::kSigmoid;
  layers.push_back(a3);
  StepLayer drop = MakeLayer(StepLayer::kDropout);
  drop.rate = 0.25f;
  layers.push_back(drop);
  StepLayer d2 = MakeLayer(StepLayer::kDense);
  d2.units = 10;
  layers.push_back(d2);
  CompareStep(layers, {n, 1, 28, 28}, 10, 1e-5, 2e-3);
}

}  // namespace
}  // namespace tessera::kernels
