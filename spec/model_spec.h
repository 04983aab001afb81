// Shape inference of a ModelSpec (proto/tessera/v1/model.proto), without a device.
//
// InferModelShapes() checks the whole spec (unknown fields, the loss, the input shape, layer
// names, every layer's fields against its input) and works out, layer by layer, the output shape,
// the parameters with their shapes and resolved initializers, and the windows of convolutions and
// pooling, with every default of model.proto filled in. The coordinator calls it through
// ValidateJobSpec (spec/job_spec.h) to refuse a spec at CreateJob; the worker's engine builds its
// layers from the result (worker/engine/model.h), so both read one set of rules.
#ifndef TESSERA_SPEC_MODEL_SPEC_H_
#define TESSERA_SPEC_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/model.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::spec {

// The dimensions of one example, without the batch dimension: [features], or
// [channels, height, width]. The same type as kernels::Shape.
using Shape = std::vector<int64_t>;

// A tensor that a layer owns. The engine allocates it, initialises it from the model seed and
// binds the layer to it in this order; the shards hold the trainable ones.
struct ParameterShape {
  std::string suffix;  // "kernel", "bias", "gamma", "beta", "moving_mean", "embeddings", ...
  Shape shape;
  v1::WeightInitializer init;  // resolved: never KIND_UNSPECIFIED
  int64_t fan_in = 0, fan_out = 0;
  bool trainable = true;  // false for the batch-norm moving statistics
  bool sparse = false;    // embedding tables: sparse rows on the shards (DESIGN.md §2)
  v1::RowLifecycle lifecycle = v1::RowLifecycle();  // sparse: admission and eviction of rows
};

// The window of a conv2d or pooling layer over its input seen as [channels, height, width] (a
// rank-2 input is one channel), defaults filled in. The output is [filters or channels, out_h,
// out_w] with out_h = (height + 2 * pad_h - kernel_h) / stride_h + 1 (and so for w).
struct Window2D {
  int64_t channels = 0, height = 0, width = 0;
  int64_t kernel_h = 0, kernel_w = 0;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t out_h = 0, out_w = 0;
};

// The statistics of a batch_norm layer: `channels` of `spatial` values per example each (1 for a
// [features] input), momentum and epsilon with their defaults filled in, and whether they are
// synchronised across a worker's devices.
struct BatchNormShape {
  int64_t channels = 0, spatial = 1;
  float momentum = 0.1f;
  float epsilon = 1e-5f;
  bool sync = false;  // SyncBN: statistics over all of a worker's devices
};

// One layer after shape inference.
struct LayerInfo {
  std::string name;  // the spec's, or "<type>_<k>" ("dense_1")
  std::string type;  // "dense", "conv2d", "max_pool2d", ...
  Shape input_shape;
  Shape output_shape;                      // without the batch dimension
  std::vector<ParameterShape> parameters;  // empty for layers without parameters
  Window2D window;                         // conv2d, max_pool2d and avg_pool2d only
  BatchNormShape batch_norm;               // batch_norm only
};

// An embedding table of a multi-input model after shape inference.
struct TableShape {
  std::string name;           // the spec's ("C1")
  ParameterShape embeddings;  // suffix "embeddings", shape {0, dim}, sparse, initializer resolved
  // The data fields (indices into sparse_features) whose ids it looks up, in order. A deep
  // table pools each field into its own [dim] vector (one bag per field and example); the wide
  // table pools every field's ids into one bag per example.
  std::vector<int> fields;
  bool wide = false;
  int64_t dim() const { return embeddings.shape[1]; }
};

// One sparse feature (a categorical field of the data) after shape inference.
struct FieldShape {
  std::string name;  // the spec's, or "sparse_features[i]"
  int table = 0;     // index into MultiInputShapes::tables
  v1::EmbeddingBag::Combiner combiner = v1::EmbeddingBag::COMBINER_SUM;  // resolved
};

// The input side of a multi-input model (ModelSpec.tables not empty).
struct MultiInputShapes {
  int64_t dense_features = 0;
  std::vector<LayerInfo> bottom;  // on [dense_features]
  int64_t bottom_width = 0;       // u's width: the bottom's output, or dense_features
  std::vector<FieldShape> fields;
  std::vector<TableShape> tables;                                    // spec order
  int wide_table = -1;                                               // index into tables, or -1
  v1::Interaction::Kind interaction = v1::Interaction::KIND_CONCAT;  // resolved
  // The interaction's input [u, e_1, ..., e_F] (the deep fields in sparse_features order), and
  // its output, the top layers' input.
  int64_t concat_width = 0;
  int64_t interaction_width = 0;
};

// A whole model after shape inference.
struct ModelShapes {
  // The spec's input_shape, or [num_rows] when the first layer is an embedding_bag.
  Shape input_shape;
  // True when the first layer is an embedding_bag (the model reads sparse batches).
  bool sparse_input = false;
  std::vector<LayerInfo> layers;  // one per spec layer, in order (a multi-input model's top)
  int64_t output_dim = 0;         // outputs per example (the last layer's elements)
  // True when the spec declares tables: the model reads dense features and sparse fields, and
  // `multi` describes its input side; input_shape is then [interaction_width].
  bool multi_input = false;
  MultiInputShapes multi;
};

// The widest embedding row a table may declare (SparseTableDecl.dim is 32 bits; a row of 64 Ki
// floats is 256 KiB, far beyond any embedding in use).
inline constexpr int64_t kMaxRowWidth = 65536;

// The deepest model a spec may declare. Deeper ones are refused here, at submission, rather than
// failing on a worker (each layer keeps its activations for the backward pass).
inline constexpr int kMaxLayers = 1000;

// Checks `spec` and infers every layer's shapes. Pure; thread-safe. INVALID_ARGUMENT names the
// layer or the field: "layers[3] (dense_2): dense.units must be > 0, got 0",
// "input_shape: must have 1 to 3 dimensions ...", "loss: ...", "layers[0]: unknown field
// number 99".
absl::StatusOr<ModelShapes> InferModelShapes(const v1::ModelSpec& spec);

// True when the model has sparse tables: an embedding_bag first layer, or declared tables
// (a multi-input model). Such a model's rows travel per batch. Pure.
inline bool HasSparseTables(const v1::ModelSpec& spec) {
  return !spec.tables().empty() || (spec.layers_size() > 0 && spec.layers(0).has_embedding_bag());
}

// True when a batch_norm layer of the model asks for synchronised statistics (SyncBN). Pure.
inline bool HasSyncBatchNorm(const v1::ModelSpec& spec) {
  for (const auto* layers : {&spec.layers(), &spec.bottom_layers()}) {
    for (const v1::Layer& layer : *layers) {
      if (layer.has_batch_norm() && layer.batch_norm().sync()) return true;
    }
  }
  return false;
}

// How the rows of the sparse table `table` (a ParameterShape with sparse set, as
// InferModelShapes gave it) named `name` ("embedding_bag_1/embeddings") are initialised on
// first touch, wherever they live: the shards (SparseTableDecl.initializer) and the standalone
// trainer's row table draw row r from (initializer, r) alike. NORMAL keeps its stddev,
// ZEROS and CONSTANT stay; a table with a row count maps GLOROT_UNIFORM to
// U(-sqrt(6 / (rows + dim)), +...) and HE_NORMAL to N(0, 2 / rows). The seed is a function of
// `model_seed` and `name`. Pure.
v1::Initializer RowInitializer(const ParameterShape& table, uint64_t model_seed,
                               absl::string_view name);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_MODEL_SPEC_H_
