#include "server/coordinator/internal/recovery.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/coordinator/internal/checkpoint_planner.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/job_lifecycle.h"
#include "server/coordinator/internal/job_steps.h"
#include "server/coordinator/internal/shard_drops.h"
#include "server/coordinator/internal/shard_failover.h"
#include "server/coordinator/internal/shard_refill.h"
#include "server/coordinator/internal/stall_inspector.h"
#include "server/coordinator/internal/task_assignments.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator::internal {
namespace {

// A membership as the shards must hear it: (effective_step, live ranks) in ascending steps, to
// be sent in this order (each replaces the shards' history from its step on).
using MembershipLayers = std::vector<std::pair<int64_t, std::vector<uint32_t>>>;

struct RecoveryPlan {
  std::string job_id;
  std::vector<int64_t> steps;  // committed checkpoints, newest first
  std::vector<std::string> addresses;
  std::vector<uint32_t> live_ranks;
  uint64_t incarnation_base = 0;
};

struct HandoverPlan {
  std::string job_id;
  int rank = 0;
  std::string member_id;
  int64_t start_step = 0;
  std::vector<std::string> addresses;
  std::vector<uint32_t> live_ranks;  // without `rank`
  MembershipLayers resend;           // sent before the join (empty: none)
};

// What Restore and UpdateMembership on the shards came to.
struct RestoreOutcome {
  int64_t restored = -1;  // the checkpoint every shard restored; -1: none
  absl::Status retry;     // a failure that is not the checkpoint's fault: try again later
  std::vector<std::string> unusable;  // why each checkpoint tried was unusable
};

// What the join of a hand-over came to on the shards.
struct JoinOutcome {
  absl::Status failed;
  int64_t completed = 0;  // the most steps a shard said it had done
  bool too_late = false;  // a shard is past the start step
};

// Restore errors that mean "this checkpoint is unusable": try the next older one.
bool CheckpointUnusable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kDataLoss ||
         status.code() == absl::StatusCode::kNotFound;
}

// The job's live ranks `live_ranks` from `effective_step` on, as layers: the ranks of
// entry.joins whose join step lies beyond `effective_step` join again at their own step.
MembershipLayers LayeredMembership(const JobEntry& entry, const std::vector<uint32_t>& live_ranks,
                                   int64_t effective_step) {
  std::map<int64_t, std::vector<uint32_t>> joining;  // join step -> the ranks joining there
  std::set<uint32_t> pending;
  for (const auto& [rank, step] : entry.joins) {
    const uint32_t r = static_cast<uint32_t>(rank);
    if (step > effective_step &&
        std::find(live_ranks.begin(), live_ranks.end(), r) != live_ranks.end()) {
      joining[step].push_back(r);
      pending.insert(r);
    }
  }
  MembershipLayers layers;
  std::vector<uint32_t> live;
  for (uint32_t rank : live_ranks) {
    if (pending.count(rank) == 0) live.push_back(rank);
  }
  // Without a rank live before the first join (the others are all lost) that layer cannot be
  // sent (the shards refuse an empty set); the joins still are.
  if (!live.empty()) layers.emplace_back(effective_step, live);
  for (auto& [step, ranks] : joining) {
    live.insert(live.end(), ranks.begin(), ranks.end());
    std::sort(live.begin(), live.end());
    layers.emplace_back(step, live);
  }
  return layers;
}

