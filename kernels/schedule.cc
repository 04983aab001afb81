#include "kernels/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tessera::kernels {
namespace {

constexpr double kPi = 3.14159265358979323846;

// SumOfSquares splits large inputs into fixed chunks whose partial sums are added in chunk order,
// so the result does not depend on the number of OpenMP threads.
constexpr int64_t kSumChunk = int64_t{1} << 15;

double SumOfSquaresRange(const float* __restrict__ x, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const double xi = x[i];
    sum += xi * xi;
  }
  return sum;
}

}  // namespace

// Warm-up, when t < warmup_steps, replaces the schedule; afterwards the schedule's formula runs on
// the same t (its step boundaries and total_steps count the warm-up updates too). Past
// total_steps the cosine schedule stays at min_learning_rate.
float ScheduledLearningRate(const v1::LearningRateSchedule& schedule, float base_lr, int64_t t) {
  t = std::max<int64_t>(t, 0);
  const double base = base_lr;
  if (t < schedule.warmup_steps()) {
    return static_cast<float>(base * static_cast<double>(t + 1) /
                              static_cast<double>(schedule.warmup_steps()));
  }
  switch (schedule.kind()) {
    case v1::LearningRateSchedule::KIND_STEP: {
      if (schedule.step_size() <= 0) return base_lr;
      const int64_t drops = t / schedule.step_size();
      return static_cast<float>(
          base * std::pow(static_cast<double>(schedule.gamma()), static_cast<double>(drops)));
    }
    case v1::LearningRateSchedule::KIND_COSINE: {
      if (schedule.total_steps() <= 0) return base_lr;
      const double progress = static_cast<double>(std::min(t, schedule.total_steps())) /
                              static_cast<double>(schedule.total_steps());
      const double min_lr = schedule.min_learning_rate();
      return static_cast<float>(min_lr + (base - min_lr) * (1.0 + std::cos(kPi * progress)) / 2.0);
    }
    default:
      return base_lr;
  }
}

double SumOfSquares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  if (n <= kSumChunk) return SumOfSquaresRange(x, n);
  const int64_t chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kSumChunk;
    partial[static_cast<size_t>(c)] = SumOfSquaresRange(x + begin, std::min(n - begin, kSumChunk));
  }
  double sum = 0.0;
  for (const double p : partial) sum += p;
  return sum;
}

// A non-finite sum of squares gives 0 (infinite norm) or NaN; callers reject such gradients first.
float ClipScale(double sum_of_squares, float max_norm) {
  if (!(max_norm > 0.0f) || sum_of_squares == 0.0) return 1.0f;
  const double norm = std::sqrt(sum_of_squares);
  if (norm <= static_cast<double>(max_norm)) return 1.0f;
  return static_cast<float>(static_cast<double>(max_norm) / norm);
}

}  // namespace tessera::kernels
