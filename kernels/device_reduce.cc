// CreateNcclReduce where the binary is built without NCCL (kernels/device_reduce.h: no CUDA
// toolkit, or one without NCCL); a build with both defines it in kernels/cuda/nccl_reduce_cuda.cc.
#include "kernels/device_reduce.h"

#include "absl/status/status.h"

namespace tessera::kernels {

absl::StatusOr<std::unique_ptr<DeviceReduce>> CreateNcclReduce(const std::vector<int>&) {
  return absl::FailedPreconditionError(
      "devices: this binary was built without NCCL, so a worker drives at most one GPU (rebuild "
      "where the CUDA toolkit has NCCL, run one worker per GPU, or use cpu:N)");
}

}  // namespace tessera::kernels
