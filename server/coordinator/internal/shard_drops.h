// Shard drops: the DropJob calls the coordinator owes the shards (a job that failed or was
// cancelled, retained weights that go), durable in the store's shard_drops table so that a
// restarted coordinator still makes them, and retried with a backoff per shard address until a
// shard settles them (docs/coordinator.md "Jobs"). Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_DROPS_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_DROPS_H_

#include <string>

#include "server/coordinator/internal/cluster_state.h"

namespace tessera::coordinator::internal {

// Owes DropJob(job_id) to the shard at `address`, in memory and (with the next FlushWrites) in
// the database. A drop owed again while its call runs is not settled by that call.
void QueueDrop(ClusterState& state, const std::string& address, const std::string& job_id)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// A shard registered at `address`: what the address is owed is tried at the next tick.
void RetryDropsAt(ClusterState& state, const std::string& address)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Calls DropJob for the owed drops that are due and whose address is a live shard; an answer OK
// or NOT_FOUND settles a drop (its row is deleted with the next flush), another error puts off
// every drop of that address for 1 s, doubling up to 60 s. Blocks on the calls (made without
// the lock, one failure per address and round).
void RunShardDrops(ClusterState& state) ABSL_LOCKS_EXCLUDED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_DROPS_H_
