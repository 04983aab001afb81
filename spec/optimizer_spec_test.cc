// The rules of an optimizer config: each field's range and message.
#include "spec/optimizer_spec.h"

#include <cmath>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::spec {
namespace {

using ::testing::HasSubstr;

TEST(ValidateOptimizerTest, ExactMessages) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_ADAM);
  config.set_learning_rate(0.1f);
  config.set_beta1(1.5f);
  EXPECT_EQ(ValidateOptimizer(config, false),
            absl::InvalidArgumentError("optimizer.beta1: must be in [0, 1), got 1.5"));
  config.set_beta1(0.0f);
  config.set_learning_rate(-1.0f);
  EXPECT_EQ(
      ValidateOptimizer(config, false),
      absl::InvalidArgumentError("optimizer.learning_rate: must be a finite number > 0, got -1"));
}

struct InvalidCase {
  std::string name;
  std::function<void(v1::OptimizerConfig&)> mutate;
  std::string message;  // expected substring: the field and the value
};

void PrintTo(const InvalidCase& c, std::ostream* os) { *os << c.name; }

class ValidateOptimizerInvalidTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(ValidateOptimizerInvalidTest, NamesFieldAndValue) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_ADAM);
  config.set_learning_rate(0.1f);
  GetParam().mutate(config);
  const absl::Status p = ValidateOptimizer(config, /*sparse=*/false);
  EXPECT_EQ(p.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateOptimizerInvalidTest,
    ::testing::ValuesIn(std::vector<InvalidCase>{
        {"LearningRateZero", [](auto& c) { c.set_learning_rate(0.0f); },
         "optimizer.learning_rate: must be a finite number > 0, got 0"},
        {"LearningRateNan", [](auto& c) { c.set_learning_rate(NAN); },
         "optimizer.learning_rate: must be a finite number > 0, got nan"},
        {"LearningRateInf", [](auto& c) { c.set_learning_rate(INFINITY); },
         "optimizer.learning_rate: must be a finite number > 0, got inf"},
        {"MomentumOne", [](auto& c) { c.set_momentum(1.0f); },
         "optimizer.momentum: must be in [0, 1), got 1"},
        {"MomentumNegative", [](auto& c) { c.set_momentum(-0.5f); },
         "optimizer.momentum: must be in [0, 1), got -0.5"},
        {"Beta1Nan", [](auto& c) { c.set_beta1(NAN); },
         "optimizer.beta1: must be in [0, 1), got nan"},
        {"Beta2One", [](auto& c) { c.set_beta2(1.0f); },
         "optimizer.beta2: must be in [0, 1), got 1"},
        {"EpsilonNegative", [](auto& c) { c.set_epsilon(-1e-8f); },
         "optimizer.epsilon: must be a finite number >= 0, got -1e-08"},
        {"WeightDecayNegative", [](auto& c) { c.set_weight_decay(-0.25f); },
         "optimizer.weight_decay: must be a finite number >= 0, got -0.25"},
        {"WeightDecayInf", [](auto& c) { c.set_weight_decay(INFINITY); },
         "optimizer.weight_decay: must be a finite number >= 0, got inf"},
        {"InitialAccumulatorNegative", [](auto& c) { c.set_initial_accumulator(-1.0f); },
         "optimizer.initial_accumulator: must be a finite number >= 0, got -1"},
        {"FtrlBetaNegative", [](auto& c) { c.set_ftrl_beta(-2.0f); },
         "optimizer.ftrl_beta: must be a finite number >= 0, got -2"},
        {"FtrlL1Negative", [](auto& c) { c.set_ftrl_l1(-0.5f); },
         "optimizer.ftrl_l1: must be a finite number >= 0, got -0.5"},
        {"FtrlL2Nan", [](auto& c) { c.set_ftrl_l2(NAN); },
         "optimizer.ftrl_l2: must be a finite number >= 0, got nan"},
        {"FtrlLrPowerPositive", [](auto& c) { c.set_ftrl_lr_power(0.5f); },
         "optimizer.ftrl_lr_power: must be a finite number <= 0, got 0.5"},
    }),
    [](const ::testing::TestParamInfo<InvalidCase>& info) { return info.param.name; });

}  // namespace
}  // namespace tessera::spec
