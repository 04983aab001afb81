#include "server/coordinator/internal/shard_drops.h"

#include <algorithm>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator::internal {
namespace {

// The longest wait between two tries of an owed DropJob on a live shard.
constexpr absl::Duration kMaxDropBackoff = absl::Seconds(60);

// A drop with the generation it had when its call was made.
using DueDrop = std::pair<ShardDrop, uint64_t>;

// The drops due now whose address is a live shard. A shard that is not live would only make the
// call wait for its deadline; its drops wait until a shard registers at the address again.
std::vector<DueDrop> DueDrops(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  std::vector<DueDrop> due;
  std::set<std::string> live;
  for (const auto& [id, member] : state.members) {
    if (member.member.role() == v1::MEMBER_ROLE_SERVER && IsLive(member.member)) {
      live.insert(member.member.address());
    }
  }
  const int64_t now = state.NowMs();
  for (const auto& [drop, retry] : state.drops) {
    if (retry.next_try_ms <= now && live.count(drop.address) > 0) {
      due.emplace_back(drop, retry.generation);
    }
  }
  return due;
}

// Settles what the calls answered OK or NOT_FOUND; backs off the addresses that failed.
void SettleDrops(ClusterState& state, const std::vector<DueDrop>& due,
                 const std::vector<std::optional<absl::Status>>& results)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  const int64_t now = state.NowMs();
  for (size_t i = 0; i < due.size(); ++i) {
    const auto& [drop, generation] = due[i];
    auto it = state.drops.find(drop);
    if (it == state.drops.end()) continue;
    if (!results[i].has_value()) continue;  // not tried this round
    const absl::Status& status = *results[i];
    if (status.ok() || status.code() == absl::StatusCode::kNotFound) {
      if (it->second.generation != generation) continue;  // owed again meanwhile
      std::vector<ShardDrop>& queued = state.pending.drops;
      queued.erase(std::remove(queued.begin(), queued.end(), drop), queued.end());
      state.pending.removed_drops.push_back(drop);
      state.drops.erase(it);
      continue;
    }
    // The backoff applies to every drop the address is owed.
    const int64_t backoff = std::clamp<int64_t>(2 * it->second.backoff_ms, 1000,
                                                absl::ToInt64Milliseconds(kMaxDropBackoff));
    for (auto& [other, retry] : state.drops) {
      if (other.address != drop.address) continue;
      retry.backoff_ms = backoff;
      retry.next_try_ms = now + backoff;
    }
    spdlog::warn("coordinator: dropping job {} on shard {} failed, trying again in {}: {}",
                 drop.job_id, drop.address, SecondsText(absl::Milliseconds(backoff)),
                 status.ToString());
  }
}

}  // namespace

void QueueDrop(ClusterState& state, const std::string& address, const std::string& job_id) {
  ShardDrop drop{address, job_id};
  // A settle of the same drop still waiting in this batch must not delete the row (a batch
  // deletes after it inserts).
  std::vector<ShardDrop>& removed = state.pending.removed_drops;
  removed.erase(std::remove(removed.begin(), removed.end(), drop), removed.end());
  auto [it, added] = state.drops.emplace(drop, DropRetry{});
  if (!added) {
    // Owed again, perhaps while a call for it runs (a Restore recreated the job): that call
    // does not settle it.
    ++it->second.generation;
    it->second.next_try_ms = 0;
  }
  state.pending.drops.push_back(std::move(drop));
}

void RetryDropsAt(ClusterState& state, const std::string& address) {
  for (auto& [drop, retry] : state.drops) {
    if (drop.address == address) retry.next_try_ms = 0;
  }
}

void RunShardDrops(ClusterState& state) {
  std::vector<DueDrop> due;
  {
    absl::MutexLock lock(&state.mu);
    if (state.drops.empty()) return;
    due = DueDrops(state);
  }
  // Unlocked: RPCs. After a failure the address's other drops wait for its backoff, so a shard
  // that cannot be called costs one deadline per tick, not one per drop.
  std::vector<std::optional<absl::Status>> results(due.size());  // empty: not tried
  std::set<std::string> failed;
  for (size_t i = 0; i < due.size(); ++i) {
    const ShardDrop& drop = due[i].first;
    if (failed.count(drop.address) > 0) continue;
    results[i] = state.shards->DropJob(drop.address, drop.job_id);
    if (!results[i]->ok() && results[i]->code() != absl::StatusCode::kNotFound) {
      failed.insert(drop.address);
    }
  }
  absl::MutexLock lock(&state.mu);
  SettleDrops(state, due, results);
}

}  // namespace tessera::coordinator::internal
