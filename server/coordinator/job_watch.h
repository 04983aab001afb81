// JobWatch: one WatchJob subscriber, a bounded queue that the coordinator fills and the transport
// (grpc_coordinator_service.cc's WatchReactor) drains.
#ifndef TESSERA_SERVER_COORDINATOR_JOB_WATCH_H_
#define TESSERA_SERVER_COORDINATOR_JOB_WATCH_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

// The coordinator never blocks on it; a watcher more than `max_queued` messages behind is ended
// with RESOURCE_EXHAUSTED. Thread-safe.
class JobWatch {
 public:
  explicit JobWatch(size_t max_queued) : max_queued_(max_queued) {}

  enum class Poll { kMessage, kEmpty, kEnded };
  // The next message (kMessage), nothing yet (kEmpty), or the end of the stream (kEnded, with
  // its status in `*end`). Never blocks.
  Poll Next(v1::WatchJobResponse* out, absl::Status* end);
  // `wakeup` runs (on the pushing thread, with no coordinator lock held by the watch) after every
  // message or end pushed. Pass nullptr to detach; SetWakeup waits for a running wakeup to return.
  void SetWakeup(std::function<void()> wakeup);
  // The client went away: later pushes are dropped.
  void Cancel();

  // Coordinator side.
  // Queues `message`; false when the watch has ended (the coordinator then forgets it).
  bool Push(v1::WatchJobResponse message);
  void End(const absl::Status& status);
  // Ends the replay: `replay` goes first, then what Push() held back since the watch began.
  void FinishReplay(std::vector<v1::WatchJobResponse> replay);

 private:
  void Wake();
  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<v1::WatchJobResponse> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::WatchJobResponse> held_ ABSL_GUARDED_BY(mu_);  // live messages during replay
  bool replaying_ ABSL_GUARDED_BY(mu_) = true;
  size_t replay_left_ ABSL_GUARDED_BY(mu_) = 0;  // replayed messages still queued (not limited)
  bool ended_ ABSL_GUARDED_BY(mu_) = false;      // no more pushes
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  absl::Mutex wakeup_mu_;
  std::function<void()> wakeup_ ABSL_GUARDED_BY(wakeup_mu_);
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_JOB_WATCH_H_
