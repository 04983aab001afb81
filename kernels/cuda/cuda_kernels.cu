// The CUDA backend's own kernels. Element-wise kernels are grid-stride loops; reductions use a
// fixed grid and a fixed order, so that a result does not depend on scheduling (the embedding
// scatter-add, which uses atomicAdd, is the one exception).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace tessera::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxBlocks = 4096;

int BlocksFor(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

__device__ __forceinline__ int64_t GlobalIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// The device twin of kernels::DropoutUniform (backend.h); both must give the same bits.
__device__ __forceinline__ float DropoutUniformDevice(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

// Sum over the block in shared memory, in a fixed order. Every thread of the block must call it;
// the result is valid in thread 0.
template <typename T>
__device__ T BlockSum(T v) {
  __shared__ T shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  return shared[0];
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The first index of the largest value over the warp: each lane holds (value, index) of its
// first maximum; ties go to the smaller index, as the CPU's left-to-right scan does.
__device__ __forceinline__ int64_t WarpArgMax(float v, int64_t idx) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) {
      v = ov;
      idx = oi;
    }
  }
  return idx;
}

__global__ void FillKernel(float* x, int64_t n, float value) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) x[i] = value;
}

__global__ void AxpyKernel(float alpha, const float* __restrict__ x, float* __restrict__ y,
                           int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) y[i] += alpha * x[i];
}

__global__ void ScaleKernel(float alpha, float* x, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) x[i] *= alpha;
}

__global__ void MultiplyKernel(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) out[i] = a[i] * b[i];
}

__global__ void AddBiasKernel(float* __restrict__ y, const float* __restrict__ b, int64_t total,
                              int64_t channels, int64_t inner) {
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    y[i] += b[(i / inner) % channels];
  }
}

// One block per channel.
__global__ void BiasGradKernel(const float* __restrict__ dy, float* __restrict__ db, int64_t outer,
                               int64_t channels, int64_t inner, bool accumulate) {
  const int64_t c = blockIdx.x;
  const int64_t count = outer * inner;
  float sum = 0.0f;
  for (int64_t t = threadIdx.x; t < count; t += blockDim.x) {
    const int64_t o = t / inner;
    const int64_t i = t - o * inner;
    sum += dy[(o * channels + c) * inner + i];
  }
  sum = BlockSum(sum);
  if (threadIdx.x == 0) db[c] = accumulate ? db[c] + sum : sum;
}

__global__ void DropoutForwardKernel(float rate, float keep_scale, uint64_t seed,
                                     const float* __restrict__ x, float* __restrict__ mask,
                                     float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float m =
        DropoutUniformDevice(seed, static_cast<uint64_t>(i)) >= rate ? keep_scale : 0.0f;
    mask[i] = m;
    y[i] = x[i] * m;
  }
}

// One block per bag (grid-stride over bags), threads over the row width.
__global__ void EmbeddingBagForwardKernel(bool mean, const float* __restrict__ table, int64_t dim,
                                          const int64_t* __restrict__ ids,
                                          const int64_t* __restrict__ offsets,
                                          const float* __restrict__ values, int64_t bags,
                                          float* __restrict__ out) {
  for (int64_t b = blockIdx.x; b < bags; b += gridDim.x) {
    const int64_t begin = offsets[b], end = offsets[b + 1];
    const float scale = (mean && end > begin) ? 1.0f / static_cast<float>(end - begin) : 1.0f;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t j = begin; j < end; ++j) {
        const float v = values != nullptr ? values[j] : 1.0f;
        acc += v * table[ids[j] * dim + d];
      }
      out[b * dim + d] = acc * scale;
    }
  }
}

__global__ void EmbeddingBagBackwardKernel(bool mean, int64_t dim, const int64_t* __restrict__ ids,
                                           const int64_t* __restrict__ offsets,
                                           const float* __restrict__ values, int64_t bags,
                                           const float* __restrict__ dout, float* dtable) {
  for (int64_t b = blockIdx.x; b < bags; b += gridDim.x) {
    const int64_t begin = offsets[b], end = offsets[b + 1];
    if (end == begin) continue;
    const float scale = mean ? 1.0f / static_cast<float>(end - begin) : 1.0f;
    for (int64_t j = begin; j < end; ++j) {
      const float v = (values != nullptr ? values[j] : 1.0f) * scale;
      float* row = dtable + ids[j] * dim;
      for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
        atomicAdd(row + d, v * dout[b * dim + d]);
      }
    }
  }
}

constexpr int kRowsPerBlock = kThreads / kWarp;

