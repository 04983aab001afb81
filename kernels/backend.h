// The compute backend interface (DESIGN.md §5): device memory and the forward and backward ops of
// every layer and loss in proto/tessera/v1/model.proto, plus the optimizer update.
//
// Two implementations: the CPU backend (oneDNN, kernels/cpu/) and the CUDA backend (cuBLAS and
// cuDNN, kernels/cuda/). CreateBackend() picks one at run time; nothing above kernels/ needs an
// #ifdef.
//
// Conventions shared by both implementations:
// - float32, NCHW, dense row-major tensors. A Dense kernel is [out, in]; a Conv2D kernel is
//   [filters, in_channels, kernel_h, kernel_w].
// - Every op is enqueued on the backend's single stream, in order. Ops may return before the work
//   is done (CUDA); the host sees results only through CopyToHost() or the ops that return a
//   host value, which synchronise. A Backend is used by one thread at a time.
// - Gradient outputs are overwritten, never accumulated into (the caller zeroes nothing).
// - An output pointer that may be null is marked "(nullable)": the op then skips that output
//   (for example the input gradient of the first layer).
// - Shapes are checked by the caller (the model validates them once); a backend may CHECK them.
//   Errors returned are those of the device (INTERNAL, RESOURCE_EXHAUSTED on allocation).
#ifndef TESSERA_KERNELS_BACKEND_H_
#define TESSERA_KERNELS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/optimizer.h"

namespace tessera::kernels {

enum class DType { kFloat32, kInt32, kInt64 };

// Size in bytes of one element of `dtype`.
int64_t DTypeSize(DType dtype);

using Shape = std::vector<int64_t>;

// Number of elements of `shape` (1 for a scalar, the empty shape).
int64_t NumElements(const Shape& shape);

// a * b for a, b >= 0, or -1 when the product does not fit in an int64 (for sizes from untrusted
// specs and files).
int64_t CheckedProduct(int64_t a, int64_t b);
// The product of `shape`'s dimensions (each >= 0), or -1 when it does not fit in an int64.
int64_t CheckedNumElements(const Shape& shape);

// The host's physical memory in bytes.
int64_t HostMemoryBytes();

// "[64, 1, 28, 28]".
std::string ShapeString(const Shape& shape);

// A handle to device memory with a shape and an element type. Copying a Tensor copies the handle
// (both share the memory, which is freed with the last handle); Reshaped() gives a view of the
// same memory. A default-constructed Tensor is empty (data() == nullptr).
// Thread-compatible.
class Tensor {
 public:
  Tensor() = default;
  // Wraps `storage` (freed by its deleter) as a tensor of `shape` starting at `data`.
  Tensor(std::shared_ptr<void> storage, void* data, Shape shape, DType dtype)
      : storage_(std::move(storage)), data_(data), shape_(std::move(shape)), dtype_(dtype) {}