// UpdateMembership of every layer, in order, on every shard; a failure sets membership_dirty.
void SendMembership(ClusterState& state, const std::string& job_id,
                    const std::vector<std::string>& addresses, const MembershipLayers& layers)
    ABSL_LOCKS_EXCLUDED(state.mu) {
  bool failed = false;
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (addresses[i].empty()) continue;  // down (shard_failover.h)
    // In order: each update replaces the shard's history from its step on.
    for (const auto& [effective_step, live_ranks] : layers) {
      v1::UpdateMembershipRequest request;
      request.set_job_id(job_id);
      for (uint32_t rank : live_ranks) request.add_live_workers(rank);
      request.set_effective_step(effective_step);
      absl::StatusOr<v1::UpdateMembershipResponse> response =
          state.shards->UpdateMembership(addresses[i], request);
      if (!response.ok()) {
        failed = true;
        spdlog::warn("coordinator: job {}: UpdateMembership at step {} on shard {} ({}) failed: {}",
                     job_id, effective_step, i, addresses[i], response.status().ToString());
        break;
      }
    }
  }
  if (failed) {
    // Tried again on a later tick; a shard that is gone is noticed by its lease.
    absl::MutexLock lock(&state.mu);
    if (JobEntry* entry = state.FindJob(job_id)) entry->membership_dirty = true;
  }
}

// --- Recovery from a checkpoint.

// Restore on every shard (the live ones too, so the cut is consistent), newest checkpoint first;
// then the live ranks from the restored step on. Unlocked: shard calls.
RestoreOutcome RestoreNewestUsable(ClusterState& state, const RecoveryPlan& plan)
    ABSL_LOCKS_EXCLUDED(state.mu) {
  RestoreOutcome out;
  for (int64_t step : plan.steps) {
    bool usable = true;
    for (size_t i = 0; i < plan.addresses.size() && usable && out.retry.ok(); ++i) {
      v1::RestoreRequest request;
      request.set_job_id(plan.job_id);
      request.set_step(step);
      request.set_min_incarnation(plan.incarnation_base);
      absl::StatusOr<v1::RestoreResponse> response =
          state.shards->Restore(plan.addresses[i], request);
      if (response.ok()) continue;
      const std::string what = absl::StrCat("checkpoint ", step, " on shard ", i, " (",
                                            plan.addresses[i], "): ", response.status().message());
      if (CheckpointUnusable(response.status())) {
        usable = false;
        out.unusable.push_back(what);
        spdlog::warn("coordinator: job {}: {}; trying an older checkpoint", plan.job_id, what);
      } else {
        out.retry = absl::Status(response.status().code(), what);
      }
    }
    if (!out.retry.ok()) break;
    if (usable) {
      out.restored = step;
      break;
    }
  }
  if (out.restored < 0) return out;
  v1::UpdateMembershipRequest request;
  request.set_job_id(plan.job_id);
  for (uint32_t rank : plan.live_ranks) request.add_live_workers(rank);
  request.set_effective_step(out.restored);
  for (size_t i = 0; i < plan.addresses.size() && out.retry.ok(); ++i) {
    absl::StatusOr<v1::UpdateMembershipResponse> response =
        state.shards->UpdateMembership(plan.addresses[i], request);
    if (!response.ok()) {
      out.retry = absl::Status(response.status().code(),
                               absl::StrCat("UpdateMembership on shard ", i, " (",
                                            plan.addresses[i], "): ", response.status().message()));
    }
  }
  return out;
}

// Sends each live rank of the plan a new Task from `restored` (a rank without a live worker
// with a task stream is lost instead). False when that ended the job.
bool RewindRanks(ClusterState& state, JobEntry& entry, const RecoveryPlan& plan, int64_t restored,
                 Assignments* assigns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  for (uint32_t rank : plan.live_ranks) {
    v1::JobWorker& worker = *job.mutable_workers(static_cast<int>(rank));
    if (worker.lost()) continue;  // lost meanwhile: its membership change is pending
    MemberEntry* member = state.FindMember(worker.member_id());
    const bool usable = member != nullptr && IsLive(member->member) && member->stream != nullptr &&
                        !member->stream->closed() &&
                        (member->member.job_id() == job.id() || member->member.job_id().empty());
    if (!usable) {
      LoseRank(state, entry, static_cast<int>(rank), "is gone (no live worker with a task stream)");
      if (job.state() != v1::JOB_STATE_RUNNING) return false;
      continue;
    }
    worker.set_step(restored);
    worker.set_done(false);
    worker.set_incarnation(plan.incarnation_base + rank);
    ReserveWorker(state, *member, job.id(), static_cast<int>(rank));
    v1::TaskEvent event = AssignEvent(job, static_cast<int>(rank), restored);
    RecordAssign(*member, event);
    assigns->emplace_back(member->member.id(), std::move(event));
  }
  return true;
}

