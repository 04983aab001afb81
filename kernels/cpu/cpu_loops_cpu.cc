#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_loops.h"

namespace tessera::kernels::cpu {
namespace {

// Below this many elements a loop runs on one thread: waking the OpenMP team costs more.
constexpr int64_t kParallelThreshold = 1 << 15;

}  // namespace

void SoftmaxCrossEntropy(const float* log_probs, const int32_t* labels, int64_t n, int64_t k,
                         float* dlogits, float* loss, float* correct) {
  double total = 0;
  int64_t right = 0;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) {
    const float* lp = log_probs + i * k;
    const int32_t label = labels[i];
    const bool valid = label >= 0 && label < k;
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (lp[j] > lp[best]) best = j;
    }
    if (valid) {
      total -= lp[label];
      if (best == label) ++right;
    }
    if (dlogits != nullptr) {
      float* d = dlogits + i * k;
      for (int64_t j = 0; j < k; ++j) d[j] = valid ? std::exp(lp[j]) * inv_n : 0.0f;
      if (valid) d[label] -= inv_n;
    }
  }
  *loss = static_cast<float>(total / static_cast<double>(n));
  *correct = static_cast<float>(right);
}

void SigmoidCrossEntropy(const float* logits, const float* targets, int64_t n, int64_t k,
                         float* dlogits, float* loss, float* correct) {
  double total = 0;
  int64_t right = 0;
  const float inv = 1.0f / static_cast<float>(n * k);
  for (int64_t i = 0; i < n; ++i) {
    bool all = true;
    for (int64_t j = 0; j < k; ++j) {
      const float x = logits[i * k + j];
      const float t = targets[i * k + j];
      // max(x, 0) - x t + log(1 + exp(-|x|))
      total += std::max(x, 0.0f) - x * t + std::log1p(std::exp(-std::fabs(x)));
      if ((x > 0) != (t > 0.5f)) all = false;
      if (dlogits != nullptr) {
        const float s = 1.0f / (1.0f + std::exp(-x));
        dlogits[i * k + j] = (s - t) * inv;
      }
    }
    if (all) ++right;
  }
  *loss = static_cast<float>(total / static_cast<double>(n * k));
  *correct = static_cast<float>(right);
}

void MeanSquaredError(const float* y, const float* targets, int64_t n, int64_t k, float* dy,
                      float* loss, float* correct) {
  double total = 0;
  int64_t right = 0;
  const float scale = 2.0f / static_cast<float>(n * k);
  for (int64_t i = 0; i < n; ++i) {
    const float* yi = y + i * k;
    const float* ti = targets + i * k;
    int64_t by = 0, bt = 0;
    for (int64_t j = 0; j < k; ++j) {
      const float d = yi[j] - ti[j];
      total += static_cast<double>(d) * d;
      if (dy != nullptr) dy[i * k + j] = scale * d;
      if (yi[j] > yi[by]) by = j;
      if (ti[j] > ti[bt]) bt = j;
    }
    if (k == 1 ? std::fabs(yi[0] - ti[0]) < 0.5f : by == bt) ++right;
  }
  *loss = static_cast<float>(total / static_cast<double>(n * k));
  *correct = static_cast<float>(right);
}

void DropoutForward(float rate, uint64_t seed, const float* x, float* mask, float* y, int64_t n) {
  const float keep_scale = 1.0f / (1.0f - rate);
#pragma omp parallel for simd if (n > kParallelThreshold) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float m = DropoutUniform(seed, static_cast<uint64_t>(i)) >= rate ? keep_scale : 0.0f;
    mask[i] = m;
    y[i] = x[i] * m;
  }
}

