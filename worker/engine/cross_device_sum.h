// Sums across the devices of one worker that train a batch together (SyncBN, DESIGN.md §5):
// the engine's view of a collective that the trainer provides (trainer/internal/host_all_reduce.h
// on CPU replicas).
#ifndef TESSERA_WORKER_ENGINE_CROSS_DEVICE_SUM_H_
#define TESSERA_WORKER_ENGINE_CROSS_DEVICE_SUM_H_

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace tessera::engine {

class CrossDeviceSum {
 public:
  virtual ~CrossDeviceSum() = default;
  // Called once by each device of the group, with as many values each and in the same order of
  // calls: replaces `values` with their sum over the devices. An error (a device failed, the step
  // was abandoned) leaves `values` unspecified.
  virtual absl::Status Sum(absl::Span<double> values) = 0;
};

}  // namespace tessera::engine

#endif  // TESSERA_WORKER_ENGINE_CROSS_DEVICE_SUM_H_
