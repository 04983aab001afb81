#include "server/consistency_gate.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tessera::server {
namespace {

bool IsCancelled(const ConsistencyGate::Wait& wait) {
  return wait.cancelled != nullptr && wait.cancelled->load(std::memory_order_acquire);
}

absl::Status CancelledStatus() {
  return absl::CancelledError("the pull was cancelled while it waited on the consistency gate");
}

}  // namespace

ConsistencyGate::ConsistencyGate(v1::Consistency mode, uint32_t staleness, uint32_t num_workers)
    : mode_(mode == v1::CONSISTENCY_UNSPECIFIED ? v1::CONSISTENCY_BSP : mode),
      staleness_(staleness),
      num_workers_(num_workers),
      clock_floor_(num_workers, 0) {
  history_.push_back(Membership{0, std::vector<bool>(num_workers, true)});
}

ConsistencyGate::~ConsistencyGate() {
  Close(absl::CancelledError("the job's state was destroyed"));
}

absl::Status ConsistencyGate::UpdateMembership(const std::vector<uint32_t>& live,
                                               int64_t effective_step) {
  if (live.empty()) {
    return absl::InvalidArgumentError("live_workers: must name at least one worker");
  }
  if (effective_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("effective_step: must be >= 0, got ", effective_step));
  }
  std::vector<bool> set(num_workers_, false);
  for (uint32_t w : live) {
    if (w >= num_workers_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "live_workers: worker ", w, " is out of range (num_workers ", num_workers_, ")"));
    }
    set[w] = true;
  }
  std::vector<Wait> ready;
  std::vector<Wait> cancelled;
  {
    absl::MutexLock lock(&mu_);
    const std::vector<bool> before = MembershipAt(effective_step - 1).live;
    while (history_.size() > 1 && history_.back().effective_step >= effective_step) {
      history_.pop_back();
    }
    if (history_.back().effective_step >= effective_step) {
      history_.back().live = set;  // replaces the entry at step 0
    } else {
      history_.push_back(Membership{effective_step, set});
    }
    for (uint32_t w = 0; w < num_workers_; ++w) {
      if (set[w] && !before[w]) clock_floor_[w] = std::max(clock_floor_[w], effective_step);
    }
    CollectOpenLocked(&ready, &cancelled);
  }
  for (Wait& w : cancelled) w.done(CancelledStatus());
  for (Wait& w : ready) w.done(absl::OkStatus());
  return absl::OkStatus();
}

const ConsistencyGate::Membership& ConsistencyGate::MembershipAt(int64_t step) const {
  for (auto it = history_.rbegin(); it != history_.rend(); ++it) {
    if (it->effective_step <= step) return *it;
  }
  return history_.front();
}

bool ConsistencyGate::IsLive(uint32_t worker, int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  return worker < num_workers_ && MembershipAt(step).live[worker];
}

std::vector<bool> ConsistencyGate::LiveSet(int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  return MembershipAt(step).live;
}

uint32_t ConsistencyGate::NumLive(int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  const std::vector<bool>& live = MembershipAt(step).live;
  return static_cast<uint32_t>(std::count(live.begin(), live.end(), true));
}

int64_t ConsistencyGate::SlowestClockLocked(const WorkerClocks& clocks, int64_t step) const {
  const std::vector<bool>& live = MembershipAt(step).live;
  int64_t slowest = INT64_MAX;
  for (uint32_t w = 0; w < num_workers_ && w < clocks.size(); ++w) {
    if (!live[w]) continue;
    const int64_t clock = std::max(clocks[w].load(std::memory_order_acquire), clock_floor_[w]);
    slowest = std::min(slowest, clock);
  }
  return slowest == INT64_MAX ? 0 : slowest;
}

int64_t ConsistencyGate::SlowestClock(const WorkerClocks& clocks, int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  return SlowestClockLocked(clocks, step);
}

absl::Status ConsistencyGate::CheckSspPushStep(absl::string_view key, const WorkerClocks& clocks,
                                               int64_t step, int64_t* slowest_out) const {
  absl::ReaderMutexLock lock(&mu_);
  const int64_t slowest = SlowestClockLocked(clocks, step);
  if (slowest_out != nullptr) *slowest_out = slowest;
  const int64_t limit = slowest + static_cast<int64_t>(staleness_) + 1;
  if (step > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key ", key, ": step ", step, " is from the future (slowest live worker's clock ", slowest,
        ", staleness ", staleness_, ", so steps up to ", limit, " are accepted)"));
  }
  return absl::OkStatus();
}

bool ConsistencyGate::IsOpenLocked(const Wait& wait) {
  for (const auto& [version, needed] : wait.versions) {
    if (version->load(std::memory_order_acquire) < needed) return false;
  }
  int64_t staleness = 0;
  for (const auto& [clocks, step] : wait.clocks) {
    const int64_t slowest = SlowestClockLocked(*clocks, step);
    if (slowest < step - static_cast<int64_t>(staleness_)) return false;
    staleness = std::max(staleness, step - slowest);
  }
  max_staleness_served_ = std::max(max_staleness_served_, staleness);
  return true;
}

void ConsistencyGate::CollectOpenLocked(std::vector<Wait>* ready, std::vector<Wait>* cancelled) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (IsCancelled(*it)) {
      cancelled->push_back(std::move(*it));
      it = parked_.erase(it);
    } else if (IsOpenLocked(*it)) {
      ready->push_back(std::move(*it));
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
}

void ConsistencyGate::CollectCancelledLocked(std::vector<Wait>* cancelled) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (IsCancelled(*it)) {
      cancelled->push_back(std::move(*it));
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
}

void ConsistencyGate::Park(Wait wait) {
  absl::Status status;
  std::vector<Wait> cancelled;
  bool parked = false;
  {
    absl::MutexLock lock(&mu_);
    status = closed_;
    if (status.ok() && IsCancelled(wait)) status = CancelledStatus();
    if (status.ok() && !IsOpenLocked(wait)) {
      parked_.push_back(std::move(wait));
      parked = true;
      if (parked_.size() >= sweep_at_) {
        CollectCancelledLocked(&cancelled);
        sweep_at_ = std::max<size_t>(64, 2 * parked_.size());
      }
    }
  }
  for (Wait& w : cancelled) w.done(CancelledStatus());
  if (!parked) wait.done(status);
}

void ConsistencyGate::Notify() {
  std::vector<Wait> ready;
  std::vector<Wait> cancelled;
  {
    absl::MutexLock lock(&mu_);
    CollectOpenLocked(&ready, &cancelled);
  }
  for (Wait& w : cancelled) w.done(CancelledStatus());
  for (Wait& w : ready) w.done(absl::OkStatus());
}

void ConsistencyGate::Close(const absl::Status& status) {
  std::list<Wait> parked;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.ok()) closed_ = status;
    parked.swap(parked_);
  }
  for (Wait& w : parked) w.done(status);
}

int64_t ConsistencyGate::MaxStalenessServed() const {
  absl::ReaderMutexLock lock(&mu_);
  return max_staleness_served_;
}

size_t ConsistencyGate::NumParked() const {
  absl::ReaderMutexLock lock(&mu_);
  return parked_.size();
}

}  // namespace tessera::server
