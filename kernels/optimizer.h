// Server-side optimizers (DESIGN.md §2): one fused pass over memory per update.
//
// Dense tensors: SGD, momentum, Nesterov, Adagrad, Adam, AdamW. Sparse rows: SGD, Adagrad, Adam,
// FTRL (a row is updated as a dense vector of `dim` values with its own update count).
// The CPU versions always build; CUDA versions (optimizer_cuda.h) build where nvcc exists.
#ifndef TESSERA_KERNELS_OPTIMIZER_H_
#define TESSERA_KERNELS_OPTIMIZER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "tessera/v1/optimizer.pb.h"

namespace tessera::kernels {

// The hyper-parameters of one update, defaults filled in.
struct OptimizerParams {
  v1::OptimizerKind kind = v1::OPTIMIZER_KIND_SGD;
  float learning_rate = 0.01f;
  float momentum = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.0f;
  float initial_accumulator = 0.1f;
  float ftrl_beta = 1.0f;
  float ftrl_l1 = 0.0f;
  float ftrl_l2 = 0.0f;
  float ftrl_lr_power = -0.5f;
};

// The hyper-parameters of `config`: 0 (unset in proto3) selects the default above for beta1,
// beta2, epsilon, initial_accumulator, ftrl_beta and ftrl_lr_power; the other fields are taken as
// they are. Pure. REQUIRES: spec::ValidateOptimizer(config, sparse).ok() for the tensors it will
// update (spec/optimizer_spec.h holds the rules: allowed kinds, every field's range).
OptimizerParams MakeOptimizerParams(const v1::OptimizerConfig& config);

// Number of per-element slot arrays the kind keeps: SGD 0, momentum/Nesterov 1 (velocity),
// Adagrad 1 (accumulator), Adam/AdamW 2 (m, v), FTRL 2 (z, n).
int NumSlots(v1::OptimizerKind kind);

// The value slot `slot` starts at (Adagrad's accumulator starts at initial_accumulator; all
// others at 0).
float SlotInitialValue(const OptimizerParams& params, int slot);

// Applies one update in place, in one pass: g' = grad_scale * g, then the optimizer's rule on w
// and slots[0..NumSlots). `lr` is the scheduled learning rate for this update, `t` the 1-based
// update count (Adam's bias correction). weight_decay is L2 added to g' for every kind except
// AdamW, where it is decoupled (w -= lr * wd * w).
// Blocks until done. From n >= 65536 (256 KiB) the pass is split over an OpenMP team of up to
// omp_get_max_threads() threads (OMP_NUM_THREADS caps it); smaller updates run on the caller's
// thread. Calls on disjoint arrays may run concurrently.
// REQUIRES: g, w and each slots[i] hold n floats and do not overlap; params came from
// MakeOptimizerParams; t >= 1 for Adam and AdamW.
void ApplyUpdateCpu(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                    const float* g, float* w, float* const* slots, int64_t n);

// ApplyUpdateCpu with the gradient given as the bytes of n fp32 values in host order (the wire's
// little-endian ENCODING_FP32 on the machines Tessera runs on) at any alignment, such as a
// gradient still lying in a transport's receive buffer: no copy to an aligned buffer is needed.
// The same weights and slots, bit for bit. REQUIRES: as for ApplyUpdateCpu, g_bytes holding 4 * n
// bytes.
void ApplyUpdateCpuUnaligned(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                             const void* g_bytes, float* w, float* const* slots, int64_t n);

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_OPTIMIZER_H_
