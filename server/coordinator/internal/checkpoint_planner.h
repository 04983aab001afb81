// The checkpoint planner (DESIGN.md §7, docs/coordinator.md "Checkpoints"): which step each job
// checkpoints next, the Checkpoint calls on every shard at once, the commit of what every shard
// confirmed (record, data positions, retention, event), and the records a job forgets. A plan is
// made under the lock; the calls run without it; the commit re-checks the job under it, so a
// checkpoint planned before a recovery is never committed. Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_CHECKPOINT_PLANNER_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_CHECKPOINT_PLANNER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::coordinator::internal {

// What a checkpoint asks of the shards, planned under the lock.
struct CheckpointPlan {
  std::string job_id;
  int64_t step = 0;
  int64_t retain_from_step = 0;
  std::vector<std::string> addresses;
  int recoveries = 0;  // the job's count when planned: a recovery in between voids it
  bool manual = false;
};

// A checkpoint of `entry` at `step`: its shards and the retention step (the K-th newest
// committed checkpoint other than `step`, 0 while fewer are committed). FAILED_PRECONDITION for
// a job that is not RUNNING or is recovering.
absl::StatusOr<CheckpointPlan> PlanCheckpoint(ClusterState& state, JobEntry& entry, int64_t step,
                                              bool manual) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// The next automatic checkpoint of a RUNNING job with checkpoint_every_steps > 0 that is not
// recovering and has no call out (then marked checkpoint_running); nullopt when none is due.
std::optional<CheckpointPlan> PlanAutoCheckpoint(ClusterState& state, JobEntry& entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Checkpoint on every shard of the plan at once (a thread per shard, joined; each call up to
// options.checkpoint_timeout). The first error, naming the shard's index and address.
absl::StatusOr<std::vector<v1::CheckpointResponse>> CallCheckpoint(ClusterState& state,
                                                                   const CheckpointPlan& plan)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Commits a checkpoint every shard confirmed (record, retention, event), then flushes. ABORTED
// when the job ended or recovered since the plan; the store's sticky error.
absl::StatusOr<v1::CheckpointRecord> CommitCheckpoint(
    ClusterState& state, const CheckpointPlan& plan,
    const std::vector<v1::CheckpointResponse>& responses) ABSL_LOCKS_EXCLUDED(state.mu);

// An automatic checkpoint: calls, commits, and clears checkpoint_running. A call cut short (or
// overtaken by a recovery) is asked again on a later tick, without an event; another error adds
// the event "checkpoint S failed: ..." and S is skipped. Blocks on the shard calls and SQLite.
void RunAutoCheckpoint(ClusterState& state, const CheckpointPlan& plan)
    ABSL_LOCKS_EXCLUDED(state.mu);

// CheckpointJob: a manual checkpoint a StepMargin ahead of the job's fastest live rank, placed
// further ahead (up to 5 tries) while a shard answers FAILED_PRECONDITION. Blocks on the shard
// calls and SQLite. See Coordinator::CheckpointJob for the error codes.
absl::StatusOr<v1::CheckpointRecord> CheckpointByHand(ClusterState& state,
                                                      const std::string& job_id)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Forgets every checkpoint record of the job (its weights left the shards).
void ForgetCheckpoints(ClusterState& state, JobEntry& entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Forgets the job's checkpoint records newer than `step` (a rewind made them unusable).
void ForgetCheckpointsAfter(ClusterState& state, JobEntry& entry, int64_t step)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_CHECKPOINT_PLANNER_H_
