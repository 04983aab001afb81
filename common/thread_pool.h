// A fixed pool of threads that run queued closures in FIFO order.
//
// Life cycle: kRunning from construction until Stop() (or the destructor), which runs every task
// already queued and joins the threads; tasks scheduled after Stop() run inline on the caller.
#ifndef TESSERA_COMMON_THREAD_POOL_H_
#define TESSERA_COMMON_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessera {

class ThreadPool {
 public:
  // REQUIRES: num_threads >= 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`. Never blocks. Thread-safe.
  void Schedule(std::function<void()> task);

  // Runs the queued tasks, then joins the threads. Idempotent.
  void Stop();

  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_THREAD_POOL_H_
