// Recovery (DESIGN.md §7, docs/coordinator.md "Fault tolerance"): a job that lost a shard is
// restored from its newest usable checkpoint on every shard and its workers are rewound; a lost
// worker's rank leaves the shards' membership so that BSP goes on without it, and is handed to an
// idle worker at a step ahead of the job; the ranks of RUNNING jobs that do not report within
// the restart grace are lost. Each tick plans at most one action per job under the lock; the
// action makes its shard calls without it, and re-checks the job under it before it changes
// anything. Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_RECOVERY_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_RECOVERY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// A RUNNING job lost a shard (or a rank hit a data-plane error): it recovers from its newest
// checkpoint, or fails with `cause` when it has none or has recovered options.max_recoveries
// times already.
void StartRecovery(ClusterState& state, JobEntry& entry, const std::string& cause)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Rank `rank` of a RUNNING job has no worker any more: it is marked lost and leaves the shards'
// membership on a later tick; the job fails when no rank is left.
void LoseRank(ClusterState& state, JobEntry& entry, int rank, const std::string& why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// The restart grace of a RUNNING job ends as soon as every rank that is not done or lost has
// reported (rebound), or at restart_deadline_ms; then the ranks that have not reported are lost
// ("lost while the coordinator restarted").
void EndRestartGrace(ClusterState& state, JobEntry& entry, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// The ranks of a stored RUNNING job that were handed over at a step the job has not reached,
// with that step (JobEntry::joins, which is not stored), re-derived from the incarnations.
std::map<int, int64_t> DerivedJoins(const v1::Job& job);

// What one tick's plans may use: the live shards and the idle workers.
struct LiveMembers {
  std::map<int, std::string> shards;       // index -> address of the READY shards
  std::vector<MemberEntry*> idle_workers;  // READY, no job, an open stream; by member number
  size_t next_idle = 0;                    // the first one not reserved by this tick yet
};
LiveMembers SurveyLiveMembers(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// The fault-tolerance action a RUNNING job (past its restart grace) needs this tick, if any and
// none is in flight: its recovery (once every shard index has a live shard; a recovery past
// options.recovery_timeout fails the job instead), the hand-over of a lost rank to an idle worker
// of `live` (reserved BUSY here), or the live ranks sent to the shards again. Marks the job's
// action_running; returns an empty function when there is nothing to do. The action blocks on
// shard calls and SQLite, and takes the lock itself.
std::function<void()> PlanRecoveryAction(ClusterState& state, JobEntry& entry, LiveMembers& live)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_RECOVERY_H_