// The job restored checkpoint `restored` on every shard: its step and its ranks go back there.
// False when a rank found gone ended the job.
bool RewindJob(ClusterState& state, JobEntry& entry, const RecoveryPlan& plan, int64_t restored,
               Assignments* assigns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  // Checkpoints newer than the restored one are unusable: forget them.
  ForgetCheckpointsAfter(state, entry, restored);
  job.set_last_checkpoint_step(restored);
  const int64_t from = job.step();
  job.set_step(restored);
  job.set_recoveries(job.recoveries() + 1);
  job.clear_recovery();
  // Every index was restored from a checkpoint taken with every shard: none is down any more.
  job.clear_down_shards();
  // The shards have just heard plan.live_ranks, every one from the checkpoint on: no join is
  // pending any more. A rank of them lost while the restore ran is still live there, so
  // they must hear the live ranks again.
  entry.joins.clear();
  entry.membership_dirty = false;
  for (uint32_t rank : plan.live_ranks) {
    if (job.workers(static_cast<int>(rank)).lost()) entry.membership_dirty = true;
  }
  entry.checkpoint_failed_step = 0;
  entry.stopped_members.clear();
  ResetStalls(entry, state.NowMs());
  AddEvent(state, entry, v1::JOB_EVENT_KIND_RECOVERY,
           absl::StrCat("restored checkpoint ", restored, "; workers rewound from step ", from,
                        " to ", restored));
  spdlog::info("coordinator: job {}: restored checkpoint {}; workers rewound from step {}",
               job.id(), restored, from);
  if (!RewindRanks(state, entry, plan, restored, assigns)) return false;
  state.QueueJob(entry);
  return true;
}

// Applies what the shards did to the job, under the lock. True when the assignments (if any)
// are to be made durable and sent.
bool FinishRecovery(ClusterState& state, const RecoveryPlan& plan, const RestoreOutcome& outcome,
                    Assignments* assigns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  JobEntry* entry = state.FindJob(plan.job_id);
  if (entry == nullptr) return false;
  entry->action_running = false;
  state.Wake();
  v1::Job& job = entry->job;
  if (job.state() != v1::JOB_STATE_RUNNING) {
    // Ended meanwhile: what Restore created on the shards goes too.
    for (const std::string& address : plan.addresses) QueueDrop(state, address, job.id());
    return false;
  }
  if (!outcome.retry.ok()) {
    spdlog::warn("coordinator: job {}: recovery attempt failed, trying again: {}", job.id(),
                 outcome.retry.ToString());
    return false;
  }
  if (outcome.restored < 0) {
    EndJob(state, *entry, v1::JOB_STATE_FAILED,
           absl::StrCat("no checkpoint could be restored: ", absl::StrJoin(outcome.unusable, "; ")),
           "");
    return true;
  }
  return RewindJob(state, *entry, plan, outcome.restored, assigns);
}

void Recover(ClusterState& state, const RecoveryPlan& plan) ABSL_LOCKS_EXCLUDED(state.mu) {
  const RestoreOutcome outcome = RestoreNewestUsable(state, plan);
  Assignments assigns;
  {
    absl::MutexLock lock(&state.mu);
    if (!FinishRecovery(state, plan, outcome, &assigns)) return;
  }
  // As in the gang scheduler: the tasks go out once the rewind is durable.
  if (!state.FlushWrites().ok()) return;
  SendAssigns(state, assigns);
}

// --- Hand-over of a lost rank.

