#include "server/consistency_gate.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/gradient_payload.h"

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
  if (step == limit + 1) {
    // A copy that lags its acting shard by a step (replication) admits it soon: try again.
    return absl::UnavailableError(absl::StrCat(
        "key ", key, ": step ", step, " is one past what is accepted (slowest live worker's clock ",
        slowest, ", staleness ", staleness_, "); try again once that worker's step is in"));
  }
  if (step > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key ", key, ": step ", step, " is from the future (slowest live worker's clock ", slowest,
        ", staleness ", staleness_, ", so steps up to ", limit, " are accepted)"));
  }
  return absl::OkStatus();
}

absl::Status ConsistencyGate::AdmitPusher(uint32_t worker, int64_t step,
                                          absl::string_view job_id) const {
  if (!IsLive(worker, step)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker_id: worker ", worker, " is not live in job '", job_id, "' at step ", step));
  }
  return absl::OkStatus();
}

absl::Status ConsistencyGate::AdmitSlice(absl::string_view key, const Partition& p, int64_t step,
                                         std::optional<int64_t>* staleness) const {
  if (!ssp(p)) return absl::OkStatus();
  int64_t slowest = 0;
  TESSERA_RETURN_IF_ERROR(CheckSspPushStep(key, p.clocks, step, &slowest));
  *staleness = step - slowest;
  return absl::OkStatus();
}

absl::StatusOr<bool> ConsistencyGate::AdmitLocked(const Partition& p, uint32_t worker,
                                                  int64_t step) const {
  if (!bsp(p)) return false;
  const int64_t version = p.version.load(std::memory_order_relaxed);
  if (step == version + 1) {
    // A copy that lags its acting shard by a step (replication) applies that step soon: try again.
    return absl::UnavailableError(absl::StrCat("key ", p.name, ": step ", step,
                                               " is one ahead of the partition (version ", version,
                                               "); try again once step ", version, " is applied"));
  }
  if (step > version) {
    return absl::InvalidArgumentError(absl::StrCat("key ", p.name, ": step ", step,
                                                   " is from the future (partition version ",
                                                   version, ", BSP accepts step ", version, ")"));
  }
  if (step < version) {
    return absl::FailedPreconditionError(absl::StrCat("key ", p.name, ": step ", step,
                                                      " was already applied (version ", version,
                                                      ") without worker ", worker));
  }
  // Pushed by an earlier incarnation: this one's seq counts as applied, so that its retries
  // after the step completes are acknowledged too.
  return p.staging.contributed[worker] != 0;
}

int64_t ConsistencyGate::StagingBytesLocked(const Partition& p, uint32_t worker,
                                            const SliceView& slice) const {
  if (!bsp(p)) return 0;
  if (!p.sparse) return p.staging.dense[worker].empty() ? p.num_elements * 4 : 0;
  const int64_t num_rows = static_cast<int64_t>(slice.row_ids.size());
  return num_rows * (int64_t{p.dim} * 4 + 8);  // staged until the step completes
}

float ConsistencyGate::PushScale(const Partition& p, int64_t step) const {
  // An averaging partition moves 1/L of the way to each push in ASP as in SSP.
  return ssp(p) || p.average ? 1.0f / static_cast<float>(NumLive(step)) : 1.0f;
}

ConsistencyGate::Applied ConsistencyGate::ApplyPushLocked(const PushPullView& request, float scale,
                                                          const PushSlice& item,
                                                          std::vector<float>* scratch) {
  Partition& p = *item.partition;
  p.mu.AssertHeld();
  const uint32_t worker = request.worker_id;
  const int64_t step = request.step;
  std::atomic<int64_t>& clock = p.clocks[worker];
  if (clock.load(std::memory_order_relaxed) < step + 1) {
    clock.store(step + 1, std::memory_order_release);
  }
  if (item.duplicate) {
    if (item.record_seq) p.RecordAppliedLocked(worker, request.incarnation, request.seq);
    return Applied{false, false, /*boundary_moved=*/!bsp(p)};
  }
  if (bsp(p)) {
    if (p.staging.contributors == 0) {
      p.staging.boundary_seqs = p.last_applied;
      p.staging.first_push_ns = SteadyNowNs();
    }
    p.RecordAppliedLocked(worker, request.incarnation, request.seq);
    StageLocked(p, worker, item);
    return CompleteStepLocked(p);
  }
  p.RecordAppliedLocked(worker, request.incarnation, request.seq);
  Applied applied{false, false, /*boundary_moved=*/true};
  if (item.skip || !p.ApplySliceLocked(step, scale, *item.slice, scratch)) return applied;
  p.version.fetch_add(1, std::memory_order_release);
  applied.version_changed = true;
  applied.updated = true;
  return applied;
}

