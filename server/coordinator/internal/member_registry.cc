#include "server/coordinator/internal/member_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/coordinator/internal/recovery.h"
#include "server/coordinator/internal/shard_drops.h"
#include "server/coordinator/internal/shard_failover.h"
#include "server/coordinator/internal/shard_refill.h"
#include "server/coordinator/internal/stall_inspector.h"
#include "server/coordinator/internal/task_assignments.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator::internal {
namespace {

// The longest address, hostname or device a member may register with (a DNS name is at most 253).
constexpr size_t kMaxMemberFieldBytes = 255;

absl::Status ValidateRegistration(const v1::RegisterRequest& request,
                                  const CoordinatorOptions& options) {
  const v1::MemberRole role = request.role();
  if (role != v1::MEMBER_ROLE_SERVER && role != v1::MEMBER_ROLE_WORKER) {
    return absl::InvalidArgumentError(absl::StrCat(
        "role: must be MEMBER_ROLE_SERVER or MEMBER_ROLE_WORKER, got ", static_cast<int>(role)));
  }
  if (role == v1::MEMBER_ROLE_SERVER) {
    if (request.address().empty() || request.address().find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("address: a shard needs host:port, got '", request.address(), "'"));
    }
    if (request.shard_index() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard_index: must be >= 0, got ", request.shard_index()));
    }
    if (options.num_shards > 0 && request.shard_index() >= options.num_shards) {
      return absl::InvalidArgumentError(absl::StrCat("shard_index: must be below --num_shards ",
                                                     options.num_shards, ", got ",
                                                     request.shard_index()));
    }
  }
  if (request.pid() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pid: must be >= 0, got ", request.pid()));
  }
  // Members are kept (and stored) for as long as they are listed: their strings are bounded.
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"address", &request.address()},
        {"hostname", &request.hostname()},
        {"device", &request.device()},
        {"identity", &request.identity()}}) {
    if (value->size() > kMaxMemberFieldBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": at most ", kMaxMemberFieldBytes, " bytes, got ", value->size()));
    }
  }
  return absl::OkStatus();
}

// A member LOST or LEFT: its stream ends; a worker's rank is lost; a shard's RUNNING jobs
// recover (or fail without a checkpoint).
void MemberGone(ClusterState& state, MemberEntry& member, v1::MemberState member_state,
                const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  member.member.set_state(member_state);
  if (member.stream != nullptr) {
    member.stream->Close(
        absl::UnavailableError(absl::StrCat("member ", member.member.id(), " ", why)));
    member.stream.reset();
  }
  spdlog::info(
      "coordinator: {} {} ({}) {}",
      member.member.role() == v1::MEMBER_ROLE_SERVER ? "shard" : "worker", member.member.id(),
      member.member.address().empty() ? member.member.hostname() : member.member.address(), why);
  if (member.member.role() == v1::MEMBER_ROLE_WORKER && !member.member.job_id().empty()) {
    JobEntry* entry = state.FindJob(member.member.job_id());
    if (entry != nullptr && entry->job.state() == v1::JOB_STATE_RUNNING) {
      for (int rank = 0; rank < entry->job.workers_size(); ++rank) {
        const v1::JobWorker& worker = entry->job.workers(rank);
        if (worker.member_id() != member.member.id() || worker.lost()) continue;
        LoseRank(state, *entry, rank, why);
        break;
      }
    }
    member.member.clear_job_id();
    member.member.clear_rank();
  }
  if (member.member.role() == v1::MEMBER_ROLE_SERVER) {
    const int index = member.member.shard_index();
    for (auto& [n, entry] : state.jobs) {
      if (entry.fill.shard == index && entry.fill.address == member.member.address()) {
        GiveUpFill(state, entry, absl::StrCat("the shard being filled ", why));
      }
      if (entry.job.state() != v1::JOB_STATE_RUNNING || index >= entry.job.shard_addresses_size() ||
          entry.job.shard_addresses(index) != member.member.address()) {
        continue;
      }
      const std::string cause =
          absl::StrCat("shard ", index, " (", member.member.address(), ") ", why);
      if (!FailOverShard(state, entry, index, cause)) StartRecovery(state, entry, cause);
    }
  }
  state.QueueMember(member);
  state.Wake();
}

