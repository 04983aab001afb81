#include "server/coordinator/internal/shard_refill.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/job_steps.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::coordinator::internal {
namespace {

// After a give-up the next fill waits 1 s, doubling per give-up in a row up to a minute (a fill
// that cannot work, such as neighbours without a data directory, is tried about once a minute).
constexpr int64_t kRetryAfterMs = 1000;
constexpr int64_t kMaxRetryAfterMs = 60000;

struct FillPlan {
  std::string job_id;
  uint64_t generation = 0;
  int shard = -1;
  std::string address;
  int64_t step = 0;
  std::vector<int> source_indices;
  std::vector<std::string> sources;
  int num_shards = 0;
  int replicas = 0;
};

bool IsDown(const v1::Job& job, int index) {
  return std::find(job.down_shards().begin(), job.down_shards().end(), index) !=
         job.down_shards().end();
}

std::string IndexList(const std::vector<int>& indices) {
  std::string out;
  for (size_t i = 0; i < indices.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : " and ", indices[i]);
  }
  return out;
}

// The fill is over (finished or given up and dropped): the next one may be planned.
void ClearFill(ClusterState& state, JobEntry& entry, bool given_up)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  entry.fill = JobEntry::Fill{};
  if (given_up) {
    ++entry.fill_attempts;
    entry.fill_retry_ms =
        state.NowMs() +
        std::min(kMaxRetryAfterMs, kRetryAfterMs << std::min(entry.fill_attempts - 1, 6));
  } else {
    entry.fill_attempts = 0;
  }
  state.Wake();
}

// Once the shard holds the job and every live rank writes it from the step on: it is a copy
// again and leaves the down shards.
void FinishIfReady(ClusterState& state, JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  JobEntry::Fill& fill = entry.fill;
  v1::Job& job = entry.job;
  if (fill.shard < 0 || fill.given_up || !fill.installed) return;
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    if (!job.workers(rank).lost() && fill.adopted.count(rank) == 0) return;
  }
  std::vector<int> down;
  for (int index : job.down_shards()) {
    if (index != fill.shard) down.push_back(index);
  }
  job.clear_down_shards();
  for (int index : down) job.add_down_shards(index);
  if (job.shard_addresses(fill.shard) != fill.address) {
    job.set_shard_addresses(fill.shard, fill.address);
  }
  const v1::FillResponse& copied = fill.copied;
  // SSP/ASP: what of the kept pushes a snapshot held already (a faster rank's later steps).
  const std::string held =
      copied.held_slices() + copied.held_rows() == 0
          ? ""
          : absl::StrFormat(", of which the snapshots held %d partition slices and %d rows",
                            copied.held_slices(), copied.held_rows());
  const std::string what = absl::StrFormat(
      "shard %d (%s) holds its copies again: filled at step %d with %d partitions, %d tables "
      "and %d rows (%.1f MB of its neighbours' snapshots copied and installed in %.2f s, %d "
      "pushes kept meanwhile%s), %.2f s after it came back",
      fill.shard, fill.address, fill.step, copied.partitions(), copied.tables(), copied.rows(),
      static_cast<double>(copied.bytes()) / 1e6, static_cast<double>(fill.copy_ms) / 1000.0,
      copied.journaled(), held, static_cast<double>(state.NowMs() - fill.started_ms) / 1000.0);
  spdlog::info("coordinator: job {}: {}", job.id(), what);
  AddEvent(state, entry, v1::JOB_EVENT_KIND_RECOVERY, what);
  ClearFill(state, entry, /*given_up=*/false);
  entry.dirty = true;
  state.QueueJob(entry);
}

