// The device buffers of a Model for one batch size (internal to worker/engine): model.cc and,
// for a multi-input model's input side, model_multi_input.cc.
#ifndef TESSERA_WORKER_ENGINE_INTERNAL_ACTIVATIONS_H_
#define TESSERA_WORKER_ENGINE_INTERNAL_ACTIVATIONS_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "worker/engine/internal/chain.h"
#include "worker/engine/internal/layers.h"
#include "worker/engine/model.h"

namespace tessera::engine::internal {

// One table's bags of a batch: a deep table pools each of its k fields into its own bag (bag
// b * k + j is field j of example b), the wide table pools every field into one bag per example.
struct TableBuffers {
  SparseInput sparse;  // views of the storage below
  kernels::Tensor ids_storage, values_storage;
  std::vector<int64_t> host_offsets, host_ids;
  std::vector<float> host_values;
  kernels::Tensor out, dout;  // [bags, dim]
};

struct MultiInputBuffers {
  kernels::Tensor dense, dense_grad;  // [n, dense_features]; the gradient only when needed
  ChainBuffers bottom;
  std::vector<TableBuffers> tables;
  kernels::Tensor concat, dconcat;  // [n, concat_width]: u, then the fields' pooled vectors
};

}  // namespace tessera::engine::internal

namespace tessera::engine {

struct Model::Activations {
  int64_t n = 0;
  uint64_t last_used = 0;
  // Dense models: [n, input_shape...]; multi-input models: the interaction's output, which the
  // top layers read.
  kernels::Tensor input;
  SparseInput sparse;  // sparse models: views of the storage below
  kernels::Tensor ids_storage, values_storage;
  std::vector<int64_t> host_offsets;
  // Only when the first layer always writes an input gradient; multi-input models: always.
  kernels::Tensor input_grad;
  internal::ChainBuffers top;  // the layers' (a multi-input model's top layers')
  kernels::Tensor labels;
  internal::MultiInputBuffers multi;  // multi-input models only
};

}  // namespace tessera::engine

#endif  // TESSERA_WORKER_ENGINE_INTERNAL_ACTIVATIONS_H_
