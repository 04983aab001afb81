#include "server/coordinator/internal/checkpoint_planner.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/job_steps.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator::internal {
namespace {

// CheckpointByHand places its step further ahead this many times before it gives up.
constexpr int kCheckpointAttempts = 5;

// The record of a checkpoint every shard of `plan` confirmed; `*bytes` is its size.
v1::CheckpointRecord MakeRecord(const v1::Job& job, const CheckpointPlan& plan,
                                const std::vector<v1::CheckpointResponse>& responses,
                                int64_t now_ms, uint64_t* bytes) {
  v1::CheckpointRecord record;
  record.set_job_id(job.id());
  record.set_step(plan.step);
  record.set_time_ms(now_ms);
  record.set_manual(plan.manual);
  *bytes = 0;
  for (size_t i = 0; i < responses.size(); ++i) {
    v1::ShardCheckpoint* shard = record.add_shards();
    shard->set_shard_index(static_cast<int32_t>(i));
    shard->set_address(plan.addresses[i]);
    shard->set_path(responses[i].path());
    shard->set_bytes(responses[i].bytes());
    shard->set_crc32c(responses[i].crc32c());
    *bytes += responses[i].bytes();
  }
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    *record.add_positions() = PositionAt(job, plan.step);
  }
  return record;
}

// Puts `record` among the job's committed checkpoints (newest first, one per step), queues it,
// and forgets those beyond the spec's keep_checkpoints.
void KeepCommitted(ClusterState& state, JobEntry& entry, const v1::CheckpointRecord& record)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  const int64_t step = record.step();
  std::vector<v1::CheckpointRecord>& kept = entry.checkpoints;
  kept.erase(std::remove_if(kept.begin(), kept.end(),
                            [&](const v1::CheckpointRecord& r) { return r.step() == step; }),
             kept.end());
  kept.insert(
      std::upper_bound(kept.begin(), kept.end(), step,
                       [](int64_t s, const v1::CheckpointRecord& r) { return s > r.step(); }),
      record);
  const size_t keep = KeepCheckpoints(job.spec());
  while (kept.size() > keep) {
    state.pending.removed_checkpoints.push_back({job.id(), kept.back().step()});
    kept.pop_back();
  }
  state.pending.checkpoints.push_back(record);
  job.set_last_checkpoint_step(kept.front().step());
}

// The plan of one manual attempt: a StepMargin (doubled per `attempt`) ahead of the fastest rank.
absl::StatusOr<CheckpointPlan> PlanByHand(ClusterState& state, const std::string& job_id,
                                          int attempt) ABSL_LOCKS_EXCLUDED(state.mu) {
  absl::MutexLock lock(&state.mu);
  if (!state.store_error.ok()) return state.store_error;
  if (state.stopping) return absl::UnavailableError("the coordinator is shutting down");
  JobEntry* entry = state.FindJob(job_id);
  if (entry == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job ", job_id));
  if (entry->restart_deadline_ms > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " waits for its workers after a coordinator restart; try again later"));
  }
  const v1::Job& job = entry->job;
  const int64_t max_step = MaxRankStep(job);
  int64_t step = max_step + StepMargin(job, attempt);
  if (job.total_steps() > 0) step = std::min(step, job.total_steps());
  if (job.state() == v1::JOB_STATE_RUNNING && step <= max_step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " has done its ", job.total_steps(), " steps; nothing to checkpoint"));
  }
  return PlanCheckpoint(state, *entry, step, /*manual=*/true);
}

}  // namespace

absl::StatusOr<CheckpointPlan> PlanCheckpoint(ClusterState& state, JobEntry& entry, int64_t step,
                                              bool manual) {
  const v1::Job& job = entry.job;
  if (job.state() != v1::JOB_STATE_RUNNING) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job.id(), " is ",
                                                      v1::JobState_Name(job.state()),
                                                      "; only a RUNNING job takes checkpoints"));
  }
  if (!job.recovery().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id(), " is recovering (", job.recovery(), "); try again later"));
  }
  if (job.down_shards_size() > 0) {
    // A checkpoint is a cut of every index; the down one's state is only on its copies, which
    // the shards do not write as its own (docs/reliability.md "Replicated shards").
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id(), " runs with shard ", job.down_shards(0),
                     " down (its copies serve it); checkpoints need every shard index"));
  }
  CheckpointPlan plan;
  plan.job_id = job.id();
  plan.step = step;
  plan.addresses.assign(job.shard_addresses().begin(), job.shard_addresses().end());
  plan.recoveries = job.recoveries();
  plan.manual = manual;
  // The shards delete the files older than the K-th newest COMMITTED checkpoint once they have
  // written this one: the one being written does not count, because it may still fail on another
  // shard and then the committed ones are all the job has.
  std::vector<int64_t> steps;
  for (const v1::CheckpointRecord& record : entry.checkpoints) {
    if (record.step() != step) steps.push_back(record.step());
  }
  std::sort(steps.rbegin(), steps.rend());
  const size_t keep = KeepCheckpoints(job.spec());
  plan.retain_from_step = steps.size() >= keep ? steps[keep - 1] : 0;
  return plan;
}