void Multiply(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
              int64_t n) {
#pragma omp parallel for simd if (n > kParallelThreshold) schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

void EmbeddingBagForward(bool mean, const float* table, int64_t dim, const int64_t* ids,
                         const int64_t* offsets, const float* values, int64_t bags, float* out) {
#pragma omp parallel for if (bags * dim > kParallelThreshold) schedule(static)
  for (int64_t b = 0; b < bags; ++b) {
    float* o = out + b * dim;
    std::fill(o, o + dim, 0.0f);
    const int64_t begin = offsets[b], end = offsets[b + 1];
    for (int64_t j = begin; j < end; ++j) {
      const float v = values != nullptr ? values[j] : 1.0f;
      const float* row = table + ids[j] * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += v * row[d];
    }
    if (mean && end > begin) {
      const float inv = 1.0f / static_cast<float>(end - begin);
      for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
    }
  }
}

void EmbeddingBagBackward(bool mean, int64_t dim, const int64_t* ids, const int64_t* offsets,
                          const float* values, int64_t bags, const float* dout, float* dtable) {
  // Serial: several bags may touch the same row.
  for (int64_t b = 0; b < bags; ++b) {
    const int64_t begin = offsets[b], end = offsets[b + 1];
    if (end == begin) continue;
    const float scale = mean ? 1.0f / static_cast<float>(end - begin) : 1.0f;
    const float* g = dout + b * dim;
    for (int64_t j = begin; j < end; ++j) {
      const float v = (values != nullptr ? values[j] : 1.0f) * scale;
      float* row = dtable + ids[j] * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] += v * g[d];
    }
  }
}

void CopyColumns(const float* src, int64_t src_cols, int64_t src_offset, float* dst,
                 int64_t dst_cols, int64_t dst_offset, int64_t rows, int64_t width,
                 bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict__ s = src + r * src_cols + src_offset;
    float* __restrict__ t = dst + r * dst_cols + dst_offset;
    if (accumulate) {
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) t[c] += s[c];
    } else {
      std::memcpy(t, s, static_cast<size_t>(width) * sizeof(float));
    }
  }
}

void DotInteractionForward(const float* x, int64_t n, int64_t m, int64_t d, float* y,
                           int64_t y_cols, int64_t y_offset) {
#pragma omp parallel for if (n * m * m * d > kParallelThreshold) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* v = x + b * m * d;
    float* out = y + b * y_cols + y_offset;
    int64_t k = 0;
    for (int64_t i = 1; i < m; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += v[i * d + c] * v[j * d + c];
        out[k++] = dot;
      }
    }
  }
}

void DotInteractionBackward(const float* x, int64_t n, int64_t m, int64_t d, const float* dy,
                            int64_t y_cols, int64_t y_offset, float* dx) {
#pragma omp parallel for if (n * m * m * d > kParallelThreshold) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* v = x + b * m * d;
    const float* g = dy + b * y_cols + y_offset;
    float* dv = dx + b * m * d;
    std::memset(dv, 0, static_cast<size_t>(m * d) * sizeof(float));
    int64_t k = 0;
    for (int64_t i = 1; i < m; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        const float w = g[k++];
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          dv[i * d + c] += w * v[j * d + c];
          dv[j * d + c] += w * v[i * d + c];
        }
      }
    }
  }
}

void Fill(float* x, int64_t n, float value) {
#pragma omp parallel for simd if (n > kParallelThreshold) schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

void Axpy(float alpha, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
#pragma omp parallel for simd if (n > kParallelThreshold) schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void Scale(float alpha, float* x, int64_t n) {
#pragma omp parallel for simd if (n > kParallelThreshold) schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
}

double SquaredNorm(const float* x, int64_t n) {
  double total = 0;
#pragma omp parallel for simd reduction(+ : total) if (n > kParallelThreshold) schedule(static)
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

void UpdateMovingStats(float momentum, int64_t count, const float* batch_mean,
                       const float* batch_var, float* moving_mean, float* moving_var, int64_t c) {
  const float unbias = count > 1 ? static_cast<float>(count) / static_cast<float>(count - 1) : 1.0f;
  for (int64_t i = 0; i < c; ++i) {
    moving_mean[i] = (1.0f - momentum) * moving_mean[i] + momentum * batch_mean[i];
    moving_var[i] = (1.0f - momentum) * moving_var[i] + momentum * batch_var[i] * unbias;
  }
}

}  // namespace tessera::kernels::cpu
