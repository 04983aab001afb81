#include "server/coordinator/internal/gang_scheduler.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/job_lifecycle.h"
#include "server/coordinator/internal/shard_drops.h"
#include "server/coordinator/internal/task_assignments.h"
#include "spdlog/spdlog.h"
#include "spec/device_spec.h"
#include "spec/job_spec.h"

namespace tessera::coordinator::internal {
namespace {

// A job whose workers are reserved, for the shards to be called.
struct GangPlan {
  std::string job_id;
  v1::JobConfig config;
  std::vector<std::string> addresses;  // by shard index
  std::vector<std::string> picked;     // member ids by rank
};

// What the cluster offers a job now.
struct GangResources {
  std::map<int, const MemberEntry*> live_shards;  // READY shards by index
  int registered_workers = 0;
  std::vector<MemberEntry*> idle;  // READY workers with an open task stream
};

void SetPendingReason(ClusterState& state, JobEntry& entry, const std::string& reason)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  if (entry.job.reason() == reason) return;
  entry.job.set_reason(reason);
  state.QueueJob(entry);
}

// The oldest PENDING job (the later ones are "queued behind" it); null when there is none or a
// RUNNING job is in its restart grace.
JobEntry* OldestPending(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  for (auto& [n, candidate] : state.jobs) {
    // After a restart, wait until the running jobs' workers are known again: they would look
    // idle before they report.
    if (candidate.restart_deadline_ms > 0) return nullptr;
  }
  JobEntry* entry = nullptr;
  for (auto& [n, candidate] : state.jobs) {
    if (candidate.job.state() == v1::JOB_STATE_PENDING) {
      entry = &candidate;
      break;
    }
  }
  if (entry == nullptr) return nullptr;
  for (auto& [n, other] : state.jobs) {
    if (n > entry->n && other.job.state() == v1::JOB_STATE_PENDING) {
      SetPendingReason(state, other, absl::StrCat("queued behind ", entry->job.id()));
    }
  }
  return entry;
}

GangResources SurveyResources(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  GangResources resources;
  for (auto& [id, member] : state.members) {
    const v1::Member& m = member.member;
    if (m.role() == v1::MEMBER_ROLE_SERVER) {
      if (m.state() == v1::MEMBER_STATE_READY) resources.live_shards[m.shard_index()] = &member;
    } else if (IsLive(m)) {
      ++resources.registered_workers;
      if (m.state() == v1::MEMBER_STATE_READY && member.stream != nullptr &&
          !member.stream->closed()) {
        resources.idle.push_back(&member);
      }
    }
  }
  return resources;
}

// The shards the job needs (-1 when they are not all there, with the job's reason saying why).
int ShardsReady(ClusterState& state, JobEntry& entry, const GangResources& resources)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  const int configured = state.options.num_shards;
  const int num_shards =
      configured > 0 ? configured : static_cast<int>(resources.live_shards.size());
  int present = 0;
  int missing = -1;
  for (int i = 0; i < num_shards; ++i) {
    if (resources.live_shards.count(i) != 0) {
      ++present;
    } else if (missing < 0) {
      missing = i;
    }
  }
  if (num_shards == 0) {
    SetPendingReason(state, entry, "waiting for shards: none registered");
    return -1;
  }
  if (missing >= 0) {
    SetPendingReason(
        state, entry,
        configured > 0
            ? absl::StrCat("waiting for shards: ", present, " of ", num_shards, " registered")
            : absl::StrCat("waiting for shards: indices must run 0..", num_shards - 1, ", shard ",
                           missing, " is missing"));
    return -1;
  }
  const int copies = spec::Replicas(entry.job.spec());
  if (num_shards < copies) {
    SetPendingReason(state, entry,
                     absl::StrCat("waiting for shards: replication ", copies, " needs ", copies,
                                  " shards, ", num_shards, " registered"));
    return -1;
  }
  return num_shards;
}

// The oldest PENDING job with its shards and its workers (lowest member numbers first, reserved
// BUSY here), when the cluster has them; otherwise the job's reason says what it waits for.
std::optional<GangPlan> ReserveGang(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  JobEntry* entry = OldestPending(state);
  if (entry == nullptr) return std::nullopt;
  const int want_workers = spec::NumWorkers(entry->job.spec());
  GangResources resources = SurveyResources(state);
  const int num_shards = ShardsReady(state, *entry, resources);
  if (num_shards < 0) return std::nullopt;
  std::vector<MemberEntry*>& idle = resources.idle;
  // A worker whose devices cannot train the model (a pipeline of S stages on cpu:N with N not 1
  // or S) is passed over: it would fail the task at its start.
  const size_t idle_workers = idle.size();
  std::string unfit_reason;
  idle.erase(std::remove_if(idle.begin(), idle.end(),
                            [&](const MemberEntry* w) {
                              const absl::Status fits = spec::CheckWorkerFitsModel(
                                  w->member.device(), entry->job.spec().model());
                              if (!fits.ok() && unfit_reason.empty()) {
                                unfit_reason =
                                    absl::StrCat(w->member.device(), ": ", fits.message());
                              }
                              return !fits.ok();
                            }),
             idle.end());
  if (static_cast<int>(idle.size()) < want_workers) {
    const int registered = resources.registered_workers;
    const size_t unfit = idle_workers - idle.size();
    SetPendingReason(
        state, *entry,
        absl::StrCat(
            "waiting for ", want_workers, " idle workers",
            unfit > 0 ? " whose devices can train the model" : "", ", ", registered, " registered",
            registered > static_cast<int>(idle_workers) ? absl::StrCat(", ", idle_workers, " idle")
                                                        : std::string(),
            unfit > 0 ? absl::StrCat(" (", unfit, " idle that cannot: ", unfit_reason, ")")
                      : std::string()));
    return std::nullopt;
  }
  std::sort(idle.begin(), idle.end(),
            [](const MemberEntry* a, const MemberEntry* b) { return a->n < b->n; });
  GangPlan plan;
  plan.job_id = entry->job.id();
  for (int rank = 0; rank < want_workers; ++rank) {
    ReserveWorker(state, *idle[rank], plan.job_id, rank);
    plan.picked.push_back(idle[rank]->member.id());
  }
  for (int i = 0; i < num_shards; ++i) {
    plan.addresses.push_back(resources.live_shards[i]->member.address());
  }
  plan.config = spec::MakeJobConfig(entry->job.spec());
  entry->starting = true;
  return plan;
}

