// ActionThreads: the threads the coordinator's fault-tolerance actions (recoveries, membership
// changes, hand-overs, automatic checkpoint calls) run on, one each, so that an action blocked
// on a shard's deadline never holds up the tick loop or another job's action. At most one action
// and one checkpoint call per job are in flight (the planners see to that), so their number is
// bounded by the jobs. Private to server/coordinator/.
//
// Life cycle: running from construction; Reap(/*all=*/true) joins every thread and runs later
// actions no more. Thread-safe.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_ACTION_THREADS_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_ACTION_THREADS_H_

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessera::coordinator::internal {

class ActionThreads {
 public:
  // `run_inline`: Run() runs the action on the calling thread (tests with a fake ShardControl).
  explicit ActionThreads(bool run_inline) : run_inline_(run_inline) {}
  ~ActionThreads() { Reap(/*all=*/true); }

  ActionThreads(const ActionThreads&) = delete;
  ActionThreads& operator=(const ActionThreads&) = delete;

  // Runs `action` on a thread of its own (inline: on this thread, blocking). Dropped after
  // Reap(true). Never blocks otherwise.
  void Run(std::function<void()> action) ABSL_LOCKS_EXCLUDED(mu_);
  // Joins the threads whose action has returned; with `all`, every thread (blocking until their
  // actions return) and later actions are dropped.
  void Reap(bool all) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct ActionThread {
    std::thread thread;
    std::shared_ptr<bool> done;  // guarded by mu_
  };
  const bool run_inline_;
  absl::Mutex mu_;
  std::vector<ActionThread> threads_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_ACTION_THREADS_H_
