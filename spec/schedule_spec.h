// The rules for a learning-rate schedule (proto/tessera/v1/optimizer.proto), checked with the
// optimizer wherever a config enters (ValidateJobSpec, the shard's CreateJobState).
// kernels::ScheduledLearningRate (kernels/schedule.h) computes the rate of a schedule that passed.
#ifndef TESSERA_SPEC_SCHEDULE_SPEC_H_
#define TESSERA_SPEC_SCHEDULE_SPEC_H_

#include "absl/status/status.h"
#include "tessera/v1/optimizer.pb.h"

namespace tessera::spec {

// INVALID_ARGUMENT naming the field for an unknown kind, negative counts, a STEP schedule without
// step_size > 0 or gamma in (0, 1], a COSINE schedule without total_steps > 0, or a non-finite
// value: "schedule.step_size: must be > 0 for KIND_STEP, got 0". Pure; thread-safe.
absl::Status ValidateSchedule(const v1::LearningRateSchedule& schedule);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_SCHEDULE_SPEC_H_