// One warp per row.
__global__ void SoftmaxCrossEntropyKernel(const float* __restrict__ log_probs,
                                          const int32_t* __restrict__ labels, int64_t n, int64_t k,
                                          float inv_n, float* __restrict__ dlogits,
                                          float* __restrict__ row_loss,
                                          float* __restrict__ row_correct) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const float* lp = log_probs + row * k;
  const int32_t label = labels[row];
  const bool valid = label >= 0 && label < k;
  float best = 0.0f;
  int64_t best_idx = INT64_MAX;
  for (int64_t j = lane; j < k; j += kWarp) {
    const float v = lp[j];
    if (best_idx == INT64_MAX || v > best) {
      best = v;
      best_idx = j;
    }
    if (dlogits != nullptr) {
      float d = valid ? expf(v) * inv_n : 0.0f;
      if (valid && j == label) d -= inv_n;
      dlogits[row * k + j] = d;
    }
  }
  if (best_idx == INT64_MAX) best = -INFINITY;
  best_idx = WarpArgMax(best, best_idx);
  if (lane == 0) {
    row_loss[row] = valid ? -lp[label] : 0.0f;
    row_correct[row] = (valid && best_idx == label) ? 1.0f : 0.0f;
  }
}

__global__ void SigmoidCrossEntropyKernel(const float* __restrict__ logits,
                                          const float* __restrict__ targets, int64_t n, int64_t k,
                                          float inv, float* __restrict__ dlogits,
                                          float* __restrict__ row_loss,
                                          float* __restrict__ row_correct) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  float total = 0.0f;
  int wrong = 0;
  for (int64_t j = lane; j < k; j += kWarp) {
    const float x = logits[row * k + j];
    const float t = targets[row * k + j];
    total += fmaxf(x, 0.0f) - x * t + log1pf(expf(-fabsf(x)));
    if ((x > 0) != (t > 0.5f)) wrong = 1;
    if (dlogits != nullptr) dlogits[row * k + j] = (1.0f / (1.0f + expf(-x)) - t) * inv;
  }
  total = WarpSum(total);
  wrong = __any_sync(0xffffffffu, wrong);
  if (lane == 0) {
    row_loss[row] = total;
    row_correct[row] = wrong ? 0.0f : 1.0f;
  }
}

__global__ void MeanSquaredErrorKernel(const float* __restrict__ y,
                                       const float* __restrict__ targets, int64_t n, int64_t k,
                                       float scale, float* __restrict__ dy,
                                       float* __restrict__ row_loss,
                                       float* __restrict__ row_correct) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;
  const float* yi = y + row * k;
  const float* ti = targets + row * k;
  float total = 0.0f;
  float by = 0.0f, bt = 0.0f;
  int64_t by_idx = INT64_MAX, bt_idx = INT64_MAX;
  for (int64_t j = lane; j < k; j += kWarp) {
    const float d = yi[j] - ti[j];
    total += d * d;
    if (dy != nullptr) dy[row * k + j] = scale * d;
    if (by_idx == INT64_MAX || yi[j] > by) {
      by = yi[j];
      by_idx = j;
    }
    if (bt_idx == INT64_MAX || ti[j] > bt) {
      bt = ti[j];
      bt_idx = j;
    }
  }
  if (by_idx == INT64_MAX) by = -INFINITY;
  if (bt_idx == INT64_MAX) bt = -INFINITY;
  total = WarpSum(total);
  by_idx = WarpArgMax(by, by_idx);
  bt_idx = WarpArgMax(bt, bt_idx);
  if (lane == 0) {
    row_loss[row] = total;
    const bool right = k == 1 ? fabsf(yi[0] - ti[0]) < 0.5f : by_idx == bt_idx;
    row_correct[row] = right ? 1.0f : 0.0f;
  }
}

// One block: metrics = {sum(row_loss) / denominator, sum(row_correct)}.
__global__ void LossReduceKernel(const float* __restrict__ row_loss,
                                 const float* __restrict__ row_correct, int64_t n,
                                 double denominator, float* __restrict__ metrics) {
  double loss = 0.0, correct = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    loss += row_loss[i];
    correct += row_correct[i];
  }
  loss = BlockSum(loss);
  __syncthreads();
  correct = BlockSum(correct);
  if (threadIdx.x == 0) {
    metrics[0] = static_cast<float>(loss / denominator);
    metrics[1] = static_cast<float>(correct);
  }
}

__global__ void SquaredNormPartialKernel(const float* __restrict__ x, int64_t n,
                                         double* __restrict__ partials) {
  double sum = 0.0;
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const double v = x[i];
    sum += v * v;
  }
  sum = BlockSum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void SquaredNormFinalKernel(const double* __restrict__ partials, int count,
                                       double* __restrict__ result) {
  double sum = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = BlockSum(sum);
  if (threadIdx.x == 0) *result = sum;
}

