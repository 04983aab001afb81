#include "server/coordinator/internal/stall_inspector.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/recovery.h"
#include "server/coordinator/internal/shard_failover.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::coordinator::internal {
namespace {

constexpr int kMaxStallEntries = 1024;
// Ranks a stall message names one by one; the rest are counted.
constexpr size_t kRanksNamed = 3;

// "6 s", "1.5 s", "2 min 5 s".
std::string WaitText(int64_t ms) {
  if (ms < 10'000) return absl::StrFormat("%.1f s", static_cast<double>(ms) / 1000.0);
  if (ms < 120'000) return absl::StrCat(ms / 1000, " s");
  return absl::StrCat(ms / 60'000, " min ", (ms / 1000) % 60, " s");
}

// How long a shard's report says the step has waited, as of `now_ms`.
int64_t WaitedMs(const JobEntry::ReportedStall& reported, int64_t now_ms) {
  return reported.stall.waiting_ms() + std::max<int64_t>(0, now_ms - reported.received_ms);
}

// What one shard waits for of one rank.
struct ShardLag {
  int shard = 0;
  int32_t partitions = 0;  // not pushed (BSP) or too far behind (SSP)
  int32_t of = 0;          // the job's partitions on the shard
  int64_t clock = 0;
};

// What the job waits for now, from its shards' reports: the oldest step reported, how long it has
// waited, and what each lagging rank owes each shard.
struct JobStall {
  int64_t step = -1;  // -1: nothing waits
  int64_t waited_ms = 0;
  std::map<int, std::vector<ShardLag>> ranks;
};

JobStall CurrentStall(const JobEntry& entry, int64_t now_ms) {
  JobStall stall;
  for (const auto& [index, reported] : entry.shard_stalls) {
    if (stall.step < 0 || reported.stall.step() < stall.step) stall.step = reported.stall.step();
  }
  if (stall.step < 0) return stall;
  for (const auto& [index, reported] : entry.shard_stalls) {
    const v1::ShardStall& s = reported.stall;
    if (s.step() != stall.step) continue;
    stall.waited_ms = std::max(stall.waited_ms, WaitedMs(reported, now_ms));
    for (const v1::LaggingRank& lagging : s.lagging()) {
      if (lagging.rank() < 0 || lagging.rank() >= entry.job.workers_size()) continue;
      const v1::JobWorker& worker = entry.job.workers(lagging.rank());
      // A rank whose own report (every half second) has it past where the shard saw it is no
      // longer what the step waits for: the shard's report (every heartbeat) is older.
      if (worker.lost() || worker.step() > lagging.clock()) continue;
      stall.ranks[lagging.rank()].push_back(
          ShardLag{index, lagging.partitions(), s.partitions(), lagging.clock()});
    }
  }
  if (stall.ranks.empty()) stall.step = -1;
  return stall;
}

// BSP: "which has not pushed 3 of its 7 partitions to shard 0 and 7 of 7 to shard 1".
// SSP: "which is at step 809 on 3 of the 7 partitions of shard 0".
std::string LagText(bool ssp, const std::vector<ShardLag>& lags) {
  std::vector<std::string> parts;
  for (const ShardLag& lag : lags) {
    if (ssp) {
      parts.push_back(absl::StrCat("at step ", lag.clock, " on ", lag.partitions, " of the ",
                                   lag.of, " partitions of shard ", lag.shard));
    } else {
      parts.push_back(absl::StrCat(lag.partitions, parts.empty() ? " of its " : " of ", lag.of,
                                   parts.empty() ? " partitions" : "", " to shard ", lag.shard));
    }
  }
  return absl::StrCat(ssp ? "which is " : "which has not pushed ", absl::StrJoin(parts, " and "));
}

// "step 812: waiting 6 s for rank 1 (w-2 on host-b), which has not pushed 3 of its 7 partitions
// to shard 0".
std::string StallMessage(const JobEntry& entry, const JobStall& stall) {
  const bool ssp = entry.job.spec().consistency() == "ssp";
  std::vector<std::string> named;
  for (const auto& [rank, lags] : stall.ranks) {
    if (named.size() == kRanksNamed) break;
    named.push_back(absl::StrCat("rank ", rank, " (", WorkerName(entry.job.workers(rank)), "), ",
                                 LagText(ssp, lags)));
  }
  std::string message = absl::StrCat("step ", stall.step, ": waiting ", WaitText(stall.waited_ms),
                                     " for ", absl::StrJoin(named, "; and "));
  if (stall.ranks.size() > kRanksNamed) {
    absl::StrAppend(&message, "; and ", stall.ranks.size() - kRanksNamed, " more ranks");
  }
  return message;
}

// The job's record and events after its shards' reports changed (or time passed).
void NameStall(ClusterState& state, JobEntry& entry, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  const JobStall stall = CurrentStall(entry, now_ms);
  const bool named =
      stall.step >= 0 && stall.waited_ms >= absl::ToInt64Milliseconds(kNameStallAfter);
  std::set<int> ranks;
  if (named) {
    for (const auto& [rank, lags] : stall.ranks) ranks.insert(rank);
  }
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    const double seconds =
        ranks.count(rank) > 0 ? static_cast<double>(stall.waited_ms) / 1000.0 : 0.0;
    if (job.workers(rank).stalled_seconds() != seconds) {
      job.mutable_workers(rank)->set_stalled_seconds(seconds);
      entry.dirty = true;
    }
  }
  const std::string message = named ? StallMessage(entry, stall) : std::string();
  if (job.stall() != message) {
    job.set_stall(message);
    entry.dirty = true;
  }
  // A named stall is over once its step no longer waits: it went through, or its ranks left.
  if (entry.named_stall_step >= 0 && (!named || stall.step != entry.named_stall_step)) {
    const std::string over =
        absl::StrCat("step ", entry.named_stall_step, ": no longer waiting (waited ",
                     WaitText(entry.named_stall_waited_ms), ")");
    spdlog::info("coordinator: job {}: {}", job.id(), over);
    AddEvent(state, entry, v1::JOB_EVENT_KIND_STALL, over);
    entry.named_stall_step = -1;
    entry.named_stall_ranks.clear();
    entry.named_stall_waited_ms = 0;
  }
  if (!named) return;
  // A new stall, or more ranks holding the same step: an event (fewer ranks: only the record).
  const bool more_ranks = !std::includes(entry.named_stall_ranks.begin(),
                                         entry.named_stall_ranks.end(), ranks.begin(), ranks.end());
  if (stall.step != entry.named_stall_step || more_ranks) {
    spdlog::warn("coordinator: job {}: {}", job.id(), message);
    AddEvent(state, entry, v1::JOB_EVENT_KIND_STALL, message);
  }
  entry.named_stall_step = stall.step;
  entry.named_stall_ranks = std::move(ranks);
  entry.named_stall_waited_ms = std::max(entry.named_stall_waited_ms, stall.waited_ms);
}

// The job's shards all heartbeat (none silent for a second past its interval), so a rank that
// makes no progress is not waiting on a shard that has stopped. The progress lease counts from
// the last time one was silent, so stall_timeout must exceed heartbeat interval + 1 s (5 s > 3 s
// by default).
bool ShardsHeartbeating(ClusterState& state, const JobEntry& entry, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  const int64_t quiet_ms = absl::ToInt64Milliseconds(state.options.heartbeat_interval) + 1000;
  std::set<std::string> fresh;
  for (const auto& [id, member] : state.members) {
    if (member.member.role() == v1::MEMBER_ROLE_SERVER &&
        member.member.state() == v1::MEMBER_STATE_READY &&
        now_ms - member.member.last_seen_ms() <= quiet_ms) {
      fresh.insert(member.member.address());
    }
  }
  for (const std::string& address : ServingAddresses(entry.job)) {
    if (!address.empty() && fresh.count(address) == 0) return false;
  }
  return true;
}

// The progress lease of one RUNNING job.
void CheckProgressLease(ClusterState& state, JobEntry& entry, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  if (!job.recovery().empty() || entry.restart_deadline_ms > 0 ||
      !ShardsHeartbeating(state, entry, now_ms)) {
    entry.progress_lease_floor_ms = now_ms;
    return;
  }
  const int64_t timeout_ms = absl::ToInt64Milliseconds(spec::StallTimeout(job.spec()));
  // With a stall named, only its ranks are what the job waits for; the others wait on them.
  const std::set<int>& waited_for = entry.named_stall_ranks;
  for (int rank = 0; rank < job.workers_size() && job.state() == v1::JOB_STATE_RUNNING; ++rank) {
    const v1::JobWorker& worker = job.workers(rank);
    if (worker.done() || worker.lost() || entry.stall_warned.count(rank) > 0) continue;
    if (worker.progress_ms() == 0) {
      job.mutable_workers(rank)->set_progress_ms(now_ms);
      continue;
    }
    const int64_t idle_ms = now_ms - std::max(worker.progress_ms(), entry.progress_lease_floor_ms);
    if (idle_ms < timeout_ms || (!waited_for.empty() && waited_for.count(rank) == 0)) continue;
    const std::string what =
        absl::StrCat("no step progress for ", WaitText(idle_ms), " (last reported step ",
                     worker.step(), "; stall_timeout_seconds ", timeout_ms / 1000, ")");
    if (!spec::EvictsStalledRanks(job.spec())) {
      entry.stall_warned.insert(rank);
      const std::string message =
          absl::StrCat("rank ", rank, " (", WorkerName(worker), ") has made ", what,
                       "; stall_policy warn: the job goes on waiting for it");
      spdlog::warn("coordinator: job {}: {}", job.id(), message);
      AddEvent(state, entry, v1::JOB_EVENT_KIND_STALL, message);
      continue;
    }
    // Evicted: the rank is lost as if its worker had gone. The worker, alive but stuck, is told
    // to stop; it stays BUSY with the job (not given the rank again, nor another task) until it
    // reports that its task ended, or its lease or stream ends.
    const std::string member_id = worker.member_id();
    // LoseRank restarts the other ranks' leases: they waited for this one.
    LoseRank(state, entry, rank, absl::StrCat("evicted: ", what));
    MemberEntry* member = state.FindMember(member_id);
    if (member != nullptr && member->stream != nullptr && member->member.job_id() == job.id()) {
      v1::TaskEvent cancel;
      cancel.mutable_cancel()->set_job_id(job.id());
      cancel.mutable_cancel()->set_reason(absl::StrCat("rank ", rank, " evicted: ", what));
      member->stream->Send(cancel);
    }
  }
}

}  // namespace

absl::Status ValidateStalls(const v1::HeartbeatRequest& request) {
  if (request.stalls_size() > kMaxStallEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("stalls: at most ", kMaxStallEntries, " jobs, got ", request.stalls_size()));
  }
  std::set<std::string> jobs;
  for (int i = 0; i < request.stalls_size(); ++i) {
    const v1::ShardStall& stall = request.stalls(i);
    const std::string field = absl::StrCat("stalls[", i, "]");
    if (!jobs.insert(stall.job_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".job_id: job ", stall.job_id(), " reported twice"));
    }
    if (stall.step() < 0 || stall.waiting_ms() < 0 || stall.partitions() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": step, waiting_ms and partitions must be >= 0, got ", stall.step(),
                       ", ", stall.waiting_ms(), ", ", stall.partitions()));
    }
    if (stall.lagging_size() > kMaxStallEntries) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".lagging: at most ", kMaxStallEntries,
                                                     " ranks, got ", stall.lagging_size()));
    }
    for (int j = 0; j < stall.lagging_size(); ++j) {
      const v1::LaggingRank& lagging = stall.lagging(j);
      if (lagging.rank() < 0 || lagging.partitions() < 0 || lagging.clock() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".lagging[", j, "]: rank, partitions and clock must be >= 0"));
      }
    }
  }
  return absl::OkStatus();
}

