#include "worker/client/replica_routing.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace client {

ReplicaRouting::ReplicaRouting(int num_shards, int replicas)
    : num_shards_(num_shards), replicas_(replicas), down_(static_cast<size_t>(num_shards), false) {}

absl::Status ReplicaRouting::Validate(int num_shards, int replicas) {
  if (replicas < 1 || replicas > num_shards) {
    return absl::InvalidArgumentError(absl::StrCat("replicas: must be in [1, ", num_shards,
                                                   "] (the number of shards), got ", replicas));
  }
  return absl::OkStatus();
}

std::vector<int> ReplicaRouting::Copies(int home) const {
  std::vector<int> copies;
  copies.reserve(static_cast<size_t>(replicas_));
  for (int c = 0; c < replicas_; ++c) copies.push_back((home + c) % num_shards_);
  return copies;
}

std::vector<int> ReplicaRouting::LiveCopies(int home) const {
  std::vector<int> live;
  absl::MutexLock lock(&mu_);
  for (int c = 0; c < replicas_; ++c) {
    const int shard = (home + c) % num_shards_;
    if (!down_[static_cast<size_t>(shard)]) live.push_back(shard);
  }
  return live;
}

std::vector<int> ReplicaRouting::WriteCopies(int home, int64_t step) {
  std::vector<int> copies;
  absl::MutexLock lock(&mu_);
  max_write_step_ = std::max(max_write_step_, step);
  for (int c = 0; c < replicas_; ++c) {
    const int shard = (home + c) % num_shards_;
    if (!down_[static_cast<size_t>(shard)]) copies.push_back(shard);
  }
  if (filling_ >= 0 && step >= fill_from_step_ && IsCopy(home, filling_)) {
    copies.push_back(filling_);
  }
  return copies;
}

std::vector<int> ReplicaRouting::WriteShards(int64_t step) {
  std::vector<int> shards;
  absl::MutexLock lock(&mu_);
  max_write_step_ = std::max(max_write_step_, step);
  for (int s = 0; s < num_shards_; ++s) {
    if (!down_[static_cast<size_t>(s)] || (s == filling_ && step >= fill_from_step_)) {
      shards.push_back(s);
    }
  }
  return shards;
}

absl::StatusOr<bool> ReplicaRouting::SetFill(int shard, int64_t from_step) {
  if (shard < 0 || shard >= num_shards_) {
    return absl::InvalidArgumentError(
        absl::StrCat("fill shard ", shard, ": must be in [0, ", num_shards_, ")"));
  }
  absl::MutexLock lock(&mu_);
  if (!down_[static_cast<size_t>(shard)]) {
    return absl::InvalidArgumentError(absl::StrCat("fill shard ", shard, ": it is not down"));
  }
  filling_ = shard;
  fill_from_step_ = from_step;
  return max_write_step_ < from_step;
}

int ReplicaRouting::ClearFill() {
  absl::MutexLock lock(&mu_);
  const int was = filling_;
  filling_ = -1;
  fill_from_step_ = 0;
  return was;
}

int ReplicaRouting::filling() const {
  absl::MutexLock lock(&mu_);
  return filling_;
}

int64_t ReplicaRouting::fill_from_step() const {
  absl::MutexLock lock(&mu_);
  return fill_from_step_;
}

bool ReplicaRouting::IsWritable(int shard, bool fill_write) const {
  absl::MutexLock lock(&mu_);
  return !down_[static_cast<size_t>(shard)] || (fill_write && shard == filling_);
}

int ReplicaRouting::Acting(int home) const {
  absl::MutexLock lock(&mu_);
  for (int c = 0; c < replicas_; ++c) {
    const int shard = (home + c) % num_shards_;
    if (!down_[static_cast<size_t>(shard)]) return shard;
  }
  return -1;
}

bool ReplicaRouting::IsCopy(int home, int shard) const {
  const int distance = ((shard - home) % num_shards_ + num_shards_) % num_shards_;
  return distance < replicas_;
}

absl::Status ReplicaRouting::SetDown(const std::vector<int>& down, std::vector<int>* newly_down) {
  std::vector<bool> next(static_cast<size_t>(num_shards_), false);
  for (int shard : down) {
    if (shard < 0 || shard >= num_shards_) {
      return absl::InvalidArgumentError(
          absl::StrCat("down shard ", shard, ": must be in [0, ", num_shards_, ")"));
    }
    next[static_cast<size_t>(shard)] = true;
  }
  absl::MutexLock lock(&mu_);
  if (newly_down != nullptr) {
    newly_down->clear();
    for (int s = 0; s < num_shards_; ++s) {
      if (next[static_cast<size_t>(s)] && !down_[static_cast<size_t>(s)]) newly_down->push_back(s);
    }
  }
  down_ = std::move(next);
  // A fill ends with its shard up again.
  if (filling_ >= 0 && !down_[static_cast<size_t>(filling_)]) {
    filling_ = -1;
    fill_from_step_ = 0;
  }
  return absl::OkStatus();
}

bool ReplicaRouting::IsDown(int shard) const {
  absl::MutexLock lock(&mu_);
  return down_[static_cast<size_t>(shard)];
}

std::vector<int> ReplicaRouting::Down() const { return Where(true); }

std::vector<int> ReplicaRouting::Live() const { return Where(false); }

std::vector<int> ReplicaRouting::Where(bool down) const {
  std::vector<int> shards;
  absl::MutexLock lock(&mu_);
  for (int s = 0; s < num_shards_; ++s) {
    if (down_[static_cast<size_t>(s)] == down) shards.push_back(s);
  }
  return shards;
}

}  // namespace client
}  // namespace tessera