void ConsistencyGate::StageLocked(Partition& p, uint32_t worker, const PushSlice& item) {
  BspStaging& staging = p.staging;
  staging.contributed[worker] = 1;
  staging.skipped[worker] = item.skip ? 1 : 0;
  ++staging.contributors;
  if (item.skip) return;
  if (!p.sparse) {
    staging.dense[worker].resize(static_cast<size_t>(p.num_elements));
    DecodeSlice(*item.slice, staging.dense[worker].data(), staging.dense[worker].size());
  } else {
    staging.rows[worker] = MergeRows(*item.slice, p.dim);
    staging.rows_bytes[worker] = item.staging_bytes;
  }
}

bool ConsistencyGate::StepStagedLocked(const Partition& p) const {
  const std::vector<uint8_t>& contributed = p.staging.contributed;
  absl::ReaderMutexLock lock(&mu_);
  const std::vector<bool>& live = MembershipAt(p.version.load(std::memory_order_relaxed)).live;
  for (size_t w = 0; w < live.size(); ++w) {
    if (live[w] && !contributed[w]) return false;
  }
  return true;
}

ConsistencyGate::Applied ConsistencyGate::CompleteStepLocked(Partition& p) {
  if (!bsp(p)) return Applied{false, false, /*boundary_moved=*/true};
  BspStaging& staging = p.staging;
  if (staging.contributors == 0 || !StepStagedLocked(p)) return Applied{};
  const int64_t step = p.version.load(std::memory_order_relaxed);
  const float scale = 1.0f / static_cast<float>(staging.contributors);
  Applied applied{true, false, true};
  applied.updated =
      p.sparse ? ApplyStagedRowsLocked(p, step, scale) : ApplyStagedDenseLocked(p, step, scale);
  std::fill(staging.contributed.begin(), staging.contributed.end(), 0);
  std::fill(staging.skipped.begin(), staging.skipped.end(), 0);
  staging.contributors = 0;
  p.version.store(step + 1, std::memory_order_release);
  return applied;
}

bool ConsistencyGate::ApplyStagedDenseLocked(Partition& p, int64_t step, float scale) {
  BspStaging& staging = p.staging;
  std::vector<float>* sum = nullptr;
  int summed = 0;
  for (size_t w = 0; w < staging.contributed.size(); ++w) {
    if (!staging.contributed[w] || staging.skipped[w]) continue;
    ++summed;
    if (sum == nullptr) {
      sum = &staging.dense[w];
      continue;
    }
    const float* __restrict__ src = staging.dense[w].data();
    float* __restrict__ dst = sum->data();
    for (int64_t i = 0; i < p.num_elements; ++i) dst[i] += src[i];
  }
  if (sum == nullptr) return false;
  if (p.average) {
    // The mean of the finite pushes (a skipped one is no value, where it is a zero gradient).
    const float inverse = 1.0f / static_cast<float>(summed);
    float* values = sum->data();
    for (int64_t i = 0; i < p.num_elements; ++i) values[i] *= inverse;
    p.ApplyDenseLocked(step, 1.0f, values);
    return true;
  }
  p.ApplyDenseLocked(step, scale, sum->data());
  return true;
}