// The join on every shard, and its undo when a shard is already past the start step or a call
// failed. Unlocked: shard calls.
JoinOutcome JoinOnShards(ClusterState& state, const HandoverPlan& plan)
    ABSL_LOCKS_EXCLUDED(state.mu) {
  v1::UpdateMembershipRequest join;
  join.set_job_id(plan.job_id);
  for (uint32_t rank : plan.live_ranks) join.add_live_workers(rank);
  join.add_live_workers(static_cast<uint32_t>(plan.rank));
  std::sort(join.mutable_live_workers()->begin(), join.mutable_live_workers()->end());
  join.set_effective_step(plan.start_step);
  JoinOutcome out;
  for (size_t i = 0; i < plan.addresses.size() && out.failed.ok(); ++i) {
    if (plan.addresses[i].empty()) continue;  // down (shard_failover.h)
    absl::StatusOr<v1::UpdateMembershipResponse> response =
        state.shards->UpdateMembership(plan.addresses[i], join);
    if (!response.ok()) {
      out.failed = response.status();
    } else {
      out.completed = std::max(out.completed, response->completed_steps());
    }
  }
  out.too_late = out.failed.ok() && out.completed > plan.start_step;
  if (!out.failed.ok() || out.too_late) {
    SendMembership(state, plan.job_id, plan.addresses, {{plan.start_step, plan.live_ranks}});
  }
  return out;
}

// Rank plan.rank of the job goes to the plan's worker from plan.start_step on.
void HandRank(ClusterState& state, JobEntry& entry, MemberEntry& member, const HandoverPlan& plan,
              Assignments* assigns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  v1::JobWorker& worker = *job.mutable_workers(plan.rank);
  const std::string old = WorkerName(worker);
  worker.set_lost(false);
  worker.set_member_id(member.member.id());
  worker.set_hostname(member.member.hostname());
  worker.set_step(plan.start_step);
  worker.set_done(false);
  worker.set_samples_per_second(0);
  worker.set_incarnation(NextIncarnation(job, state.NowMs()));
  worker.set_progress_ms(state.NowMs());
  worker.set_stalled_seconds(0);
  entry.stall_warned.erase(plan.rank);
  entry.handover_attempts = 0;
  entry.handover_floor = 0;
  // Live on the shards from start_step only, until the job gets there.
  entry.joins[plan.rank] = plan.start_step;
  AddEvent(state, entry, v1::JOB_EVENT_KIND_MEMBERSHIP,
           absl::StrCat("rank ", plan.rank, " handed to ", member.member.id(), " from step ",
                        plan.start_step));
  spdlog::info("coordinator: job {}: rank {} (was {}) handed to {} from step {}", job.id(),
               plan.rank, old, member.member.id(), plan.start_step);
  v1::TaskEvent event = AssignEvent(job, plan.rank, plan.start_step);
  RecordAssign(member, event);
  assigns->emplace_back(member.member.id(), std::move(event));
}

// Applies the join's outcome under the lock. True when the assignment is to be made durable and
// sent.
bool FinishHandover(ClusterState& state, const HandoverPlan& plan, const JoinOutcome& outcome,
                    Assignments* assigns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  JobEntry* entry = state.FindJob(plan.job_id);
  MemberEntry* member = state.FindMember(plan.member_id);
  if (entry == nullptr) return false;
  entry->action_running = false;
  state.Wake();
  v1::Job& job = entry->job;
  const bool reserved = member != nullptr && IsLive(member->member) &&
                        member->member.job_id() == job.id() && member->member.rank() == plan.rank;
  const bool usable = reserved && member->stream != nullptr && !member->stream->closed();
  if (outcome.failed.ok() && !outcome.too_late && usable && job.state() == v1::JOB_STATE_RUNNING &&
      job.recovery().empty() && job.workers(plan.rank).lost()) {
    HandRank(state, *entry, *member, plan, assigns);
    return true;
  }
  if (reserved) ReleaseWorker(state, *member, job.id());
  if (job.state() != v1::JOB_STATE_RUNNING) return false;
  if (outcome.too_late) {
    ++entry->handover_attempts;
    entry->handover_floor = std::max(entry->handover_floor, outcome.completed);
    spdlog::info(
        "coordinator: job {}: handing rank {} over at step {} came too late (a shard has "
        "done {} steps); trying further ahead",
        job.id(), plan.rank, plan.start_step, outcome.completed);
  } else if (!outcome.failed.ok()) {
    spdlog::warn("coordinator: job {}: handing rank {} over failed: {}", job.id(), plan.rank,
                 outcome.failed.ToString());
  } else {
    // The join reached the shards but the rank cannot be handed over now: the shards hear
    // the live ranks again.
    entry->membership_dirty = true;
  }
  return false;
}