cudaError_t LaunchLossReduce(const float* row_loss, const float* row_correct, int64_t n,
                             double denominator, float* metrics, cudaStream_t stream) {
  LossReduceKernel<<<1, kThreads, 0, stream>>>(row_loss, row_correct, n, denominator, metrics);
  return cudaGetLastError();
}

int RowBlocks(int64_t n) { return static_cast<int>((n + kRowsPerBlock - 1) / kRowsPerBlock); }

}  // namespace

cudaError_t LaunchFill(float* x, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, n, value);
  return cudaGetLastError();
}

cudaError_t LaunchAxpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AxpyKernel<<<BlocksFor(n), kThreads, 0, stream>>>(alpha, x, y, n);
  return cudaGetLastError();
}

cudaError_t LaunchScale(float alpha, float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScaleKernel<<<BlocksFor(n), kThreads, 0, stream>>>(alpha, x, n);
  return cudaGetLastError();
}

cudaError_t LaunchMultiply(const float* a, const float* b, float* out, int64_t n,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MultiplyKernel<<<BlocksFor(n), kThreads, 0, stream>>>(a, b, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddBias(float* y, const float* b, int64_t outer, int64_t channels, int64_t inner,
                          cudaStream_t stream) {
  const int64_t total = outer * channels * inner;
  if (total <= 0) return cudaSuccess;
  AddBiasKernel<<<BlocksFor(total), kThreads, 0, stream>>>(y, b, total, channels, inner);
  return cudaGetLastError();
}

cudaError_t LaunchBiasGrad(const float* dy, float* db, int64_t outer, int64_t channels,
                           int64_t inner, bool accumulate, cudaStream_t stream) {
  if (channels <= 0) return cudaSuccess;
  BiasGradKernel<<<static_cast<unsigned>(channels), kThreads, 0, stream>>>(dy, db, outer, channels,
                                                                           inner, accumulate);
  return cudaGetLastError();
}

cudaError_t LaunchDropoutForward(float rate, uint64_t seed, const float* x, float* mask, float* y,
                                 int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  DropoutForwardKernel<<<BlocksFor(n), kThreads, 0, stream>>>(rate, 1.0f / (1.0f - rate), seed, x,
                                                              mask, y, n);
  return cudaGetLastError();
}

namespace {
int EmbeddingThreads(int64_t dim) {
  return static_cast<int>(std::min<int64_t>(kThreads, (dim + kWarp - 1) / kWarp * kWarp));
}
unsigned EmbeddingBlocks(int64_t bags) {
  return static_cast<unsigned>(std::min<int64_t>(bags, 65535 * 16));
}
}  // namespace

cudaError_t LaunchEmbeddingBagForward(bool mean, const float* table, int64_t dim,
                                      const int64_t* ids, const int64_t* offsets,
                                      const float* values, int64_t bags, float* out,
                                      cudaStream_t stream) {
  if (bags <= 0 || dim <= 0) return cudaSuccess;
  EmbeddingBagForwardKernel<<<EmbeddingBlocks(bags), EmbeddingThreads(dim), 0, stream>>>(
      mean, table, dim, ids, offsets, values, bags, out);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingBagBackward(bool mean, int64_t dim, const int64_t* ids,
                                       const int64_t* offsets, const float* values, int64_t bags,
                                       const float* dout, float* dtable, cudaStream_t stream) {
  if (bags <= 0 || dim <= 0) return cudaSuccess;
  EmbeddingBagBackwardKernel<<<EmbeddingBlocks(bags), EmbeddingThreads(dim), 0, stream>>>(
      mean, dim, ids, offsets, values, bags, dout, dtable);
  return cudaGetLastError();
}

namespace {

__global__ void AddColumnsKernel(const float* src, int64_t src_cols, int64_t src_offset, float* dst,
                                 int64_t dst_cols, int64_t dst_offset, int64_t rows,
                                 int64_t width) {
  const int64_t total = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    dst[r * dst_cols + dst_offset + c] += src[r * src_cols + src_offset + c];
  }
}

// One block per example; thread t computes pairs t, t + blockDim.x, ... of its row.
__global__ void DotInteractionForwardKernel(const float* x, int64_t m, int64_t d, float* y,
                                            int64_t y_cols, int64_t y_offset) {
  const int64_t b = blockIdx.x;
  const float* v = x + b * m * d;
  float* out = y + b * y_cols + y_offset;
  const int64_t pairs = m * (m - 1) / 2;
  for (int64_t k = threadIdx.x; k < pairs; k += blockDim.x) {
    // k = i * (i - 1) / 2 + j with j < i.
    int64_t i = static_cast<int64_t>((1.0 + sqrt(1.0 + 8.0 * static_cast<double>(k))) / 2.0);
    while (i * (i - 1) / 2 > k) --i;
    while ((i + 1) * i / 2 <= k) ++i;
    const int64_t j = k - i * (i - 1) / 2;
    float dot = 0.0f;
    for (int64_t c = 0; c < d; ++c) dot += v[i * d + c] * v[j * d + c];
    out[k] = dot;
  }
}

// One block per example; thread t computes the values (i, c) t, t + blockDim.x, ... of dx:
// dx[i, c] = sum over j != i of g(i, j) * x[j, c], with g(i, j) = dy[pair(max, min)].
__global__ void DotInteractionBackwardKernel(const float* x, int64_t m, int64_t d, const float* dy,
                                             int64_t y_cols, int64_t y_offset, float* dx) {
  const int64_t b = blockIdx.x;
  const float* v = x + b * m * d;
  const float* g = dy + b * y_cols + y_offset;
  float* dv = dx + b * m * d;
  for (int64_t e = threadIdx.x; e < m * d; e += blockDim.x) {
    const int64_t i = e / d, c = e % d;
    float sum = 0.0f;
    for (int64_t j = 0; j < m; ++j) {
      if (j == i) continue;
      const int64_t hi = i > j ? i : j, lo = i > j ? j : i;
      sum += g[hi * (hi - 1) / 2 + lo] * v[j * d + c];
    }
    dv[e] = sum;
  }
}

}  // namespace

cudaError_t LaunchAddColumns(const float* src, int64_t src_cols, int64_t src_offset, float* dst,
                             int64_t dst_cols, int64_t dst_offset, int64_t rows, int64_t width,
                             cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((rows * width + kThreads - 1) / kThreads, 65535);
  AddColumnsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      src, src_cols, src_offset, dst, dst_cols, dst_offset, rows, width);
  return cudaGetLastError();
}

cudaError_t LaunchDotInteractionForward(const float* x, int64_t n, int64_t m, int64_t d, float* y,
                                        int64_t y_cols, int64_t y_offset, cudaStream_t stream) {
  if (n <= 0 || m < 2) return cudaSuccess;
  DotInteractionForwardKernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(x, m, d, y, y_cols,
                                                                            y_offset);
  return cudaGetLastError();
}

cudaError_t LaunchDotInteractionBackward(const float* x, int64_t n, int64_t m, int64_t d,
                                         const float* dy, int64_t y_cols, int64_t y_offset,
                                         float* dx, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  DotInteractionBackwardKernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(x, m, d, dy, y_cols,
                                                                             y_offset, dx);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxCrossEntropy(const float* log_probs, const int32_t* labels, int64_t n,
                                      int64_t k, float* dlogits, float* row_loss,
                                      float* row_correct, float* metrics, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  SoftmaxCrossEntropyKernel<<<RowBlocks(n), kThreads, 0, stream>>>(
      log_probs, labels, n, k, 1.0f / static_cast<float>(n), dlogits, row_loss, row_correct);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchLossReduce(row_loss, row_correct, n, static_cast<double>(n), metrics, stream);
}

cudaError_t LaunchSigmoidCrossEntropy(const float* logits, const float* targets, int64_t n,
                                      int64_t k, float* dlogits, float* row_loss,
                                      float* row_correct, float* metrics, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  SigmoidCrossEntropyKernel<<<RowBlocks(n), kThreads, 0, stream>>>(
      logits, targets, n, k, 1.0f / static_cast<float>(n * k), dlogits, row_loss, row_correct);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchLossReduce(row_loss, row_correct, n, static_cast<double>(n * k), metrics, stream);
}

cudaError_t LaunchMeanSquaredError(const float* y, const float* targets, int64_t n, int64_t k,
                                   float* dy, float* row_loss, float* row_correct, float* metrics,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MeanSquaredErrorKernel<<<RowBlocks(n), kThreads, 0, stream>>>(
      y, targets, n, k, 2.0f / static_cast<float>(n * k), dy, row_loss, row_correct);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchLossReduce(row_loss, row_correct, n, static_cast<double>(n * k), metrics, stream);
}

cudaError_t LaunchSquaredNorm(const float* x, int64_t n, double* partials, double* result,
                              cudaStream_t stream) {
  if (n <= 0) return cudaMemsetAsync(result, 0, sizeof(double), stream);
  const int blocks =
      static_cast<int>(std::min<int64_t>(kSquaredNormPartials, (n + kThreads - 1) / kThreads));
  SquaredNormPartialKernel<<<blocks, kThreads, 0, stream>>>(x, n, partials);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SquaredNormFinalKernel<<<1, kThreads, 0, stream>>>(partials, blocks, result);
  return cudaGetLastError();
}

}  // namespace tessera::kernels::cuda
