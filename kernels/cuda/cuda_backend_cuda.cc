// The CUDA backend (kernels/backend.h): cuBLAS for the Dense products, cuDNN 9 for convolution,
// pooling, activations, log-softmax and batch normalisation, and own kernels
// (kernels/cuda/cuda_kernels.cu) for bias, losses, dropout, embedding bags and reductions.
//
// Streams and memory. A backend owns one non-blocking stream, and every op is enqueued on it, so
// ops run in order without host synchronisation. Only CopyToHost(), SquaredNorm() and
// Synchronize() wait for the stream. Device memory comes from the stream-ordered allocator
// (cudaMallocAsync) whose pool keeps freed memory, so a steady-state step allocates nothing from
// the driver; a tensor's memory goes back with cudaFreeAsync on the same stream when its last
// handle drops, which is safe while earlier work still reads it. The stream lives in a
// shared StreamOwner that every tensor's deleter holds, so tensors may outlive the backend.
// Host-to-device copies go through a ring of pinned staging buffers (one cudaEvent each), so
// CopyToDevice() returns as soon as the bytes are staged; device-to-host copies land in a pinned
// buffer before the final memcpy.
//
// Convolutions. A cache entry per geometry holds the cuDNN descriptors and the algorithms chosen
// by the _v7 heuristics for forward, backward data and backward filter (the first algorithm the
// heuristics rank that runs in strict FP32 FMA math and fits kWorkspaceLimit). One device
// workspace, grown to the largest need, serves every convolution: it is only used on the stream,
// in order, so the sharing is safe.
//
// Numerics. cuBLAS and cuDNN run in FP32 without TF32 tensor-op math, so the results agree with
// the CPU backend to FP32 rounding (kernels/cuda/cuda_backend_test.cc).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/device.h"
#include "kernels/optimizer.h"
#include "kernels/optimizer_cuda.h"

namespace tessera::kernels {
namespace {

using cuda::CudaStatus;

// Most device memory one convolution algorithm may use as workspace, unless no algorithm fits.
constexpr size_t kWorkspaceLimit = size_t{1} << 30;
// Pinned staging buffers for host-to-device copies in flight at once.
constexpr int kUploadSlots = 4;

// Makes `device` current for the calling thread and restores the previous device on exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      if (cudaSetDevice(device) == cudaSuccess) restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// The stream of one backend. Shared by the backend and by the deleter of every tensor it
// allocated, so that memory can be freed in stream order whatever is destroyed first.
class StreamOwner {
 public:
  StreamOwner(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~StreamOwner() {
    DeviceGuard guard(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  StreamOwner(const StreamOwner&) = delete;
  StreamOwner& operator=(const StreamOwner&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

 private:
  const int device_;
  const cudaStream_t stream_;
};

// Dimensions handed to cuBLAS and cuDNN, which take int.
absl::Status CheckFitsInt(std::initializer_list<int64_t> values, const char* op) {
  for (int64_t v : values) {
    if (v < 0 || v > INT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": dimension ", v, " is outside the range the CUDA libraries take"));
    }
  }
  return absl::OkStatus();
}

int I(int64_t v) { return static_cast<int>(v); }

// A device buffer reused across calls, grown (in stream order) when a call needs more.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;

  // Frees in stream order; call before the stream is destroyed.
  void Release(cudaStream_t stream) {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream);
    ptr_ = nullptr;
    bytes_ = 0;
  }

  absl::StatusOr<void*> Get(size_t bytes, cudaStream_t stream) {
    if (bytes <= bytes_ && ptr_ != nullptr) return ptr_;
    Release(stream);
    const size_t want = std::max<size_t>(bytes, 256);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&ptr_, want, stream));
    bytes_ = want;
    return ptr_;
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Pinned host memory, grown on demand. Not thread-safe (one backend, one thread at a time).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // REQUIRES: no copy in flight uses the buffer.
  absl::StatusOr<void*> Reserve(size_t bytes) {
    if (bytes <= bytes_ && ptr_ != nullptr) return ptr_;
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
    size_t want = 4096;
    while (want < bytes) want *= 2;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&ptr_, want));
    bytes_ = want;
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct UploadSlot {
  PinnedBuffer buffer;
  cudaEvent_t done = nullptr;
  bool pending = false;
};

struct ConvEntry {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionFwdAlgo_t fwd_algo{};
  cudnnMathType_t fwd_math = CUDNN_FMA_MATH;
  size_t fwd_bytes = 0;
  bool bwd_ready = false;
  cudnnConvolutionBwdDataAlgo_t bwd_data_algo{};
  cudnnMathType_t bwd_data_math = CUDNN_FMA_MATH;
  size_t bwd_data_bytes = 0;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_algo{};
  cudnnMathType_t bwd_filter_math = CUDNN_FMA_MATH;
  size_t bwd_filter_bytes = 0;