  bool empty() const { return data_ == nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  DType dtype() const { return dtype_; }
  int64_t num_elements() const { return NumElements(shape_); }
  int64_t num_bytes() const { return num_elements() * DTypeSize(dtype_); }

  // Device pointers (host pointers on the CPU backend).
  void* raw() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  int32_t* i32() const { return static_cast<int32_t*>(data_); }
  int64_t* i64() const { return static_cast<int64_t*>(data_); }

  // A view of the same memory with another shape of the same number of elements.
  // REQUIRES: NumElements(shape) == num_elements().
  Tensor Reshaped(Shape shape) const;

  // A view of `count` leading rows (dim 0) of this tensor. REQUIRES: 0 < count <= dim(0).
  Tensor LeadingRows(int64_t count) const;

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::kFloat32;
};

// Geometry of a 2-D convolution on x [n, c, h, w] with w [k, c, kh, kw] giving y [n, k, oh, ow].
struct Conv2DGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t k = 0, kh = 0, kw = 0;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t oh = 0, ow = 0;  // filled by the caller: (h + 2*pad_h - kh) / stride_h + 1
};

enum class PoolKind { kMax, kAvg };

// Geometry of pooling x [n, c, h, w] into y [n, c, oh, ow]. Average pooling excludes padding from
// the divisor.
struct Pool2DGeometry {
  PoolKind kind = PoolKind::kMax;
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t kh = 2, kw = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
  int64_t oh = 0, ow = 0;  // filled by the caller
};

enum class Activation { kRelu, kTanh, kSigmoid };

enum class LossKind { kSoftmaxCrossEntropy, kSigmoidCrossEntropy, kMeanSquaredError };

enum class Combiner { kSum, kMean };

// Batch normalisation over x [n, c] or [n, c, h, w], per channel.
struct BatchNormGeometry {
  int64_t n = 0, c = 0, spatial = 1;  // spatial = h * w (1 for 2-D inputs)
  float epsilon = 1e-5f;
  float momentum = 0.1f;  // moving = (1 - momentum) * moving + momentum * batch (unbiased var)
};

// The dropout mask stream: element i (in NCHW order) of a dropout with seed s is kept when
// DropoutUniform(s, i) >= rate. Both backends use this function, so masks agree across devices.
//   z = s + (i + 1) * 0x9E3779B97F4A7C15; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//   z = (z ^ (z >> 27)) * 0x94D049BB133111EB; z ^= z >> 31;  u = (z >> 40) * 2^-24
inline float DropoutUniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:0"; and a human-readable description for logs (library versions, threads).
  virtual std::string Name() const = 0;
  virtual std::string Description() const = 0;
  virtual bool IsCuda() const = 0;
  // CPU threads the backend's ops use when called from this thread (1 on a device backend).
  virtual int Threads() const { return 1; }
  // Sets them (the caller's thread; OpenMP keeps the count per calling thread), between steps: a
  // CPU backend remakes its primitives for the new count, so no op may be half done (a backward
  // pass still to come for a forward pass made before). A device backend has no CPU threads to
  // set: FAILED_PRECONDITION. INVALID_ARGUMENT for threads < 1.
  virtual absl::Status SetThreads(int threads);

  // --- Memory ----------------------------------------------------------------------------------
  // Bytes of memory this backend's tensors can use at most, for refusing a model or a batch that
  // cannot fit before allocating it. The default is the host's physical memory (right for the CPU
  // backend; a device backend may override it with its device memory).
  virtual int64_t MemoryCapacityBytes() const;
  // Allocates an uninitialised tensor. RESOURCE_EXHAUSTED when the device is out of memory.
  virtual absl::StatusOr<Tensor> Allocate(const Shape& shape, DType dtype = DType::kFloat32) = 0;
  // Copies dst.num_bytes() bytes from host memory into `dst`. `host` may be reused when this
  // returns (the copy is staged if needed).
  virtual absl::Status CopyToDevice(const void* host, const Tensor& dst) = 0;
  // Copies src.num_bytes() bytes into host memory. Blocks until the copy (and all work before it
  // on the stream) is done.
  virtual absl::Status CopyToHost(const Tensor& src, void* host) = 0;
  // dst = src on the device. REQUIRES: same number of bytes.
  virtual absl::Status CopyDeviceToDevice(const Tensor& src, const Tensor& dst) = 0;
  // Sets every float of `t` to `value`. REQUIRES: t is kFloat32.
  virtual absl::Status Fill(const Tensor& t, float value) = 0;
  // Blocks until all enqueued work is done.
  virtual absl::Status Synchronize() = 0;

