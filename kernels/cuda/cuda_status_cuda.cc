#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace tessera::kernels::cuda {

absl::Status CudaStatus(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so that later calls start clean
  const std::string msg =
      absl::StrCat(call, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status CublasStatus(cublasStatus_t st, const char* call) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(call, ": ", cublasGetStatusName(st), ": ", cublasGetStatusString(st));
  if (st == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status CudnnStatus(cudnnStatus_t st, const char* call) {
  if (st == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  char last[256] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  std::string msg = absl::StrCat(call, ": ", cudnnGetErrorString(st));
  if (last[0] != '\0') absl::StrAppend(&msg, " (", last, ")");
  if (st == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      st == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) {
    return absl::ResourceExhaustedError(msg);
  }
  return absl::InternalError(msg);
}

}  // namespace tessera::kernels::cuda
