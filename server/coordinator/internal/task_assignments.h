// Task assignments: which worker holds which rank of which job, and the Task each one was sent
// (docs/coordinator.md "Assignments and replaced task streams"). An assignment is recorded under
// the lock, made durable with the records that cause it, and only then sent on the worker's task
// stream; a stream that replaces another gets it again. Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_TASK_ASSIGNMENTS_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_TASK_ASSIGNMENTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/coordinator/internal/cluster_state.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// (member id, the assign event recorded for it), to be sent once durable.
using Assignments = std::vector<std::pair<std::string, v1::TaskEvent>>;

// The Task of `rank` in `job` at its current incarnation, with the job's shards and spec; with
// `start_step` (a rewind or a hand-over) also the step and the data position to start from.
v1::TaskEvent AssignEvent(const v1::Job& job, int rank, std::optional<int64_t> start_step);

// Records `event` as the member's assignment, to be sent by SendAssigns once durable.
// REQUIRES: the state's lock (the member lives in ClusterState::members).
void RecordAssign(MemberEntry& member, const v1::TaskEvent& event);

// Whether the member's recorded assignment is still its rank's current one in a RUNNING job
// that is not recovering, and the member has not finished it.
bool StillAssigned(ClusterState& state, const MemberEntry& member)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// Marks each assignment durable and sends it on the member's current task stream (if any),
// unless it is no longer StillAssigned (released, reassigned, the job ended meanwhile). Takes
// the lock; never blocks (TaskStream::Send queues).
void SendAssigns(ClusterState& state, const Assignments& assigns) ABSL_LOCKS_EXCLUDED(state.mu);

// The worker BUSY with rank `rank` of `job_id`, queued for writing.
void ReserveWorker(ClusterState& state, MemberEntry& member, const std::string& job_id, int rank)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

// The worker back to READY without an assignment, when it is BUSY with `job_id`.
void ReleaseWorker(ClusterState& state, MemberEntry& member, const std::string& job_id)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_TASK_ASSIGNMENTS_H_