  // --- Dense (inner product) -------------------------------------------------------------------
  // y[n, o] = x[n, i] w[o, i]^T + b[o]. x may be any rank; it is read as [dim(0), rest].
  virtual absl::Status DenseForward(const Tensor& x, const Tensor& w, const Tensor& b,
                                    const Tensor& y) = 0;
  // dx (nullable) = dy w; dw = dy^T x; db = sum over n of dy. With `accumulate`, dw += dy^T x
  // and db += sum over n of dy instead (a pipeline's micro-batches sum their weight gradients in
  // the GEMM rather than in a pass of their own).
  virtual absl::Status DenseBackward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                     const Tensor* dx, const Tensor& dw, const Tensor& db,
                                     bool accumulate) = 0;

  // --- Conv2D ----------------------------------------------------------------------------------
  virtual absl::Status Conv2DForward(const Conv2DGeometry& g, const Tensor& x, const Tensor& w,
                                     const Tensor& b, const Tensor& y) = 0;
  // dx (nullable): backward data; dw, db: backward filter and bias.
  // REQUIRES: x and w still hold the values of the last Conv2DForward with this geometry (a
  // backend may reuse what it derived from them).
  virtual absl::Status Conv2DBackward(const Conv2DGeometry& g, const Tensor& x, const Tensor& w,
                                      const Tensor& dy, const Tensor* dx, const Tensor& dw,
                                      const Tensor& db) = 0;

  // --- Pooling ---------------------------------------------------------------------------------
  // A pooling layer owns a workspace from PoolWorkspace() (it may be empty for a backend that
  // needs none); the forward pass of a training step writes it, and the backward pass reads it.
  virtual absl::StatusOr<Tensor> PoolWorkspace(const Pool2DGeometry& g) = 0;
  virtual absl::Status Pool2DForward(const Pool2DGeometry& g, const Tensor& x, const Tensor& y,
                                     const Tensor& workspace, bool training) = 0;
  // Reads x and y (cuDNN) or the workspace (oneDNN); writes dx.
  virtual absl::Status Pool2DBackward(const Pool2DGeometry& g, const Tensor& x, const Tensor& y,
                                      const Tensor& dy, const Tensor& workspace,
                                      const Tensor& dx) = 0;

  // --- Activations (element-wise, any shape; y may alias x in the forward pass) ----------------
  virtual absl::Status ActivationForward(Activation kind, const Tensor& x, const Tensor& y) = 0;
  // Reads x (ReLU) or y (tanh, sigmoid); x and y must still hold the forward values. The model
  // runs ReLU in place after Dense and Conv2D, so for ReLU x may be the same tensor as y (the
  // sign of relu(x) is all the backward pass needs).
  virtual absl::Status ActivationBackward(Activation kind, const Tensor& x, const Tensor& y,
                                          const Tensor& dy, const Tensor& dx) = 0;

  // --- Dropout ---------------------------------------------------------------------------------
  // mask[i] = DropoutUniform(seed, i) >= rate ? 1 / (1 - rate) : 0; y = x * mask.
  virtual absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x,
                                      const Tensor& mask, const Tensor& y) = 0;
  // dx = dy * mask.
  virtual absl::Status DropoutBackward(const Tensor& dy, const Tensor& mask, const Tensor& dx) = 0;

  // --- Batch normalisation ---------------------------------------------------------------------
  // Training: normalises with the batch statistics, writes save_mean and save_var ([c]; their
  // contents are backend-defined and only for BatchNormBackward of the same backend), and updates
  // moving_mean and moving_var in place.
  virtual absl::Status BatchNormForwardTraining(const BatchNormGeometry& g, const Tensor& x,
                                                const Tensor& gamma, const Tensor& beta,
                                                const Tensor& y, const Tensor& moving_mean,
                                                const Tensor& moving_var, const Tensor& save_mean,
                                                const Tensor& save_var) = 0;
  virtual absl::Status BatchNormForwardInference(const BatchNormGeometry& g, const Tensor& x,
                                                 const Tensor& gamma, const Tensor& beta,
                                                 const Tensor& moving_mean,
                                                 const Tensor& moving_var, const Tensor& y) = 0;
  virtual absl::Status BatchNormBackward(const BatchNormGeometry& g, const Tensor& x,
                                         const Tensor& gamma, const Tensor& save_mean,
                                         const Tensor& save_var, const Tensor& dy, const Tensor& dx,
                                         const Tensor& dgamma, const Tensor& dbeta) = 0;

  // --- EmbeddingBag ----------------------------------------------------------------------------
  // Bag b holds ids[offsets[b] .. offsets[b+1]) (int64, in [0, rows)), with per-id weights
  // `values` (nullable: all ones). out[b, :] = sum of values[j] * table[ids[j], :], divided by the
  // bag size for kMean (an empty bag gives zeros). offsets is int64 [n + 1] with offsets[0] == 0,
  // values float [nnz], out is [n, dim].
  virtual absl::Status EmbeddingBagForward(Combiner combiner, const Tensor& table,
                                           const Tensor& ids, const Tensor& offsets,
                                           const Tensor* values, const Tensor& out) = 0;
  // dtable = 0, then scatter-adds the gradient of each bag into the rows it read.
  virtual absl::Status EmbeddingBagBackward(Combiner combiner, const Tensor& ids,
                                            const Tensor& offsets, const Tensor* values,
                                            const Tensor& dout, const Tensor& dtable) = 0;

  // --- Multi-input models ----------------------------------------------------------------------
  // src and dst are float [rows, src_cols] and [rows, dst_cols] (rows = dim(0), cols = the rest):
  // dst[r, dst_offset + c] = src[r, src_offset + c] for c < width, or += when `accumulate`.
  virtual absl::Status CopyColumns(const Tensor& src, int64_t src_offset, const Tensor& dst,
                                   int64_t dst_offset, int64_t width, bool accumulate) = 0;
  // DLRM's dot interaction. x is [n, m, d] (m vectors per example); y is [n, cols]:
  // y[b, y_offset + k] = <x[b, i], x[b, j]> for i = 1..m-1, j = 0..i-1, k counting them.
  virtual absl::Status DotInteractionForward(const Tensor& x, const Tensor& y,
                                             int64_t y_offset) = 0;
  // dx [n, m, d] = the gradient through the dot products of dy[:, y_offset, ...] (overwritten).
  virtual absl::Status DotInteractionBackward(const Tensor& x, const Tensor& dy, int64_t y_offset,
                                              const Tensor& dx) = 0;

  // --- Losses ----------------------------------------------------------------------------------
  // logits [n, k]. labels: int32 [n] class indices for kSoftmaxCrossEntropy, float [n, k]
  // targets otherwise. Writes dlogits (the gradient of the mean loss, see model.proto for the
  // normalisation of each kind) and metrics, a float [2] device tensor: {loss (mean),
  // number of correct examples}. Does not synchronise.
  virtual absl::Status LossForwardBackward(LossKind kind, const Tensor& logits,
                                           const Tensor& labels, const Tensor* dlogits,
                                           const Tensor& metrics) = 0;

  // --- Element-wise and reductions -------------------------------------------------------------
  // y += alpha * x.
  virtual absl::Status Axpy(float alpha, const Tensor& x, const Tensor& y) = 0;
  // x *= alpha.
  virtual absl::Status Scale(float alpha, const Tensor& x) = 0;
  // Sum of squares of x, accumulated in double; synchronises.
  virtual absl::StatusOr<double> SquaredNorm(const Tensor& x) = 0;

  // --- Optimizer -------------------------------------------------------------------------------
  // One update of w from grad with the optimizer's slots (NumSlots(params.kind) tensors shaped
  // like w), as kernels::ApplyUpdateCpu defines it. The CPU backend calls ApplyUpdateCpu; the
  // CUDA backend runs its own kernel.
  virtual absl::Status ApplyUpdate(const OptimizerParams& params, float lr, int64_t t,
                                   float grad_scale, const Tensor& grad, const Tensor& w,
                                   absl::Span<const Tensor> slots) = 0;
};

