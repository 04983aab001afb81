// CPU optimizer kernels. Each kind is one loop over [begin, end) that reads g, w and the slots
// once and writes w and the slots once. The loops take `__restrict__` pointers and carry
// `#pragma omp simd`, the kind is dispatched before the loop, and per-call scalars (bias
// corrections, 1/alpha, ...) are computed once outside it, so GCC emits packed loads, FMAs,
// sqrtps and divps and no branch inside the loop (tessera_kernels builds with -fno-math-errno so
// that sqrtf needs no errno check). Large arrays are split across OpenMP threads in contiguous
// chunks; OMP_NUM_THREADS caps the team.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/base/internal/raw_logging.h"
#include "absl/status/status.h"
#include "kernels/optimizer.h"
#include "kernels/optimizer_cuda.h"

namespace tessera::kernels {
namespace {

// Below this many elements an update runs on the calling thread: a 256 KiB gradient takes a few
// microseconds, comparable to waking an OpenMP team.
constexpr int64_t kParallelThreshold = int64_t{1} << 16;
// Work unit of the parallel split (64 KiB of each array); OpenMP's static schedule hands each
// thread one contiguous run of chunks.
constexpr int64_t kChunk = int64_t{1} << 14;

// The gradient as the kernels read it: g[i] from aligned floats, or the i-th fp32 value of a byte
// array at any alignment (a 4-byte memcpy, which GCC turns into an unaligned vector load).
inline float GradAt(const float* __restrict__ g, int64_t i) { return g[i]; }
inline float GradAt(const unsigned char* __restrict__ g, int64_t i) {
  float v;
  std::memcpy(&v, g + 4 * i, sizeof v);
  return v;
}
// The gradient from value k on.
inline const float* GradFrom(const float* g, int64_t k) { return g + k; }
inline const unsigned char* GradFrom(const unsigned char* g, int64_t k) { return g + 4 * k; }

// Calls range(begin, end) over [0, n): once on this thread for small n, otherwise in kChunk
// pieces spread over the OpenMP team.
template <typename Range>
void ForRanges(int64_t n, const Range& range) {
  if (n < kParallelThreshold) {
    range(int64_t{0}, n);
    return;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    range(c * kChunk, std::min(n, (c + 1) * kChunk));
  }
}

// In every kernel g' = scale * g + l2 * w (l2 is weight_decay, or 0 for AdamW).

// SGD: w -= lr * g'.
template <typename T>
void SgdRange(const T* __restrict__ g, float* __restrict__ w, int64_t n, float lr, float scale,
              float l2) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = scale * GradAt(g, i) + l2 * w[i];
    w[i] -= lr * gi;
  }
}

// Heavy-ball momentum as in PyTorch's SGD(momentum=mu, dampening=0) and TF's MomentumOptimizer:
//   v = mu * v + g';  w -= lr * v.
// Nesterov (PyTorch's nesterov=True, TF's use_nesterov=True):
//   v = mu * v + g';  w -= lr * (g' + mu * v).
template <bool kNesterov, typename T>
void MomentumRange(const T* __restrict__ g, float* __restrict__ w, float* __restrict__ v, int64_t n,
                   float lr, float scale, float l2, float mu) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = scale * GradAt(g, i) + l2 * w[i];
    const float vi = mu * v[i] + gi;
    v[i] = vi;
    w[i] -= lr * (kNesterov ? gi + mu * vi : vi);
  }
}

// Adagrad as in PyTorch: acc += g'^2;  w -= lr * g' / (sqrt(acc) + eps).
template <typename T>
void AdagradRange(const T* __restrict__ g, float* __restrict__ w, float* __restrict__ acc,
                  int64_t n, float lr, float scale, float l2, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = scale * GradAt(g, i) + l2 * w[i];
    const float ai = acc[i] + gi * gi;
    acc[i] = ai;
    w[i] -= lr * gi / (std::sqrt(ai) + eps);
  }
}