std::optional<CheckpointPlan> PlanAutoCheckpoint(ClusterState& state, JobEntry& entry) {
  // Automatic checkpoints have a slot of their own: the call waits on the shards until the step
  // is written, and membership changes and recoveries must not queue behind it.
  const v1::Job& job = entry.job;
  const int64_t every = job.spec().checkpoint_every_steps();
  if (every <= 0 || entry.checkpoint_running || !job.recovery().empty()) return std::nullopt;
  // The next multiple to commit: the newest one the job has reached if it is not committed
  // yet, else the first one after the newest commit (a manual one may lie between two
  // multiples), and never one that failed (the one after it instead). The call is made ahead
  // of time (a long poll: a shard answers once that step's file is durable), so the commit
  // follows the write at once instead of the workers' next progress report.
  const int64_t last = job.last_checkpoint_step();
  const int64_t reached = job.step() / every * every;
  int64_t next = reached > last ? reached : (last / every + 1) * every;
  if (next <= entry.checkpoint_failed_step) {
    next = (entry.checkpoint_failed_step / every + 1) * every;
  }
  // Ahead of the job only while total_steps is known (the workers report it): a step past
  // the end never comes, and its call would hold a thread until its deadline.
  const int64_t limit = job.total_steps() > 0 ? job.total_steps() : job.step();
  if (next > limit) return std::nullopt;
  absl::StatusOr<CheckpointPlan> plan = PlanCheckpoint(state, entry, next, /*manual=*/false);
  if (!plan.ok()) return std::nullopt;
  entry.checkpoint_running = true;
  return *std::move(plan);
}

absl::StatusOr<std::vector<v1::CheckpointResponse>> CallCheckpoint(ClusterState& state,
                                                                   const CheckpointPlan& plan) {
  // Every shard at once: each call answers only once that shard has written the step, and the
  // shards train in lockstep, so a shard asked after another one answered would be past the step.
  const size_t n = plan.addresses.size();
  std::vector<absl::StatusOr<v1::CheckpointResponse>> results(
      n, absl::StatusOr<v1::CheckpointResponse>(absl::UnknownError("not called")));
  auto call = [&state, &plan, &results](size_t i) {
    v1::CheckpointRequest request;
    request.set_job_id(plan.job_id);
    request.set_step(plan.step);
    request.set_retain_from_step(plan.retain_from_step);
    results[i] =
        state.shards->Checkpoint(plan.addresses[i], request, state.options.checkpoint_timeout);
  };
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 1; i < n; ++i) threads.emplace_back(call, i);
  if (n > 0) call(0);  // shard 0 on this thread
  for (std::thread& thread : threads) thread.join();
  std::vector<v1::CheckpointResponse> responses;
  for (size_t i = 0; i < n; ++i) {
    if (!results[i].ok()) {
      return absl::Status(
          results[i].status().code(),
          absl::StrCat("shard ", i, " (", plan.addresses[i], "): ", results[i].status().message()));
    }
    responses.push_back(*std::move(results[i]));
  }
  return responses;
}

