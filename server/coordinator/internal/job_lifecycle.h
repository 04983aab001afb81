// The jobs' life cycle (docs/coordinator.md "Jobs"): a validated spec queued as PENDING, a user's
// cancel, the end of a job that failed or was cancelled (its workers cancelled or released, its
// shards owed a DropJob, its checkpoint records forgotten), and --retain_models, which drops the
// weights of the oldest succeeded jobs from the shards. Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_LIFECYCLE_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_LIFECYCLE_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// The message that starts the event of a job whose weights --retain_models dropped (a restarted
// coordinator reads it back to know which succeeded jobs still have weights on the shards).
inline constexpr char kWeightsDropped[] = "weights dropped from the shards";

// CreateJob: validates the spec (INVALID_ARGUMENT naming the field; nothing is stored for a
// refused one), queues the job as "<name>-<n>" with the event "queued", and returns its record
// once durable. The store's sticky error. Blocks on SQLite.
absl::StatusOr<v1::Job> CreateJob(ClusterState& state, const v1::JobSpec& spec)
    ABSL_LOCKS_EXCLUDED(state.mu);

// CancelJob: PENDING or RUNNING -> CANCELLED ("cancelled by the user"); a cancelled job is
// returned unchanged; INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION for one that ended
// otherwise; the store's sticky error. Blocks on SQLite.
absl::StatusOr<v1::Job> CancelJob(ClusterState& state, const std::string& job_id)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Ends a RUNNING or PENDING job: FAILED or CANCELLED with `reason`; cancels its workers' tasks
// (except `except_member`'s; workers without a stream, or stopped, are released instead) and,
// for a RUNNING job, owes DropJob to its shards and forgets its checkpoint records.
void EndJob(ClusterState& state, JobEntry& entry, v1::JobState job_state, const std::string& reason,
            const std::string& except_member) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Drops the weights of the oldest succeeded jobs beyond options.retain_models from the shards.
void ApplyRetention(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_LIFECYCLE_H_
