// Plain OpenMP loops for what oneDNN lacks: losses, dropout, embedding bags and small
// element-wise updates. Internal to the CPU backend (kernels/cpu/).
#ifndef TESSERA_KERNELS_CPU_CPU_LOOPS_H_
#define TESSERA_KERNELS_CPU_CPU_LOOPS_H_

#include <cstdint>

namespace tessera::kernels::cpu {

// log_probs [n, k] (log-softmax of the logits). Writes dlogits (nullable) = (softmax - onehot) / n
// and returns {mean loss, correct}. Labels outside [0, k) count as wrong with zero loss and
// gradient (the model validates labels before the step).
void SoftmaxCrossEntropy(const float* log_probs, const int32_t* labels, int64_t n, int64_t k,
                         float* dlogits, float* loss, float* correct);

// Mean over n*k of the numerically stable sigmoid cross-entropy; dlogits = (sigmoid(x) - t)/(n k).
void SigmoidCrossEntropy(const float* logits, const float* targets, int64_t n, int64_t k,
                         float* dlogits, float* loss, float* correct);

// Mean over n*k of (y - t)^2; dy = 2 (y - t) / (n k).
void MeanSquaredError(const float* y, const float* targets, int64_t n, int64_t k, float* dy,
                      float* loss, float* correct);

void DropoutForward(float rate, uint64_t seed, const float* x, float* mask, float* y, int64_t n);
void Multiply(const float* a, const float* b, float* out, int64_t n);

void EmbeddingBagForward(bool mean, const float* table, int64_t dim, const int64_t* ids,
                         const int64_t* offsets, const float* values, int64_t bags, float* out);
// dtable must be zeroed by the caller.
void EmbeddingBagBackward(bool mean, int64_t dim, const int64_t* ids, const int64_t* offsets,
                          const float* values, int64_t bags, const float* dout, float* dtable);

// dst[r * dst_cols + dst_offset + c] (+)= src[r * src_cols + src_offset + c], r < rows,
// c < width: accumulates when `accumulate`, else overwrites.
void CopyColumns(const float* src, int64_t src_cols, int64_t src_offset, float* dst,
                 int64_t dst_cols, int64_t dst_offset, int64_t rows, int64_t width,
                 bool accumulate);
// DLRM's dot interaction of the m vectors of d values of each of n examples (x is [n, m, d]):
// y[b * y_cols + y_offset + k] = <x[b, i], x[b, j]>, k counting i = 1..m-1, j = 0..i-1.
void DotInteractionForward(const float* x, int64_t n, int64_t m, int64_t d, float* y,
                           int64_t y_cols, int64_t y_offset);
// dx[b, i] = sum over j != i of dy[b, pair(i, j)] * x[b, j] (overwrites dx).
void DotInteractionBackward(const float* x, int64_t n, int64_t m, int64_t d, const float* dy,
                            int64_t y_cols, int64_t y_offset, float* dx);

void Fill(float* x, int64_t n, float value);
void Axpy(float alpha, const float* x, float* y, int64_t n);
void Scale(float alpha, float* x, int64_t n);
double SquaredNorm(const float* x, int64_t n);

// moving = (1 - momentum) * moving + momentum * batch, with the batch variance made unbiased by
// count / (count - 1).
void UpdateMovingStats(float momentum, int64_t count, const float* batch_mean,
                       const float* batch_var, float* moving_mean, float* moving_var, int64_t c);

}  // namespace tessera::kernels::cpu

#endif  // TESSERA_KERNELS_CPU_CPU_LOOPS_H_