// A shard registering. The READY shard holding its index is its own dead instance when it had
// the same address (a process that restarted on its port) or the same data-directory identity (a
// restart on a new port; the directory's lock proves the old process gone): that member is lost at
// once (its jobs recover) and its number is returned, for the new registration to take over, so
// that `tessera cluster` shows the shard once. Any other READY shard of that index is
// ALREADY_EXISTS. 0: no member to replace.
absl::StatusOr<int64_t> MakeRoomForShard(ClusterState& state, const v1::RegisterRequest& request)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  MemberEntry* previous = nullptr;
  for (auto& [id, other] : state.members) {
    if (other.member.role() != v1::MEMBER_ROLE_SERVER ||
        other.member.state() != v1::MEMBER_STATE_READY ||
        other.member.shard_index() != request.shard_index()) {
      continue;
    }
    const bool same_identity =
        !request.identity().empty() && other.member.identity() == request.identity();
    if (other.member.address() != request.address() && !same_identity) {
      return absl::AlreadyExistsError(absl::StrCat("shard_index: shard ", request.shard_index(),
                                                   " is already served by ", id, " at ",
                                                   other.member.address()));
    }
    previous = &other;
  }
  if (previous == nullptr) return 0;
  MemberGone(state, *previous, v1::MEMBER_STATE_LOST,
             previous->member.address() == request.address()
                 ? std::string("restarted (registered again)")
                 : absl::StrCat("restarted at ", request.address(), " (registered again)"));
  return previous->n;
}

// The new member, READY, queued for writing; its id. `replaces` > 0: it takes over the number (and
// id) of that member, which MakeRoomForShard made LOST.
std::string AddMember(ClusterState& state, const v1::RegisterRequest& request, int64_t replaces)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  MemberEntry entry;
  const bool server = request.role() == v1::MEMBER_ROLE_SERVER;
  if (replaces > 0) {
    entry.n = replaces;
  } else {
    entry.n = server ? state.next_shard_n++ : state.next_worker_n++;
  }
  v1::Member& member = entry.member;
  member.set_id(absl::StrCat(server ? "s-" : "w-", entry.n));
  member.set_role(request.role());
  member.set_state(v1::MEMBER_STATE_READY);
  member.set_address(request.address());
  member.set_shard_index(server ? request.shard_index() : 0);
  member.set_hostname(request.hostname());
  member.set_pid(request.pid());
  member.set_device(request.device());
  member.set_identity(request.identity());
  member.set_registered_ms(state.NowMs());
  member.set_last_seen_ms(member.registered_ms());
  state.QueueMember(entry);
  // What this address is owed is tried at the next tick.
  if (server) RetryDropsAt(state, member.address());
  spdlog::info("coordinator: {} registered: {}{} (pid {})", member.id(),
               server ? absl::StrCat("shard ", member.shard_index(), " at ", member.address())
                      : absl::StrCat("worker on ", member.hostname()),
               member.device().empty() ? "" : absl::StrCat(", ", member.device()), member.pid());
  std::string id = member.id();
  state.members.erase(id);
  state.members.emplace(id, std::move(entry));
  state.Wake();
  return id;
}

}  // namespace

absl::StatusOr<v1::RegisterResponse> RegisterMember(ClusterState& state,
                                                    const v1::RegisterRequest& request) {
  TESSERA_RETURN_IF_ERROR(ValidateRegistration(request, state.options));
  v1::RegisterResponse response;
  {
    absl::MutexLock lock(&state.mu);
    if (!state.store_error.ok()) return state.store_error;
    int64_t replaces = 0;
    if (request.role() == v1::MEMBER_ROLE_SERVER) {
      TESSERA_ASSIGN_OR_RETURN(replaces, MakeRoomForShard(state, request));
    }
    response.set_member_id(AddMember(state, request, replaces));
  }
  response.set_lease_ms(absl::ToInt64Milliseconds(state.options.lease));
  response.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(state.options.heartbeat_interval));
  TESSERA_RETURN_IF_ERROR(state.FlushWrites());
  return response;
}

absl::Status RenewLease(ClusterState& state, const v1::HeartbeatRequest& request) {
  if (request.member_id().empty()) return absl::InvalidArgumentError("member_id: must be set");
  TESSERA_RETURN_IF_ERROR(ValidateStalls(request));
  {
    absl::MutexLock lock(&state.mu);
    MemberEntry* member = state.FindMember(request.member_id());
    if (member == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("member_id: unknown member ", request.member_id(), "; register again"));
    }
    if (!IsLive(member->member)) {
      return absl::NotFoundError(absl::StrCat("member_id: ", request.member_id(), " is ",
                                              v1::MemberState_Name(member->member.state()),
                                              "; register again"));
    }
    if (member->member.role() != v1::MEMBER_ROLE_SERVER && request.stalls_size() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("stalls: only shards report stalls; ", request.member_id(), " is a worker"));
    }
    const int64_t now = state.NowMs();
    member->member.set_last_seen_ms(now);
    member->suspected_ms = 0;
    if (member->member.role() != v1::MEMBER_ROLE_SERVER) return absl::OkStatus();
    RecordShardStalls(state, *member, request, now);
  }
  // A stall named or over is an event.
  return state.FlushWrites();
}

absl::Status DeregisterMember(ClusterState& state, const v1::DeregisterRequest& request) {
  if (request.member_id().empty()) return absl::InvalidArgumentError("member_id: must be set");
  {
    absl::MutexLock lock(&state.mu);
    MemberEntry* member = state.FindMember(request.member_id());
    if (member == nullptr) {
      return absl::NotFoundError(absl::StrCat("member_id: unknown member ", request.member_id()));
    }
    if (!IsLive(member->member)) return absl::OkStatus();
    member->member.set_last_seen_ms(state.NowMs());
    MemberGone(state, *member, v1::MEMBER_STATE_LEFT, "left the cluster");
  }
  return state.FlushWrites();
}

