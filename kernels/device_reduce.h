// Sums tensors across the devices of one host (DESIGN.md §5: "NCCL on GPUs"), for the data-
// parallel replicas of one worker (worker/trainer/internal/local_replicas.h): once every
// replica's backward pass is complete, one thread hands all replicas' gradients to SumToFirst,
// and replica 0's hold the sum, which its backend copies to the host for the one push.
//
// The CUDA implementation (kernels/cuda/nccl_reduce_cuda.cc) holds one NCCL communicator per
// device (ncclCommInitAll over the worker's GPUs, one process) and one stream of its own per
// device, and issues every rank's reduce from the calling thread in one NCCL group. So no rank
// can be left waiting for another that failed before its reduce, and a process-wide lock keeps
// two instances over the same GPUs (two tasks, two test ranks) from running at once, which NCCL
// does not allow ("Using multiple NCCL communicators concurrently"). The CPU replicas sum on the
// host instead (local_replicas.cc) and use none of this.
#ifndef TESSERA_KERNELS_DEVICE_REDUCE_H_
#define TESSERA_KERNELS_DEVICE_REDUCE_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace tessera::kernels {

class DeviceReduce {
 public:
  virtual ~DeviceReduce() = default;

  // The number of devices (ranks); rank r is the r-th device Create was given.
  virtual int size() const = 0;

  // tensors[r]: rank r's tensors, on its device, complete (its backend synchronised): the same
  // count, element counts and order on every rank, float32. Sums every rank's tensors into rank
  // 0's (ncclReduce, root 0, in place, all in one NCCL group) and returns once the sums are
  // complete on rank 0's device. The other ranks' tensors are left as they were.
  // INVALID_ARGUMENT when the ranks' tensors do not match; NCCL's errors as INTERNAL.
  virtual absl::Status SumToFirst(absl::Span<const std::vector<Tensor>> tensors) = 0;
};

// NCCL over the CUDA devices `cuda_devices` (ordinals, distinct; one device is a valid
// communicator too). FAILED_PRECONDITION when the binary was built without CUDA, or a device is
// not usable; INVALID_ARGUMENT for an empty or repeated list; NCCL's own errors as INTERNAL with
// ncclGetErrorString.
absl::StatusOr<std::unique_ptr<DeviceReduce>> CreateNcclReduce(
    const std::vector<int>& cuda_devices);

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_DEVICE_REDUCE_H_