void Handover(ClusterState& state, const HandoverPlan& plan) ABSL_LOCKS_EXCLUDED(state.mu) {
  const JoinOutcome outcome = JoinOnShards(state, plan);
  Assignments assigns;
  {
    absl::MutexLock lock(&state.mu);
    if (!FinishHandover(state, plan, outcome, &assigns)) return;
  }
  if (!state.FlushWrites().ok()) return;
  SendAssigns(state, assigns);
}

// --- Planning.

// A recovering job's Restore, once every shard index of the job has a live shard (a replacement
// at another address is taken). Fails the job past options.recovery_timeout.
std::function<void()> PlanRecovery(ClusterState& state, JobEntry& entry, const LiveMembers& live,
                                   const std::vector<uint32_t>& live_ranks)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  std::vector<std::string> addresses;
  int missing = -1;
  for (int i = 0; i < job.shard_addresses_size() && missing < 0; ++i) {
    auto it = live.shards.find(i);
    if (it == live.shards.end()) {
      missing = i;
    } else {
      addresses.push_back(it->second);
    }
  }
  const absl::Duration timeout = state.options.recovery_timeout;
  if (state.NowMs() - entry.recovery_since_ms >= absl::ToInt64Milliseconds(timeout)) {
    EndJob(state, entry, v1::JOB_STATE_FAILED,
           absl::StrCat("not recovered within ", SecondsText(timeout), " (", job.recovery(), ")"),
           "");
    return nullptr;
  }
  if (missing >= 0) return nullptr;
  for (int i = 0; i < job.shard_addresses_size(); ++i) {
    if (job.shard_addresses(i) != addresses[i]) {
      spdlog::info("coordinator: job {}: shard {} is now at {}", job.id(), i, addresses[i]);
      job.set_shard_addresses(i, addresses[i]);
    }
  }
  RecoveryPlan plan;
  plan.job_id = job.id();
  for (const v1::CheckpointRecord& record : entry.checkpoints) plan.steps.push_back(record.step());
  plan.addresses = std::move(addresses);
  plan.live_ranks = live_ranks;
  plan.incarnation_base = NextIncarnation(job, state.NowMs());
  entry.action_running = true;
  state.QueueJob(entry);
  return [state = &state, plan] { Recover(*state, plan); };
}

// Lost rank `lost_rank` joins again with `member` (reserved here) at a step ahead of the job,
// after the live ranks `resend` (when the shards must hear them again).
std::function<void()> PlanHandover(ClusterState& state, JobEntry& entry, MemberEntry& member,
                                   int lost_rank, const std::vector<uint32_t>& live_ranks,
                                   MembershipLayers resend)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  const v1::Job& job = entry.job;
  ReserveWorker(state, member, job.id(), lost_rank);
  HandoverPlan plan;
  plan.job_id = job.id();
  plan.rank = lost_rank;
  plan.member_id = member.member.id();
  // After a join that came too late, the shards' answer (the steps they had done) is a
  // fresher floor than the workers' reports, which trail by up to one progress interval.
  const int64_t margin = StepMargin(job, entry.handover_attempts);
  plan.start_step = std::max(MaxRankStep(job), entry.handover_floor) + margin;
  if (job.total_steps() > 0) plan.start_step = std::min(plan.start_step, job.total_steps());
  plan.addresses = ServingAddresses(job);
  plan.live_ranks = live_ranks;
  plan.resend = std::move(resend);
  entry.membership_dirty = false;
  entry.action_running = true;
  return [state = &state, plan] {
    if (!plan.resend.empty()) SendMembership(*state, plan.job_id, plan.addresses, plan.resend);
    Handover(*state, plan);
  };
}

}  // namespace