bool ConsistencyGate::ApplyStagedRowsLocked(Partition& p, int64_t step, float scale) {
  BspStaging& staging = p.staging;
  SparseGrad merged;
  absl::flat_hash_map<int64_t, size_t> index;
  for (size_t w = 0; w < staging.contributed.size(); ++w) {
    if (!staging.contributed[w] || staging.skipped[w]) continue;
    const SparseGrad& g = staging.rows[w];
    for (size_t i = 0; i < g.ids.size(); ++i) {
      auto [it, inserted] = index.try_emplace(g.ids[i], merged.ids.size());
      const float* src = g.values.data() + i * p.dim;
      if (inserted) {
        merged.ids.push_back(g.ids[i]);
        merged.values.insert(merged.values.end(), src, src + p.dim);
      } else {
        float* dst = merged.values.data() + it->second * p.dim;
        for (uint32_t j = 0; j < p.dim; ++j) dst[j] += src[j];
      }
    }
    staging.rows[w] = SparseGrad();
    p.ReleaseCharge(staging.rows_bytes[w]);
    staging.rows_bytes[w] = 0;
  }
  if (merged.ids.empty()) return false;
  p.ApplySparseLocked(step, scale, merged);
  return true;
}

void ConsistencyGate::NotifyAfterPush(bool version_changed) {
  if ((version_changed && bsp()) || ssp()) Notify();
}

absl::Status ConsistencyGate::CheckPullStep(absl::string_view field, const SliceView& key,
                                            const Partition& p, int64_t gate_step) const {
  if (!bsp(p) || gate_step < 0) return absl::OkStatus();
  const int64_t version = p.version.load(std::memory_order_acquire);
  if (gate_step == version + 2) {
    // One further ahead than a pull may park: a copy that lags the shard the worker read its last
    // weights from (replication). It catches up soon: try again.
    return absl::UnavailableError(
        absl::StrCat(field, " key ", KeyName(key), ": pull for step ", gate_step,
                     " is one further ahead than can wait (partition version ", version,
                     "); try again once step ", version, " is applied"));
  }
  if (gate_step > version + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " key ", KeyName(key), ": pull for step ", gate_step,
                     " is from the future (partition version ", version, ")"));
  }
  return absl::OkStatus();
}

void ConsistencyGate::AddToWait(const std::shared_ptr<Partition>& p, int64_t gate_step,
                                Wait* wait) const {
  if (gate_step < 0) return;
  if (bsp(*p)) {
    wait->versions.emplace_back(std::shared_ptr<const std::atomic<int64_t>>(p, &p->version),
                                gate_step);
  } else if (ssp(*p)) {
    wait->clocks.emplace_back(std::shared_ptr<const WorkerClocks>(p, &p->clocks), gate_step);
  }
}

int64_t ConsistencyGate::StepsCompletedLocked(const Partition& p, int64_t step) const {
  return bsp(p) ? p.version.load(std::memory_order_relaxed) : SlowestClock(p.clocks, step);
}

int64_t ConsistencyGate::FurthestStepLocked(const Partition& p,
                                            const std::vector<bool>* live) const {
  if (bsp(p)) return p.version.load(std::memory_order_relaxed);
  int64_t furthest = 0;
  for (size_t w = 0; w < p.clocks.size(); ++w) {
    if (live != nullptr && (w >= live->size() || !(*live)[w])) continue;
    furthest = std::max(furthest, p.clocks[w].load(std::memory_order_relaxed));
  }
  return furthest;
}

int64_t ConsistencyGate::BoundaryClockLocked(const Partition& p, size_t worker) const {
  const int64_t clock = p.clocks[worker].load(std::memory_order_relaxed);
  return bsp(p) ? std::min(clock, p.version.load(std::memory_order_relaxed)) : clock;
}

