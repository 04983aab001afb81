// The rules of a learning-rate schedule: each field's range and message.
#include "spec/schedule_spec.h"

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
using Schedule = v1::LearningRateSchedule;

struct InvalidScheduleCase {
  std::string name;
  std::function<void(Schedule&)> configure;
  std::string message;
};

void PrintTo(const InvalidScheduleCase& c, std::ostream* os) { *os << c.name; }

class ValidateScheduleTest : public ::testing::TestWithParam<InvalidScheduleCase> {};

TEST_P(ValidateScheduleTest, NamesFieldAndValue) {
  Schedule s;
  GetParam().configure(s);
  const absl::Status status = ValidateSchedule(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateScheduleTest,
    ::testing::ValuesIn(std::vector<InvalidScheduleCase>{
        {"NegativeWarmup", [](Schedule& s) { s.set_warmup_steps(-1); },
         "schedule.warmup_steps: must be >= 0, got -1"},
        {"NegativeStepSize", [](Schedule& s) { s.set_step_size(-3); },
         "schedule.step_size: must be >= 0, got -3"},
        {"NegativeTotalSteps", [](Schedule& s) { s.set_total_steps(-7); },
         "schedule.total_steps: must be >= 0, got -7"},
        {"StepWithoutStepSize",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_STEP);
           s.set_gamma(0.5f);
         },
         "schedule.step_size: must be > 0 for KIND_STEP, got 0"},
        {"StepGammaZero",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_STEP);
           s.set_step_size(10);
         },
         "schedule.gamma: must be in (0, 1] for KIND_STEP, got 0"},
        {"StepGammaAboveOne",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_STEP);
           s.set_step_size(10);
           s.set_gamma(1.5f);
         },
         "schedule.gamma: must be in (0, 1] for KIND_STEP, got 1.5"},
        {"CosineWithoutTotalSteps", [](Schedule& s) { s.set_kind(Schedule::KIND_COSINE); },
         "schedule.total_steps: must be > 0 for KIND_COSINE, got 0"},
        {"GammaNan", [](Schedule& s) { s.set_gamma(NAN); },
         "schedule.gamma: must be a finite number, got nan"},
        {"MinLearningRateInf",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_COSINE);
           s.set_total_steps(10);
           s.set_min_learning_rate(INFINITY);
         },
         "schedule.min_learning_rate: must be a finite number >= 0, got inf"},
        {"MinLearningRateNegative", [](Schedule& s) { s.set_min_learning_rate(-0.5f); },
         "schedule.min_learning_rate: must be a finite number >= 0, got -0.5"},
        {"UnknownKind", [](Schedule& s) { s.set_kind(static_cast<Schedule::Kind>(42)); },
         "schedule.kind: unknown schedule kind 42"},
    }),
    [](const ::testing::TestParamInfo<InvalidScheduleCase>& info) { return info.param.name; });

TEST(ValidateScheduleTest, AcceptsDefaultsAndGammaOne) {
  EXPECT_TRUE(ValidateSchedule(Schedule()).ok());
  Schedule s;
  s.set_kind(Schedule::KIND_STEP);
  s.set_step_size(1);
  s.set_gamma(1.0f);
  EXPECT_TRUE(ValidateSchedule(s).ok());
}

}  // namespace
}  // namespace tessera::spec