// Adam and AdamW as in PyTorch, with t the 1-based update count:
//   m = b1 * m + (1 - b1) * g';  v = b2 * v + (1 - b2) * g'^2;
//   w = decay * w - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps),
// where decay = 1 for Adam (whose weight decay is the L2 term in g') and 1 - lr * wd for AdamW.
template <typename T>
void AdamRange(const T* __restrict__ g, float* __restrict__ w, float* __restrict__ m,
               float* __restrict__ v, int64_t n, float scale, float l2, float decay, float b1,
               float b2, float step, float inv_sqrt_bc2, float eps) {
  const float one_minus_b1 = 1.0f - b1;
  const float one_minus_b2 = 1.0f - b2;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[i];
    const float gi = scale * GradAt(g, i) + l2 * wi;
    const float mi = b1 * m[i] + one_minus_b1 * gi;
    const float vi = b2 * v[i] + one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    w[i] = decay * wi - step * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

// FTRL-proximal per coordinate (McMahan et al. 2013, Algorithm 1) with TensorFlow's
// ApplyFtrl conventions: alpha = lr, p = -lr_power (0.5 gives the paper's square roots), l2 is
// the coefficient of l2 * w^2 (hence 2 * l2 below) and beta enters as in Keras' Ftrl
// (l2 + beta / (2 * alpha)). With z the linear slot and n the squared-gradient slot:
//   n' = n + g'^2;  sigma = (n'^p - n^p) / alpha;  z += g' - sigma * w;
//   w = |z| <= l1 ? 0 : (sign(z) * l1 - z) / ((n'^p + beta) / alpha + 2 * l2);  n = n'.
// For p = 0.5 sigma is computed as g'^2 / (alpha * (sqrt(n') + sqrt(n))), which equals the
// difference of square roots without its cancellation; this is the vectorised case. Other
// powers call powf per element (glibc offers no vector powf without -ffast-math).
template <bool kSqrtPower, typename T>
void FtrlRange(const T* __restrict__ g, float* __restrict__ w, float* __restrict__ z,
               float* __restrict__ acc, int64_t n, float scale, float l2_grad, float inv_alpha,
               float power, float beta, float l1, float two_l2) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[i];
    const float gi = scale * GradAt(g, i) + l2_grad * wi;
    const float n_old = acc[i];
    const float g2 = gi * gi;
    const float n_new = n_old + g2;
    float sigma;
    float n_new_pow;
    if constexpr (kSqrtPower) {
      n_new_pow = std::sqrt(n_new);
      // denom is 0 only when g' = 0 and n = 0, and then g2 = 0 and sigma = 0; otherwise it is at
      // least sqrt(g2) >= 3.7e-23 > FLT_MIN. The max keeps the division unconditional.
      const float denom = std::max(n_new_pow + std::sqrt(n_old), FLT_MIN);
      sigma = g2 * inv_alpha / denom;
    } else {
      n_new_pow = std::pow(n_new, power);
      sigma = (n_new_pow - std::pow(n_old, power)) * inv_alpha;
    }
    const float zi = z[i] + gi - sigma * wi;
    z[i] = zi;
    acc[i] = n_new;
    const float quadratic = (n_new_pow + beta) * inv_alpha + two_l2;
    // (sign(z) * l1 - z) / quadratic when |z| > l1, else 0, written as a soft threshold so that
    // the loop has no control flow. quadratic is 0 only for an untouched coordinate with
    // beta = l2 = 0, where shrunk is 0 too; 0 - x turns -0 into +0.
    const float shrunk = std::copysign(std::max(std::fabs(zi) - l1, 0.0f), zi);
    w[i] = 0.0f - shrunk / std::max(quadratic, FLT_MIN);
  }
}

}  // namespace

OptimizerParams MakeOptimizerParams(const v1::OptimizerConfig& config) {
  OptimizerParams p;
  p.kind = config.kind();
  p.learning_rate = config.learning_rate();
  p.momentum = config.momentum();
  // Proto3 cannot tell an unset float from 0, so 0 selects the default for the fields below
  // (optimizer.proto documents this).
  if (config.beta1() != 0.0f) p.beta1 = config.beta1();
  if (config.beta2() != 0.0f) p.beta2 = config.beta2();
  if (config.epsilon() != 0.0f) p.epsilon = config.epsilon();
  p.weight_decay = config.weight_decay();
  if (config.initial_accumulator() != 0.0f) p.initial_accumulator = config.initial_accumulator();
  if (config.ftrl_beta() != 0.0f) p.ftrl_beta = config.ftrl_beta();
  p.ftrl_l1 = config.ftrl_l1();
  p.ftrl_l2 = config.ftrl_l2();
  if (config.ftrl_lr_power() != 0.0f) p.ftrl_lr_power = config.ftrl_lr_power();
  return p;
}

int NumSlots(v1::OptimizerKind kind) {
  switch (kind) {
    case v1::OPTIMIZER_KIND_MOMENTUM:
    case v1::OPTIMIZER_KIND_NESTEROV:
    case v1::OPTIMIZER_KIND_ADAGRAD:
      return 1;
    case v1::OPTIMIZER_KIND_ADAM:
    case v1::OPTIMIZER_KIND_ADAMW:
    case v1::OPTIMIZER_KIND_FTRL:
      return 2;
    default:
      return 0;
  }
}

float SlotInitialValue(const OptimizerParams& params, int slot) {
  if (params.kind == v1::OPTIMIZER_KIND_ADAGRAD && slot == 0) return params.initial_accumulator;
  return 0.0f;
}