  ConvEntry() = default;
  ConvEntry(const ConvEntry&) = delete;
  ConvEntry& operator=(const ConvEntry&) = delete;
  ~ConvEntry() {
    if (w != nullptr) cudnnDestroyFilterDescriptor(w);
    if (conv != nullptr) cudnnDestroyConvolutionDescriptor(conv);
    // x and y belong to the backend's tensor-descriptor cache.
  }
};

struct PoolEntry {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnPoolingDescriptor_t pool = nullptr;

  PoolEntry() = default;
  PoolEntry(const PoolEntry&) = delete;
  PoolEntry& operator=(const PoolEntry&) = delete;
  ~PoolEntry() {
    if (pool != nullptr) cudnnDestroyPoolingDescriptor(pool);
  }
};

// Picks the first algorithm in the heuristics' ranking that succeeds in FP32 (FMA or default math,
// which PickMath() turns into FMA) within the workspace limit; failing that, the first in FP32
// math with any workspace; failing that, the first that succeeds at all.
bool Fp32Math(cudnnMathType_t m) { return m == CUDNN_FMA_MATH || m == CUDNN_DEFAULT_MATH; }

template <typename Perf>
int PickAlgorithm(const Perf* perf, int count) {
  for (int i = 0; i < count; ++i) {
    if (perf[i].status == CUDNN_STATUS_SUCCESS && Fp32Math(perf[i].mathType) &&
        perf[i].memory <= kWorkspaceLimit) {
      return i;
    }
  }
  for (int i = 0; i < count; ++i) {
    if (perf[i].status == CUDNN_STATUS_SUCCESS && Fp32Math(perf[i].mathType)) return i;
  }
  for (int i = 0; i < count; ++i) {
    if (perf[i].status == CUDNN_STATUS_SUCCESS) return i;
  }
  return -1;
}

// Default math lets cuDNN use TF32 tensor cores on sm_80 and later; FMA keeps full FP32, as the
// CPU backend computes (and as PyTorch does with allow_tf32 off).
cudnnMathType_t PickMath(cudnnMathType_t m) { return m == CUDNN_DEFAULT_MATH ? CUDNN_FMA_MATH : m; }

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}

  ~CudaBackend() override {
    DeviceGuard guard(device_);
    if (owner_ != nullptr) cudaStreamSynchronize(owner_->stream());
    conv_.clear();
    pool_.clear();
    for (auto& [key, desc] : tensor_descs_) cudnnDestroyTensorDescriptor(desc);
    for (cudnnActivationDescriptor_t d : activations_) {
      if (d != nullptr) cudnnDestroyActivationDescriptor(d);
    }
    for (UploadSlot& slot : upload_) {
      if (slot.done != nullptr) cudaEventDestroy(slot.done);
    }
    if (owner_ != nullptr) {
      for (DeviceScratch* s : {&workspace_, &loss_scratch_, &log_probs_, &norm_scratch_}) {
        s->Release(owner_->stream());
      }
      cudaStreamSynchronize(owner_->stream());
    }
    if (cudnn_ != nullptr) cudnnDestroy(cudnn_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
  }

  // Fallible set-up: the stream, the library handles, the memory pool and the descriptors that
  // never change.
  absl::Status Init() {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaStream_t stream = nullptr;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    owner_ = std::make_shared<StreamOwner>(device_, stream);
    stream_ = stream;

    int pools = 0;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_));
    if (pools == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", device_, ": the device does not support stream-ordered memory"));
    }
    cudaMemPool_t pool = nullptr;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device_));
    uint64_t keep = UINT64_MAX;  // keep freed memory in the pool between steps
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));

    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreate(&cudnn_));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetStream(cudnn_, stream_));

    const cudnnActivationMode_t modes[3] = {CUDNN_ACTIVATION_RELU, CUDNN_ACTIVATION_TANH,
                                            CUDNN_ACTIVATION_SIGMOID};
    for (int i = 0; i < 3; ++i) {
      TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreateActivationDescriptor(&activations_[i]));
      TESSERA_CUDNN_RETURN_IF_ERROR(
          cudnnSetActivationDescriptor(activations_[i], modes[i], CUDNN_NOT_PROPAGATE_NAN, 0.0));
    }
    for (UploadSlot& slot : upload_) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    }

    cudaDeviceProp prop;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
    int cublas_version = 0;
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasGetVersion(cublas_, &cublas_version));
    const size_t cudnn_version = cudnnGetVersion();
    description_ = absl::StrCat("cuda:", device_, " (", prop.name, ", sm_", prop.major, prop.minor,
                                ", ", prop.totalGlobalMem >> 20, " MiB; cuDNN ",
                                cudnn_version / 10000, ".", (cudnn_version % 10000) / 100, ".",
                                cudnn_version % 100, ", cuBLAS ", cublas_version, ")");
    return absl::OkStatus();
  }

  std::string Name() const override { return absl::StrCat("cuda:", device_); }
  std::string Description() const override { return description_; }
  bool IsCuda() const override { return true; }
  // The device's total memory: models and batches are checked against the GPU, not the host.
  int64_t MemoryCapacityBytes() const override {
    DeviceGuard guard(device_);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();
      return Backend::MemoryCapacityBytes();
    }
    return static_cast<int64_t>(total_bytes);
  }

  // --- Memory ----------------------------------------------------------------------------------
  absl::StatusOr<Tensor> Allocate(const Shape& shape, DType dtype) override {
    for (int64_t d : shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("Allocate: negative dimension in shape ", ShapeString(shape)));
      }
    }
    DeviceGuard guard(device_);
    const int64_t bytes = NumElements(shape) * DTypeSize(dtype);
    // At least 256 bytes, so that even an empty tensor has a distinct non-null address.
    const size_t rounded = static_cast<size_t>(std::max<int64_t>(256, (bytes + 255) / 256 * 256));
    void* p = nullptr;
    const cudaError_t err = cudaMallocAsync(&p, rounded, stream_);
    if (err != cudaSuccess) {
      TESSERA_RETURN_IF_ERROR(CudaStatus(
          err, absl::StrCat("cudaMallocAsync(", bytes, " bytes, shape ", ShapeString(shape), ")")
                   .c_str()));
    }
    std::shared_ptr<StreamOwner> owner = owner_;
    std::shared_ptr<void> storage(p, [owner](void* ptr) {
      DeviceGuard g(owner->device());
      cudaFreeAsync(ptr, owner->stream());
    });
    return Tensor(std::move(storage), p, shape, dtype);
  }

  absl::Status CopyToDevice(const void* host, const Tensor& dst) override {
    const size_t bytes = static_cast<size_t>(dst.num_bytes());
    if (bytes == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    UploadSlot& slot = upload_[next_upload_];
    next_upload_ = (next_upload_ + 1) % kUploadSlots;
    if (slot.pending) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.done));
      slot.pending = false;
    }
    TESSERA_ASSIGN_OR_RETURN(void* staging, slot.buffer.Reserve(bytes));
    std::memcpy(staging, host, bytes);
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.raw(), staging, bytes, cudaMemcpyHostToDevice, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done, stream_));
    slot.pending = true;
    return absl::OkStatus();
  }

  absl::Status CopyToHost(const Tensor& src, void* host) override {
    const size_t bytes = static_cast<size_t>(src.num_bytes());
    DeviceGuard guard(device_);
    if (bytes == 0) return Synchronize();
    TESSERA_ASSIGN_OR_RETURN(void* staging, download_.Reserve(bytes));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging, src.raw(), bytes, cudaMemcpyDeviceToHost, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    std::memcpy(host, staging, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyDeviceToDevice(const Tensor& src, const Tensor& dst) override {
    if (src.num_bytes() != dst.num_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CopyDeviceToDevice: ", src.num_bytes(), " bytes into ", dst.num_bytes()));
    }
    if (src.raw() == dst.raw() || src.num_bytes() == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.raw(), src.raw(), src.num_bytes(), cudaMemcpyDeviceToDevice, stream_));
    return absl::OkStatus();
  }

  absl::Status Fill(const Tensor& t, float value) override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchFill(t.f32(), t.num_elements(), value, stream_));
    return absl::OkStatus();
  }

  absl::Status Synchronize() override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  // --- Dense -----------------------------------------------------------------------------------
  // Row-major [n, in] and [out, in] are column-major [in, n] and [in, out], so
  // y^T (out x n) = w (out x in) x^T is Sgemm(T, N) on the untransposed buffers.
  absl::Status DenseForward(const Tensor& x, const Tensor& w, const Tensor& b,
                            const Tensor& y) override {
    const int64_t n = x.dim(0), in = w.dim(1), out = w.dim(0);
    TESSERA_RETURN_IF_ERROR(CheckFitsInt({n, in, out}, "DenseForward"));
    DeviceGuard guard(device_);
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, I(out), I(n),
                                               I(in), &one, w.f32(), I(in), x.f32(), I(in), &zero,
                                               y.f32(), I(out)));
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchAddBias(y.f32(), b.f32(), n, out, 1, stream_));
    return absl::OkStatus();
  }

  absl::Status DenseBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor* dx,
                             const Tensor& dw, const Tensor& db, bool accumulate) override {
    const int64_t n = x.dim(0), in = w.dim(1), out = w.dim(0);
    TESSERA_RETURN_IF_ERROR(CheckFitsInt({n, in, out}, "DenseBackward"));
    DeviceGuard guard(device_);
    const float one = 1.0f, zero = 0.0f;
    const float* beta = accumulate ? &one : &zero;
    // dw^T (in x out) = x^T (in x n) dy (n x out) (+ dw^T).
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, I(in), I(out),
                                               I(n), &one, x.f32(), I(in), dy.f32(), I(out), beta,
                                               dw.f32(), I(in)));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchBiasGrad(dy.f32(), db.f32(), n, out, 1, accumulate, stream_));
    if (dx != nullptr) {
      // dx^T (in x n) = w^T (in x out) dy^T (out x n).
      TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, I(in), I(n),
                                                 I(out), &one, w.f32(), I(in), dy.f32(), I(out),
                                                 &zero, dx->f32(), I(in)));
    }
    return absl::OkStatus();
  }

  // --- Conv2D ----------------------------------------------------------------------------------
  absl::Status Conv2DForward(const Conv2DGeometry& g, const Tensor& x, const Tensor& w,
                             const Tensor& b, const Tensor& y) override {
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(ConvEntry * e, ConvFor(g));
    TESSERA_ASSIGN_OR_RETURN(void* ws, workspace_.Get(e->fwd_bytes, stream_));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, e->fwd_math));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionForward(cudnn_, &one, e->x, x.raw(), e->w,
                                                          w.raw(), e->conv, e->fwd_algo, ws,
                                                          e->fwd_bytes, &zero, e->y, y.raw()));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchAddBias(y.f32(), b.f32(), g.n, g.k, g.oh * g.ow, stream_));
    return absl::OkStatus();
  }

  absl::Status Conv2DBackward(const Conv2DGeometry& g, const Tensor& x, const Tensor& w,
                              const Tensor& dy, const Tensor* dx, const Tensor& dw,
                              const Tensor& db) override {
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(ConvEntry * e, ConvFor(g));
    if (!e->bwd_ready) TESSERA_RETURN_IF_ERROR(InitConvBackward(e));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchBiasGrad(dy.f32(), db.f32(), g.n, g.k, g.oh * g.ow, false, stream_));
    {
      TESSERA_ASSIGN_OR_RETURN(void* ws, workspace_.Get(e->bwd_filter_bytes, stream_));
      TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, e->bwd_filter_math));
      TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionBackwardFilter(
          cudnn_, &one, e->x, x.raw(), e->y, dy.raw(), e->conv, e->bwd_filter_algo, ws,
          e->bwd_filter_bytes, &zero, e->w, dw.raw()));
    }
    if (dx != nullptr) {
      TESSERA_ASSIGN_OR_RETURN(void* ws, workspace_.Get(e->bwd_data_bytes, stream_));
      TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, e->bwd_data_math));
      TESSERA_CUDNN_RETURN_IF_ERROR(cudnnConvolutionBackwardData(
          cudnn_, &one, e->w, w.raw(), e->y, dy.raw(), e->conv, e->bwd_data_algo, ws,
          e->bwd_data_bytes, &zero, e->x, dx->raw()));
    }
    return absl::OkStatus();
  }

  // --- Pooling ---------------------------------------------------------------------------------
  // cuDNN's pooling backward reads x and y, so no workspace is needed.
  absl::StatusOr<Tensor> PoolWorkspace(const Pool2DGeometry& g) override { return Tensor(); }

  absl::Status Pool2DForward(const Pool2DGeometry& g, const Tensor& x, const Tensor& y,
                             const Tensor& workspace, bool training) override {
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(PoolEntry * e, PoolFor(g));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnPoolingForward(cudnn_, e->pool, &one, e->x, x.raw(), &zero, e->y, y.raw()));
    return absl::OkStatus();
  }

  absl::Status Pool2DBackward(const Pool2DGeometry& g, const Tensor& x, const Tensor& y,
                              const Tensor& dy, const Tensor& workspace,
                              const Tensor& dx) override {
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(PoolEntry * e, PoolFor(g));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnPoolingBackward(cudnn_, e->pool, &one, e->y, y.raw(), e->y,
                                                       dy.raw(), e->x, x.raw(), &zero, e->x,
                                                       dx.raw()));
    return absl::OkStatus();
  }

  // --- Activations -----------------------------------------------------------------------------
  absl::Status ActivationForward(Activation kind, const Tensor& x, const Tensor& y) override {
    if (x.num_elements() == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(cudnnTensorDescriptor_t d, FlatDesc(x));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnActivationForward(cudnn_, ActivationDesc(kind), &one, d, x.raw(), &zero, d, y.raw()));
    return absl::OkStatus();
  }

  absl::Status ActivationBackward(Activation kind, const Tensor& x, const Tensor& y,
                                  const Tensor& dy, const Tensor& dx) override {
    if (x.num_elements() == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(cudnnTensorDescriptor_t d, FlatDesc(x));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnActivationBackward(cudnn_, ActivationDesc(kind), &one, d,
                                                          y.raw(), d, dy.raw(), d, x.raw(), &zero,
                                                          d, dx.raw()));
    return absl::OkStatus();
  }

  // --- Dropout ---------------------------------------------------------------------------------
  absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x, const Tensor& mask,
                              const Tensor& y) override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchDropoutForward(rate, seed, x.f32(), mask.f32(),
                                                            y.f32(), x.num_elements(), stream_));
    return absl::OkStatus();
  }

  absl::Status DropoutBackward(const Tensor& dy, const Tensor& mask, const Tensor& dx) override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchMultiply(dy.f32(), mask.f32(), dx.f32(), dy.num_elements(), stream_));
    return absl::OkStatus();
  }

  // --- Batch normalisation (cuDNN, spatial mode: one mean and variance per channel) -------------
  // save_mean holds the batch mean and save_var cuDNN's saved inverse standard deviation.
  absl::Status BatchNormForwardTraining(const BatchNormGeometry& g, const Tensor& x,
                                        const Tensor& gamma, const Tensor& beta, const Tensor& y,
                                        const Tensor& moving_mean, const Tensor& moving_var,
                                        const Tensor& save_mean, const Tensor& save_var) override {
    DeviceGuard guard(device_);
    cudnnTensorDescriptor_t xd = nullptr, sd = nullptr;
    TESSERA_RETURN_IF_ERROR(BatchNormDescs(g, &xd, &sd));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnBatchNormalizationForwardTraining(
        cudnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero, xd, x.raw(), xd, y.raw(), sd, gamma.raw(),
        beta.raw(), static_cast<double>(g.momentum), moving_mean.raw(), moving_var.raw(),
        static_cast<double>(g.epsilon), save_mean.raw(), save_var.raw()));
    return absl::OkStatus();
  }

  absl::Status BatchNormForwardInference(const BatchNormGeometry& g, const Tensor& x,
                                         const Tensor& gamma, const Tensor& beta,
                                         const Tensor& moving_mean, const Tensor& moving_var,
                                         const Tensor& y) override {
    DeviceGuard guard(device_);
    cudnnTensorDescriptor_t xd = nullptr, sd = nullptr;
    TESSERA_RETURN_IF_ERROR(BatchNormDescs(g, &xd, &sd));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnBatchNormalizationForwardInference(
        cudnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero, xd, x.raw(), xd, y.raw(), sd, gamma.raw(),
        beta.raw(), moving_mean.raw(), moving_var.raw(), static_cast<double>(g.epsilon)));
    return absl::OkStatus();
  }

  absl::Status BatchNormBackward(const BatchNormGeometry& g, const Tensor& x, const Tensor& gamma,
                                 const Tensor& save_mean, const Tensor& save_var, const Tensor& dy,
                                 const Tensor& dx, const Tensor& dgamma,
                                 const Tensor& dbeta) override {
    DeviceGuard guard(device_);
    cudnnTensorDescriptor_t xd = nullptr, sd = nullptr;
    TESSERA_RETURN_IF_ERROR(BatchNormDescs(g, &xd, &sd));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnBatchNormalizationBackward(
        cudnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero, &one, &zero, xd, x.raw(), xd, dy.raw(), xd,
        dx.raw(), sd, gamma.raw(), dgamma.raw(), dbeta.raw(), static_cast<double>(g.epsilon),
        save_mean.raw(), save_var.raw()));
    return absl::OkStatus();
  }

  // --- EmbeddingBag ----------------------------------------------------------------------------
  absl::Status EmbeddingBagForward(Combiner combiner, const Tensor& table, const Tensor& ids,
                                   const Tensor& offsets, const Tensor* values,
                                   const Tensor& out) override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchEmbeddingBagForward(
        combiner == Combiner::kMean, table.f32(), table.dim(1), ids.i64(), offsets.i64(),
        values != nullptr ? values->f32() : nullptr, out.dim(0), out.f32(), stream_));
    return absl::OkStatus();
  }

  absl::Status EmbeddingBagBackward(Combiner combiner, const Tensor& ids, const Tensor& offsets,
                                    const Tensor* values, const Tensor& dout,
                                    const Tensor& dtable) override {
    DeviceGuard guard(device_);
    if (dtable.num_bytes() > 0) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dtable.raw(), 0, dtable.num_bytes(), stream_));
    }
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchEmbeddingBagBackward(combiner == Combiner::kMean, dtable.dim(1), ids.i64(),
                                         offsets.i64(), values != nullptr ? values->f32() : nullptr,
                                         dout.dim(0), dout.f32(), dtable.f32(), stream_));
    return absl::OkStatus();
  }

  // --- Multi-input models ----------------------------------------------------------------------
  absl::Status CopyColumns(const Tensor& src, int64_t src_offset, const Tensor& dst,
                           int64_t dst_offset, int64_t width, bool accumulate) override {
    const int64_t rows = src.dim(0);
    if (rows == 0 || width == 0) return absl::OkStatus();
    const int64_t src_cols = src.num_elements() / rows, dst_cols = dst.num_elements() / rows;
    DeviceGuard guard(device_);
    if (accumulate) {
      TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchAddColumns(
          src.f32(), src_cols, src_offset, dst.f32(), dst_cols, dst_offset, rows, width, stream_));
      return absl::OkStatus();
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        dst.f32() + dst_offset, dst_cols * sizeof(float), src.f32() + src_offset,
        src_cols * sizeof(float), width * sizeof(float), rows, cudaMemcpyDeviceToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status DotInteractionForward(const Tensor& x, const Tensor& y, int64_t y_offset) override {
    const int64_t n = x.dim(0);
    if (n == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchDotInteractionForward(
        x.f32(), n, x.dim(1), x.dim(2), y.f32(), y.num_elements() / n, y_offset, stream_));
    return absl::OkStatus();
  }
  absl::Status DotInteractionBackward(const Tensor& x, const Tensor& dy, int64_t y_offset,
                                      const Tensor& dx) override {
    const int64_t n = x.dim(0);
    if (n == 0) return absl::OkStatus();
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchDotInteractionBackward(x.f32(), n, x.dim(1), x.dim(2),
                                                                    dy.f32(), dy.num_elements() / n,
                                                                    y_offset, dx.f32(), stream_));
    return absl::OkStatus();
  }

  // --- Losses ----------------------------------------------------------------------------------
  absl::Status LossForwardBackward(LossKind kind, const Tensor& logits, const Tensor& labels,
                                   const Tensor* dlogits, const Tensor& metrics) override {
    const int64_t n = logits.dim(0);
    const int64_t k = n > 0 ? logits.num_elements() / n : 0;
    DeviceGuard guard(device_);
    if (n == 0) {
      TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchFill(metrics.f32(), 2, 0.0f, stream_));
      return absl::OkStatus();
    }
    float* d = dlogits != nullptr ? dlogits->f32() : nullptr;
    TESSERA_ASSIGN_OR_RETURN(
        void* rows, loss_scratch_.Get(2 * static_cast<size_t>(n) * sizeof(float), stream_));
    float* row_loss = static_cast<float*>(rows);
    float* row_correct = row_loss + n;
    switch (kind) {
      case LossKind::kSoftmaxCrossEntropy: {
        TESSERA_RETURN_IF_ERROR(CheckFitsInt({n, k}, "LossForwardBackward"));
        TESSERA_ASSIGN_OR_RETURN(
            void* lp, log_probs_.Get(static_cast<size_t>(n * k) * sizeof(float), stream_));
        TESSERA_ASSIGN_OR_RETURN(cudnnTensorDescriptor_t desc, TensorDesc(n, k, 1, 1));
        const float one = 1.0f, zero = 0.0f;
        TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSoftmaxForward(cudnn_, CUDNN_SOFTMAX_LOG,
                                                          CUDNN_SOFTMAX_MODE_INSTANCE, &one, desc,
                                                          logits.raw(), &zero, desc, lp));
        TESSERA_CUDA_RETURN_IF_ERROR(
            cuda::LaunchSoftmaxCrossEntropy(static_cast<const float*>(lp), labels.i32(), n, k, d,
                                            row_loss, row_correct, metrics.f32(), stream_));
        break;
      }
      case LossKind::kSigmoidCrossEntropy:
        TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchSigmoidCrossEntropy(
            logits.f32(), labels.f32(), n, k, d, row_loss, row_correct, metrics.f32(), stream_));
        break;
      case LossKind::kMeanSquaredError:
        TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchMeanSquaredError(
            logits.f32(), labels.f32(), n, k, d, row_loss, row_correct, metrics.f32(), stream_));
        break;
    }
    return absl::OkStatus();
  }

  // --- Element-wise and reductions -------------------------------------------------------------
  absl::Status Axpy(float alpha, const Tensor& x, const Tensor& y) override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchAxpy(alpha, x.f32(), y.f32(), x.num_elements(), stream_));
    return absl::OkStatus();
  }

  absl::Status Scale(float alpha, const Tensor& x) override {
    DeviceGuard guard(device_);
    TESSERA_CUDA_RETURN_IF_ERROR(cuda::LaunchScale(alpha, x.f32(), x.num_elements(), stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<double> SquaredNorm(const Tensor& x) override {
    DeviceGuard guard(device_);
    TESSERA_ASSIGN_OR_RETURN(
        void* scratch,
        norm_scratch_.Get((cuda::kSquaredNormPartials + 1) * sizeof(double), stream_));
    double* partials = static_cast<double*>(scratch);
    double* result = partials + cuda::kSquaredNormPartials;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cuda::LaunchSquaredNorm(x.f32(), x.num_elements(), partials, result, stream_));
    TESSERA_ASSIGN_OR_RETURN(void* host, download_.Reserve(sizeof(double)));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, result, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    double value = 0;
    std::memcpy(&value, host, sizeof(double));
    return value;
  }

  // --- Optimizer -------------------------------------------------------------------------------
  absl::Status ApplyUpdate(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                           const Tensor& grad, const Tensor& w,
                           absl::Span<const Tensor> slots) override {
    if (static_cast<int>(slots.size()) != NumSlots(params.kind)) {
      return absl::InvalidArgumentError(absl::StrCat("ApplyUpdate: ", slots.size(),
                                                     " slots given, the optimizer needs ",
                                                     NumSlots(params.kind)));
    }
    std::vector<float*> slot_ptrs(slots.size() + 1, nullptr);
    for (size_t i = 0; i < slots.size(); ++i) slot_ptrs[i] = slots[i].f32();
    DeviceGuard guard(device_);
    return ApplyUpdateCuda(params, lr, t, grad_scale, grad.f32(), w.f32(), slot_ptrs.data(),
                           w.num_elements(), stream_);
  }

 private:
  cudnnActivationDescriptor_t ActivationDesc(Activation kind) const {
    switch (kind) {
      case Activation::kRelu:
        return activations_[0];
      case Activation::kTanh:
        return activations_[1];
      case Activation::kSigmoid:
        return activations_[2];
    }
    return activations_[0];
  }

  // A cached NCHW float descriptor; owned by the backend.
  absl::StatusOr<cudnnTensorDescriptor_t> TensorDesc(int64_t n, int64_t c, int64_t h, int64_t w) {
    TESSERA_RETURN_IF_ERROR(CheckFitsInt({n, c, h, w}, "cuDNN tensor"));
    const std::array<int, 4> key = {I(n), I(c), I(h), I(w)};
    auto it = tensor_descs_.find(key);
    if (it != tensor_descs_.end()) return it->second;
    cudnnTensorDescriptor_t d = nullptr;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreateTensorDescriptor(&d));
    const cudnnStatus_t st =
        cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, I(n), I(c), I(h), I(w));
    if (st != CUDNN_STATUS_SUCCESS) {
      cudnnDestroyTensorDescriptor(d);
      return cuda::CudnnStatus(st, "cudnnSetTensor4dDescriptor");
    }
    tensor_descs_.emplace(key, d);
    return d;
  }

  // Any tensor, read as [dim(0), rest, 1, 1], for the element-wise cuDNN ops.
  absl::StatusOr<cudnnTensorDescriptor_t> FlatDesc(const Tensor& t) {
    const int64_t n = t.rank() > 0 ? t.dim(0) : 1;
    const int64_t rest = n > 0 ? t.num_elements() / n : 0;
    return TensorDesc(n, rest, 1, 1);
  }

  absl::Status BatchNormDescs(const BatchNormGeometry& g, cudnnTensorDescriptor_t* x,
                              cudnnTensorDescriptor_t* stats) {
    TESSERA_ASSIGN_OR_RETURN(*x, TensorDesc(g.n, g.c, g.spatial, 1));
    TESSERA_ASSIGN_OR_RETURN(*stats, TensorDesc(1, g.c, 1, 1));
    return absl::OkStatus();
  }

  absl::StatusOr<ConvEntry*> ConvFor(const Conv2DGeometry& g) {
    const std::array<int64_t, 11> key = {g.n,  g.c,        g.h,        g.w,     g.k,    g.kh,
                                         g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
    std::unique_ptr<ConvEntry>& slot = conv_[key];
    if (slot != nullptr) return slot.get();
    TESSERA_RETURN_IF_ERROR(CheckFitsInt(
        {g.n, g.c, g.h, g.w, g.k, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.oh, g.ow},
        "Conv2D"));
    auto e = std::make_unique<ConvEntry>();
    TESSERA_ASSIGN_OR_RETURN(e->x, TensorDesc(g.n, g.c, g.h, g.w));
    TESSERA_ASSIGN_OR_RETURN(e->y, TensorDesc(g.n, g.k, g.oh, g.ow));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreateFilterDescriptor(&e->w));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetFilter4dDescriptor(
        e->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, I(g.k), I(g.c), I(g.kh), I(g.kw)));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreateConvolutionDescriptor(&e->conv));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolution2dDescriptor(
        e->conv, I(g.pad_h), I(g.pad_w), I(g.stride_h), I(g.stride_w), 1, 1,
        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, CUDNN_FMA_MATH));
    int on = 0, oc = 0, oh = 0, ow = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnGetConvolution2dForwardOutputDim(e->conv, e->x, e->w, &on, &oc, &oh, &ow));
    if (oh != g.oh || ow != g.ow || on != g.n || oc != g.k) {
      return absl::InvalidArgumentError(
          absl::StrCat("Conv2D: output ", ShapeString({g.n, g.k, g.oh, g.ow}),
                       " does not match cuDNN's ", ShapeString({on, oc, oh, ow})));
    }

    int max_count = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionForwardAlgorithmMaxCount(cudnn_, &max_count));
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<size_t>(std::max(max_count, 1)));
    int returned = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionForwardAlgorithm_v7(
        cudnn_, e->x, e->w, e->conv, e->y, static_cast<int>(perf.size()), &returned, perf.data()));
    const int pick = PickAlgorithm(perf.data(), returned);
    if (pick < 0) {
      return absl::InternalError(absl::StrCat("Conv2D: cuDNN offers no forward algorithm for x ",
                                              ShapeString({g.n, g.c, g.h, g.w})));
    }
    e->fwd_algo = perf[pick].algo;
    e->fwd_math = PickMath(perf[pick].mathType);
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, e->fwd_math));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionForwardWorkspaceSize(
        cudnn_, e->x, e->w, e->conv, e->y, e->fwd_algo, &e->fwd_bytes));
    slot = std::move(e);
    return slot.get();
  }

  absl::Status InitConvBackward(ConvEntry* e) {
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, CUDNN_FMA_MATH));
    int max_count = 0;
    int returned = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnn_, &max_count));
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> data_perf(
        static_cast<size_t>(std::max(max_count, 1)));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionBackwardDataAlgorithm_v7(
        cudnn_, e->w, e->y, e->conv, e->x, static_cast<int>(data_perf.size()), &returned,
        data_perf.data()));
    const int data_pick = PickAlgorithm(data_perf.data(), returned);
    if (data_pick < 0) {
      return absl::InternalError("Conv2D: cuDNN offers no backward-data algorithm");
    }

    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnn_, &max_count));
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> filter_perf(
        static_cast<size_t>(std::max(max_count, 1)));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        cudnn_, e->x, e->y, e->conv, e->w, static_cast<int>(filter_perf.size()), &returned,
        filter_perf.data()));
    const int filter_pick = PickAlgorithm(filter_perf.data(), returned);
    if (filter_pick < 0) {
      return absl::InternalError("Conv2D: cuDNN offers no backward-filter algorithm");
    }

    e->bwd_data_algo = data_perf[data_pick].algo;
    e->bwd_data_math = PickMath(data_perf[data_pick].mathType);
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, e->bwd_data_math));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionBackwardDataWorkspaceSize(
        cudnn_, e->w, e->y, e->conv, e->x, e->bwd_data_algo, &e->bwd_data_bytes));
    e->bwd_filter_algo = filter_perf[filter_pick].algo;
    e->bwd_filter_math = PickMath(filter_perf[filter_pick].mathType);
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnSetConvolutionMathType(e->conv, e->bwd_filter_math));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnGetConvolutionBackwardFilterWorkspaceSize(
        cudnn_, e->x, e->y, e->conv, e->w, e->bwd_filter_algo, &e->bwd_filter_bytes));
    e->bwd_ready = true;
    return absl::OkStatus();
  }

  absl::StatusOr<PoolEntry*> PoolFor(const Pool2DGeometry& g) {
    const std::array<int64_t, 11> key = {static_cast<int64_t>(g.kind),
                                         g.n,
                                         g.c,
                                         g.h,
                                         g.w,
                                         g.kh,
                                         g.kw,
                                         g.stride_h,
                                         g.stride_w,
                                         g.pad_h,
                                         g.pad_w};
    std::unique_ptr<PoolEntry>& slot = pool_[key];
    if (slot != nullptr) return slot.get();
    TESSERA_RETURN_IF_ERROR(
        CheckFitsInt({g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.oh, g.ow}, "Pool2D"));
    auto e = std::make_unique<PoolEntry>();
    TESSERA_ASSIGN_OR_RETURN(e->x, TensorDesc(g.n, g.c, g.h, g.w));
    TESSERA_ASSIGN_OR_RETURN(e->y, TensorDesc(g.n, g.c, g.oh, g.ow));
    TESSERA_CUDNN_RETURN_IF_ERROR(cudnnCreatePoolingDescriptor(&e->pool));
    const cudnnPoolingMode_t mode = g.kind == PoolKind::kMax
                                        ? CUDNN_POOLING_MAX_DETERMINISTIC
                                        : CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnSetPooling2dDescriptor(e->pool, mode, CUDNN_NOT_PROPAGATE_NAN, I(g.kh), I(g.kw),
                                    I(g.pad_h), I(g.pad_w), I(g.stride_h), I(g.stride_w)));
    int on = 0, oc = 0, oh = 0, ow = 0;
    TESSERA_CUDNN_RETURN_IF_ERROR(
        cudnnGetPooling2dForwardOutputDim(e->pool, e->x, &on, &oc, &oh, &ow));
    if (oh != g.oh || ow != g.ow) {
      return absl::InvalidArgumentError(
          absl::StrCat("Pool2D: output ", ShapeString({g.n, g.c, g.oh, g.ow}),
                       " does not match cuDNN's ", ShapeString({on, oc, oh, ow})));
    }
    slot = std::move(e);
    return slot.get();
  }

  const int device_;
  std::string description_;
  std::shared_ptr<StreamOwner> owner_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  std::array<cudnnActivationDescriptor_t, 3> activations_ = {nullptr, nullptr, nullptr};
  std::map<std::array<int, 4>, cudnnTensorDescriptor_t> tensor_descs_;
  std::map<std::array<int64_t, 11>, std::unique_ptr<ConvEntry>> conv_;
  std::map<std::array<int64_t, 11>, std::unique_ptr<PoolEntry>> pool_;
  DeviceScratch workspace_;     // convolution workspace, shared by every geometry
  DeviceScratch loss_scratch_;  // per-row loss and correctness
  DeviceScratch log_probs_;     // log-softmax of the logits
  DeviceScratch norm_scratch_;  // SquaredNorm partial sums
  std::array<UploadSlot, kUploadSlots> upload_;
  int next_upload_ = 0;
  PinnedBuffer download_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options) {
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: no usable CUDA device (", CudaUnavailableReason(), ")"));
  }
  if (options.cuda_device < 0 || options.cuda_device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_device: must be in [0, ", count, "), got ", options.cuda_device));
  }
  auto backend = std::make_unique<CudaBackend>(options.cuda_device);
  TESSERA_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace tessera::kernels
