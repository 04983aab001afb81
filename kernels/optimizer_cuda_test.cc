#include "kernels/optimizer_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "kernels/optimizer.h"
#include "spec/optimizer_spec.h"

namespace tessera::kernels {
namespace {

#define SKIP_WITHOUT_GPU()                                               \
  do {                                                                   \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << CudaUnavailableReason(); \
  } while (0)

// Device buffer of n floats, freed on destruction.
class DeviceFloats {
 public:
  explicit DeviceFloats(const std::vector<float>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, n_ * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceFloats() { cudaFree(ptr_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  float* get() const { return ptr_; }
  std::vector<float> ToHost() const {
    std::vector<float> host(n_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, n_ * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  size_t n_;
  float* ptr_ = nullptr;
};

struct CudaCase {
  std::string name;
  bool sparse;
  std::function<void(v1::OptimizerConfig&)> configure;
  // |gpu - cpu| <= rel * |cpu| + abs. CUDA's powf is within 4 ulp rather than glibc's 1, and
  // FTRL's n'^p - n^p cancels, hence the wider bound for lr_power != -0.5.
  double rel = 1e-5;
  double abs = 1e-6;
};

void PrintTo(const CudaCase& c, std::ostream* os) { *os << c.name; }

class ApplyUpdateCudaTest : public ::testing::TestWithParam<CudaCase> {};

// The GPU and the CPU kernels agree on random data to within rounding (the GPU contracts
// multiply-adds into FMAs), over several steps and sizes that are not multiples of a block.
TEST_P(ApplyUpdateCudaTest, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  v1::OptimizerConfig config;
  config.set_learning_rate(0.05f);
  GetParam().configure(config);
  ASSERT_TRUE(spec::ValidateOptimizer(config, GetParam().sparse).ok());
  const OptimizerParams params = MakeOptimizerParams(config);
  const double rel = GetParam().rel;
  const double abs = GetParam().abs;
  const int num_slots = NumSlots(params.kind);
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (const int64_t n : {int64_t{1}, int64_t{1000}, (int64_t{1} << 20) + 3}) {
    SCOPED_TRACE(absl::StrCat("n = ", n));
    std::vector<float> w(n);
    for (float& x : w) x = uniform(rng);
    std::vector<std::vector<float>> slots(num_slots);
    for (int s = 0; s < num_slots; ++s) slots[s].assign(n, SlotInitialValue(params, s));

    DeviceFloats d_w(w);
    std::vector<std::unique_ptr<DeviceFloats>> d_slots;
    std::vector<float*> d_slot_ptrs, slot_ptrs;
    for (int s = 0; s < num_slots; ++s) {
      d_slots.push_back(std::make_unique<DeviceFloats>(slots[s]));
      d_slot_ptrs.push_back(d_slots.back()->get());
      slot_ptrs.push_back(slots[s].data());
    }
    std::vector<float> g(n);
    for (int64_t t = 1; t <= 4; ++t) {
      for (float& x : g) x = uniform(rng);
      DeviceFloats d_g(g);
      const float lr = 0.05f / static_cast<float>(t);
      const absl::Status status = ApplyUpdateCuda(params, lr, t, 0.5f, d_g.get(), d_w.get(),
                                                  d_slot_ptrs.data(), n, nullptr);
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ApplyUpdateCpu(params, lr, t, 0.5f, g.data(), w.data(), slot_ptrs.data(), n);
    }
    const std::vector<float> gpu_w = d_w.ToHost();
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(gpu_w[i], w[i], rel * std::abs(w[i]) + abs) << "w[" << i << "]";
    }
    for (int s = 0; s < num_slots; ++s) {
      const std::vector<float> gpu_slot = d_slots[s]->ToHost();
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(gpu_slot[i], slots[s][i], rel * std::abs(slots[s][i]) + abs)
            << "slot" << s << "[" << i << "]";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllKinds, ApplyUpdateCudaTest,
    ::testing::ValuesIn(std::vector<CudaCase>{
        {"Sgd", false,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_SGD);
           c.set_weight_decay(0.01f);
         }},
        {"Momentum", false,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
           c.set_momentum(0.9f);
         }},
        {"Nesterov", false,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_NESTEROV);
           c.set_momentum(0.9f);
           c.set_weight_decay(0.01f);
         }},
        {"Adagrad", false, [](auto& c) { c.set_kind(v1::OPTIMIZER_KIND_ADAGRAD); }},
        {"Adam", false,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_ADAM);
           c.set_weight_decay(0.01f);
         }},
        {"AdamW", false,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_ADAMW);
           c.set_weight_decay(0.1f);
         }},
        {"Ftrl", true,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_FTRL);
           c.set_ftrl_l1(0.01f);
           c.set_ftrl_l2(0.01f);
         }},
        {"FtrlLrPower", true,
         [](auto& c) {
           c.set_kind(v1::OPTIMIZER_KIND_FTRL);
           c.set_ftrl_lr_power(-0.3f);
         },
         1e-4, 1e-5},
    }),
    [](const ::testing::TestParamInfo<CudaCase>& info) { return info.param.name; });

// Argument checks come before any CUDA call, so they run without a GPU too.
TEST(ApplyUpdateCudaArgsTest, RejectsBadArguments) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_ADAM);
  config.set_learning_rate(0.1f);
  ASSERT_TRUE(spec::ValidateOptimizer(config, false).ok());
  const OptimizerParams adam = MakeOptimizerParams(config);
  float* no_slots[] = {nullptr, nullptr};
  float fake = 0.0f;  // never dereferenced: every call below fails validation first
  EXPECT_EQ(ApplyUpdateCuda(adam, 0.1f, 1, 1.0f, &fake, &fake, no_slots, -1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyUpdateCuda(adam, 0.1f, 1, 1.0f, nullptr, &fake, no_slots, 4, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyUpdateCuda(adam, 0.1f, 1, 1.0f, &fake, &fake, nullptr, 4, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyUpdateCuda(adam, 0.1f, 1, 1.0f, &fake, &fake, no_slots, 4, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  float* slots[] = {&fake, &fake};
  EXPECT_EQ(ApplyUpdateCuda(adam, 0.1f, 0, 1.0f, &fake, &fake, slots, 4, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  OptimizerParams unspecified = adam;
  unspecified.kind = v1::OPTIMIZER_KIND_UNSPECIFIED;
  EXPECT_EQ(ApplyUpdateCuda(unspecified, 0.1f, 1, 1.0f, &fake, &fake, slots, 4, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ApplyUpdateCuda(adam, 0.1f, 1, 1.0f, &fake, &fake, slots, 0, nullptr).ok());
}

}  // namespace
}  // namespace tessera::kernels