// CreateJobState on every shard of the plan, in index order; the first error, naming the shard.
// Unlocked: RPCs to the shards. The workers are marked BUSY, so nothing else takes them.
absl::Status CreateJobStates(ClusterState& state, const GangPlan& plan)
    ABSL_LOCKS_EXCLUDED(state.mu) {
  for (size_t i = 0; i < plan.addresses.size(); ++i) {
    absl::Status status = state.shards->CreateJobState(plan.addresses[i], plan.job_id, plan.config);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("shard ", i, " (", plan.addresses[i],
                                                      "): ", status.message()));
    }
  }
  return absl::OkStatus();
}

void ReleaseGang(ClusterState& state, const GangPlan& plan)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  for (const std::string& id : plan.picked) {
    if (MemberEntry* member = state.FindMember(id)) ReleaseWorker(state, *member, plan.job_id);
  }
}

// Whether every picked worker is still BUSY with the job and has an open task stream.
bool GangStillThere(ClusterState& state, const GangPlan& plan)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  bool all_there = true;
  for (const std::string& id : plan.picked) {
    const MemberEntry* member = state.FindMember(id);
    all_there = all_there && member != nullptr && member->stream != nullptr &&
                !member->stream->closed() && member->member.state() == v1::MEMBER_STATE_BUSY &&
                member->member.job_id() == plan.job_id;
  }
  return all_there;
}

// The job RUNNING on the plan's shards and workers ("started on W workers and S shards"), each
// rank's Task recorded.
void StartJob(ClusterState& state, JobEntry& entry, const GangPlan& plan, Assignments* assigns)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  const int64_t now = state.NowMs();
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_reason("");
  job.set_start_time_ms(now);
  job.clear_shard_addresses();
  for (const std::string& address : plan.addresses) job.add_shard_addresses(address);
  job.clear_workers();
  for (size_t rank = 0; rank < plan.picked.size(); ++rank) {
    MemberEntry& member = *state.FindMember(plan.picked[rank]);
    v1::JobWorker* worker = job.add_workers();
    worker->set_rank(static_cast<int>(rank));
    worker->set_member_id(member.member.id());
    worker->set_hostname(member.member.hostname());
    worker->set_incarnation(static_cast<uint64_t>(now) * 1024 + rank);
    worker->set_progress_ms(now);
  }
  AddEvent(state, entry, v1::JOB_EVENT_KIND_STATE,
           absl::StrCat("started on ", plan.picked.size(), " workers and ", plan.addresses.size(),
                        " shards"));
  spdlog::info("coordinator: job {} started on {} workers and {} shards", plan.job_id,
               plan.picked.size(), plan.addresses.size());
  for (size_t rank = 0; rank < plan.picked.size(); ++rank) {
    MemberEntry& member = *state.FindMember(plan.picked[rank]);
    v1::TaskEvent event = AssignEvent(job, static_cast<int>(rank), std::nullopt);
    RecordAssign(member, event);
    assigns->emplace_back(member.member.id(), std::move(event));
  }
}

}  // namespace

bool ScheduleOldestPending(ClusterState& state) {
  std::optional<GangPlan> plan;
  {
    absl::MutexLock lock(&state.mu);
    plan = ReserveGang(state);
  }
  if (!plan.has_value()) return false;
  const absl::Status shard_error = CreateJobStates(state, *plan);
  Assignments assigns;
  {
    absl::MutexLock lock(&state.mu);
    JobEntry* entry = state.FindJob(plan->job_id);
    entry->starting = false;
    const bool cancelled = entry->job.state() != v1::JOB_STATE_PENDING;
    if (cancelled || !shard_error.ok()) {
      // Cancelled while the shards were called, or refused by a shard: what the shards made goes.
      ReleaseGang(state, *plan);
      for (const std::string& address : plan->addresses) QueueDrop(state, address, plan->job_id);
      if (!cancelled) {
        EndJob(state, *entry, v1::JOB_STATE_FAILED, std::string(shard_error.message()), "");
      }
      return true;  // the queue moved
    }
    if (!GangStillThere(state, *plan)) {
      // A worker went away meanwhile: the job stays queued and the next pass tries again.
      ReleaseGang(state, *plan);
      return false;
    }
    StartJob(state, *entry, *plan, &assigns);
  }
  if (assigns.empty()) return false;
  // The workers hear of the task only once RUNNING (and their BUSY records) is durable: a
  // coordinator killed before that restarts with the job PENDING, and nobody trains it. A cancel
  // that lands in between may reach a worker before its assign; its next report then gets
  // ack.cancel.
  absl::Status flushed = state.FlushWrites();
  if (!flushed.ok()) {
    spdlog::error("coordinator: job {} not started: {}", plan->job_id, flushed.ToString());
    return false;
  }
  SendAssigns(state, assigns);
  return true;
}

}  // namespace tessera::coordinator::internal
