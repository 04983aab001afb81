#include "kernels/device.h"

#ifdef TESSERA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace tessera::kernels {

#ifdef TESSERA_HAVE_CUDA
bool BuiltWithCuda() { return true; }

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  return n;
}

std::string CudaUnavailableReason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(err);
  }
  return n == 0 ? "no CUDA device present" : "";
}
#else
bool BuiltWithCuda() { return false; }
int CudaDeviceCount() { return 0; }
std::string CudaUnavailableReason() { return "built without CUDA (TESSERA_CUDA=OFF or no nvcc)"; }
#endif

}  // namespace tessera::kernels
