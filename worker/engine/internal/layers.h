// The layers of a Model (internal to worker/engine). Each layer knows its input and output shapes
// (without the batch dimension) and runs its forward and backward ops on the backend. Shapes,
// parameters and defaults come from spec::InferModelShapes (spec/model_spec.h), which checked
// them; a layer only computes.
#ifndef TESSERA_WORKER_ENGINE_INTERNAL_LAYERS_H_
#define TESSERA_WORKER_ENGINE_INTERNAL_LAYERS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "spec/model_spec.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/cross_device_sum.h"
#include "worker/engine/model.h"

namespace tessera::engine {

// Sparse input of an EmbeddingBag first layer, on the device.
struct SparseInput {
  kernels::Tensor ids, offsets, values;  // values empty when the batch has none
};

struct ForwardArgs {
  int64_t n = 0;
  kernels::Tensor x, y;
  std::vector<kernels::Tensor>* scratch = nullptr;  // from Model::Layer::Scratch
  const SparseInput* sparse = nullptr;
  bool training = false;
  uint64_t dropout_seed = 0;
};

struct BackwardArgs {
  int64_t n = 0;
  kernels::Tensor x, y, dy;
  const kernels::Tensor* dx = nullptr;  // null for the first layer
  std::vector<kernels::Tensor>* scratch = nullptr;
  const SparseInput* sparse = nullptr;
  // Add this pass's parameter gradients to those in the grads (only for a layer that
  // AccumulatesGrads; micro-batches after the first).
  bool accumulate = false;
};

class Model::Layer {
 public:
  explicit Layer(const spec::LayerInfo& info)
      : name_(info.name),
        type_(info.type),
        in_shape_(info.input_shape),
        out_shape_(info.output_shape) {}
  virtual ~Layer() = default;

  const std::string& name() const { return name_; }
  const std::string& type() const { return type_; }
  const kernels::Shape& in_shape() const { return in_shape_; }
  const kernels::Shape& out_shape() const { return out_shape_; }

  // Receives the value and grad tensors of the layer's parameters (LayerInfo::parameters), in
  // that order.
  void Bind(std::vector<kernels::Tensor> values, std::vector<kernels::Tensor> grads) {
    values_ = std::move(values);
    grads_ = std::move(grads);
  }
  // Replaces the tensors of parameter `position` (a sparse table's rows, after SetRows).
  void Rebind(size_t position, kernels::Tensor value, kernels::Tensor grad) {
    values_[position] = std::move(value);
    grads_[position] = std::move(grad);
  }
  // Per-batch-size buffers the layer keeps between forward and backward.
  virtual absl::StatusOr<std::vector<kernels::Tensor>> Scratch(kernels::Backend* backend,
                                                               int64_t n) {
    return std::vector<kernels::Tensor>{};
  }
  // True when the output is a view of the input (Flatten): no buffers, no ops.
  virtual bool IsView() const { return false; }
  // True when the forward pass may overwrite its input with its output (ReLU: its backward pass
  // reads only the sign, which relu(x) keeps).
  virtual bool CanRunInPlace() const { return false; }
  // True when backward does not read this layer's own output (so a later layer may overwrite it).
  virtual bool BackwardIgnoresOutput() const { return false; }
  // True when backward needs a dx buffer even for the first layer (it always writes one).
  virtual bool WritesInputGrad() const { return false; }
  // True when Backward can add its parameter gradients to the grads (BackwardArgs::accumulate).
  virtual bool AccumulatesGrads() const { return false; }
  // SyncBN: the collective a synchronised BatchNorm sums its statistics with (others ignore it).
  virtual void SetCrossDeviceSum(CrossDeviceSum* sum) {}

  virtual absl::Status Forward(kernels::Backend* backend, const ForwardArgs& args) = 0;
  virtual absl::Status Backward(kernels::Backend* backend, const BackwardArgs& args) = 0;

 protected:
  std::vector<kernels::Tensor> values_, grads_;

 private:
  std::string name_, type_;
  kernels::Shape in_shape_, out_shape_;
};

// Makes the layer that `info` describes; `layer` is its spec (for the values shape inference does
// not resolve: dropout's rate, embedding_bag's combiner). INTERNAL for a layer without a kind.
// REQUIRES: `info` came from spec::InferModelShapes of the spec holding `layer`.
absl::StatusOr<std::unique_ptr<Model::Layer>> MakeLayer(const v1::Layer& layer,
                                                        const spec::LayerInfo& info);

}  // namespace tessera::engine

#endif  // TESSERA_WORKER_ENGINE_INTERNAL_LAYERS_H_
