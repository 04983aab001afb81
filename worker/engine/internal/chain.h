// A chain of layers (internal to worker/engine): the buffers one batch size needs, forward and
// backward. A Model runs one chain (its layers), or, for a multi-input model, two: the bottom
// layers on the dense features and the top layers on the interaction's output.
#ifndef TESSERA_WORKER_ENGINE_INTERNAL_CHAIN_H_
#define TESSERA_WORKER_ENGINE_INTERNAL_CHAIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "spec/model_spec.h"
#include "worker/engine/internal/layers.h"
#include "worker/engine/model.h"

namespace tessera::engine::internal {

// Per layer: its output, output gradient and scratch, for one batch size.
struct ChainBuffers {
  std::vector<kernels::Tensor> y, dy;
  std::vector<std::vector<kernels::Tensor>> scratch;
};

using Layers = std::vector<std::unique_ptr<Model::Layer>>;

// Allocates the buffers of `layers` for a batch of `n` on `input` ([n, ...]): views share
// memory, and a ReLU after a layer whose backward pass ignores its output runs in place.
absl::Status AllocateChain(kernels::Backend* backend, const Layers& layers, int64_t n,
                           const kernels::Tensor& input, ChainBuffers* out);

// Bytes per example of AllocateChain's buffers (saturating at the int64 maximum).
int64_t ChainBytesPerExample(const Layers& layers);

// Forward through every layer; layer i's dropout seed is Mix(seed, seed_offset + i). With
// `before_layer`, before_layer(i) runs before layer i (its error ends the pass).
absl::Status ForwardChain(kernels::Backend* backend, const Layers& layers, int64_t n,
                          const kernels::Tensor& input, ChainBuffers& buffers,
                          const SparseInput* sparse, bool training, uint64_t seed,
                          uint64_t seed_offset, const Model::BeforeLayer& before_layer = {});

// Backward from buffers.dy.back(), last layer first. The first layer writes `input_grad` when
// it is not null (always, when the layer WritesInputGrad); a first layer without parameters
// and no input_grad is skipped. With `accumulate`, the layers that AccumulatesGrads add their
// gradients to the grads. After each layer, `on_grad_ready` (may be empty) gets the indices of
// its parameters in `layer_parameters`.
absl::Status BackwardChain(kernels::Backend* backend, const Layers& layers,
                           const std::vector<spec::LayerInfo>& infos,
                           const std::vector<std::vector<int>>& layer_parameters, int64_t n,
                           const kernels::Tensor& input, const kernels::Tensor* input_grad,
                           ChainBuffers& buffers, const SparseInput* sparse, bool accumulate,
                           const std::function<void(int)>& on_grad_ready);

// The dropout seeds' mix of a seed and a layer index (SplitMix64).
uint64_t Mix(uint64_t a, uint64_t b);

// [n, s...].
kernels::Shape WithBatch(int64_t n, const kernels::Shape& s);
// a + b and a * b for sizes >= 0, saturating at the int64 maximum (a saturated size never fits
// anywhere).
int64_t SaturatingAdd(int64_t a, int64_t b);
int64_t SaturatingProduct(int64_t a, int64_t b);

}  // namespace tessera::engine::internal

#endif  // TESSERA_WORKER_ENGINE_INTERNAL_CHAIN_H_