// Checkpoint(step) on every source at once: each call waits for the step.
absl::Status SnapshotSources(ClusterState& state, const FillPlan& plan)
    ABSL_LOCKS_EXCLUDED(state.mu) {
  std::vector<absl::Status> results(plan.sources.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < plan.sources.size(); ++i) {
    threads.emplace_back([&, i] {
      v1::CheckpointRequest request;
      request.set_job_id(plan.job_id);
      request.set_step(plan.step);
      results[i] =
          state.shards->Checkpoint(plan.sources[i], request, state.options.checkpoint_timeout)
              .status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      return absl::Status(
          results[i].code(),
          absl::StrCat("snapshot of shard ", plan.source_indices[i], ": ", results[i].message()));
    }
  }
  return absl::OkStatus();
}

void RunFill(ClusterState& state, const FillPlan& plan) ABSL_LOCKS_EXCLUDED(state.mu) {
  const absl::Time plan_time = absl::Now();
  v1::FillRequest shape;
  shape.set_job_id(plan.job_id);
  shape.set_step(plan.step);
  shape.set_num_shards(static_cast<uint32_t>(plan.num_shards));
  shape.set_replicas(static_cast<uint32_t>(plan.replicas));
  // The shard keeps the ranks' pushes of the step on until the fill is installed, so that they
  // train on meanwhile. Without the journal they wait at the step instead: their pushes of it to
  // the shard are answered once it holds the job.
  const absl::Status opened = state.shards->OpenFill(plan.address, shape);
  if (!opened.ok()) {
    spdlog::warn(
        "coordinator: job {}: shard {} keeps no pushes while it is filled ({}); the ranks wait "
        "at step {} until it is",
        plan.job_id, plan.shard, opened.ToString(), plan.step);
  }
  const absl::Status snapshots = SnapshotSources(state, plan);
  const absl::Time copy_start = absl::Now();
  if (snapshots.ok()) {
    spdlog::info(
        "coordinator: job {}: the snapshots of step {} for shard {} are written, {} ms "
        "after the plan; copying them",
        plan.job_id, plan.step, plan.shard, absl::ToInt64Milliseconds(copy_start - plan_time));
  }
  absl::StatusOr<v1::FillResponse> copied = absl::UnknownError("not copied");
  if (!snapshots.ok()) {
    copied = snapshots;
  } else {
    copied =
        state.shards->CopyFill(plan.sources, plan.address, shape, state.options.checkpoint_timeout);
  }
  bool drop = false;
  {
    absl::MutexLock lock(&state.mu);
    JobEntry* entry = state.FindJob(plan.job_id);
    if (entry == nullptr || entry->fill.generation != plan.generation) return;
    JobEntry::Fill& fill = entry->fill;
    fill.action_done = true;
    if (entry->job.state() != v1::JOB_STATE_RUNNING) {
      drop = true;
    } else if (!copied.ok()) {
      GiveUpFill(state, *entry,
                 absl::StrCat(copied.status().ToString(), "; trying again further ahead"));
      drop = true;
    } else if (fill.given_up) {
      drop = true;
    } else {
      fill.installed = true;
      // Every rank says again, from a report after the install, that it writes the shard (and
      // missed nothing meanwhile: a write that failed for good turns its report into a miss).
      fill.adopted.clear();
      fill.copied = *copied;
      fill.copy_ms = absl::ToInt64Milliseconds(absl::Now() - copy_start);
      spdlog::info(
          "coordinator: job {}: shard {} installed step {} ({} bytes copied in {} ms, {} pushes "
          "kept meanwhile applied); waiting for every rank to write it",
          plan.job_id, plan.shard, plan.step, copied->bytes(), fill.copy_ms, copied->journaled());
      FinishIfReady(state, *entry);
    }
  }
  if (drop) {
    // Before the next fill can start: what this one installed must not outlive it.
    const absl::Status dropped = state.shards->DropJob(plan.address, plan.job_id);
    if (!dropped.ok() && dropped.code() != absl::StatusCode::kNotFound) {
      spdlog::warn("coordinator: job {}: dropping the given-up fill on {}: {}", plan.job_id,
                   plan.address, dropped.ToString());
    }
    absl::MutexLock lock(&state.mu);
    JobEntry* entry = state.FindJob(plan.job_id);
    if (entry != nullptr && entry->fill.generation == plan.generation) {
      ClearFill(state, *entry, /*given_up=*/true);
    }
  }
  (void)state.FlushWrites();
}

// Logs why the job is not filled, once per reason.
std::function<void()> Refuse(JobEntry& entry, const std::string& why) {
  if (entry.fill_refused != why) {
    entry.fill_refused = why;
    spdlog::info("coordinator: job {}: {}", entry.job.id(), why);
  }
  return nullptr;
}

}  // namespace

