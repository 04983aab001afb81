// An all-reduce over the threads of a worker's CPU devices (engine::CrossDeviceSum, for SyncBN):
// each device adds its values to a shared total under a mutex, waits until every device of the
// step has, and reads the sum back. Rounds follow one another: a device that comes to round k + 1
// waits until every device has read round k.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_HOST_ALL_REDUCE_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_HOST_ALL_REDUCE_H_

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "worker/engine/cross_device_sum.h"

namespace tessera::trainer::internal {

class HostAllReduce final : public engine::CrossDeviceSum {
 public:
  // Before each step: `devices` (>= 1) take part in every Sum of the step. Clears an Abort.
  void Begin(int devices);
  // A device of the step failed: every Sum waiting, and every one to come until the next Begin,
  // returns `why` (so no device waits for one that will never come).
  void Abort(const absl::Status& why);
  // INTERNAL when the devices of a round disagree on the number of values.
  absl::Status Sum(absl::Span<double> values) override;

 private:
  absl::Mutex mu_;
  int devices_ ABSL_GUARDED_BY(mu_) = 1;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int departed_ ABSL_GUARDED_BY(mu_) = 0;
  bool full_ ABSL_GUARDED_BY(mu_) = false;  // every device of the round has added its values
  std::vector<double> total_ ABSL_GUARDED_BY(mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_HOST_ALL_REDUCE_H_
