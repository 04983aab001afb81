// The CUDA backend's own kernels (kernels/cuda/cuda_kernels.cu): what cuBLAS and cuDNN lack.
// Internal to the CUDA backend. Each launcher enqueues its kernels on `stream` and returns at
// once with the launch error (cudaSuccess when the launch was accepted); nothing synchronises.
// The formulas are those of the CPU backend's loops (kernels/cpu/cpu_loops.h), so the two
// backends agree to within rounding.
#ifndef TESSERA_KERNELS_CUDA_CUDA_KERNELS_H_
#define TESSERA_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::kernels::cuda {

// x[i] = value for i in [0, n).
cudaError_t LaunchFill(float* x, int64_t n, float value, cudaStream_t stream);
// y += alpha * x.
cudaError_t LaunchAxpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t stream);
// x *= alpha.
cudaError_t LaunchScale(float alpha, float* x, int64_t n, cudaStream_t stream);
// out = a * b, element-wise.
cudaError_t LaunchMultiply(const float* a, const float* b, float* out, int64_t n,
                           cudaStream_t stream);

// y viewed as [outer, channels, inner]: y[o, c, i] += b[c].
cudaError_t LaunchAddBias(float* y, const float* b, int64_t outer, int64_t channels, int64_t inner,
                          cudaStream_t stream);
// db[c] = sum over o and i of dy[o, c, i] (with `accumulate`, db[c] += that sum).
cudaError_t LaunchBiasGrad(const float* dy, float* db, int64_t outer, int64_t channels,
                           int64_t inner, bool accumulate, cudaStream_t stream);

// The mask and output of kernels::Backend::DropoutForward, with the same DropoutUniform stream.
cudaError_t LaunchDropoutForward(float rate, uint64_t seed, const float* x, float* mask, float* y,
                                 int64_t n, cudaStream_t stream);

// EmbeddingBag: see kernels::Backend::EmbeddingBagForward. `values` may be null (all ones).
cudaError_t LaunchEmbeddingBagForward(bool mean, const float* table, int64_t dim,
                                      const int64_t* ids, const int64_t* offsets,
                                      const float* values, int64_t bags, float* out,
                                      cudaStream_t stream);
// Scatter-adds (atomicAdd) into dtable, which the caller zeroes first.
cudaError_t LaunchEmbeddingBagBackward(bool mean, int64_t dim, const int64_t* ids,
                                       const int64_t* offsets, const float* values, int64_t bags,
                                       const float* dout, float* dtable, cudaStream_t stream);

// Multi-input models: see kernels::Backend::CopyColumns and DotInteractionForward/Backward.
cudaError_t LaunchAddColumns(const float* src, int64_t src_cols, int64_t src_offset, float* dst,
                             int64_t dst_cols, int64_t dst_offset, int64_t rows, int64_t width,
                             cudaStream_t stream);
cudaError_t LaunchDotInteractionForward(const float* x, int64_t n, int64_t m, int64_t d, float* y,
                                        int64_t y_cols, int64_t y_offset, cudaStream_t stream);
cudaError_t LaunchDotInteractionBackward(const float* x, int64_t n, int64_t m, int64_t d,
                                         const float* dy, int64_t y_cols, int64_t y_offset,
                                         float* dx, cudaStream_t stream);

// Losses over n rows of k values. Each writes per-row partial results into `row_loss` and
// `row_correct` (device scratch of n floats each), dlogits (nullable), and then reduces them
// into metrics[0] = mean loss and metrics[1] = number of correct rows, in double, in a fixed
// order (deterministic).
//
// Softmax cross-entropy from log-probabilities (cuDNN's log-softmax of the logits):
// dlogits = (exp(log_probs) - onehot(label)) / n; a label outside [0, k) counts as wrong with
// zero loss and zero gradient. Correct when the first arg-max is the label.
cudaError_t LaunchSoftmaxCrossEntropy(const float* log_probs, const int32_t* labels, int64_t n,
                                      int64_t k, float* dlogits, float* row_loss,
                                      float* row_correct, float* metrics, cudaStream_t stream);
// Mean over n*k of max(x, 0) - x t + log1p(exp(-|x|)); dlogits = (sigmoid(x) - t) / (n k).
// A row is correct when every (x > 0) matches (t > 0.5).
cudaError_t LaunchSigmoidCrossEntropy(const float* logits, const float* targets, int64_t n,
                                      int64_t k, float* dlogits, float* row_loss,
                                      float* row_correct, float* metrics, cudaStream_t stream);
// Mean over n*k of (y - t)^2; dy = 2 (y - t) / (n k). A row is correct when |y - t| < 0.5 (k ==
// 1) or when the first arg-max of y and of t agree.
cudaError_t LaunchMeanSquaredError(const float* y, const float* targets, int64_t n, int64_t k,
                                   float* dy, float* row_loss, float* row_correct, float* metrics,
                                   cudaStream_t stream);

// Number of double partial sums LaunchSquaredNorm needs as scratch.
constexpr int kSquaredNormPartials = 512;
// *result = sum of x[i]^2 in double; `partials` is device scratch of kSquaredNormPartials doubles.
cudaError_t LaunchSquaredNorm(const float* x, int64_t n, double* partials, double* result,
                              cudaStream_t stream);

}  // namespace tessera::kernels::cuda

#endif  // TESSERA_KERNELS_CUDA_CUDA_KERNELS_H_
