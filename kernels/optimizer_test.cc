#include "kernels/optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_cuda.h"
#include "spec/optimizer_spec.h"

namespace tessera::kernels {
namespace {

using ::testing::HasSubstr;

// A config through spec's rules (spec/optimizer_spec.h), then the update's hyper-parameters.
absl::StatusOr<OptimizerParams> ValidParams(const v1::OptimizerConfig& config, bool sparse) {
  TESSERA_RETURN_IF_ERROR(spec::ValidateOptimizer(config, sparse));
  return MakeOptimizerParams(config);
}

// An independent double-precision statement of each rule, written from the papers and the
// PyTorch/TensorFlow documentation rather than from optimizer_cpu.cc. `slots` holds NumSlots(kind)
// arrays. Every step: g' = scale * g + wd * w (not for AdamW).
void ReferenceStep(const OptimizerParams& p, double lr, int64_t t, double scale,
                   const std::vector<float>& g, std::vector<double>& w,
                   std::vector<std::vector<double>>& slots) {
  const double wd = p.weight_decay;
  const double mu = p.momentum;
  const double eps = p.epsilon;
  const double b1 = p.beta1;
  const double b2 = p.beta2;
  for (size_t i = 0; i < w.size(); ++i) {
    const bool adamw = p.kind == v1::OPTIMIZER_KIND_ADAMW;
    const double gi = scale * static_cast<double>(g[i]) + (adamw ? 0.0 : wd * w[i]);
    switch (p.kind) {
      case v1::OPTIMIZER_KIND_SGD:
        w[i] = w[i] - lr * gi;
        break;
      case v1::OPTIMIZER_KIND_MOMENTUM: {
        double& v = slots[0][i];
        v = mu * v + gi;
        w[i] = w[i] - lr * v;
        break;
      }
      case v1::OPTIMIZER_KIND_NESTEROV: {
        double& v = slots[0][i];
        v = mu * v + gi;
        w[i] = w[i] - lr * (gi + mu * v);
        break;
      }
      case v1::OPTIMIZER_KIND_ADAGRAD: {
        double& acc = slots[0][i];
        acc += gi * gi;
        w[i] = w[i] - lr * gi / (std::sqrt(acc) + eps);
        break;
      }
      case v1::OPTIMIZER_KIND_ADAM:
      case v1::OPTIMIZER_KIND_ADAMW: {
        double& m = slots[0][i];
        double& v = slots[1][i];
        if (adamw) w[i] = w[i] - lr * wd * w[i];
        m = b1 * m + (1 - b1) * gi;
        v = b2 * v + (1 - b2) * gi * gi;
        const double m_hat = m / (1 - std::pow(b1, static_cast<double>(t)));
        const double v_hat = v / (1 - std::pow(b2, static_cast<double>(t)));
        w[i] = w[i] - lr * m_hat / (std::sqrt(v_hat) + eps);
        break;
      }
      case v1::OPTIMIZER_KIND_FTRL: {
        // tf.raw_ops.ApplyFtrlV2 with l2_shrinkage 0, beta folded into l2 as Keras' Ftrl does.
        double& linear = slots[0][i];
        double& accum = slots[1][i];
        const double power = -static_cast<double>(p.ftrl_lr_power);
        const double l1 = p.ftrl_l1;
        const double l2 = static_cast<double>(p.ftrl_l2) + p.ftrl_beta / (2 * lr);
        const double new_accum = accum + gi * gi;
        linear += gi - (std::pow(new_accum, power) - std::pow(accum, power)) / lr * w[i];
        const double quadratic = std::pow(new_accum, power) / lr + 2 * l2;
        w[i] = std::abs(linear) > l1 ? ((linear > 0 ? l1 : -l1) - linear) / quadratic : 0.0;
        accum = new_accum;
        break;
      }
      default:
        FAIL() << "no reference for kind " << p.kind;
    }
  }
}

// True when got is within rel * |want| + abs of want.
::testing::AssertionResult Near(const char* what, size_t i, double got, double want) {
  constexpr double kRel = 1e-5;
  constexpr double kAbs = 1e-6;
  if (std::abs(got - want) <= kRel * std::abs(want) + kAbs) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << "[" << i << "] = " << got << ", reference "
                                       << want << " (diff " << got - want << ")";
}

struct UpdateCase {
  std::string name;
  bool sparse;
  std::function<void(v1::OptimizerConfig&)> configure;
};

void PrintTo(const UpdateCase& c, std::ostream* os) { *os << c.name; }

std::vector<UpdateCase> UpdateCases() {
  using C = v1::OptimizerConfig;
  return {
      {"Sgd", false, [](C& c) { c.set_kind(v1::OPTIMIZER_KIND_SGD); }},
      {"SgdWeightDecay", false,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_SGD);
         c.set_weight_decay(0.05f);
       }},
      {"SgdSparse", true, [](C& c) { c.set_kind(v1::OPTIMIZER_KIND_SGD); }},
      {"Momentum", false,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
         c.set_momentum(0.9f);
       }},
      {"MomentumWeightDecay", false,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
         c.set_momentum(0.5f);
         c.set_weight_decay(0.01f);
       }},
      {"Nesterov", false,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_NESTEROV);
         c.set_momentum(0.9f);
       }},
      {"NesterovWeightDecay", false,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_NESTEROV);
         c.set_momentum(0.7f);
         c.set_weight_decay(0.02f);
       }},
      {"Adagrad", false, [](C& c) { c.set_kind(v1::OPTIMIZER_KIND_ADAGRAD); }},
      {"AdagradCustom", true,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_ADAGRAD);
         c.set_initial_accumulator(0.5f);
         c.set_epsilon(1e-6f);
         c.set_weight_decay(0.01f);
       }},
      {"Adam", false, [](C& c) { c.set_kind(v1::OPTIMIZER_KIND_ADAM); }},
      {"AdamCustom", true,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_ADAM);
         c.set_beta1(0.8f);
         c.set_beta2(0.99f);
         c.set_epsilon(1e-6f);
         c.set_weight_decay(0.01f);
       }},
      {"AdamW", false,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_ADAMW);
         c.set_weight_decay(0.1f);
       }},
      {"Ftrl", true, [](C& c) { c.set_kind(v1::OPTIMIZER_KIND_FTRL); }},
      {"FtrlRegularised", true,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_FTRL);
         c.set_ftrl_l1(0.05f);
         c.set_ftrl_l2(0.01f);
         c.set_ftrl_beta(0.5f);
         c.set_weight_decay(0.01f);
       }},
      {"FtrlLrPower", true,
       [](C& c) {
         c.set_kind(v1::OPTIMIZER_KIND_FTRL);
         c.set_ftrl_l1(0.02f);
         c.set_ftrl_lr_power(-0.3f);
       }},
  };
}

