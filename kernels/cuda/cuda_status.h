// CUDA, cuBLAS and cuDNN errors as absl::Status (STYLE.md: CUDA errors become absl::Status at the
// kernels/ boundary). Each macro returns from the enclosing function, which must return
// absl::Status or absl::StatusOr<T>, with the failing call and the library's error string.
#ifndef TESSERA_KERNELS_CUDA_CUDA_STATUS_H_
#define TESSERA_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "absl/status/status.h"

namespace tessera::kernels::cuda {

// OK for cudaSuccess; otherwise INTERNAL ("<call>: <error name>: <error string>"), except
// cudaErrorMemoryAllocation, which is RESOURCE_EXHAUSTED. Clears the runtime's last error.
absl::Status CudaStatus(cudaError_t err, const char* call);
// OK for CUBLAS_STATUS_SUCCESS; otherwise INTERNAL (RESOURCE_EXHAUSTED for allocation failures).
absl::Status CublasStatus(cublasStatus_t st, const char* call);
// OK for CUDNN_STATUS_SUCCESS; otherwise INTERNAL (RESOURCE_EXHAUSTED for allocation failures).
absl::Status CudnnStatus(cudnnStatus_t st, const char* call);

}  // namespace tessera::kernels::cuda

#define TESSERA_CUDA_RETURN_IF_ERROR(call)                       \
  do {                                                           \
    const ::absl::Status tessera_cuda_status_ =                  \
        ::tessera::kernels::cuda::CudaStatus((call), #call);     \
    if (!tessera_cuda_status_.ok()) return tessera_cuda_status_; \
  } while (0)

#define TESSERA_CUBLAS_RETURN_IF_ERROR(call)                     \
  do {                                                           \
    const ::absl::Status tessera_cuda_status_ =                  \
        ::tessera::kernels::cuda::CublasStatus((call), #call);   \
    if (!tessera_cuda_status_.ok()) return tessera_cuda_status_; \
  } while (0)

#define TESSERA_CUDNN_RETURN_IF_ERROR(call)                      \
  do {                                                           \
    const ::absl::Status tessera_cuda_status_ =                  \
        ::tessera::kernels::cuda::CudnnStatus((call), #call);    \
    if (!tessera_cuda_status_.ok()) return tessera_cuda_status_; \
  } while (0)

#endif  // TESSERA_KERNELS_CUDA_CUDA_STATUS_H_
