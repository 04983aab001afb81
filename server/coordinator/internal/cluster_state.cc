#include "server/coordinator/internal/cluster_state.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator::internal {

int64_t ClusterState::NowMs() const {
  if (options.now_ms) return options.now_ms();
  return absl::ToUnixMillis(absl::Now());
}

JobEntry* ClusterState::FindJob(const std::string& job_id) {
  auto it = job_n.find(job_id);
  if (it == job_n.end()) return nullptr;
  return &jobs.at(it->second);
}

MemberEntry* ClusterState::FindMember(const std::string& member_id) {
  auto it = members.find(member_id);
  return it == members.end() ? nullptr : &it->second;
}

void ClusterState::QueueJob(JobEntry& entry) {
  pending.jobs.push_back({entry.n, entry.job});
  entry.dirty = false;
  entry.last_write_ms = NowMs();
}

void ClusterState::QueueMember(const MemberEntry& entry) {
  pending.members.push_back(entry.member);
}

absl::Status ClusterState::FlushWrites() {
  absl::MutexLock write_lock(&write_mu);
  StoreWrite batch;
  {
    absl::MutexLock lock(&mu);
    if (!store_error.ok()) return store_error;
    if (pending.empty()) return absl::OkStatus();
    std::swap(batch, pending);
  }
  // Unlocked: SQLite I/O. write_mu keeps batches in the order they were queued.
  absl::Status status = store->Write(batch);
  if (!status.ok()) {
    spdlog::error("coordinator: the database write failed; refusing further changes: {}",
                  status.ToString());
    absl::MutexLock lock(&mu);
    if (store_error.ok()) {
      store_error =
          absl::Status(status.code(), absl::StrCat("coordinator database: ", status.message()));
    }
    return store_error;
  }
  return absl::OkStatus();
}

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

bool IsLive(const v1::Member& member) {
  return member.state() == v1::MEMBER_STATE_READY || member.state() == v1::MEMBER_STATE_BUSY;
}

std::string WorkerName(const v1::JobWorker& worker) {
  return absl::StrCat(worker.member_id(), " on ",
                      worker.hostname().empty() ? "?" : worker.hostname());
}

std::string SecondsText(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), " s"); }

}  // namespace tessera::coordinator::internal
