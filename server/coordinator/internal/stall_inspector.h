// The stall inspector and the progress lease (issue #16, docs/coordinator.md "Stalls").
//
// Shards send with each heartbeat what every job has waited for over a second on them
// (v1::ShardStall: the step, how long, and per lagging rank the partitions it has not pushed).
// This room keeps each shard's latest report per job, and from them names the laggards: in the
// job's record (Job.stall, JobWorker.stalled_seconds, the tessera_job_rank_stall_seconds metric)
// and in a STALL event once a step has waited kNameStallAfter for the same ranks, and again when
// it no longer waits. The progress lease: a rank whose step has not moved for the job's
// stall_timeout while the job waits for it (the shards name it, or name nobody) is warned about
// once (stall_policy "warn") or evicted ("evict": lost as if its worker had gone, and its worker
// told to stop). Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_STALL_INSPECTOR_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_STALL_INSPECTOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// A step that has waited this long for the same ranks is named (Job.stall, an event).
inline constexpr absl::Duration kNameStallAfter = absl::Seconds(2);

// The stalls of a heartbeat, before anything is changed: INVALID_ARGUMENT naming the field for
// more than 1024 jobs or ranks, a negative number, or a job named twice.
absl::Status ValidateStalls(const v1::HeartbeatRequest& request);

// A heartbeat of `shard` (READY): its stalls replace what it reported before, for every RUNNING
// job it serves; then each such job's stall is named again.
void RecordShardStalls(ClusterState& state, const MemberEntry& shard,
                       const v1::HeartbeatRequest& request, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Every tick: forgets reports a shard has not renewed (it stopped heartbeating), names each
// RUNNING job's stall again, and applies the progress lease.
void InspectStalls(ClusterState& state, int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// The job's step moved for every rank (a start, a rewind, a restart of the coordinator): what the
// shards reported is void, and each live rank's progress lease starts again at `now_ms`.
void ResetStalls(JobEntry& entry, int64_t now_ms);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_STALL_INSPECTOR_H_
