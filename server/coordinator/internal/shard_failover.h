// Replicated jobs (spec.replication 2, docs/reliability.md "Replicated shards"): a lost shard's
// partitions are served by their copies on the next shard index, so the job goes on without a
// rewind. The index is recorded in Job.down_shards, which the ranks learn from their progress
// acks (and new tasks from Task.down_shards); the shard stays down until a shard serving its
// index again is filled (shard_refill.h).
// Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_FAILOVER_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_FAILOVER_H_

#include <string>
#include <vector>

#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// True when `index` may be down for `job` while every partition keeps a live copy: the job keeps
// two copies and neither neighbouring index (whose copies `index` holds, or which holds its own)
// is down already.
bool CanFailOver(const v1::Job& job, int index);

// The job's shard addresses by index, "" for the down ones (which get no control calls).
std::vector<std::string> ServingAddresses(const v1::Job& job);

// A RUNNING job lost shard `index`: when CanFailOver, the index joins job.down_shards, a
// RECOVERY event says so ("no rewind") and true is returned; otherwise false (the caller
// recovers from a checkpoint). A shard already down: true, nothing changes.
bool FailOverShard(ClusterState& state, JobEntry& entry, int index, const std::string& cause)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// A rank of a replicated job found these shards unreachable (ProgressReport.unreachable_shards):
// the READY shard members serving them are suspected, and their lease shortens to
// SuspectLeaseMs(), so that a dead one is found in about a heartbeat rather than a full lease.
void SuspectShards(ClusterState& state, const JobEntry& entry, const v1::ProgressReport& report,
                   int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
int64_t SuspectLeaseMs(const CoordinatorOptions& options);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_FAILOVER_H_
