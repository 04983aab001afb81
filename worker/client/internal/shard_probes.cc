#include "worker/client/internal/shard_probes.h"

#include <utility>

namespace tessera {
namespace client {

ShardProbes::ShardProbes(std::function<bool(int)> answers, std::function<void(int)> silent)
    : answers_(std::move(answers)), silent_(std::move(silent)), thread_([this] { Run(); }) {}

ShardProbes::~ShardProbes() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void ShardProbes::Probe(int shard) {
  absl::MutexLock lock(&mu_);
  if (stop_ || !pending_.insert(shard).second) return;
  queue_.push_back(shard);
}

int ShardProbes::probes_run() const {
  absl::MutexLock lock(&mu_);
  return probes_run_;
}

void ShardProbes::Run() {
  for (;;) {
    int shard = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &ShardProbes::Woken));
      if (stop_) return;
      shard = queue_.front();
      queue_.pop_front();
    }
    const bool answered = answers_(shard);  // without the lock: it blocks
    if (!answered) silent_(shard);
    absl::MutexLock lock(&mu_);
    pending_.erase(shard);
    ++probes_run_;
  }
}

}  // namespace client
}  // namespace tessera