std::function<void()> PlanFill(ClusterState& state, JobEntry& entry, const LiveMembers& live) {
  v1::Job& job = entry.job;
  JobEntry::Fill& fill = entry.fill;
  if (job.down_shards_size() == 0 || spec::Replicas(job.spec()) < 2) return nullptr;
  if (fill.shard >= 0) {
    // Given up after the install (a rank missed the step): drop it before anything else.
    if (!fill.given_up || !fill.action_done) return nullptr;
    fill.action_done = false;
    FillPlan plan;
    plan.job_id = job.id();
    plan.generation = fill.generation;
    plan.address = fill.address;
    return [state = &state, plan] {
      (void)state->shards->DropJob(plan.address, plan.job_id);
      absl::MutexLock lock(&state->mu);
      JobEntry* e = state->FindJob(plan.job_id);
      if (e != nullptr && e->fill.generation == plan.generation) {
        ClearFill(*state, *e, /*given_up=*/true);
      }
    };
  }
  if (entry.action_running || !job.recovery().empty() || entry.membership_dirty ||
      !entry.joins.empty() || state.NowMs() < entry.fill_retry_ms) {
    return nullptr;
  }
  int shard = -1;
  for (int index : job.down_shards()) {
    if (live.shards.count(index) > 0) {
      shard = index;
      break;
    }
  }
  if (shard < 0) return nullptr;
  const std::string& address = live.shards.at(shard);
  const int n = job.shard_addresses_size();
  FillPlan plan;
  plan.job_id = job.id();
  plan.shard = shard;
  plan.address = address;
  plan.num_shards = n;
  plan.replicas = spec::Replicas(job.spec());
  // The neighbours that hold its copies: the next one has the copies of its own partitions, the
  // previous one the partitions it keeps copies of.
  for (int source : {(shard + 1) % n, (shard + n - 1) % n}) {
    if (std::find(plan.source_indices.begin(), plan.source_indices.end(), source) !=
        plan.source_indices.end()) {
      continue;
    }
    auto it = live.shards.find(source);
    if (IsDown(job, source) || it == live.shards.end() ||
        it->second != job.shard_addresses(source)) {
      return nullptr;  // a neighbour is not serving: its loss is being handled
    }
    plan.source_indices.push_back(source);
    plan.sources.push_back(it->second);
  }
  plan.step = MaxRankStep(job) + StepMargin(job, entry.fill_attempts + 1);
  if (job.total_steps() > 0 && plan.step >= job.total_steps()) {
    return Refuse(entry, absl::StrCat("shard ", shard, " serves again at ", address,
                                      ", but the job ends before it could be filled"));
  }
  entry.fill_refused.clear();
  fill = JobEntry::Fill{};
  fill.shard = shard;
  fill.address = address;
  fill.step = plan.step;
  fill.generation = ++entry.fill_generation;
  fill.started_ms = state.NowMs();
  plan.generation = fill.generation;
  const std::string what = absl::StrCat(
      "shard ", shard, " serves again at ", address, ": filling its copies from shard ",
      IndexList(plan.source_indices), " at step ", plan.step, " while the job trains",
      entry.fill_attempts > 0 ? absl::StrCat(" (attempt ", entry.fill_attempts + 1, ")") : "");
  spdlog::info("coordinator: job {}: {}", job.id(), what);
  AddEvent(state, entry, v1::JOB_EVENT_KIND_RECOVERY, what);
  state.QueueJob(entry);
  return [state = &state, plan] { RunFill(*state, plan); };
}

void NoteFillReport(ClusterState& state, JobEntry& entry, const v1::ProgressReport& report,
                    v1::ProgressAck* ack) {
  JobEntry::Fill& fill = entry.fill;
  if (fill.shard < 0 || fill.given_up) return;
  if (report.fill_missed() && report.fill_from_step() == fill.step) {
    GiveUpFill(state, entry,
               absl::StrCat("rank ", report.rank(), " had pushed step ", fill.step,
                            " before it heard of filling shard ", fill.shard,
                            "; trying again further ahead"));
    return;
  }
  if (report.fill_from_step() == fill.step) fill.adopted.insert(report.rank());
  if (entry.job.state() != v1::JOB_STATE_RUNNING) return;
  FinishIfReady(state, entry);
  if (fill.shard < 0) return;  // finished: the ack's down shards say the rest
  v1::ShardFill* out = ack->mutable_fill();
  out->set_shard(fill.shard);
  out->set_address(fill.address);
  out->set_from_step(fill.step);
}

void GiveUpFill(ClusterState& state, JobEntry& entry, const std::string& why) {
  JobEntry::Fill& fill = entry.fill;
  if (fill.shard < 0 || fill.given_up) return;
  // An event: the user sees why the shard stays down for a while longer.
  const std::string what =
      absl::StrCat("filling shard ", fill.shard, " at step ", fill.step, " is given up: ", why);
  spdlog::info("coordinator: job {}: {}", entry.job.id(), what);
  AddEvent(state, entry, v1::JOB_EVENT_KIND_RECOVERY, what);
  fill.given_up = true;
  state.Wake();
}

}  // namespace tessera::coordinator::internal
