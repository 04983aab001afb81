// Learning-rate schedules and gradient clipping (DESIGN.md §2): what they compute; the rules of a
// schedule are spec/schedule_spec.h's.
#ifndef TESSERA_KERNELS_SCHEDULE_H_
#define TESSERA_KERNELS_SCHEDULE_H_

#include <cstdint>

#include "tessera/v1/optimizer.pb.h"

namespace tessera::kernels {

// The learning rate for the update that follows `t` applied updates (t = 0 for the first).
// Warm-up scales linearly: base_lr * (t + 1) / warmup_steps while t < warmup_steps.
// From t = warmup_steps on, the kind's formula (optimizer.proto) runs on the same t, so step
// boundaries and total_steps count the warm-up updates; cosine stays at min_learning_rate past
// total_steps. Negative t counts as 0. REQUIRES: spec::ValidateSchedule(schedule).ok()
// (spec/schedule_spec.h holds the rules).
float ScheduledLearningRate(const v1::LearningRateSchedule& schedule, float base_lr, int64_t t);

// Sum of squares of n floats, accumulated in double.
double SumOfSquares(const float* x, int64_t n);

// The factor that brings a gradient of L2 norm sqrt(sum_of_squares) to at most max_norm:
// min(1, max_norm / norm). Returns 1 when max_norm <= 0 (clipping off) or the norm is 0.
float ClipScale(double sum_of_squares, float max_norm);

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_SCHEDULE_H_