class ApplyUpdateCpuTest : public ::testing::TestWithParam<UpdateCase> {};

// The case's optimizer at learning rate 0.1.
absl::StatusOr<OptimizerParams> ParamsOf(const UpdateCase& c) {
  v1::OptimizerConfig config;
  config.set_learning_rate(0.1f);
  c.configure(config);
  return ValidParams(config, c.sparse);
}

// Several random sizes (one above the threshold where OpenMP splits the work), five steps each
// with a different learning rate, compared element by element with ReferenceStep.
TEST_P(ApplyUpdateCpuTest, MatchesDoublePrecisionReference) {
  const absl::StatusOr<OptimizerParams> params = ParamsOf(GetParam());
  ASSERT_TRUE(params.ok()) << params.status();
  const int num_slots = NumSlots(params->kind);

  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int64_t> small_size(1, 5000);
  const std::vector<int64_t> sizes = {
      1, 3, 16, small_size(rng), small_size(rng), (int64_t{1} << 16) + 77};
  for (const int64_t n : sizes) {
    SCOPED_TRACE(absl::StrCat("n = ", n));
    std::vector<float> w(n);
    for (float& x : w) x = uniform(rng);
    std::vector<std::vector<float>> slots(num_slots);
    std::vector<float*> slot_ptrs;
    for (int s = 0; s < num_slots; ++s) {
      slots[s].assign(n, SlotInitialValue(*params, s));
      slot_ptrs.push_back(slots[s].data());
    }
    std::vector<double> ref_w(w.begin(), w.end());
    std::vector<std::vector<double>> ref_slots;
    for (const auto& s : slots) ref_slots.emplace_back(s.begin(), s.end());

    std::vector<float> g(n);
    for (int64_t t = 1; t <= 5; ++t) {
      for (float& x : g) x = uniform(rng);
      const float lr = 0.1f / static_cast<float>(t);
      const float scale = t % 2 == 0 ? 0.5f : 1.0f;
      ApplyUpdateCpu(*params, lr, t, scale, g.data(), w.data(), slot_ptrs.data(), n);
      ReferenceStep(*params, lr, t, scale, g, ref_w, ref_slots);
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(Near("w", i, w[i], ref_w[i]));
      for (int s = 0; s < num_slots; ++s) {
        ASSERT_TRUE(Near(absl::StrCat("slot", s).c_str(), i, slots[s][i], ref_slots[s][i]));
      }
    }
  }
}