namespace {

// ApplyUpdateCpu over gradient elements of type T (float, or the bytes of floats: GradAt).
template <typename T>
void ApplyUpdate(const OptimizerParams& params, float lr, int64_t t, float grad_scale, const T* g,
                 float* w, float* const* slots, int64_t n) {
  if (n <= 0) return;
  const float scale = grad_scale;
  const float wd = params.weight_decay;
  switch (params.kind) {
    case v1::OPTIMIZER_KIND_SGD:
      ForRanges(
          n, [&](int64_t b, int64_t e) { SgdRange(GradFrom(g, b), w + b, e - b, lr, scale, wd); });
      return;
    case v1::OPTIMIZER_KIND_MOMENTUM: {
      float* v = slots[0];
      const float mu = params.momentum;
      ForRanges(n, [&](int64_t b, int64_t e) {
        MomentumRange<false>(GradFrom(g, b), w + b, v + b, e - b, lr, scale, wd, mu);
      });
      return;
    }
    case v1::OPTIMIZER_KIND_NESTEROV: {
      float* v = slots[0];
      const float mu = params.momentum;
      ForRanges(n, [&](int64_t b, int64_t e) {
        MomentumRange<true>(GradFrom(g, b), w + b, v + b, e - b, lr, scale, wd, mu);
      });
      return;
    }
    case v1::OPTIMIZER_KIND_ADAGRAD: {
      float* acc = slots[0];
      const float eps = params.epsilon;
      ForRanges(n, [&](int64_t b, int64_t e) {
        AdagradRange(GradFrom(g, b), w + b, acc + b, e - b, lr, scale, wd, eps);
      });
      return;
    }
    case v1::OPTIMIZER_KIND_ADAM:
    case v1::OPTIMIZER_KIND_ADAMW: {
      ABSL_RAW_CHECK(t >= 1, "ApplyUpdateCpu: Adam's update count t must be >= 1");
      const bool decoupled = params.kind == v1::OPTIMIZER_KIND_ADAMW;
      const float l2 = decoupled ? 0.0f : wd;
      const float decay = decoupled ? static_cast<float>(1.0 - double{lr} * wd) : 1.0f;
      const double td = static_cast<double>(t);
      const double bc1 = 1.0 - std::pow(static_cast<double>(params.beta1), td);
      const double bc2 = 1.0 - std::pow(static_cast<double>(params.beta2), td);
      const float step = static_cast<float>(lr / bc1);
      const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
      float* m = slots[0];
      float* v = slots[1];
      const float b1 = params.beta1;
      const float b2 = params.beta2;
      const float eps = params.epsilon;
      ForRanges(n, [&](int64_t b, int64_t e) {
        AdamRange(GradFrom(g, b), w + b, m + b, v + b, e - b, scale, l2, decay, b1, b2, step,
                  inv_sqrt_bc2, eps);
      });
      return;
    }
    case v1::OPTIMIZER_KIND_FTRL: {
      float* z = slots[0];
      float* acc = slots[1];
      const float inv_alpha = 1.0f / lr;
      const float power = -params.ftrl_lr_power;
      const float beta = params.ftrl_beta;
      const float l1 = params.ftrl_l1;
      const float two_l2 = 2.0f * params.ftrl_l2;
      if (params.ftrl_lr_power == -0.5f) {
        ForRanges(n, [&](int64_t b, int64_t e) {
          FtrlRange<true>(GradFrom(g, b), w + b, z + b, acc + b, e - b, scale, wd, inv_alpha, power,
                          beta, l1, two_l2);
        });
      } else {
        ForRanges(n, [&](int64_t b, int64_t e) {
          FtrlRange<false>(GradFrom(g, b), w + b, z + b, acc + b, e - b, scale, wd, inv_alpha,
                           power, beta, l1, two_l2);
        });
      }
      return;
    }
    default:
      ABSL_RAW_LOG(FATAL, "ApplyUpdateCpu: optimizer kind %d not from MakeOptimizerParams",
                   static_cast<int>(params.kind));
  }
}

}  // namespace

void ApplyUpdateCpu(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                    const float* g, float* w, float* const* slots, int64_t n) {
  ApplyUpdate(params, lr, t, grad_scale, g, w, slots, n);
}

void ApplyUpdateCpuUnaligned(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                             const void* g_bytes, float* w, float* const* slots, int64_t n) {
  ApplyUpdate(params, lr, t, grad_scale, static_cast<const unsigned char*>(g_bytes), w, slots, n);
}

#ifndef TESSERA_HAVE_CUDA
// A build without CUDA still links callers of ApplyUpdateCuda; they check BuiltWithCuda() or
// CudaDeviceCount() first, and this is the answer when they do not.
absl::Status ApplyUpdateCuda(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                             const float* d_g, float* d_w, float* const* d_slots, int64_t n,
                             void* stream) {
  return absl::FailedPreconditionError(
      "ApplyUpdateCuda: this binary was built without CUDA (TESSERA_CUDA=OFF or no nvcc)");
}
#endif  // TESSERA_HAVE_CUDA

}  // namespace tessera::kernels
