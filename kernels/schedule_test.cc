#include "kernels/schedule.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spec/schedule_spec.h"

namespace tessera::kernels {
namespace {

using Schedule = v1::LearningRateSchedule;

struct LrPoint {
  int64_t t;
  double lr;
};

struct ScheduleCase {
  std::string name;
  std::function<void(Schedule&)> configure;
  float base_lr;
  std::vector<LrPoint> points;  // values worked out by hand in the comments below
};

void PrintTo(const ScheduleCase& c, std::ostream* os) { *os << c.name; }

class ScheduledLearningRateTest : public ::testing::TestWithParam<ScheduleCase> {};

TEST_P(ScheduledLearningRateTest, KnownPoints) {
  Schedule s;
  GetParam().configure(s);
  ASSERT_TRUE(spec::ValidateSchedule(s).ok()) << spec::ValidateSchedule(s);
  for (const LrPoint& p : GetParam().points) {
    EXPECT_FLOAT_EQ(ScheduledLearningRate(s, GetParam().base_lr, p.t), p.lr) << "t = " << p.t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, ScheduledLearningRateTest,
    ::testing::ValuesIn(std::vector<ScheduleCase>{
        // Unset kind is constant.
        {"Unspecified", [](Schedule&) {}, 0.1f, {{0, 0.1}, {1, 0.1}, {1000000, 0.1}}},
        {"Constant",
         [](Schedule& s) { s.set_kind(Schedule::KIND_CONSTANT); },
         0.3f,
         {{0, 0.3}, {77, 0.3}}},
        // Warm-up over 4 updates: 0.1 * (t + 1) / 4 = 0.025, 0.05, 0.075, 0.1, then 0.1.
        {"ConstantWithWarmup",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_CONSTANT);
           s.set_warmup_steps(4);
         },
         0.1f,
         {{0, 0.025}, {1, 0.05}, {2, 0.075}, {3, 0.1}, {4, 0.1}, {1000, 0.1}}},
        // 0.2 * 0.5^floor(t / 10): t 0..9 -> 0.2, 10..19 -> 0.1, 29 -> 0.05, 30 -> 0.025.
        {"Step",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_STEP);
           s.set_step_size(10);
           s.set_gamma(0.5f);
         },
         0.2f,
         {{0, 0.2}, {9, 0.2}, {10, 0.1}, {19, 0.1}, {29, 0.05}, {30, 0.025}}},
        // Warm-up 5 then the step formula on the same t: t = 2 -> 0.2 * 3 / 5 = 0.12,
        // t = 5 -> 0.2 * 0.5^0 = 0.2, t = 10 -> 0.1.
        {"StepWithWarmup",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_STEP);
           s.set_step_size(10);
           s.set_gamma(0.5f);
           s.set_warmup_steps(5);
         },
         0.2f,
         {{0, 0.04}, {2, 0.12}, {5, 0.2}, {10, 0.1}}},
        // 0.01 + (0.11 - 0.01) * (1 + cos(pi * t / 100)) / 2:
        // t = 25: 0.01 + 0.05 * (1 + 0.7071067811865476) = 0.09535533905932738;
        // t = 50: 0.01 + 0.05 = 0.06; t = 75: 0.01 + 0.05 * (1 - 0.7071067811865476) =
        // 0.024644660940672627; t >= 100: 0.01.
        {"Cosine",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_COSINE);
           s.set_total_steps(100);
           s.set_min_learning_rate(0.01f);
         },
         0.11f,
         {{0, 0.11},
          {25, 0.09535533905932738},
          {50, 0.06},
          {75, 0.024644660940672627},
          {100, 0.01},
          {1000, 0.01}}},
        // Warm-up 10: t = 0 -> 0.011, t = 4 -> 0.055, t = 9 -> 0.11; then t = 10:
        // 0.01 + 0.05 * (1 + cos(0.1 pi)) = 0.01 + 0.05 * 1.9510565162951535 = 0.10755282581475768.
        {"CosineWithWarmup",
         [](Schedule& s) {
           s.set_kind(Schedule::KIND_COSINE);
           s.set_total_steps(100);
           s.set_min_learning_rate(0.01f);
           s.set_warmup_steps(10);
         },
         0.11f,
         {{0, 0.011}, {4, 0.055}, {9, 0.11}, {10, 0.10755282581475768}, {50, 0.06}}},
    }),
    [](const ::testing::TestParamInfo<ScheduleCase>& info) { return info.param.name; });

TEST(SumOfSquaresTest, SmallValues) {
  const float x[] = {3.0f, -4.0f};
  EXPECT_EQ(SumOfSquares(x, 2), 25.0);
  EXPECT_EQ(SumOfSquares(x, 0), 0.0);
}

// 2^24 + 16 ones: a float accumulator stops at 2^24 = 16777216, a double one counts them all.
TEST(SumOfSquaresTest, AccumulatesInDouble) {
  const int64_t n = (int64_t{1} << 24) + 16;
  const std::vector<float> ones(n, 1.0f);
  EXPECT_EQ(SumOfSquares(ones.data(), n), static_cast<double>(n));
}

TEST(SumOfSquaresTest, MatchesSerialDoubleSum) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{33333}, int64_t{1} << 20}) {
    std::vector<float> x(n);
    for (float& v : x) v = uniform(rng);
    double want = 0.0;
    for (const float v : x) want += static_cast<double>(v) * v;
    EXPECT_NEAR(SumOfSquares(x.data(), n), want, 1e-12 * want) << "n = " << n;
  }
}

TEST(ClipScaleTest, KnownValues) {
  EXPECT_EQ(ClipScale(25.0, 10.0f), 1.0f);   // norm 5 <= 10
  EXPECT_EQ(ClipScale(25.0, 5.0f), 1.0f);    // norm 5 == 5
  EXPECT_EQ(ClipScale(25.0, 2.5f), 0.5f);    // 2.5 / 5
  EXPECT_EQ(ClipScale(400.0, 1.0f), 0.05f);  // 1 / 20
  EXPECT_EQ(ClipScale(25.0, 0.0f), 1.0f);    // clipping off
  EXPECT_EQ(ClipScale(25.0, -1.0f), 1.0f);   // clipping off
  EXPECT_EQ(ClipScale(0.0, 1.0f), 1.0f);     // zero gradient
}

// Clipping a random gradient with SumOfSquares and ClipScale gives a norm of max_norm.
TEST(ClipScaleTest, ClippedNormEqualsMaxNorm) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(10000);
  for (float& v : g) v = normal(rng);
  const float scale = ClipScale(SumOfSquares(g.data(), static_cast<int64_t>(g.size())), 3.0f);
  ASSERT_LT(scale, 1.0f);
  for (float& v : g) v *= scale;
  EXPECT_NEAR(std::sqrt(SumOfSquares(g.data(), static_cast<int64_t>(g.size()))), 3.0, 1e-5);
}

}  // namespace
}  // namespace tessera::kernels