// The gradient read from bytes at every misalignment gives the aligned update bit for bit, over
// sizes on both sides of the OpenMP split.
TEST_P(ApplyUpdateCpuTest, UnalignedGradientBytesGiveTheSameUpdateBitForBit) {
  const absl::StatusOr<OptimizerParams> params = ParamsOf(GetParam());
  ASSERT_TRUE(params.ok()) << params.status();
  const int num_slots = NumSlots(params->kind);
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (const int64_t n : {int64_t{1}, int64_t{37}, int64_t{4099}, (int64_t{1} << 16) + 5}) {
    for (size_t misalign = 0; misalign < 4; ++misalign) {
      SCOPED_TRACE(absl::StrCat("n = ", n, ", misaligned by ", misalign));
      std::vector<float> w0(n);
      for (float& x : w0) x = uniform(rng);
      std::vector<float> aligned_w = w0;
      std::vector<float> bytes_w = w0;
      std::vector<std::vector<float>> aligned_slots(num_slots), bytes_slots(num_slots);
      std::vector<float*> aligned_ptrs, bytes_ptrs;
      for (int s = 0; s < num_slots; ++s) {
        aligned_slots[s].assign(n, SlotInitialValue(*params, s));
        bytes_slots[s] = aligned_slots[s];
        aligned_ptrs.push_back(aligned_slots[s].data());
        bytes_ptrs.push_back(bytes_slots[s].data());
      }
      std::vector<float> g(n);
      std::vector<unsigned char> raw(4 * n + misalign);
      for (int64_t t = 1; t <= 3; ++t) {
        for (float& x : g) x = uniform(rng);
        std::memcpy(raw.data() + misalign, g.data(), 4 * n);
        const float lr = 0.05f * static_cast<float>(t);
        ApplyUpdateCpu(*params, lr, t, 0.75f, g.data(), aligned_w.data(), aligned_ptrs.data(), n);
        ApplyUpdateCpuUnaligned(*params, lr, t, 0.75f, raw.data() + misalign, bytes_w.data(),
                                bytes_ptrs.data(), n);
      }
      ASSERT_EQ(0, std::memcmp(aligned_w.data(), bytes_w.data(), 4 * n));
      ASSERT_NE(0, std::memcmp(aligned_w.data(), w0.data(), 4 * n));  // the update did something
      for (int s = 0; s < num_slots; ++s) {
        ASSERT_EQ(0, std::memcmp(aligned_slots[s].data(), bytes_slots[s].data(), 4 * n)) << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllKinds, ApplyUpdateCpuTest, ::testing::ValuesIn(UpdateCases()),
                         [](const ::testing::TestParamInfo<UpdateCase>& info) {
                           return info.param.name;
                         });

OptimizerParams Params(v1::OptimizerKind kind, float momentum = 0.0f) {
  v1::OptimizerConfig config;
  config.set_kind(kind);
  config.set_learning_rate(0.1f);
  config.set_momentum(momentum);
  return ValidParams(config, kind == v1::OPTIMIZER_KIND_FTRL).value();
}

// Momentum by hand: w = 1, g = 1, lr = 0.1, mu = 0.9.
// Step 1: v = 1, w = 1 - 0.1 = 0.9. Step 2: v = 0.9 + 1 = 1.9, w = 0.9 - 0.19 = 0.71.
TEST(ApplyUpdateCpuByHandTest, MomentumByHand) {
  const OptimizerParams p = Params(v1::OPTIMIZER_KIND_MOMENTUM, 0.9f);
  float w = 1.0f, v = 0.0f, g = 1.0f;
  float* slots[] = {&v};
  ApplyUpdateCpu(p, 0.1f, 1, 1.0f, &g, &w, slots, 1);
  EXPECT_FLOAT_EQ(v, 1.0f);
  EXPECT_FLOAT_EQ(w, 0.9f);
  ApplyUpdateCpu(p, 0.1f, 2, 1.0f, &g, &w, slots, 1);
  EXPECT_FLOAT_EQ(v, 1.9f);
  EXPECT_FLOAT_EQ(w, 0.71f);
}

// Nesterov by hand, same inputs. Step 1: v = 1, w = 1 - 0.1 * (1 + 0.9) = 0.81.
// Step 2: v = 1.9, w = 0.81 - 0.1 * (1 + 1.71) = 0.539.
TEST(ApplyUpdateCpuByHandTest, NesterovByHand) {
  const OptimizerParams p = Params(v1::OPTIMIZER_KIND_NESTEROV, 0.9f);
  float w = 1.0f, v = 0.0f, g = 1.0f;
  float* slots[] = {&v};
  ApplyUpdateCpu(p, 0.1f, 1, 1.0f, &g, &w, slots, 1);
  EXPECT_FLOAT_EQ(w, 0.81f);
  ApplyUpdateCpu(p, 0.1f, 2, 1.0f, &g, &w, slots, 1);
  EXPECT_FLOAT_EQ(v, 1.9f);
  EXPECT_FLOAT_EQ(w, 0.539f);
}

// Adam's first bias-corrected step is lr * g / (|g| + eps): about lr * sign(g) for any scale of g.
TEST(ApplyUpdateCpuByHandTest, AdamFirstStepIsLearningRateTimesSign) {
  const OptimizerParams p = Params(v1::OPTIMIZER_KIND_ADAM);
  std::vector<float> g = {1e-3f, -2.0f, 50.0f};
  std::vector<float> w = {0.0f, 0.0f, 0.0f}, m(3, 0.0f), v(3, 0.0f);
  float* slots[] = {m.data(), v.data()};
  ApplyUpdateCpu(p, 0.01f, 1, 1.0f, g.data(), w.data(), slots, 3);
  EXPECT_NEAR(w[0], -0.01f, 1e-6);
  EXPECT_NEAR(w[1], 0.01f, 1e-6);
  EXPECT_NEAR(w[2], -0.01f, 1e-6);
}

// FTRL with l1 keeps a coordinate at exactly 0 while |z| <= l1. Default beta 1, lr 0.1:
// w = 0.2, g = 0.05: n = 0.0025, sigma = 0.05 / 0.1 = 0.5, z = 0.05 - 0.5 * 0.2 = -0.05, and
// |z| <= l1 = 0.1 gives w = 0 (without l1 it would be 0.05 / ((0.05 + 1) / 0.1) = 0.00476).
// g = 1: z = 1, n = 1, w = -(1 - 0.1) / ((1 + 1) / 0.1) = -0.045.
TEST(ApplyUpdateCpuByHandTest, FtrlL1GivesExactZeros) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_FTRL);
  config.set_learning_rate(0.1f);
  config.set_ftrl_l1(0.1f);
  const OptimizerParams p = ValidParams(config, /*sparse=*/true).value();
  std::vector<float> g = {0.05f, 1.0f};
  std::vector<float> w = {0.2f, 0.0f}, z(2, 0.0f), n(2, 0.0f);
  float* slots[] = {z.data(), n.data()};
  ApplyUpdateCpu(p, 0.1f, 1, 1.0f, g.data(), w.data(), slots, 2);
  EXPECT_FLOAT_EQ(z[0], -0.05f);
  EXPECT_EQ(w[0], 0.0f);
  EXPECT_FLOAT_EQ(n[1], 1.0f);
  EXPECT_FLOAT_EQ(w[1], -0.045f);
}

TEST(ApplyUpdateCpuByHandTest, EmptyUpdateTouchesNothing) {
  const OptimizerParams p = Params(v1::OPTIMIZER_KIND_SGD);
  float w = 2.0f, g = 1.0f;
  ApplyUpdateCpu(p, 0.1f, 1, 1.0f, &g, &w, nullptr, 0);
  EXPECT_EQ(w, 2.0f);
}

#ifndef TESSERA_HAVE_CUDA
TEST(ApplyUpdateCudaFallbackTest, FailsInBuildWithoutCuda) {
  const OptimizerParams p = Params(v1::OPTIMIZER_KIND_SGD);
  float w = 2.0f, g = 1.0f;
  EXPECT_EQ(ApplyUpdateCuda(p, 0.1f, 1, 1.0f, &g, &w, nullptr, 1, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(w, 2.0f);
}
#endif  // TESSERA_HAVE_CUDA

TEST(NumSlotsTest, PerKind) {
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_SGD), 0);
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_MOMENTUM), 1);
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_NESTEROV), 1);
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_ADAGRAD), 1);
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_ADAM), 2);
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_ADAMW), 2);
  EXPECT_EQ(NumSlots(v1::OPTIMIZER_KIND_FTRL), 2);
}

