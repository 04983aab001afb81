// Filling a down shard of a replicated job again (docs/reliability.md "Filling a new copy"):
// when a shard serves a down index again (the lost process restarted, or a new one took its
// index), its copies are rebuilt from its neighbours while the job trains, and the index stops
// being down. Private to server/coordinator/.
//
// 1. Plan (under the lock): a step S ahead of the job (StepMargin); JobEntry::fill names the
//    shard, its address and S, and every progress ack carries it (ProgressAck.fill).
// 2. The ranks write the shard every push of step S and later (not its pulls: it is still down
//    for them) and say so in their reports (fill_from_step); a rank that had already sent a push
//    of S or later without it says fill_missed.
// 3. The action (no lock): OpenFill on the shard (it keeps the ranks' pushes of S and later and
//    acknowledges them, so they train on), Checkpoint(S) on the neighbours that hold its copies
//    (ordinary files, not committed as a job checkpoint), then CopyFill of those files to the
//    shard, which cuts its own partitions and rows from them, installs the job at step S and
//    applies the pushes it kept. A shard that keeps none (OpenFill failed) refuses the pushes
//    until the install (the job is unknown there): the ranks retry them and wait at S.
// 4. Once the shard is installed and every live rank has said so again in a report after the
//    install (it writes the shard from S and missed nothing), the index leaves
//    Job.down_shards (an event says so, with the bytes and seconds), and the ranks read from it
//    again. A rank that missed S, a membership change, a recovery or a failed call gives the fill
//    up: the shard's state is dropped and a later tick tries again further ahead.
// Every consistency model: under SSP and ASP a neighbour's snapshot of S is taken once its
// slowest rank reaches S, so it may hold a faster rank's pushes of S and later too; the shard
// applies of those kept pushes only what its cut lacks (server/shard_fill.h FillOverlap).
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_REFILL_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_REFILL_H_

#include <functional>
#include <string>

#include "server/coordinator/internal/cluster_state.h"
#include "server/coordinator/internal/recovery.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// The fill a RUNNING replicated job can start this tick: a down index that a READY shard of
// `live` serves again, none in flight, no recovery, hand-over or membership change pending. Sets
// entry.fill; returns the action (empty: nothing to do).
std::function<void()> PlanFill(ClusterState& state, JobEntry& entry, const LiveMembers& live)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// A rank's report: records whether it writes the shard being filled (or missed the step), and
// finishes the fill when that was the last rank it waited for. Fills the ack's `fill`.
void NoteFillReport(ClusterState& state, JobEntry& entry, const v1::ProgressReport& report,
                    v1::ProgressAck* ack) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Gives the job's fill up (a membership change, a recovery): `why` is logged; the action in
// flight drops what it installed when it sees this.
void GiveUpFill(ClusterState& state, JobEntry& entry, const std::string& why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_SHARD_REFILL_H_
