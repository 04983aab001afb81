// Steps, margins, incarnations and data positions of a job record: pure functions, shared by the
// checkpoint planner and recovery. Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_STEPS_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_STEPS_H_

#include <cstddef>
#include <cstdint>

#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// The largest step reported by a rank that is not lost (0: none).
int64_t MaxRankStep(const v1::Job& job);
// Steps a rank can be expected to do within a second at the job's rate (at least 10, at most
// total_steps once known), doubled per earlier `attempt` that came too late.
int64_t StepMargin(const v1::Job& job, int attempt);
// An incarnation above every one the job has handed out (>= now_ms * 1024).
uint64_t NextIncarnation(const v1::Job& job, int64_t now_ms);
// Where the trainer's data stands at `step`: epoch and batch offset from Job.steps_per_epoch
// (epoch 0, offset `step` while it is unknown), pass 0, the spec's seed.
v1::DataPosition PositionAt(const v1::Job& job, int64_t step);
// Committed checkpoints kept per job: JobSpec.keep_checkpoints, 0 meaning 3.
size_t KeepCheckpoints(const v1::JobSpec& spec);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_STEPS_H_