TEST(SlotInitialValueTest, AdagradAccumulatorStartsAtInitialAccumulator) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_ADAGRAD);
  config.set_learning_rate(0.1f);
  EXPECT_FLOAT_EQ(SlotInitialValue(ValidParams(config, false).value(), 0), 0.1f);
  config.set_initial_accumulator(0.25f);
  EXPECT_FLOAT_EQ(SlotInitialValue(ValidParams(config, false).value(), 0), 0.25f);
  EXPECT_EQ(SlotInitialValue(Params(v1::OPTIMIZER_KIND_ADAM), 1), 0.0f);
  EXPECT_EQ(SlotInitialValue(Params(v1::OPTIMIZER_KIND_FTRL), 1), 0.0f);
  EXPECT_EQ(SlotInitialValue(Params(v1::OPTIMIZER_KIND_MOMENTUM), 0), 0.0f);
}

TEST(MakeOptimizerParamsTest, ZeroMeansDefault) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_FTRL);
  config.set_learning_rate(0.5f);
  const OptimizerParams p = ValidParams(config, /*sparse=*/true).value();
  EXPECT_EQ(p.kind, v1::OPTIMIZER_KIND_FTRL);
  EXPECT_EQ(p.learning_rate, 0.5f);
  EXPECT_EQ(p.beta1, 0.9f);
  EXPECT_EQ(p.beta2, 0.999f);
  EXPECT_EQ(p.epsilon, 1e-8f);
  EXPECT_EQ(p.initial_accumulator, 0.1f);
  EXPECT_EQ(p.ftrl_beta, 1.0f);
  EXPECT_EQ(p.ftrl_lr_power, -0.5f);
  EXPECT_EQ(p.momentum, 0.0f);
  EXPECT_EQ(p.weight_decay, 0.0f);
}

