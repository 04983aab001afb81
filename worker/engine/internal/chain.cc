#include "worker/engine/internal/chain.h"

#include "common/status_macros.h"

namespace tessera::engine::internal {

using kernels::Shape;
using kernels::Tensor;

Shape WithBatch(int64_t n, const Shape& s) {
  Shape r;
  r.reserve(s.size() + 1);
  r.push_back(n);
  r.insert(r.end(), s.begin(), s.end());
  return r;
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return INT64_MAX;
  return r;
}

int64_t SaturatingProduct(int64_t a, int64_t b) {
  const int64_t r = kernels::CheckedProduct(a, b);
  return r < 0 ? INT64_MAX : r;
}

namespace {

// A ReLU after Dense or Conv2D overwrites their output, which their backward pass never reads:
// one activation less to write and keep in cache.
bool InPlace(const Layers& layers, size_t i) {
  return i > 0 && layers[i]->CanRunInPlace() && layers[i - 1]->BackwardIgnoresOutput();
}

}  // namespace

uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t z = a + 0x9E3779B97F4A7C15ULL * (b + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

int64_t ChainBytesPerExample(const Layers& layers) {
  int64_t per_example = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t out = kernels::NumElements(layers[i]->out_shape());
    int64_t copies = 3;  // y, dy, scratch
    if (layers[i]->IsView()) {
      copies = i == 0 ? 1 : 0;
    } else if (InPlace(layers, i)) {
      copies = 2;
    }
    per_example = SaturatingAdd(per_example, SaturatingProduct(out, copies));
  }
  return SaturatingProduct(per_example, 4);
}

absl::Status AllocateChain(kernels::Backend* backend, const Layers& layers, int64_t n,
                           const Tensor& input, ChainBuffers* out) {
  const size_t count = layers.size();
  out->y.assign(count, Tensor());
  out->dy.assign(count, Tensor());
  out->scratch.assign(count, {});
  for (size_t i = 0; i < count; ++i) {
    const Shape shape = WithBatch(n, layers[i]->out_shape());
    if (layers[i]->IsView()) {
      out->y[i] = (i == 0 ? input : out->y[i - 1]).Reshaped(shape);
      if (i > 0) {
        out->dy[i] = out->dy[i - 1].Reshaped(shape);
      } else {
        TESSERA_ASSIGN_OR_RETURN(out->dy[i], backend->Allocate(shape));
      }
    } else if (InPlace(layers, i)) {
      out->y[i] = out->y[i - 1];
      TESSERA_ASSIGN_OR_RETURN(out->dy[i], backend->Allocate(shape));
    } else {
      TESSERA_ASSIGN_OR_RETURN(out->y[i], backend->Allocate(shape));
      TESSERA_ASSIGN_OR_RETURN(out->dy[i], backend->Allocate(shape));
    }
    TESSERA_ASSIGN_OR_RETURN(out->scratch[i], layers[i]->Scratch(backend, n));
  }
  return absl::OkStatus();
}

absl::Status ForwardChain(kernels::Backend* backend, const Layers& layers, int64_t n,
                          const Tensor& input, ChainBuffers& buffers, const SparseInput* sparse,
                          bool training, uint64_t seed, uint64_t seed_offset,
                          const Model::BeforeLayer& before_layer) {
  for (size_t i = 0; i < layers.size(); ++i) {
    if (before_layer) TESSERA_RETURN_IF_ERROR(before_layer(static_cast<int>(i)));
    ForwardArgs args;
    args.n = n;
    args.x = i == 0 ? input : buffers.y[i - 1];
    args.y = buffers.y[i];
    args.scratch = &buffers.scratch[i];
    args.sparse = sparse;
    args.training = training;
    args.dropout_seed = Mix(seed, seed_offset + i);
    TESSERA_RETURN_IF_ERROR(layers[i]->Forward(backend, args));
  }
  return absl::OkStatus();
}

absl::Status BackwardChain(kernels::Backend* backend, const Layers& layers,
                           const std::vector<spec::LayerInfo>& infos,
                           const std::vector<std::vector<int>>& layer_parameters, int64_t n,
                           const Tensor& input, const Tensor* input_grad, ChainBuffers& buffers,
                           const SparseInput* sparse, bool accumulate,
                           const std::function<void(int)>& on_grad_ready) {
  for (size_t k = layers.size(); k-- > 0;) {
    Model::Layer& layer = *layers[k];
    const Tensor* dx = nullptr;
    if (k > 0) {
      dx = &buffers.dy[k - 1];
    } else if (input_grad != nullptr) {
      dx = input_grad;
    } else if (infos[k].parameters.empty()) {
      continue;  // nothing to compute for a first layer without parameters
    }
    BackwardArgs args;
    args.n = n;
    args.x = k == 0 ? input : buffers.y[k - 1];
    args.y = buffers.y[k];
    args.dy = buffers.dy[k];
    args.dx = dx;
    args.scratch = &buffers.scratch[k];
    args.sparse = sparse;
    args.accumulate = accumulate && layer.AccumulatesGrads();
    TESSERA_RETURN_IF_ERROR(layer.Backward(backend, args));
    if (on_grad_ready) {
      for (int p : layer_parameters[k]) on_grad_ready(p);
    }
  }
  return absl::OkStatus();
}

}  // namespace tessera::engine::internal
