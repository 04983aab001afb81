// CUDA optimizer kernels: one grid-stride kernel per kind, each with the formulas of
// optimizer_cpu.cc (see the comments there), so that a GPU shard and a CPU shard agree to within
// rounding. Per-call scalars are computed on the host exactly as the CPU path computes them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/optimizer_cuda.h"

namespace tessera::kernels {
namespace {

enum class Rule { kSgd, kMomentum, kNesterov, kAdagrad, kAdam, kFtrlSqrt, kFtrlPow };

struct UpdateArgs {
  const float* __restrict__ g;
  float* __restrict__ w;
  float* __restrict__ s0;
  float* __restrict__ s1;
  int64_t n;
  float lr;
  float scale;
  float l2;  // weight_decay added to the gradient (0 for AdamW)
  float mu;
  float eps;
  // Adam/AdamW.
  float decay;
  float b1;
  float b2;
  float step;
  float inv_sqrt_bc2;
  // FTRL.
  float inv_alpha;
  float power;
  float beta;
  float l1;
  float two_l2;
};

template <Rule kRule>
__global__ void UpdateKernel(UpdateArgs a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n;
       i += stride) {
    const float wi = a.w[i];
    const float gi = a.scale * a.g[i] + a.l2 * wi;
    if constexpr (kRule == Rule::kSgd) {
      a.w[i] = wi - a.lr * gi;
    } else if constexpr (kRule == Rule::kMomentum || kRule == Rule::kNesterov) {
      const float vi = a.mu * a.s0[i] + gi;
      a.s0[i] = vi;
      a.w[i] = wi - a.lr * (kRule == Rule::kNesterov ? gi + a.mu * vi : vi);
    } else if constexpr (kRule == Rule::kAdagrad) {
      const float acc = a.s0[i] + gi * gi;
      a.s0[i] = acc;
      a.w[i] = wi - a.lr * gi / (sqrtf(acc) + a.eps);
    } else if constexpr (kRule == Rule::kAdam) {
      const float mi = a.b1 * a.s0[i] + (1.0f - a.b1) * gi;
      const float vi = a.b2 * a.s1[i] + (1.0f - a.b2) * gi * gi;
      a.s0[i] = mi;
      a.s1[i] = vi;
      a.w[i] = a.decay * wi - a.step * mi / (sqrtf(vi) * a.inv_sqrt_bc2 + a.eps);
    } else {
      const float n_old = a.s1[i];
      const float g2 = gi * gi;
      const float n_new = n_old + g2;
      float sigma;
      float n_new_pow;
      if constexpr (kRule == Rule::kFtrlSqrt) {
        n_new_pow = sqrtf(n_new);
        const float denom = fmaxf(n_new_pow + sqrtf(n_old), FLT_MIN);
        sigma = g2 * a.inv_alpha / denom;
      } else {
        n_new_pow = powf(n_new, a.power);
        sigma = (n_new_pow - powf(n_old, a.power)) * a.inv_alpha;
      }
      const float zi = a.s0[i] + gi - sigma * wi;
      a.s0[i] = zi;
      a.s1[i] = n_new;
      const float quadratic = (n_new_pow + a.beta) * a.inv_alpha + a.two_l2;
      const float shrunk = copysignf(fmaxf(fabsf(zi) - a.l1, 0.0f), zi);
      a.w[i] = 0.0f - shrunk / fmaxf(quadratic, FLT_MIN);
    }
  }
}

constexpr int kThreadsPerBlock = 256;
// Enough blocks to fill an H100/H200 many times over; the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

template <Rule kRule>
absl::Status Launch(const UpdateArgs& args, cudaStream_t stream) {
  const int64_t blocks = std::min(kMaxBlocks, (args.n + kThreadsPerBlock - 1) / kThreadsPerBlock);
  UpdateKernel<kRule><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(args);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat(
        "ApplyUpdateCuda: kernel launch: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyUpdateCuda(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                             const float* d_g, float* d_w, float* const* d_slots, int64_t n,
                             void* stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("ApplyUpdateCuda: n = ", n, " < 0"));
  const int slots = NumSlots(params.kind);
  if (params.kind == v1::OPTIMIZER_KIND_UNSPECIFIED ||
      (slots == 0 && params.kind != v1::OPTIMIZER_KIND_SGD)) {
    return absl::InvalidArgumentError(absl::StrCat("ApplyUpdateCuda: optimizer kind ",
                                                   static_cast<int>(params.kind),
                                                   " did not come from MakeOptimizerParams"));
  }
  if (n == 0) return absl::OkStatus();
  if (d_g == nullptr || d_w == nullptr || (slots > 0 && d_slots == nullptr)) {
    return absl::InvalidArgumentError("ApplyUpdateCuda: null gradient, weight or slot array");
  }
  for (int i = 0; i < slots; ++i) {
    if (d_slots[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("ApplyUpdateCuda: slot ", i, " is null"));
    }
  }

  UpdateArgs a{};
  a.g = d_g;
  a.w = d_w;
  a.s0 = slots > 0 ? d_slots[0] : nullptr;
  a.s1 = slots > 1 ? d_slots[1] : nullptr;
  a.n = n;
  a.lr = lr;
  a.scale = grad_scale;
  a.l2 = params.weight_decay;
  a.mu = params.momentum;
  a.eps = params.epsilon;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (params.kind) {
    case v1::OPTIMIZER_KIND_SGD:
      return Launch<Rule::kSgd>(a, s);
    case v1::OPTIMIZER_KIND_MOMENTUM:
      return Launch<Rule::kMomentum>(a, s);
    case v1::OPTIMIZER_KIND_NESTEROV:
      return Launch<Rule::kNesterov>(a, s);
    case v1::OPTIMIZER_KIND_ADAGRAD:
      return Launch<Rule::kAdagrad>(a, s);
    case v1::OPTIMIZER_KIND_ADAM:
    case v1::OPTIMIZER_KIND_ADAMW: {
      if (t < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("ApplyUpdateCuda: Adam's update count t must be >= 1, got ", t));
      }
      const bool decoupled = params.kind == v1::OPTIMIZER_KIND_ADAMW;
      if (decoupled) a.l2 = 0.0f;
      a.decay = decoupled ? static_cast<float>(1.0 - static_cast<double>(lr) * params.weight_decay)
                          : 1.0f;
      a.b1 = params.beta1;
      a.b2 = params.beta2;
      const double td = static_cast<double>(t);
      const double bc1 = 1.0 - std::pow(static_cast<double>(params.beta1), td);
      const double bc2 = 1.0 - std::pow(static_cast<double>(params.beta2), td);
      a.step = static_cast<float>(lr / bc1);
      a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
      return Launch<Rule::kAdam>(a, s);
    }
    case v1::OPTIMIZER_KIND_FTRL:
      a.inv_alpha = 1.0f / lr;
      a.power = -params.ftrl_lr_power;
      a.beta = params.ftrl_beta;
      a.l1 = params.ftrl_l1;
      a.two_l2 = 2.0f * params.ftrl_l2;
      return params.ftrl_lr_power == -0.5f ? Launch<Rule::kFtrlSqrt>(a, s)
                                           : Launch<Rule::kFtrlPow>(a, s);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("ApplyUpdateCuda: unknown optimizer kind ", static_cast<int>(params.kind)));
  }
}

}  // namespace tessera::kernels