void RecordShardStalls(ClusterState& state, const MemberEntry& shard,
                       const v1::HeartbeatRequest& request, int64_t now_ms) {
  const int index = shard.member.shard_index();
  std::map<std::string, const v1::ShardStall*> reported;
  for (const v1::ShardStall& stall : request.stalls()) reported[stall.job_id()] = &stall;
  for (auto& [n, entry] : state.jobs) {
    if (entry.job.state() != v1::JOB_STATE_RUNNING || index >= entry.job.shard_addresses_size() ||
        entry.job.shard_addresses(index) != shard.member.address()) {
      continue;
    }
    auto it = reported.find(entry.job.id());
    if (it == reported.end()) {
      if (entry.shard_stalls.erase(index) == 0) continue;
    } else {
      entry.shard_stalls[index] = JobEntry::ReportedStall{*it->second, now_ms};
    }
    NameStall(state, entry, now_ms);
  }
}

void InspectStalls(ClusterState& state, int64_t now_ms) {
  const int64_t stale_ms = 2 * absl::ToInt64Milliseconds(state.options.heartbeat_interval) + 1000;
  for (auto& [n, entry] : state.jobs) {
    if (entry.job.state() != v1::JOB_STATE_RUNNING) continue;
    for (auto it = entry.shard_stalls.begin(); it != entry.shard_stalls.end();) {
      it =
          now_ms - it->second.received_ms > stale_ms ? entry.shard_stalls.erase(it) : std::next(it);
    }
    NameStall(state, entry, now_ms);
    CheckProgressLease(state, entry, now_ms);
  }
}

void ResetStalls(JobEntry& entry, int64_t now_ms) {
  entry.shard_stalls.clear();
  entry.stall_warned.clear();
  entry.progress_lease_floor_ms = now_ms;
  for (v1::JobWorker& worker : *entry.job.mutable_workers()) {
    worker.set_stalled_seconds(0);
    if (!worker.lost()) worker.set_progress_ms(now_ms);
  }
  entry.job.clear_stall();
}

}  // namespace tessera::coordinator::internal
