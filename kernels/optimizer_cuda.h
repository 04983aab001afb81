// CUDA versions of the server-side optimizers in optimizer.h. Include without CUDA headers.
#ifndef TESSERA_KERNELS_OPTIMIZER_CUDA_H_
#define TESSERA_KERNELS_OPTIMIZER_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/optimizer.h"

namespace tessera::kernels {

// The update of ApplyUpdateCpu on device memory, with the same formulas, enqueued on `stream`
// (a cudaStream_t; nullptr is the default stream). Asynchronous: it returns once the kernel is
// queued; synchronise the stream before reading w or the slots on the host. `d_slots` is a host
// array of NumSlots(params.kind) device pointers.
// Errors: INVALID_ARGUMENT for n < 0, null pointers, t < 1 with Adam/AdamW or a kind that did not
// come from MakeOptimizerParams; INTERNAL with the CUDA error for a failed launch;
// FAILED_PRECONDITION in a build without CUDA (BuiltWithCuda() is false).
// REQUIRES: d_g, d_w and each d_slots[i] hold n floats on the current device and do not overlap.
absl::Status ApplyUpdateCuda(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                             const float* d_g, float* d_w, float* const* d_slots, int64_t n,
                             void* stream);

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_OPTIMIZER_CUDA_H_
