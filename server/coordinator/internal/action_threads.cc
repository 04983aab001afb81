#include "server/coordinator/internal/action_threads.h"

#include <utility>

namespace tessera::coordinator::internal {

void ActionThreads::Run(std::function<void()> action) {
  if (run_inline_) {
    action();
    return;
  }
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  auto done = std::make_shared<bool>(false);
  std::thread thread([this, done, action = std::move(action)] {
    action();
    absl::MutexLock lock(&mu_);
    *done = true;
  });
  threads_.push_back({std::move(thread), std::move(done)});
}

void ActionThreads::Reap(bool all) {
  std::vector<ActionThread> finished;
  {
    absl::MutexLock lock(&mu_);
    if (all) stopped_ = true;
    std::vector<ActionThread> running;
    for (ActionThread& action : threads_) {
      (all || *action.done ? finished : running).push_back(std::move(action));
    }
    threads_.swap(running);
  }
  // Unlocked: an action takes mu_ as it ends.
  for (ActionThread& action : finished) action.thread.join();
}

}  // namespace tessera::coordinator::internal