std::vector<v1::Member> ListMembers(ClusterState& state) {
  absl::MutexLock lock(&state.mu);
  std::vector<const MemberEntry*> shards, workers;
  for (const auto& [id, entry] : state.members) {
    (entry.member.role() == v1::MEMBER_ROLE_SERVER ? shards : workers).push_back(&entry);
  }
  std::sort(shards.begin(), shards.end(), [](const MemberEntry* a, const MemberEntry* b) {
    return std::make_pair(a->member.shard_index(), a->n) <
           std::make_pair(b->member.shard_index(), b->n);
  });
  std::sort(workers.begin(), workers.end(),
            [](const MemberEntry* a, const MemberEntry* b) { return a->n < b->n; });
  std::vector<v1::Member> members;
  for (const MemberEntry* entry : shards) members.push_back(entry->member);
  for (const MemberEntry* entry : workers) members.push_back(entry->member);
  return members;
}

absl::Status OpenTaskStream(ClusterState& state, const std::string& member_id,
                            std::shared_ptr<TaskStream> stream) {
  if (member_id.empty()) return absl::InvalidArgumentError("member_id: must be set");
  absl::MutexLock lock(&state.mu);
  // Stop() has ended every stream; a new one would stay open until the server's grace runs out.
  if (state.stopping) return absl::UnavailableError("the coordinator is shutting down");
  MemberEntry* member = state.FindMember(member_id);
  if (member == nullptr || !IsLive(member->member)) {
    return absl::NotFoundError(
        absl::StrCat("member_id: no live member ", member_id, "; register again"));
  }
  if (member->member.role() != v1::MEMBER_ROLE_WORKER) {
    return absl::InvalidArgumentError(
        absl::StrCat("member_id: ", member_id, " is a shard; only workers watch tasks"));
  }
  if (member->stream != nullptr) {
    member->stream->Close(absl::AbortedError("replaced by a newer WatchTasks stream"));
  }
  member->stream = std::move(stream);
  member->member.set_last_seen_ms(state.NowMs());
  if (member->assign.has_value() && member->assign_durable && StillAssigned(state, *member)) {
    const v1::Task& task = member->assign->assign();
    spdlog::info("coordinator: {}: new task stream; sending job {} rank {} incarnation {} again",
                 member_id, task.job_id(), task.rank(), task.incarnation());
    member->stream->Send(*member->assign);
  }
  state.Wake();
  return absl::OkStatus();
}

void ExpireLeases(ClusterState& state, int64_t now_ms) {
  const int64_t full_ms = absl::ToInt64Milliseconds(state.options.lease);
  for (auto& [id, member] : state.members) {
    const bool suspected = member.suspected_ms > 0;
    const int64_t lease_ms = suspected ? SuspectLeaseMs(state.options) : full_ms;
    if (!IsLive(member.member) || now_ms - member.member.last_seen_ms() <= lease_ms) continue;
    MemberGone(state, member, v1::MEMBER_STATE_LOST,
               suspected
                   ? absl::StrCat("lost: unreachable from a worker and no heartbeat for ",
                                  SecondsText(absl::Milliseconds(lease_ms)))
                   : absl::StrCat("lost: no heartbeat for ", SecondsText(state.options.lease)));
  }
}

void ForgetDepartedMembers(ClusterState& state) {
  for (const v1::MemberRole role : {v1::MEMBER_ROLE_SERVER, v1::MEMBER_ROLE_WORKER}) {
    std::vector<std::pair<int64_t, std::string>> departed;  // (n, id)
    for (const auto& [id, member] : state.members) {
      if (member.member.role() == role && !IsLive(member.member)) {
        departed.emplace_back(member.n, id);
      }
    }
    if (departed.size() <= state.options.max_departed_members) continue;
    std::sort(departed.begin(), departed.end());
    departed.resize(departed.size() - state.options.max_departed_members);
    for (const auto& [n, id] : departed) {
      state.members.erase(id);
      state.pending.removed_members.push_back(id);
    }
  }
}

void ReapStreams(ClusterState& state) {
  for (auto& [id, member] : state.members) {
    if (member.stream == nullptr || !member.stream->closed()) continue;
    member.stream.reset();
    if (member.member.job_id().empty()) continue;
    const JobEntry* entry = state.FindJob(member.member.job_id());
    if (entry == nullptr || IsTerminal(entry->job.state())) {
      ReleaseWorker(state, member, member.member.job_id());
    }
  }
}

void CloseTaskStreams(ClusterState& state, const absl::Status& status) {
  for (auto& [id, member] : state.members) {
    if (member.stream != nullptr) member.stream->Close(status);
    member.stream.reset();
  }
}

}  // namespace tessera::coordinator::internal
