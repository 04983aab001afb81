#include "server/coordinator/internal/shard_failover.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/shard_refill.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::coordinator::internal {
namespace {

bool IsDown(const v1::Job& job, int index) {
  return std::find(job.down_shards().begin(), job.down_shards().end(), index) !=
         job.down_shards().end();
}

}  // namespace

std::vector<std::string> ServingAddresses(const v1::Job& job) {
  std::vector<std::string> addresses(job.shard_addresses().begin(), job.shard_addresses().end());
  for (int index : job.down_shards()) {
    if (index >= 0 && index < static_cast<int>(addresses.size())) addresses[index].clear();
  }
  return addresses;
}

bool CanFailOver(const v1::Job& job, int index) {
  const int n = job.shard_addresses_size();
  if (spec::Replicas(job.spec()) < 2 || n < 2 || index < 0 || index >= n) return false;
  // With two copies, index i holds the partitions homed at i and i - 1; the copies of those are
  // at i + 1 and i - 1.
  return !IsDown(job, (index + 1) % n) && !IsDown(job, (index + n - 1) % n);
}

bool FailOverShard(ClusterState& state, JobEntry& entry, int index, const std::string& cause) {
  v1::Job& job = entry.job;
  if (IsDown(job, index)) return true;
  if (!job.recovery().empty() || !CanFailOver(job, index)) return false;
  GiveUpFill(state, entry, absl::StrCat("shard ", index, " is down too"));
  std::vector<int> down(job.down_shards().begin(), job.down_shards().end());
  down.push_back(index);
  std::sort(down.begin(), down.end());
  job.clear_down_shards();
  for (int d : down) job.add_down_shards(d);
  const int n = job.shard_addresses_size();
  const int next = (index + 1) % n;
  const int previous = (index + n - 1) % n;
  const std::string what = absl::StrCat(
      cause, "; its partitions are served by their copies on shard ", next,
      previous == next ? std::string() : absl::StrCat(" and shard ", previous), ", no rewind");
  spdlog::info("coordinator: job {}: {}", job.id(), what);
  AddEvent(state, entry, v1::JOB_EVENT_KIND_RECOVERY, what);
  // Stalls reported by the lost shard are over; the live ranks' progress leases start again.
  entry.shard_stalls.erase(index);
  entry.progress_lease_floor_ms = state.NowMs();
  entry.dirty = true;
  state.QueueJob(entry);
  state.Wake();
  return true;
}

int64_t SuspectLeaseMs(const CoordinatorOptions& options) {
  const int64_t heartbeat_ms = absl::ToInt64Milliseconds(options.heartbeat_interval);
  return std::min(absl::ToInt64Milliseconds(options.lease), heartbeat_ms + heartbeat_ms / 4);
}

void SuspectShards(ClusterState& state, const JobEntry& entry, const v1::ProgressReport& report,
                   int64_t now_ms) {
  const v1::Job& job = entry.job;
  if (spec::Replicas(job.spec()) < 2) return;
  for (int index : report.unreachable_shards()) {
    if (index < 0 || index >= job.shard_addresses_size() || IsDown(job, index)) continue;
    for (auto& [id, member] : state.members) {
      if (member.member.role() != v1::MEMBER_ROLE_SERVER ||
          member.member.state() != v1::MEMBER_STATE_READY || member.member.shard_index() != index ||
          member.member.address() != job.shard_addresses(index)) {
        continue;
      }
      if (member.suspected_ms == 0) {
        member.suspected_ms = now_ms;
        spdlog::info("coordinator: job {}: rank {} cannot reach shard {} ({}); its lease is {} ms",
                     job.id(), report.rank(), index, member.member.address(),
                     SuspectLeaseMs(state.options));
      }
    }
  }
}

}  // namespace tessera::coordinator::internal
