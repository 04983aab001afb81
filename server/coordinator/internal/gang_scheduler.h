// The gang scheduler (DESIGN.md §6, docs/coordinator.md "Scheduling"): strict FIFO, only the
// oldest PENDING job may start, and it starts when its shards are registered and num_workers
// idle workers with open task streams are there. The workers are reserved BUSY under the lock,
// the shards get CreateJobState without it, and the job goes RUNNING (its Tasks sent once that
// is durable) or fails naming the shard that refused. Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_GANG_SCHEDULER_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_GANG_SCHEDULER_H_

#include "server/coordinator/internal/cluster_state.h"

namespace tessera::coordinator::internal {

// One scheduling pass over the oldest PENDING job (none while a RUNNING job is in its restart
// grace: its workers would look idle); otherwise its `reason` says what it waits for. True when
// the queue moved (the job started, failed, or was cancelled meanwhile). Blocks on the shards'
// CreateJobState calls and SQLite.
bool ScheduleOldestPending(ClusterState& state) ABSL_LOCKS_EXCLUDED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_GANG_SCHEDULER_H_
