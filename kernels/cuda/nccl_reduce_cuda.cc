// NCCL over the GPUs of one worker (kernels/device_reduce.h).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/device.h"
#include "kernels/device_reduce.h"

namespace tessera::kernels {
namespace {

absl::Status NcclStatus(ncclResult_t r, const char* call) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": ", ncclGetErrorString(r)));
}

#define TESSERA_NCCL_RETURN_IF_ERROR(call)                                 \
  do {                                                                     \
    const ::absl::Status tessera_nccl_status_ = NcclStatus((call), #call); \
    if (!tessera_nccl_status_.ok()) return tessera_nccl_status_;           \
  } while (0)

// Every NcclReduce's group, one at a time in the process (see device_reduce.h). Never destroyed.
absl::Mutex* ProcessLock() {
  static absl::Mutex* const mu = new absl::Mutex();
  return mu;
}

// Restores the calling thread's current CUDA device on scope exit.
class DeviceRestorer {
 public:
  DeviceRestorer() { ok_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~DeviceRestorer() {
    if (ok_) cudaSetDevice(device_);
  }
  DeviceRestorer(const DeviceRestorer&) = delete;
  DeviceRestorer& operator=(const DeviceRestorer&) = delete;

 private:
  int device_ = 0;
  bool ok_ = false;
};

class NcclReduce final : public DeviceReduce {
 public:
  explicit NcclReduce(std::vector<int> devices) : devices_(std::move(devices)) {}
  ~NcclReduce() override {
    const DeviceRestorer restore;
    for (size_t r = 0; r < comms_.size(); ++r) {
      if (comms_[r] != nullptr) ncclCommDestroy(comms_[r]);
    }
    for (size_t r = 0; r < streams_.size(); ++r) {
      if (streams_[r] == nullptr) continue;
      cudaSetDevice(devices_[r]);
      cudaStreamDestroy(streams_[r]);
    }
  }
  NcclReduce(const NcclReduce&) = delete;
  NcclReduce& operator=(const NcclReduce&) = delete;

  absl::Status Init() {
    const DeviceRestorer restore;
    const int n = static_cast<int>(devices_.size());
    streams_.assign(devices_.size(), nullptr);
    for (int r = 0; r < n; ++r) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[r]));
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
    }
    comms_.assign(devices_.size(), nullptr);
    TESSERA_NCCL_RETURN_IF_ERROR(ncclCommInitAll(comms_.data(), n, devices_.data()));
    return absl::OkStatus();
  }

  int size() const override { return static_cast<int>(devices_.size()); }

  absl::Status SumToFirst(absl::Span<const std::vector<Tensor>> tensors) override {
    if (static_cast<int>(tensors.size()) != size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SumToFirst: ", tensors.size(), " ranks' tensors for ", size(), " ranks"));
    }
    for (int r = 0; r < size(); ++r) {
      if (tensors[r].size() != tensors[0].size()) {
        return absl::InvalidArgumentError(absl::StrCat("SumToFirst: rank ", r, " has ",
                                                       tensors[r].size(), " tensors, rank 0 ",
                                                       tensors[0].size()));
      }
      for (size_t k = 0; k < tensors[r].size(); ++k) {
        const Tensor& t = tensors[r][k];
        if (t.dtype() != DType::kFloat32 || t.num_elements() != tensors[0][k].num_elements()) {
          return absl::InvalidArgumentError(
              absl::StrCat("SumToFirst: rank ", r, "'s tensor ", k, " is not float32 of ",
                           tensors[0][k].num_elements(), " elements like rank 0's"));
        }
      }
    }
    absl::MutexLock lock(ProcessLock());
    const DeviceRestorer restore;
    TESSERA_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    absl::Status issued;
    for (int r = 0; r < size() && issued.ok(); ++r) {
      issued = cuda::CudaStatus(cudaSetDevice(devices_[r]), "cudaSetDevice");
      for (size_t k = 0; k < tensors[r].size() && issued.ok(); ++k) {
        const Tensor& t = tensors[r][k];
        if (t.num_elements() == 0) continue;
        issued = NcclStatus(
            ncclReduce(t.raw(), r == 0 ? t.raw() : nullptr, static_cast<size_t>(t.num_elements()),
                       ncclFloat32, ncclSum, /*root=*/0, comms_[r], streams_[r]),
            "ncclReduce");
      }
    }
    // The group is closed even after an error: an open group would hold the next call.
    const absl::Status closed = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    TESSERA_RETURN_IF_ERROR(issued);
    TESSERA_RETURN_IF_ERROR(closed);
    for (int r = 0; r < size(); ++r) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[r]));
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(streams_[r]));
    }
    return absl::OkStatus();
  }

 private:
  const std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;  // per rank, on its device
  std::vector<ncclComm_t> comms_;      // per rank
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceReduce>> CreateNcclReduce(
    const std::vector<int>& cuda_devices) {
  if (cuda_devices.empty()) {
    return absl::InvalidArgumentError("devices: NCCL needs at least one CUDA device");
  }
  const int count = CudaDeviceCount();
  for (size_t i = 0; i < cuda_devices.size(); ++i) {
    const int d = cuda_devices[i];
    if (d < 0 || d >= count) {
      return absl::FailedPreconditionError(absl::StrCat(
          "devices: cuda:", d, " is not usable: ", count, " CUDA devices are visible",
          count == 0 ? absl::StrCat(" (", CudaUnavailableReason(), ")") : std::string()));
    }
    if (std::find(cuda_devices.begin(), cuda_devices.begin() + i, d) != cuda_devices.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("devices: cuda:", d, " is named twice"));
    }
  }
  auto reduce = std::make_unique<NcclReduce>(cuda_devices);
  TESSERA_RETURN_IF_ERROR(reduce->Init());
  return std::unique_ptr<DeviceReduce>(std::move(reduce));
}

}  // namespace tessera::kernels
