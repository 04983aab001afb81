// One thread per local device of a worker (a CPU replica, a pipeline stage): each device's
// backend is made and driven on its own thread, because OpenMP's thread count and the denormal
// flush are per calling thread. LocalReplicas and PipelineStages run their steps on these.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_DEVICE_THREADS_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_DEVICE_THREADS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace tessera::trainer::internal {

class DeviceThreads {
 public:
  // Starts `n` (>= 1) threads; thread i runs init(i) first and returns its error, prefixed
  // `what` and i ("cpu replica 1: ..."), the first one's when several fail. The threads stop
  // when the object goes.
  static absl::StatusOr<std::unique_ptr<DeviceThreads>> Start(
      int n, const std::string& what, const std::function<absl::Status(int)>& init);
  ~DeviceThreads();
  DeviceThreads(const DeviceThreads&) = delete;
  DeviceThreads& operator=(const DeviceThreads&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }

  // Runs task(i) on every thread i at once and waits for all; the first error wins. One caller
  // at a time.
  absl::Status RunOnAll(const std::function<absl::Status(int)>& task);

 private:
  DeviceThreads() = default;
  void Serve(int i, const std::string& what, const std::function<absl::Status(int)>& init);

  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  const std::function<absl::Status(int)>* task_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped per task
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_DEVICE_THREADS_H_
