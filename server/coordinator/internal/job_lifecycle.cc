#include "server/coordinator/internal/job_lifecycle.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/coordinator/internal/checkpoint_planner.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/shard_drops.h"
#include "server/coordinator/internal/task_assignments.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::coordinator::internal {

absl::StatusOr<v1::Job> CreateJob(ClusterState& state, const v1::JobSpec& spec) {
  {
    absl::MutexLock lock(&state.mu);
    if (!state.store_error.ok()) return state.store_error;
  }
  spec::ValidateOptions validate;
  validate.check_files = state.options.check_files;
  validate.distributed = true;
  validate.dataset_roots = state.options.dataset_roots;
  TESSERA_RETURN_IF_ERROR(spec::ValidateJobSpec(spec, validate));
  if (state.options.num_shards > 0 && spec::Replicas(spec) > state.options.num_shards) {
    return absl::InvalidArgumentError(absl::StrCat("replication: ", spec::Replicas(spec),
                                                   " copies need as many shards; this cluster has ",
                                                   state.options.num_shards, " (--num_shards)"));
  }
  v1::Job created;
  {
    absl::MutexLock lock(&state.mu);
    JobEntry entry;
    entry.n = state.jobs.empty() ? 1 : state.jobs.rbegin()->first + 1;
    entry.job.set_id(absl::StrCat(spec.name(), "-", entry.n));
    *entry.job.mutable_spec() = spec;
    entry.job.set_state(v1::JOB_STATE_PENDING);
    entry.job.set_reason("queued");
    entry.job.set_create_time_ms(state.NowMs());
    JobEntry& stored = state.jobs.emplace(entry.n, std::move(entry)).first->second;
    state.job_n[stored.job.id()] = stored.n;
    AddEvent(state, stored, v1::JOB_EVENT_KIND_STATE, "queued");
    created = stored.job;
    state.Wake();
  }
  TESSERA_RETURN_IF_ERROR(state.FlushWrites());
  spdlog::info("coordinator: job {} queued ({} workers)", created.id(),
               spec::NumWorkers(created.spec()));
  return created;
}

absl::StatusOr<v1::Job> CancelJob(ClusterState& state, const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must be set");
  v1::Job result;
  {
    absl::MutexLock lock(&state.mu);
    if (!state.store_error.ok()) return state.store_error;
    JobEntry* entry = state.FindJob(job_id);
    if (entry == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job ", job_id));
    switch (entry->job.state()) {
      case v1::JOB_STATE_CANCELLED:
        return entry->job;
      case v1::JOB_STATE_SUCCEEDED:
      case v1::JOB_STATE_FAILED:
        return absl::FailedPreconditionError(
            absl::StrCat("job ", job_id, " already ended ", v1::JobState_Name(entry->job.state()),
                         "; only a PENDING or RUNNING job can be cancelled"));
      default:
        EndJob(state, *entry, v1::JOB_STATE_CANCELLED, "cancelled by the user", "");
        break;
    }
    result = entry->job;
  }
  TESSERA_RETURN_IF_ERROR(state.FlushWrites());
  return result;
}

void EndJob(ClusterState& state, JobEntry& entry, v1::JobState job_state, const std::string& reason,
            const std::string& except_member) {
  v1::Job& job = entry.job;
  const bool was_running = job.state() == v1::JOB_STATE_RUNNING;
  job.set_state(job_state);
  job.set_reason(reason);
  job.set_end_time_ms(state.NowMs());
  entry.restart_deadline_ms = 0;
  for (const v1::JobWorker& worker : job.workers()) {
    MemberEntry* member = state.FindMember(worker.member_id());
    if (member == nullptr || member->member.id() == except_member ||
        member->member.job_id() != job.id()) {
      continue;
    }
    if (member->stream != nullptr && member->member.state() == v1::MEMBER_STATE_BUSY &&
        entry.stopped_members.count(member->member.id()) == 0) {
      // It stays BUSY until it reports a terminal phase or its stream ends.
      v1::TaskEvent cancel;
      cancel.mutable_cancel()->set_job_id(job.id());
      cancel.mutable_cancel()->set_reason(reason);
      member->stream->Send(cancel);
    } else {
      ReleaseWorker(state, *member, job.id());
    }
  }
  entry.stopped_members.clear();
  if (was_running) {
    for (const std::string& address : job.shard_addresses()) QueueDrop(state, address, job.id());
    ForgetCheckpoints(state, entry);
  }
  job.clear_recovery();
  const char* verb = job_state == v1::JOB_STATE_FAILED ? "failed" : "cancelled";
  spdlog::info("coordinator: job {} {}: {}", job.id(), verb, reason);
  AddEvent(state, entry, v1::JOB_EVENT_KIND_STATE,
           job_state == v1::JOB_STATE_CANCELLED && reason == "cancelled by the user"
               ? reason
               : absl::StrCat(verb, ": ", reason));
  state.Wake();
}

void ApplyRetention(ClusterState& state) {
  std::vector<JobEntry*> kept;
  for (auto& [n, entry] : state.jobs) {
    if (entry.weights_on_shards) kept.push_back(&entry);
  }
  const size_t retain = static_cast<size_t>(state.options.retain_models);
  for (size_t i = 0; i + retain < kept.size(); ++i) {
    JobEntry& old = *kept[i];
    old.weights_on_shards = false;
    for (const std::string& address : old.job.shard_addresses()) {
      QueueDrop(state, address, old.job.id());
    }
    ForgetCheckpoints(state, old);
    AddEvent(state, old, v1::JOB_EVENT_KIND_MODEL,
             absl::StrCat(kWeightsDropped, " (--retain_models ", state.options.retain_models, ")"));
    state.Wake();
  }
}

}  // namespace tessera::coordinator::internal