TEST(MakeOptimizerParamsTest, KeepsGivenValues) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_ADAMW);
  config.set_learning_rate(0.002f);
  config.set_momentum(0.3f);
  config.set_beta1(0.5f);
  config.set_beta2(0.75f);
  config.set_epsilon(1e-4f);
  config.set_weight_decay(0.25f);
  config.set_initial_accumulator(2.0f);
  config.set_ftrl_beta(3.0f);
  config.set_ftrl_l1(0.125f);
  config.set_ftrl_l2(0.0625f);
  config.set_ftrl_lr_power(-1.0f);
  const OptimizerParams p = ValidParams(config, /*sparse=*/false).value();
  EXPECT_EQ(p.kind, v1::OPTIMIZER_KIND_ADAMW);
  EXPECT_EQ(p.learning_rate, 0.002f);
  EXPECT_EQ(p.momentum, 0.3f);
  EXPECT_EQ(p.beta1, 0.5f);
  EXPECT_EQ(p.beta2, 0.75f);
  EXPECT_EQ(p.epsilon, 1e-4f);
  EXPECT_EQ(p.weight_decay, 0.25f);
  EXPECT_EQ(p.initial_accumulator, 2.0f);
  EXPECT_EQ(p.ftrl_beta, 3.0f);
  EXPECT_EQ(p.ftrl_l1, 0.125f);
  EXPECT_EQ(p.ftrl_l2, 0.0625f);
  EXPECT_EQ(p.ftrl_lr_power, -1.0f);
}

