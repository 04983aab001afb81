#include "worker/client/replica_routing.h"

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
