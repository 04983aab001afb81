// Progress reports (docs/coordinator.md "Jobs"): the workers' ReportProgress turned into the
// job's record (the slowest rank's step, the sum of the ranks' rates, rank 0's loss, accuracy,
// epoch and ETA) and into throttled events: one on each evaluation and epoch change, otherwise at
// most one progress event a second, and the record written at most every 500 ms between them.
// A report's phase may end a rank, the job (SUCCEEDED, FAILED) or start a recovery.
// Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_PROGRESS_REPORTS_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_PROGRESS_REPORTS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// ReportProgress: see Coordinator::ReportProgress. INVALID_ARGUMENT naming the field, NOT_FOUND
// for an unknown job, the store's sticky error; a report that no longer speaks for its rank
// gets ack.cancel and changes nothing. Blocks on SQLite.
absl::StatusOr<v1::ProgressAck> ReportProgress(ClusterState& state,
                                               const v1::ProgressReport& report)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Queues the job's record when it changed and was last written 500 ms or more before `now_ms`.
void WriteThrottledRecord(ClusterState& state, JobEntry& entry, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_PROGRESS_REPORTS_H_
