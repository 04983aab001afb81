// Which compute devices this process can use. The device is chosen at run time (DESIGN.md §5).
#ifndef TESSERA_KERNELS_DEVICE_H_
#define TESSERA_KERNELS_DEVICE_H_

#include <string>

namespace tessera::kernels {

// True when this binary was built with the CUDA kernels.
bool BuiltWithCuda();

// Number of CUDA devices usable now: 0 in a CPU-only build, without a driver, or without a GPU.
// Never fails; the reason for 0 is in CudaUnavailableReason().
int CudaDeviceCount();

// Why CudaDeviceCount() is 0 (empty when it is not), for logs and test skip messages.
std::string CudaUnavailableReason();

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_DEVICE_H_