TEST(MakeOptimizerParamsTest, AllowedKinds) {
  struct KindCase {
    v1::OptimizerKind kind;
    bool sparse;
    bool ok;
  };
  const KindCase cases[] = {
      {v1::OPTIMIZER_KIND_SGD, false, true},
      {v1::OPTIMIZER_KIND_SGD, true, true},
      {v1::OPTIMIZER_KIND_MOMENTUM, false, true},
      {v1::OPTIMIZER_KIND_MOMENTUM, true, false},
      {v1::OPTIMIZER_KIND_NESTEROV, false, true},
      {v1::OPTIMIZER_KIND_NESTEROV, true, false},
      {v1::OPTIMIZER_KIND_ADAGRAD, false, true},
      {v1::OPTIMIZER_KIND_ADAGRAD, true, true},
      {v1::OPTIMIZER_KIND_ADAM, false, true},
      {v1::OPTIMIZER_KIND_ADAM, true, true},
      {v1::OPTIMIZER_KIND_ADAMW, false, true},
      {v1::OPTIMIZER_KIND_ADAMW, true, false},
      {v1::OPTIMIZER_KIND_FTRL, false, false},
      {v1::OPTIMIZER_KIND_FTRL, true, true},
      {v1::OPTIMIZER_KIND_UNSPECIFIED, false, false},
      {v1::OPTIMIZER_KIND_UNSPECIFIED, true, false},
      {static_cast<v1::OptimizerKind>(99), false, false},
  };
  for (const KindCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("kind ", c.kind, " sparse ", c.sparse));
    v1::OptimizerConfig config;
    config.set_kind(c.kind);
    config.set_learning_rate(0.1f);
    const absl::StatusOr<OptimizerParams> p = ValidParams(config, c.sparse);
    if (c.ok) {
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->kind, c.kind);
    } else {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(p.status().message(), HasSubstr("optimizer.kind: "));
    }
  }
}

}  // namespace
}  // namespace tessera::kernels
