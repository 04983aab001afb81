// The layers of a Model (internal to worker/engine). Each layer knows its input and output shapes
// (without the batch dimension), declares its parameters, and runs its forward and backward ops on
// the backend. Shapes are checked once, when the layer is made from its spec.
#ifndef TESSERA_WORKER_ENGINE_INTERNAL_LAYERS_H_
#define TESSERA_WORKER_ENGINE_INTERNAL_LAYERS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/model.h"

namespace tessera::engine {

// A parameter a layer asks for; the model allocates it and hands the tensors back in order.
struct ParameterDecl {
  std::string suffix;  // "kernel", "bias", "gamma", ...
  kernels::Shape shape;
  v1::WeightInitializer init;  // resolved (never KIND_UNSPECIFIED)
  int64_t fan_in = 0, fan_out = 0;
  bool trainable = true;
  bool sparse = false;
};

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
};

class Model::Layer {
 public:
  Layer(std::string name, std::string type, kernels::Shape in_shape, kernels::Shape out_shape)
      : name_(std::move(name)),
        type_(std::move(type)),
        in_shape_(std::move(in_shape)),
        out_shape_(std::move(out_shape)) {}
  virtual ~Layer() = default;

  const std::string& name() const { return name_; }
  const std::string& type() const { return type_; }
  const kernels::Shape& in_shape() const { return in_shape_; }
  const kernels::Shape& out_shape() const { return out_shape_; }

  virtual std::vector<ParameterDecl> Parameters() const { return {}; }
  // Receives the declared parameters' value and grad tensors, in declaration order.
  void Bind(std::vector<kernels::Tensor> values, std::vector<kernels::Tensor> grads) {
    values_ = std::move(values);
    grads_ = std::move(grads);
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
  // True when backward does anything when it is the first layer (it has parameters).
  bool HasParameters() const { return !Parameters().empty(); }

  virtual absl::Status Forward(kernels::Backend* backend, const ForwardArgs& args) = 0;
  virtual absl::Status Backward(kernels::Backend* backend, const BackwardArgs& args) = 0;

 protected:
  std::vector<kernels::Tensor> values_, grads_;

 private:
  std::string name_, type_;
  kernels::Shape in_shape_, out_shape_;
};

// Makes layer `index` from its spec, given its input shape; INVALID_ARGUMENT names the layer.
// `name` is the resolved name (the spec's or "<type>_<k>").
absl::StatusOr<std::unique_ptr<Model::Layer>> MakeLayer(const v1::Layer& spec, int index,
                                                        const std::string& name,
                                                        const kernels::Shape& in_shape);

// The default-name prefix of a layer kind ("dense", "conv2d", ...), or "" when no kind is set.
std::string LayerTypeName(const v1::Layer& spec);

}  // namespace tessera::engine

#endif  // TESSERA_WORKER_ENGINE_INTERNAL_LAYERS_H_