const std::vector<AppliedSeq>& ConsistencyGate::BoundarySeqsLocked(const Partition& p) const {
  return bsp(p) && p.staging.contributors > 0 ? p.staging.boundary_seqs : p.last_applied;
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
      wait.parked_ns = SteadyNowNs();
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

std::optional<v1::ShardStall> ConsistencyGate::FindStall(
    const std::vector<std::shared_ptr<Partition>>& partitions, int64_t now_ns,
    int64_t min_wait_ns) const {
  std::optional<v1::ShardStall> stall;
  if (bsp()) stall = FindBspStall(partitions, now_ns, min_wait_ns);
  if (ssp() && !stall.has_value()) stall = FindSspStall(now_ns, min_wait_ns);
  if (stall.has_value()) stall->set_partitions(static_cast<int32_t>(partitions.size()));
  return stall;
}

std::optional<v1::ShardStall> ConsistencyGate::FindBspStall(
    const std::vector<std::shared_ptr<Partition>>& partitions, int64_t now_ns,
    int64_t min_wait_ns) const {
  // One look at each partition: its step (version), whether the step has begun, since when, and
  // who pushed it.
  struct Seen {
    int64_t step = 0;
    int64_t first_push_ns = 0;  // 0: nobody pushed the step yet
    std::vector<uint8_t> contributed;
  };
  std::vector<Seen> seen;
  seen.reserve(partitions.size());
  int64_t oldest = INT64_MAX;
  for (const std::shared_ptr<Partition>& p : partitions) {
    absl::ReaderMutexLock lock(&p->mu);
    Seen s;
    s.step = p->version.load(std::memory_order_relaxed);
    if (p->staging.contributors > 0) {
      s.first_push_ns = p->staging.first_push_ns;
      s.contributed = p->staging.contributed;
    }
    oldest = std::min(oldest, s.step);
    seen.push_back(std::move(s));
  }
  if (seen.empty()) return std::nullopt;
  // The oldest step is what every later one waits for; it is visible here once pushed somewhere.
  int64_t first_push_ns = INT64_MAX;
  for (const Seen& s : seen) {
    if (s.step == oldest && s.first_push_ns > 0)
      first_push_ns = std::min(first_push_ns, s.first_push_ns);
  }
  if (first_push_ns == INT64_MAX || now_ns - first_push_ns < min_wait_ns) return std::nullopt;
  const std::vector<bool> live = LiveSet(oldest);
  v1::ShardStall stall;
  stall.set_step(oldest);
  stall.set_waiting_ms((now_ns - first_push_ns) / 1'000'000);
  for (uint32_t w = 0; w < live.size(); ++w) {
    if (!live[w]) continue;
    int32_t missing = 0;
    for (const Seen& s : seen) {
      if (s.step == oldest && (s.contributed.size() <= w || !s.contributed[w])) ++missing;
    }
    if (missing == 0) continue;
    v1::LaggingRank* lagging = stall.add_lagging();
    lagging->set_rank(static_cast<int32_t>(w));
    lagging->set_partitions(missing);
    lagging->set_clock(oldest);
  }
  if (stall.lagging().empty()) return std::nullopt;
  return stall;
}

std::optional<v1::ShardStall> ConsistencyGate::FindSspStall(int64_t now_ns,
                                                            int64_t min_wait_ns) const {
  absl::ReaderMutexLock lock(&mu_);
  const Wait* oldest = nullptr;
  for (const Wait& wait : parked_) {
    if (IsCancelled(wait) || wait.clocks.empty()) continue;
    if (oldest == nullptr || wait.parked_ns < oldest->parked_ns) oldest = &wait;
  }
  if (oldest == nullptr || now_ns - oldest->parked_ns < min_wait_ns) return std::nullopt;
  int64_t step = 0;
  for (const auto& [clocks, need] : oldest->clocks) step = std::max(step, need);
  const std::vector<bool>& live = MembershipAt(step).live;
  v1::ShardStall stall;
  stall.set_step(step);
  stall.set_waiting_ms((now_ns - oldest->parked_ns) / 1'000'000);
  for (uint32_t w = 0; w < num_workers_; ++w) {
    if (!live[w]) continue;
    int32_t behind = 0;
    int64_t least = INT64_MAX;
    for (const auto& [clocks, need] : oldest->clocks) {
      if (w >= clocks->size()) continue;
      const int64_t clock = std::max((*clocks)[w].load(std::memory_order_acquire), clock_floor_[w]);
      if (clock < need - static_cast<int64_t>(staleness_)) {
        ++behind;
        least = std::min(least, clock);
      }
    }
    if (behind == 0) continue;
    v1::LaggingRank* lagging = stall.add_lagging();
    lagging->set_rank(static_cast<int32_t>(w));
    lagging->set_partitions(behind);
    lagging->set_clock(least);
  }
  if (stall.lagging().empty()) return std::nullopt;
  return stall;
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
