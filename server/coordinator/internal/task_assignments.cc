#include "server/coordinator/internal/task_assignments.h"

#include "server/coordinator/internal/job_steps.h"

namespace tessera::coordinator::internal {

v1::TaskEvent AssignEvent(const v1::Job& job, int rank, std::optional<int64_t> start_step) {
  v1::TaskEvent event;
  v1::Task* task = event.mutable_assign();
  task->set_job_id(job.id());
  task->set_rank(rank);
  task->set_world_size(job.workers_size());
  for (const std::string& address : job.shard_addresses()) task->add_shard_addresses(address);
  *task->mutable_spec() = job.spec();
  *task->mutable_down_shards() = job.down_shards();
  task->set_incarnation(job.workers(rank).incarnation());
  if (start_step.has_value()) {
    task->set_start_step(*start_step);
    *task->mutable_data_position() = PositionAt(job, *start_step);
  }
  return event;
}

void RecordAssign(MemberEntry& member, const v1::TaskEvent& event) {
  member.assign = event;
  member.assign_durable = false;
}

bool StillAssigned(ClusterState& state, const MemberEntry& member) {
  if (!member.assign.has_value() || member.member.state() != v1::MEMBER_STATE_BUSY) return false;
  const v1::Task& task = member.assign->assign();
  if (member.member.job_id() != task.job_id()) return false;
  const JobEntry* entry = state.FindJob(task.job_id());
  if (entry == nullptr || entry->job.state() != v1::JOB_STATE_RUNNING ||
      !entry->job.recovery().empty() || entry->stopped_members.count(member.member.id()) > 0 ||
      task.rank() < 0 || task.rank() >= entry->job.workers_size()) {
    return false;
  }
  const v1::JobWorker& worker = entry->job.workers(task.rank());
  return worker.member_id() == member.member.id() && worker.incarnation() == task.incarnation() &&
         !worker.lost() && !worker.done();
}

void SendAssigns(ClusterState& state, const Assignments& assigns) {
  absl::MutexLock lock(&state.mu);
  for (const auto& [member_id, event] : assigns) {
    MemberEntry* member = state.FindMember(member_id);
    if (member == nullptr || !member->assign.has_value()) continue;
    const v1::Task& current = member->assign->assign();
    if (current.job_id() != event.assign().job_id() || current.rank() != event.assign().rank() ||
        current.incarnation() != event.assign().incarnation() || !StillAssigned(state, *member)) {
      continue;  // released, reassigned or ended meanwhile
    }
    member->assign_durable = true;
    // Without a stream now, the next one the worker opens gets it (OpenTaskStream).
    if (member->stream != nullptr) member->stream->Send(event);
  }
}

void ReserveWorker(ClusterState& state, MemberEntry& member, const std::string& job_id, int rank) {
  member.member.set_state(v1::MEMBER_STATE_BUSY);
  member.member.set_job_id(job_id);
  member.member.set_rank(rank);
  state.QueueMember(member);
}

void ReleaseWorker(ClusterState& state, MemberEntry& member, const std::string& job_id) {
  if (member.member.job_id() != job_id) return;
  member.assign.reset();
  member.assign_durable = false;
  member.member.clear_job_id();
  member.member.clear_rank();
  if (member.member.state() == v1::MEMBER_STATE_BUSY) {
    member.member.set_state(v1::MEMBER_STATE_READY);
  }
  state.QueueMember(member);
  state.Wake();
}

}  // namespace tessera::coordinator::internal
