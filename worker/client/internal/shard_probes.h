// ShardProbes: asks shards whether their process answers at all, for a replicated client whose
// call to a shard has waited long (ParameterClient::TakeUnreachableShards). A stopped process
// (SIGSTOP, a host that froze) answers nothing, while a call parked at a barrier for another rank
// waits just as long on a shard that is fine: the probe tells the two apart. Private to
// worker/client/.
#ifndef TESSERA_WORKER_CLIENT_INTERNAL_SHARD_PROBES_H_
#define TESSERA_WORKER_CLIENT_INTERNAL_SHARD_PROBES_H_

#include <deque>
#include <functional>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace client {

class ShardProbes {
 public:
  // `answers(shard)` probes one shard (blocking, bounded by its own deadline): true when it
  // answered. `silent(shard)` runs on the probe thread when it did not.
  ShardProbes(std::function<bool(int)> answers, std::function<void(int)> silent);
  // Waits for the probe in flight; queued ones are dropped.
  ~ShardProbes();

  ShardProbes(const ShardProbes&) = delete;
  ShardProbes& operator=(const ShardProbes&) = delete;

  // Queues a probe of `shard`, unless one is queued or running already. Thread-safe.
  void Probe(int shard);

  // Probes run so far (for tests).
  int probes_run() const;

 private:
  void Run();
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  const std::function<bool(int)> answers_;
  const std::function<void(int)> silent_;
  mutable absl::Mutex mu_;
  std::deque<int> queue_ ABSL_GUARDED_BY(mu_);
  std::set<int> pending_ ABSL_GUARDED_BY(mu_);  // queued or running
  int probes_run_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_INTERNAL_SHARD_PROBES_H_