absl::StatusOr<v1::CheckpointRecord> CommitCheckpoint(
    ClusterState& state, const CheckpointPlan& plan,
    const std::vector<v1::CheckpointResponse>& responses) {
  v1::CheckpointRecord record;
  {
    absl::MutexLock lock(&state.mu);
    if (!state.store_error.ok()) return state.store_error;
    JobEntry* entry = state.FindJob(plan.job_id);
    if (entry == nullptr || entry->job.state() != v1::JOB_STATE_RUNNING ||
        entry->job.recoveries() != plan.recoveries || !entry->job.recovery().empty()) {
      return absl::AbortedError(absl::StrCat("job ", plan.job_id,
                                             " ended or recovered while checkpoint ", plan.step,
                                             " was written; not committed"));
    }
    if (entry->job.down_shards_size() > 0) {
      // A shard of a replicated job was lost while the step was written: the cut is not one the
      // job can restore on every index (docs/reliability.md "Replicated shards").
      return absl::AbortedError(
          absl::StrCat("job ", plan.job_id, ": shard ", entry->job.down_shards(0),
                       " went down while checkpoint ", plan.step, " was written; not committed"));
    }
    uint64_t bytes = 0;
    record = MakeRecord(entry->job, plan, responses, state.NowMs(), &bytes);
    KeepCommitted(state, *entry, record);
    if (plan.step == entry->checkpoint_failed_step) entry->checkpoint_failed_step = 0;
    spdlog::info("coordinator: job {}: checkpoint {} committed ({} shards, {} bytes)",
                 entry->job.id(), plan.step, responses.size(), bytes);
    AddEvent(state, *entry, v1::JOB_EVENT_KIND_CHECKPOINT,
             absl::StrCat("checkpoint ", plan.step, " committed", plan.manual ? " (by hand)" : "",
                          ": ", responses.size(), " shards, ", bytes, " bytes"));
  }
  TESSERA_RETURN_IF_ERROR(state.FlushWrites());
  return record;
}

void RunAutoCheckpoint(ClusterState& state, const CheckpointPlan& plan) {
  absl::StatusOr<std::vector<v1::CheckpointResponse>> responses = CallCheckpoint(state, plan);
  absl::Status status = responses.status();
  if (responses.ok()) status = CommitCheckpoint(state, plan, *responses).status();
  absl::MutexLock lock(&state.mu);
  JobEntry* entry = state.FindJob(plan.job_id);
  if (entry == nullptr) return;
  entry->checkpoint_running = false;
  // A call cut short (its deadline, a shutdown, or the job restored or dropped under it) is
  // simply made again on a later tick when it still makes sense. So is one that a recovery
  // overtook: its error is most likely the lost shard's, and the step is still worth taking
  // from the restored state.
  const bool interrupted = status.code() == absl::StatusCode::kDeadlineExceeded ||
                           status.code() == absl::StatusCode::kAborted ||
                           status.code() == absl::StatusCode::kCancelled ||
                           entry->job.recoveries() != plan.recoveries ||
                           !entry->job.recovery().empty();
  if (!status.ok() && !interrupted && entry->job.state() == v1::JOB_STATE_RUNNING) {
    // Nothing is committed; the job goes on, and the next multiple is tried.
    entry->checkpoint_failed_step = plan.step;
    spdlog::warn("coordinator: job {}: checkpoint {} failed: {}", plan.job_id, plan.step,
                 status.ToString());
    AddEvent(state, *entry, v1::JOB_EVENT_KIND_CHECKPOINT,
             absl::StrCat("checkpoint ", plan.step, " failed: ", status.message()));
  }
  state.Wake();
}

absl::StatusOr<v1::CheckpointRecord> CheckpointByHand(ClusterState& state,
                                                      const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must be set");
  absl::Status last;
  for (int attempt = 0; attempt < kCheckpointAttempts; ++attempt) {
    TESSERA_ASSIGN_OR_RETURN(CheckpointPlan plan, PlanByHand(state, job_id, attempt));
    // Unlocked: the shards answer once the job has reached the step and the files are durable.
    absl::StatusOr<std::vector<v1::CheckpointResponse>> responses = CallCheckpoint(state, plan);
    if (responses.ok()) return CommitCheckpoint(state, plan, *responses);
    if (responses.status().code() != absl::StatusCode::kFailedPrecondition) {
      return responses.status();
    }
    last = responses.status();
    spdlog::info("coordinator: job {}: checkpoint {} came too late ({}); trying further ahead",
                 job_id, plan.step, std::string(last.message()));
  }
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, ": no checkpoint after ",
                                                    kCheckpointAttempts,
                                                    " tries, each too late: ", last.message()));
}

void ForgetCheckpoints(ClusterState& state, JobEntry& entry) {
  if (entry.checkpoints.empty() && entry.job.last_checkpoint_step() == 0) return;
  entry.checkpoints.clear();
  state.pending.removed_checkpoints.push_back({entry.job.id(), -1});
}

void ForgetCheckpointsAfter(ClusterState& state, JobEntry& entry, int64_t step) {
  std::vector<v1::CheckpointRecord>& kept = entry.checkpoints;
  while (!kept.empty() && kept.front().step() > step) {
    state.pending.removed_checkpoints.push_back({entry.job.id(), kept.front().step()});
    kept.erase(kept.begin());
  }
}

}  // namespace tessera::coordinator::internal
