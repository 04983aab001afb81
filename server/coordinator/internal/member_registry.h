// The member registry (docs/coordinator.md "Members and leases"): shards and workers register,
// heartbeat and leave; a member whose lease runs out is LOST; departed members are kept, up to
// options.max_departed_members per role; each worker has at most one task stream. A shard that
// goes makes its RUNNING jobs recover; a worker that goes loses its rank. Private to
// server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_MEMBER_REGISTRY_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_MEMBER_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/coordinator/internal/cluster_state.h"
#include "server/coordinator/task_stream.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// Register: "s-<n>" or "w-<n>" with the lease and the heartbeat interval, once durable.
// INVALID_ARGUMENT naming the field; ALREADY_EXISTS for a shard index a live shard at another
// address holds (one at the same address is that shard restarted: the old member is LOST at
// once); the store's sticky error. Blocks on SQLite.
absl::StatusOr<v1::RegisterResponse> RegisterMember(ClusterState& state,
                                                    const v1::RegisterRequest& request)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Heartbeat: renews the lease. NOT_FOUND for an unknown, LOST or LEFT member (it registers
// again). No I/O.
absl::Status RenewLease(ClusterState& state, const v1::HeartbeatRequest& request)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Deregister: the member is LEFT (OK for one that is gone already). NOT_FOUND for an unknown
// one. Blocks on SQLite.
absl::Status DeregisterMember(ClusterState& state, const v1::DeregisterRequest& request)
    ABSL_LOCKS_EXCLUDED(state.mu);

// Every member: the shards by index then number, then the workers by number.
std::vector<v1::Member> ListMembers(ClusterState& state) ABSL_LOCKS_EXCLUDED(state.mu);

// Makes `stream` the worker's task stream (an older one is closed with ABORTED) and sends it the
// worker's durable assignment again. NOT_FOUND for an unknown, lost or departed member;
// INVALID_ARGUMENT for an empty id or a shard; UNAVAILABLE once stopping.
absl::Status OpenTaskStream(ClusterState& state, const std::string& member_id,
                            std::shared_ptr<TaskStream> stream) ABSL_LOCKS_EXCLUDED(state.mu);

// Members without a heartbeat for options.lease at `now_ms` are LOST.
void ExpireLeases(ClusterState& state, int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Forgets the oldest departed members beyond options.max_departed_members per role. The newest
// member of each role stays, so ids are not handed out again after a restart.
void ForgetDepartedMembers(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Forgets task streams that have ended; a worker still holding a task of an ended job goes back
// to READY.
void ReapStreams(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Ends every task stream with `status` (the coordinator stops).
void CloseTaskStreams(ClusterState& state, const absl::Status& status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_MEMBER_REGISTRY_H_