// Which backend CreateBackend makes. The device strings of specs and flags are parsed by
// spec::ParseDeviceChoice (spec/device_spec.h).
enum class DeviceChoice { kAuto, kCpu, kCuda };

struct BackendOptions {
  DeviceChoice device = DeviceChoice::kAuto;
  // CPU: OpenMP threads for oneDNN and own loops; 0 keeps the OpenMP default (OMP_NUM_THREADS).
  int num_threads = 0;
  // CUDA: which device.
  int cuda_device = 0;
  // CPU: MemoryCapacityBytes() (0: the host's physical memory). For tests and shared hosts.
  int64_t memory_limit_bytes = 0;
};

// kAuto: CUDA when CudaDeviceCount() > 0, otherwise CPU. kCuda: FAILED_PRECONDITION when no device
// is usable (the message says why). kCpu: always the CPU backend.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options);

// The CPU (oneDNN) backend; kernels/cpu/cpu_backend_cpu.cc.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const BackendOptions& options);

// The CUDA (cuBLAS, cuDNN) backend, defined in kernels/cuda/ by the CUDA backend's author.
// CreateBackend() calls it only where TESSERA_HAVE_CUDA_BACKEND is defined (kernels/CMakeLists.txt
// defines it when KERNELS_HAVE_CUDA_BACKEND is set next to the CUDA backend's sources) and a
// device exists; otherwise kCuda is FAILED_PRECONDITION.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options);

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_BACKEND_H_
