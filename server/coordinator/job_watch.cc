#include "server/coordinator/job_watch.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::coordinator {

JobWatch::Poll JobWatch::Next(v1::WatchJobResponse* out, absl::Status* end) {
  absl::MutexLock lock(&mu_);
  if (replaying_) return Poll::kEmpty;
  if (!queue_.empty()) {
    *out = std::move(queue_.front());
    queue_.pop_front();
    if (replay_left_ > 0) --replay_left_;
    return Poll::kMessage;
  }
  if (ended_) {
    *end = end_status_;
    return Poll::kEnded;
  }
  return Poll::kEmpty;
}

void JobWatch::SetWakeup(std::function<void()> wakeup) {
  absl::MutexLock lock(&wakeup_mu_);
  wakeup_ = std::move(wakeup);
}

void JobWatch::Cancel() {
  absl::MutexLock lock(&mu_);
  ended_ = true;
  queue_.clear();
  held_.clear();
}

bool JobWatch::Push(v1::WatchJobResponse message) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return false;
    std::deque<v1::WatchJobResponse>& target = replaying_ ? held_ : queue_;
    target.push_back(std::move(message));
    const size_t live = replaying_ ? held_.size() : queue_.size() - replay_left_;
    if (live > max_queued_) {
      ended_ = true;
      queue_.clear();
      held_.clear();
      replay_left_ = 0;
      end_status_ = absl::ResourceExhaustedError(
          absl::StrCat("this watcher fell more than ", max_queued_, " events behind; watch again"));
    }
  }
  Wake();
  return true;
}

void JobWatch::End(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    end_status_ = status;
  }
  Wake();
}

void JobWatch::FinishReplay(std::vector<v1::WatchJobResponse> replay) {
  {
    absl::MutexLock lock(&mu_);
    if (!replaying_) return;
    replaying_ = false;
    std::deque<v1::WatchJobResponse> queue(std::make_move_iterator(replay.begin()),
                                           std::make_move_iterator(replay.end()));
    replay_left_ = queue.size();
    for (v1::WatchJobResponse& message : held_) queue.push_back(std::move(message));
    held_.clear();
    queue_.swap(queue);
    if (ended_ && !end_status_.ok()) {
      // Overflowed or failed: the error goes out at once.
      queue_.clear();
      replay_left_ = 0;
    }
  }
  Wake();
}

void JobWatch::Wake() {
  absl::MutexLock lock(&wakeup_mu_);
  if (wakeup_) wakeup_();
}

}  // namespace tessera::coordinator