void StartRecovery(ClusterState& state, JobEntry& entry, const std::string& cause) {
  v1::Job& job = entry.job;
  if (!job.recovery().empty()) {
    spdlog::info("coordinator: job {} is already recovering; also: {}", job.id(), cause);
    return;
  }
  if (entry.checkpoints.empty()) {
    EndJob(state, entry, v1::JOB_STATE_FAILED, cause, "");
    return;
  }
  if (job.recoveries() >= state.options.max_recoveries) {
    EndJob(state, entry, v1::JOB_STATE_FAILED,
           absl::StrCat(cause, " (recovered ", job.recoveries(), " times already; giving up)"), "");
    return;
  }
  GiveUpFill(state, entry, "the job recovers from a checkpoint");
  job.set_recovery(
      absl::StrCat(cause, ": recovering from checkpoint ", entry.checkpoints.front().step()));
  entry.recovery_since_ms = state.NowMs();
  entry.shard_stalls.clear();
  spdlog::info("coordinator: job {}: {}", job.id(), job.recovery());
  AddEvent(state, entry, v1::JOB_EVENT_KIND_RECOVERY, job.recovery());
  state.Wake();
}

void LoseRank(ClusterState& state, JobEntry& entry, int rank, const std::string& why) {
  v1::Job& job = entry.job;
  v1::JobWorker& worker = *job.mutable_workers(rank);
  const std::string what = absl::StrCat("worker rank ", rank, " (", WorkerName(worker), ") ", why);
  worker.set_lost(true);
  worker.set_samples_per_second(0);
  int live = 0;
  for (const v1::JobWorker& w : job.workers()) live += w.lost() ? 0 : 1;
  if (live == 0) {
    EndJob(state, entry, v1::JOB_STATE_FAILED, what, "");
    return;
  }
  entry.membership_dirty = true;
  GiveUpFill(state, entry, absl::StrCat("rank ", rank, " left the job"));
  // The live ranks may have waited for this one: their progress leases start again.
  entry.progress_lease_floor_ms = state.NowMs();
  spdlog::info("coordinator: job {}: {}; continuing with {} workers", job.id(), what, live);
  AddEvent(state, entry, v1::JOB_EVENT_KIND_MEMBERSHIP,
           absl::StrCat(what, "; continuing with ", live, " workers"));
  state.Wake();
}

void EndRestartGrace(ClusterState& state, JobEntry& entry, int64_t now_ms) {
  if (entry.job.state() != v1::JOB_STATE_RUNNING || entry.restart_deadline_ms <= 0) return;
  bool every_rank_back = true;
  for (int rank = 0; rank < entry.job.workers_size(); ++rank) {
    const v1::JobWorker& worker = entry.job.workers(rank);
    const bool seen = rank < static_cast<int>(entry.rank_seen.size()) && entry.rank_seen[rank];
    if (!seen && !worker.done() && !worker.lost()) every_rank_back = false;
  }
  if (!every_rank_back && now_ms < entry.restart_deadline_ms) return;
  entry.restart_deadline_ms = 0;
  if (every_rank_back) {
    spdlog::info("coordinator: job {}: every rank is back after the restart", entry.job.id());
    state.Wake();
    return;
  }
  for (int rank = 0; rank < entry.job.workers_size(); ++rank) {
    const bool seen = rank < static_cast<int>(entry.rank_seen.size()) && entry.rank_seen[rank];
    const v1::JobWorker& worker = entry.job.workers(rank);
    if (!seen && !worker.done() && !worker.lost()) {
      if (MemberEntry* member = state.FindMember(worker.member_id())) {
        ReleaseWorker(state, *member, entry.job.id());
      }
      LoseRank(state, entry, rank, "lost while the coordinator restarted");
      if (entry.job.state() != v1::JOB_STATE_RUNNING) break;
    }
  }
}

