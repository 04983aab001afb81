// Sums tensors across the devices of one host (DESIGN.md §5: "NCCL on GPUs"), for the data-
// parallel replicas of one worker (worker/trainer/internal/local_replicas.h): after every
// replica's backward pass, each replica's thread hands its gradients to SumToFirst at once, and
// replica 0's hold the sum, which its backend copies to the host for the one push.
//
// The CUDA implementation (kernels/cuda/nccl_reduce_cuda.cc) holds one NCCL communicator per
// device (ncclCommInitAll over the worker's GPUs, one process) and one stream of its own per
// device; the CPU replicas sum on the host instead (local_replicas.cc) and use none of this.
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

  // Called from every rank's own thread at once, each with its rank's backend (a CUDA backend on
  // that rank's device) and its tensors: the same count, element counts and order on every rank,
  // float32. Waits for the backend's queued work (the gradients are complete), then sums every
  // rank's tensors into rank 0's (ncclReduce, root 0, all tensors in one NCCL group) and returns
  // once the sums are complete on rank 0's device. The other ranks' tensors are left as they
  // were. A rank that does not call it leaves the others waiting: callers run it only once every
  // rank's step succeeded.
  virtual absl::Status SumToFirst(int rank, Backend* backend, absl::Span<const Tensor> tensors) = 0;
};

// NCCL over the CUDA devices `cuda_devices` (ordinals, distinct; one device is a valid
// communicator too). FAILED_PRECONDITION when the binary was built without CUDA, or a device is
// not usable; INVALID_ARGUMENT for an empty or repeated list; NCCL's own errors as INTERNAL with
// ncclGetErrorString.
absl::StatusOr<std::unique_ptr<DeviceReduce>> CreateNcclReduce(
    const std::vector<int>& cuda_devices);

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_DEVICE_REDUCE_H_
