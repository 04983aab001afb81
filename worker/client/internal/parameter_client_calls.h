// The pieces of one ParameterClient call that its dense (parameter_client.cc) and sparse
// (parameter_client_sparse.cc) halves share: the operation, its attempts and the retry timer.
// Private to worker/client/.
#ifndef TESSERA_WORKER_CLIENT_INTERNAL_PARAMETER_CLIENT_CALLS_H_
#define TESSERA_WORKER_CLIENT_INTERNAL_PARAMETER_CLIENT_CALLS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/client/parameter_client.h"

namespace tessera {
namespace client {

// One multi-request operation (a PushPull over several partitions or shards). Completes when
// every request has finished, successfully or not.
struct ParameterClient::Op {
  PushPullCallback done;
  std::atomic<int> remaining{0};
  absl::Mutex mu;
  absl::Status status ABSL_GUARDED_BY(mu);
  PushPullResult result ABSL_GUARDED_BY(mu);
  bool have_version ABSL_GUARDED_BY(mu) = false;
};

// One request of an Op, with its retry state. `accept` decodes the weights of a successful
// response into the caller's buffer; it is empty when no weights were asked for.
struct ParameterClient::Attempt {
  std::shared_ptr<Op> op;
  int shard = 0;
  // What every attempt sends: the request, the fp32 push data lent from the caller's gradient
  // (entry i is the data of request->push(i), whose own data is empty) and, for dense partitions,
  // where the transport may decode the weights in place (then it sets `weights_written` and
  // `accept` is skipped).
  ShardClient::PushPullCall call;
  int attempts = 0;
  std::string what;
  std::function<absl::Status(const v1::PushPullResponse&)> accept;
  bool weights_written = false;
  // Replication: the home shards of the partitions and rows in the request (replica_routing.h)
  // and of those it asks weights for, when the first retryable error came (the failover timeout
  // counts from it), and whether the request was already sent to another copy once.
  std::vector<int> homes;
  std::vector<int> want_homes;
  absl::Time first_failure = absl::InfiniteFuture();
  bool rerouted = false;
  // A write to the shard being filled (ReplicaRouting::WriteCopies): only such attempts go to a
  // down shard, and only while its fill lasts; one made before the shard went down never does.
  bool fill_write = false;
};

// Runs retries after their backoff on one thread.
class ParameterClient::RetryTimer {
 public:
  RetryTimer() : thread_([this] { Run(); }) {}
  ~RetryTimer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  void After(absl::Duration delay, std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    tasks_.emplace(absl::Now() + delay, std::move(fn));
    changed_ = true;
  }

  // Every waiting retry runs now (the routing changed: a retry for a down shard goes elsewhere).
  void RunAllNow() {
    absl::MutexLock lock(&mu_);
    std::multimap<absl::Time, std::function<void()>> now;
    for (auto& [when, fn] : tasks_) now.emplace(absl::InfinitePast(), std::move(fn));
    tasks_ = std::move(now);
    changed_ = true;
  }

 private:
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || changed_; }

  void Run() {
    for (;;) {
      std::function<void()> fn;
      {
        absl::MutexLock lock(&mu_);
        for (;;) {
          if (stop_) return;
          if (!tasks_.empty() && tasks_.begin()->first <= absl::Now()) {
            fn = std::move(tasks_.begin()->second);
            tasks_.erase(tasks_.begin());
            break;
          }
          const absl::Time next = tasks_.empty() ? absl::InfiniteFuture() : tasks_.begin()->first;
          changed_ = false;
          mu_.AwaitWithDeadline(absl::Condition(this, &RetryTimer::Woken), next);
        }
      }
      fn();
    }
  }

  absl::Mutex mu_;
  std::multimap<absl::Time, std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

namespace internal {

// Runs fn(i) for every i in `items`, concurrently when there is more than one, and returns the
// first error.
absl::Status ForEachConcurrently(const std::vector<int>& items,
                                 const std::function<absl::Status(int)>& fn);

// EncodeValues, except that fp32 is one copy straight into the bytes field (resize() would
// zero-fill the buffer first: a whole extra pass over a 4 MiB partition).
void EncodeInto(v1::Encoding encoding, const float* in, size_t n, std::string* out);

}  // namespace internal
}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_INTERNAL_PARAMETER_CLIENT_CALLS_H_