std::map<int, int64_t> DerivedJoins(const v1::Job& job) {
  // A start and a rewind give every rank base + rank as its incarnation; a hand-over gives its
  // rank one above all of them, so the ranks with incarnation - rank above the smallest were
  // handed over since. Such a rank's step is its join step until it reports, and above it after
  // (in BSP at most one step ahead of the others): never below it, so the join is never re-sent
  // earlier than it was made.
  std::map<int, int64_t> joins;
  int64_t base = std::numeric_limits<int64_t>::max();
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    const v1::JobWorker& worker = job.workers(rank);
    if (worker.lost()) continue;
    if (worker.incarnation() == 0) return joins;  // a job from before hand-overs existed
    base = std::min(base, static_cast<int64_t>(worker.incarnation()) - rank);
  }
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    const v1::JobWorker& worker = job.workers(rank);
    if (!worker.lost() && static_cast<int64_t>(worker.incarnation()) - rank > base &&
        worker.step() > job.step()) {
      joins[rank] = worker.step();
    }
  }
  return joins;
}

LiveMembers SurveyLiveMembers(ClusterState& state) {
  LiveMembers live;
  for (auto& [id, member] : state.members) {
    const v1::Member& m = member.member;
    if (m.role() == v1::MEMBER_ROLE_SERVER) {
      if (m.state() == v1::MEMBER_STATE_READY) live.shards[m.shard_index()] = m.address();
    } else if (m.state() == v1::MEMBER_STATE_READY && m.job_id().empty() &&
               member.stream != nullptr && !member.stream->closed()) {
      live.idle_workers.push_back(&member);
    }
  }
  std::sort(live.idle_workers.begin(), live.idle_workers.end(),
            [](const MemberEntry* a, const MemberEntry* b) { return a->n < b->n; });
  return live;
}

std::function<void()> PlanRecoveryAction(ClusterState& state, JobEntry& entry, LiveMembers& live) {
  v1::Job& job = entry.job;
  if (entry.action_running) return nullptr;
  std::vector<uint32_t> live_ranks;
  int lost_rank = -1;
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    if (!job.workers(rank).lost()) {
      live_ranks.push_back(static_cast<uint32_t>(rank));
    } else if (lost_rank < 0) {
      lost_rank = rank;
    }
  }
  if (!job.recovery().empty()) return PlanRecovery(state, entry, live, live_ranks);

  // Joins the job has reached are history (and a rank lost again has left anyway).
  for (auto it = entry.joins.begin(); it != entry.joins.end();) {
    const bool over = it->second <= job.step() || it->first >= job.workers_size() ||
                      job.workers(it->first).lost();
    it = over ? entry.joins.erase(it) : std::next(it);
  }
  // A lost rank leaves the shards' membership first (so the steps in between do not wait for
  // it), then joins again with an idle worker at a step ahead of the job. The live ranks are
  // sent from the job's step on, except that a rank handed over at a later step joins there
  // again (the shards replace their history from each update's step on).
  const bool send_membership = entry.membership_dirty;
  MembershipLayers layers;
  if (send_membership) layers = LayeredMembership(entry, live_ranks, job.step());
  if (lost_rank >= 0 && live.next_idle < live.idle_workers.size()) {
    MemberEntry& member = *live.idle_workers[live.next_idle++];
    return PlanHandover(state, entry, member, lost_rank, live_ranks, std::move(layers));
  }
  if (!send_membership) return nullptr;
  entry.membership_dirty = false;
  entry.action_running = true;
  const std::vector<std::string> addresses = ServingAddresses(job);
  return [state = &state, job_id = job.id(), addresses, layers = std::move(layers)] {
    SendMembership(*state, job_id, addresses, layers);
    absl::MutexLock lock(&state->mu);
    if (JobEntry* e = state->FindJob(job_id)) e->action_running = false;
    state->Wake();
  };
}

}  // namespace tessera::coordinator::internal
