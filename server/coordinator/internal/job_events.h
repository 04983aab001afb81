// Job events and their watchers (docs/coordinator.md "Watching"): each change worth telling
// becomes a JobEvent, stored with the job's record and pushed to the job's JobWatch queues.
// Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_EVENTS_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_EVENTS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/coordinator/internal/cluster_state.h"
#include "server/coordinator/job_watch.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// Appends an event of `kind` built from the job's record and `message`, queues both for writing,
// and pushes them to the job's watchers (which end OK after a terminal event). Never blocks.
void AddEvent(ClusterState& state, JobEntry& entry, v1::JobEventKind kind,
              const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// WatchJob: a watch that starts with the current record, then the stored events after
// `after_seq`, then live ones, and ends OK after the terminal event. Blocks on one flush and one
// SQLite read (without the lock). INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE once stopping; a
// read error ends the returned watch instead.
absl::StatusOr<std::shared_ptr<JobWatch>> OpenJobWatch(ClusterState& state,
                                                       const v1::WatchJobRequest& request)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Ends every job's watches with `status` (the coordinator stops).
void EndJobWatches(ClusterState& state, const absl::Status& status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_JOB_EVENTS_H_
