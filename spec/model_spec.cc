#include "spec/model_spec.h"

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "google/protobuf/unknown_field_set.h"
#include "spec/internal/shape_math.h"
#include "spec/pipeline_spec.h"
#include "spec/row_lifecycle_spec.h"

namespace tessera::spec {
namespace {

using internal::CheckedNumElements;
using internal::CheckedProduct;
using internal::NumElements;
using internal::ShapeString;

// Sizes beyond this per example are refused (they would overflow the 32-bit indexing of the
// compute libraries, and no model here needs them).
constexpr int64_t kMaxElements = int64_t{1} << 31;

// INVALID_ARGUMENT when `msg` or any message inside it carries fields this build does not know
// (a spec written for a newer schema, or a typo that reached the binary encoding).
absl::Status CheckNoUnknownFields(const google::protobuf::Message& msg, const std::string& path) {
  const google::protobuf::Reflection* r = msg.GetReflection();
  const google::protobuf::UnknownFieldSet& unknown = r->GetUnknownFields(msg);
  if (!unknown.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path.empty() ? "model" : path, ": unknown field number ", unknown.field(0).number()));
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(msg, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    const std::string base = path.empty() ? f->name() : absl::StrCat(path, ".", f->name());
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(msg, f); ++i) {
        TESSERA_RETURN_IF_ERROR(CheckNoUnknownFields(r->GetRepeatedMessage(msg, f, i),
                                                     absl::StrCat(base, "[", i, "]")));
      }
    } else {
      TESSERA_RETURN_IF_ERROR(CheckNoUnknownFields(r->GetMessage(msg, f), base));
    }
  }
  return absl::OkStatus();
}

bool ValidLayerName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

// The default-name prefix of a layer kind ("dense", "conv2d", ...), or "" when no kind is set.
std::string LayerTypeName(const v1::Layer& spec) {
  switch (spec.kind_case()) {
    case v1::Layer::kDense:
      return "dense";
    case v1::Layer::kConv2D:
      return "conv2d";
    case v1::Layer::kMaxPool2D:
      return "max_pool2d";
    case v1::Layer::kAvgPool2D:
      return "avg_pool2d";
    case v1::Layer::kRelu:
      return "relu";
    case v1::Layer::kTanh:
      return "tanh";
    case v1::Layer::kSigmoid:
      return "sigmoid";
    case v1::Layer::kDropout:
      return "dropout";
    case v1::Layer::kFlatten:
      return "flatten";
    case v1::Layer::kBatchNorm:
      return "batch_norm";
    case v1::Layer::kEmbeddingBag:
      return "embedding_bag";
    case v1::Layer::KIND_NOT_SET:
      return "";
  }
  return "";
}

// --- One layer -----------------------------------------------------------------------------------
// Each Infer* function checks layer `index` against its input shape (info->input_shape) and fills
// the rest of *info; INVALID_ARGUMENT names the layer.

absl::Status LayerError(int index, const std::string& name, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("layers[", index, "] (", name, "): ", what));
}

v1::WeightInitializer Resolve(const v1::WeightInitializer& init,
                              v1::WeightInitializer::Kind default_kind) {
  v1::WeightInitializer r = init;
  if (r.kind() == v1::WeightInitializer::KIND_UNSPECIFIED) r.set_kind(default_kind);
  return r;
}

absl::Status CheckInitializer(int index, const std::string& name, const char* field,
                              const v1::WeightInitializer& init) {
  if (!v1::WeightInitializer::Kind_IsValid(init.kind())) {
    return LayerError(index, name, absl::StrCat(field, ".kind: unknown value ", init.kind()));
  }
  if (!std::isfinite(init.stddev()) || init.stddev() < 0) {
    return LayerError(
        index, name,
        absl::StrCat(field, ".stddev: must be a finite number >= 0, got ", init.stddev()));
  }
  if (!std::isfinite(init.value())) {
    return LayerError(index, name, absl::StrCat(field, ".value: must be finite"));
  }
  return absl::OkStatus();
}

absl::Status CheckSize(int index, const std::string& name, const std::string& field,
                       int64_t value) {
  if (value <= 0) {
    return LayerError(index, name, absl::StrCat(field, " must be > 0, got ", value));
  }
  if (value > kMaxElements) {
    return LayerError(index, name,
                      absl::StrCat(field, " must be <= ", kMaxElements, ", got ", value));
  }
  return absl::OkStatus();
}

// [C, H, W] view of a rank-2 or rank-3 example shape.
bool AsImage(const Shape& s, Window2D* w) {
  if (s.size() == 3) {
    w->channels = s[0], w->height = s[1], w->width = s[2];
    return true;
  }
  if (s.size() == 2) {
    w->channels = 1, w->height = s[0], w->width = s[1];
    return true;
  }
  return false;
}

absl::Status InferDense(const v1::Dense& d, int index, LayerInfo* info) {
  const std::string& name = info->name;
  const Shape& in = info->input_shape;
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "dense.units", d.units()));
  const int64_t in_features = NumElements(in);
  if (d.in_features() != 0 && d.in_features() != in_features) {
    return LayerError(
        index, name,
        absl::StrCat("dense.in_features is ", d.in_features(), " but the input of this layer has ",
                     in_features, " features (shape ", ShapeString(in), ")"));
  }
  TESSERA_RETURN_IF_ERROR(
      CheckInitializer(index, name, "dense.kernel_initializer", d.kernel_initializer()));
  TESSERA_RETURN_IF_ERROR(
      CheckInitializer(index, name, "dense.bias_initializer", d.bias_initializer()));
  const int64_t kernel_elements = CheckedProduct(in_features, d.units());
  if (kernel_elements < 0 || kernel_elements > kMaxElements) {
    return LayerError(
        index, name,
        absl::StrCat("dense kernel of ", d.units(), " x ", in_features, " is too large"));
  }
  const int64_t out = d.units();
  info->output_shape = {out};
  info->parameters = {
      {"kernel",
       {out, in_features},
       Resolve(d.kernel_initializer(), v1::WeightInitializer::KIND_GLOROT_UNIFORM),
       in_features,
       out},
      {"bias",
       {out},
       Resolve(d.bias_initializer(), v1::WeightInitializer::KIND_ZEROS),
       in_features,
       out},
  };
  return absl::OkStatus();
}

absl::Status InferConv2D(const v1::Conv2D& c, int index, LayerInfo* info) {
  const std::string& name = info->name;
  Window2D& g = info->window;
  if (!AsImage(info->input_shape, &g)) {
    return LayerError(index, name,
                      absl::StrCat("conv2d needs a [channels, height, width] input, got ",
                                   ShapeString(info->input_shape)));
  }
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.filters", c.filters()));
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.kernel_h", c.kernel_h()));
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.kernel_w", c.kernel_w()));
  const int64_t k = c.filters();
  g.kernel_h = c.kernel_h();
  g.kernel_w = c.kernel_w();
  g.stride_h = c.stride_h() == 0 ? 1 : c.stride_h();
  g.stride_w = c.stride_w() == 0 ? 1 : c.stride_w();
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.stride_h", g.stride_h));
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.stride_w", g.stride_w));
  if (c.padding_h() < 0 || c.padding_w() < 0 || c.padding_h() > kMaxElements ||
      c.padding_w() > kMaxElements) {
    return LayerError(index, name,
                      absl::StrCat("conv2d.padding_h and padding_w must be in [0, ", kMaxElements,
                                   "], got ", c.padding_h(), " and ", c.padding_w()));
  }
  g.pad_h = c.padding_h();
  g.pad_w = c.padding_w();
  if (g.height + 2 * g.pad_h < g.kernel_h || g.width + 2 * g.pad_w < g.kernel_w) {
    return LayerError(index, name,
                      absl::StrCat("conv2d kernel ", g.kernel_h, "x", g.kernel_w,
                                   " is larger than the padded input ", g.height + 2 * g.pad_h, "x",
                                   g.width + 2 * g.pad_w));
  }
  TESSERA_RETURN_IF_ERROR(
      CheckInitializer(index, name, "conv2d.kernel_initializer", c.kernel_initializer()));
  TESSERA_RETURN_IF_ERROR(
      CheckInitializer(index, name, "conv2d.bias_initializer", c.bias_initializer()));
  g.out_h = (g.height + 2 * g.pad_h - g.kernel_h) / g.stride_h + 1;
  g.out_w = (g.width + 2 * g.pad_w - g.kernel_w) / g.stride_w + 1;
  const int64_t out_elements = CheckedNumElements({k, g.out_h, g.out_w});
  const int64_t kernel_elements = CheckedNumElements({k, g.channels, g.kernel_h, g.kernel_w});
  if (out_elements < 0 || out_elements > kMaxElements || kernel_elements < 0 ||
      kernel_elements > kMaxElements) {
    return LayerError(index, name,
                      absl::StrCat("conv2d output [", k, ", ", g.out_h, ", ", g.out_w,
                                   "] or kernel [", k, ", ", g.channels, ", ", g.kernel_h, ", ",
                                   g.kernel_w, "] has more than ", kMaxElements, " elements"));
  }
  info->output_shape = {k, g.out_h, g.out_w};
  const int64_t fan_in = g.channels * g.kernel_h * g.kernel_w;
  const int64_t fan_out = k * g.kernel_h * g.kernel_w;
  info->parameters = {
      {"kernel",
       {k, g.channels, g.kernel_h, g.kernel_w},
       Resolve(c.kernel_initializer(), v1::WeightInitializer::KIND_GLOROT_UNIFORM),
       fan_in,
       fan_out},
      {"bias",
       {k},
       Resolve(c.bias_initializer(), v1::WeightInitializer::KIND_ZEROS),
       fan_in,
       fan_out},
  };
  return absl::OkStatus();
}

absl::Status InferPool(const v1::Pool2D& p, int index, LayerInfo* info) {
  const std::string& name = info->name;
  const std::string& type = info->type;
  Window2D& g = info->window;
  if (!AsImage(info->input_shape, &g)) {
    return LayerError(index, name,
                      absl::StrCat(type, " needs a [channels, height, width] input, got ",
                                   ShapeString(info->input_shape)));
  }
  g.kernel_h = p.pool_h() == 0 ? 2 : p.pool_h();
  g.kernel_w = p.pool_w() == 0 ? 2 : p.pool_w();
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, absl::StrCat(type, ".pool_h"), g.kernel_h));
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, absl::StrCat(type, ".pool_w"), g.kernel_w));
  g.stride_h = p.stride_h() == 0 ? g.kernel_h : p.stride_h();
  g.stride_w = p.stride_w() == 0 ? g.kernel_w : p.stride_w();
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, absl::StrCat(type, ".stride_h"), g.stride_h));
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, absl::StrCat(type, ".stride_w"), g.stride_w));
  g.pad_h = p.padding_h();
  g.pad_w = p.padding_w();
  if (g.pad_h < 0 || g.pad_h >= g.kernel_h) {
    return LayerError(
        index, name,
        absl::StrCat(type, ".padding_h must be in [0, pool_h = ", g.kernel_h, "), got ", g.pad_h));
  }
  if (g.pad_w < 0 || g.pad_w >= g.kernel_w) {
    return LayerError(
        index, name,
        absl::StrCat(type, ".padding_w must be in [0, pool_w = ", g.kernel_w, "), got ", g.pad_w));
  }
  if (g.height + 2 * g.pad_h < g.kernel_h || g.width + 2 * g.pad_w < g.kernel_w) {
    return LayerError(
        index, name,
        absl::StrCat(type, " window ", g.kernel_h, "x", g.kernel_w, " is larger than the padded ",
                     "input ", g.height + 2 * g.pad_h, "x", g.width + 2 * g.pad_w));
  }
  g.out_h = (g.height + 2 * g.pad_h - g.kernel_h) / g.stride_h + 1;
  g.out_w = (g.width + 2 * g.pad_w - g.kernel_w) / g.stride_w + 1;
  Shape out{g.channels, g.out_h, g.out_w};
  const int64_t out_elements = CheckedNumElements(out);
  if (out_elements < 0 || out_elements > kMaxElements) {
    return LayerError(index, name,
                      absl::StrCat(type, " output ", ShapeString(out), " has more than ",
                                   kMaxElements, " elements"));
  }
  info->output_shape = std::move(out);
  return absl::OkStatus();
}

absl::Status InferBatchNorm(const v1::BatchNorm& b, int index, LayerInfo* info) {
  const std::string& name = info->name;
  const Shape& in = info->input_shape;
  BatchNormShape& norm = info->batch_norm;
  norm.momentum = b.momentum() == 0.0f ? 0.1f : b.momentum();
  norm.epsilon = b.epsilon() == 0.0f ? 1e-5f : b.epsilon();
  norm.sync = b.sync();
  if (!(norm.momentum > 0.0f && norm.momentum <= 1.0f)) {
    return LayerError(index, name,
                      absl::StrCat("batch_norm.momentum must be in (0, 1], got ", b.momentum()));
  }
  if (!(norm.epsilon > 0.0f) || !std::isfinite(norm.epsilon)) {
    return LayerError(index, name,
                      absl::StrCat("batch_norm.epsilon must be > 0, got ", b.epsilon()));
  }
  if (in.size() == 1) {
    norm.channels = in[0];
    norm.spatial = 1;
  } else if (in.size() == 3) {
    norm.channels = in[0];
    norm.spatial = in[1] * in[2];
  } else {
    return LayerError(index, name,
                      absl::StrCat("batch_norm needs a [features] or [channels, height, width] ",
                                   "input, got ", ShapeString(in)));
  }
  info->output_shape = in;
  v1::WeightInitializer ones, zeros;
  ones.set_kind(v1::WeightInitializer::KIND_CONSTANT);
  ones.set_value(1.0f);
  zeros.set_kind(v1::WeightInitializer::KIND_ZEROS);
  const int64_t c = norm.channels;
  info->parameters = {
      {"gamma", {c}, ones, c, c},
      {"beta", {c}, zeros, c, c},
      {"moving_mean", {c}, zeros, c, c, /*trainable=*/false},
      {"moving_variance", {c}, ones, c, c, /*trainable=*/false},
  };
  return absl::OkStatus();
}

absl::Status InferEmbeddingBag(const v1::EmbeddingBag& e, int index, LayerInfo* info) {
  const std::string& name = info->name;
  if (index != 0) {
    return LayerError(index, name,
                      "embedding_bag must be the first layer (it reads the "
                      "sparse input)");
  }
  // num_rows 0: hashed ids, any int64 value; the rows exist only on the shards.
  if (e.num_rows() != 0) {
    TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "embedding_bag.num_rows", e.num_rows()));
  }
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "embedding_bag.dim", e.dim()));
  if (e.dim() > kMaxRowWidth) {
    return LayerError(
        index, name,
        absl::StrCat("embedding_bag.dim must be <= ", kMaxRowWidth, ", got ", e.dim()));
  }
  if (!v1::EmbeddingBag::Combiner_IsValid(e.combiner())) {
    return LayerError(index, name,
                      absl::StrCat("embedding_bag.combiner: unknown value ", e.combiner()));
  }
  TESSERA_RETURN_IF_ERROR(CheckInitializer(index, name, "embedding_bag.embeddings_initializer",
                                           e.embeddings_initializer()));
  info->input_shape = {e.num_rows()};
  info->output_shape = {e.dim()};
  v1::WeightInitializer init = e.embeddings_initializer();
  if (init.kind() == v1::WeightInitializer::KIND_UNSPECIFIED) {
    init.set_kind(v1::WeightInitializer::KIND_NORMAL);
    init.set_stddev(0.01f);
  }
  if (e.num_rows() == 0 && (init.kind() == v1::WeightInitializer::KIND_GLOROT_UNIFORM ||
                            init.kind() == v1::WeightInitializer::KIND_HE_NORMAL)) {
    return LayerError(
        index, name,
        absl::StrCat("embedding_bag.embeddings_initializer.kind: ",
                     v1::WeightInitializer::Kind_Name(init.kind()),
                     " needs the table's row count; a hashed table (num_rows 0) takes KIND_NORMAL, "
                     "KIND_ZEROS or KIND_CONSTANT"));
  }
  const absl::Status lifecycle = ValidateRowLifecycle(e.lifecycle(), "embedding_bag.lifecycle");
  if (!lifecycle.ok()) return LayerError(index, name, std::string(lifecycle.message()));
  ParameterShape table{"embeddings", {e.num_rows(), e.dim()}, init, e.num_rows(), e.dim()};
  table.sparse = true;
  table.lifecycle = e.lifecycle();
  info->parameters = {table};
  return absl::OkStatus();
}

// Checks layer `index` (named `name`) against its input shape `in` and infers the rest.
absl::StatusOr<LayerInfo> InferLayer(const v1::Layer& spec, int index, const std::string& name,
                                     const Shape& in) {
  LayerInfo info;
  info.name = name;
  info.type = LayerTypeName(spec);
  info.input_shape = in;
  switch (spec.kind_case()) {
    case v1::Layer::kDense:
      TESSERA_RETURN_IF_ERROR(InferDense(spec.dense(), index, &info));
      return info;
    case v1::Layer::kConv2D:
      TESSERA_RETURN_IF_ERROR(InferConv2D(spec.conv2d(), index, &info));
      return info;
    case v1::Layer::kMaxPool2D:
      TESSERA_RETURN_IF_ERROR(InferPool(spec.max_pool2d(), index, &info));
      return info;
    case v1::Layer::kAvgPool2D:
      TESSERA_RETURN_IF_ERROR(InferPool(spec.avg_pool2d(), index, &info));
      return info;
    case v1::Layer::kRelu:
    case v1::Layer::kTanh:
    case v1::Layer::kSigmoid:
      info.output_shape = in;
      return info;
    case v1::Layer::kDropout: {
      const float rate = spec.dropout().rate();
      if (!(rate >= 0.0f && rate < 1.0f)) {
        return LayerError(index, name, absl::StrCat("dropout.rate must be in [0, 1), got ", rate));
      }
      info.output_shape = in;
      return info;
    }
    case v1::Layer::kFlatten:
      info.output_shape = {NumElements(in)};
      return info;
    case v1::Layer::kBatchNorm:
      TESSERA_RETURN_IF_ERROR(InferBatchNorm(spec.batch_norm(), index, &info));
      return info;
    case v1::Layer::kEmbeddingBag:
      TESSERA_RETURN_IF_ERROR(InferEmbeddingBag(spec.embedding_bag(), index, &info));
      return info;
    case v1::Layer::KIND_NOT_SET:
      break;
  }
  return LayerError(index, name,
                    "no layer type set (expected one of dense, conv2d, max_pool2d, avg_pool2d, "
                    "relu, tanh, sigmoid, dropout, flatten, batch_norm, embedding_bag)");
}

// --- The whole model -----------------------------------------------------------------------------

absl::Status CheckLoss(v1::Loss loss) {
  switch (loss) {
    case v1::LOSS_SOFTMAX_CROSS_ENTROPY:
    case v1::LOSS_SIGMOID_CROSS_ENTROPY:
    case v1::LOSS_MEAN_SQUARED_ERROR:
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("loss: must be LOSS_SOFTMAX_CROSS_ENTROPY, LOSS_SIGMOID_CROSS_ENTROPY or "
                       "LOSS_MEAN_SQUARED_ERROR, got ",
                       v1::Loss_IsValid(loss) ? v1::Loss_Name(loss) : absl::StrCat(loss)));
  }
}

absl::StatusOr<Shape> DenseInputShape(const v1::ModelSpec& spec) {
  if (spec.input_shape_size() < 1 || spec.input_shape_size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("input_shape: must have 1 to 3 dimensions ([features] or [channels, "
                     "height, width]), got ",
                     spec.input_shape_size()));
  }
  for (int i = 0; i < spec.input_shape_size(); ++i) {
    if (spec.input_shape(i) <= 0 || spec.input_shape(i) > (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_shape[", i, "]: must be in [1, 2^31], got ", spec.input_shape(i)));
    }
  }
  Shape shape(spec.input_shape().begin(), spec.input_shape().end());
  const int64_t input_elements = CheckedNumElements(shape);
  if (input_elements < 0 || input_elements > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("input_shape: ", ShapeString(shape), " is too large"));
  }
  return shape;
}

// The name of every layer: the spec's, or "<type>_<k>" with k counting that type from 1.
// Explicit names are reserved first so that a default name never takes one.
// `field` names the list ("layers", "bottom_layers"); default names start with `prefix`; `names`
// holds the names taken so far (explicit ones of every list are reserved before any default).
absl::Status ReserveLayerNames(const google::protobuf::RepeatedPtrField<v1::Layer>& layers,
                               const char* field, std::set<std::string>* names) {
  for (int i = 0; i < layers.size(); ++i) {
    const std::string& n = layers[i].name();
    if (n.empty()) continue;
    if (!ValidLayerName(n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "].name: \"", n, "\" must be 1 to 128 letters, digits, '_', '-' or '.'"));
    }
    if (!names->insert(n).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "].name: \"", n, "\" is used by an earlier layer or table"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> DefaultLayerNames(
    const google::protobuf::RepeatedPtrField<v1::Layer>& layers, const std::string& prefix,
    std::set<std::string>* names) {
  std::map<std::string, int> type_counts;
  std::vector<std::string> out;
  for (int i = 0; i < layers.size(); ++i) {
    std::string name = layers[i].name();
    if (name.empty()) {
      const std::string kind = LayerTypeName(layers[i]);
      const std::string type = prefix + (kind.empty() ? "layer" : kind);
      do {
        name = absl::StrCat(type, "_", ++type_counts[type]);
      } while (names->count(name) > 0);
      names->insert(name);
    }
    out.push_back(std::move(name));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> LayerNames(const v1::ModelSpec& spec) {
  std::set<std::string> names;
  TESSERA_RETURN_IF_ERROR(ReserveLayerNames(spec.layers(), "layers", &names));
  return DefaultLayerNames(spec.layers(), "", &names);
}

// "layers[i] (name): ..." of a bottom layer, as "bottom_layers[i] (name): ...".
absl::Status AsBottom(const absl::Status& s) {
  if (s.ok() || !absl::StartsWith(s.message(), "layers[")) return s;
  return absl::Status(s.code(), absl::StrCat("bottom_", s.message()));
}

absl::Status TableError(int index, const v1::EmbeddingTable& t, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("tables[", index, "]", t.name().empty() ? "" : absl::StrCat(" (", t.name(), ")"),
                   ": ", what));
}

// A multi-input model (spec.tables not empty): the tables, fields, bottom layers and
// interaction, then the top layers (`spec.layers`) on the interaction's output.
absl::Status InferMultiInput(const v1::ModelSpec& spec, ModelShapes* out) {
  MultiInputShapes& m = out->multi;
  if (spec.input_shape_size() > 0) {
    return absl::InvalidArgumentError(
        "input_shape: must be empty in a multi-input model (tables declared); the dense input is "
        "dense_features wide");
  }
  if (spec.dense_features() < 0 || spec.dense_features() > kMaxElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense_features: must be in [0, 2^31], got ", spec.dense_features()));
  }
  m.dense_features = spec.dense_features();
  if (spec.bottom_layers_size() > 0 && m.dense_features == 0) {
    return absl::InvalidArgumentError(
        "bottom_layers: run on the dense features, but dense_features is 0");
  }
  if (spec.layers_size() + spec.bottom_layers_size() > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("layers: a model has at most ", kMaxLayers,
                                                   " layers (top and bottom), got ",
                                                   spec.layers_size() + spec.bottom_layers_size()));
  }
  if (!v1::Interaction::Kind_IsValid(spec.interaction().kind())) {
    return absl::InvalidArgumentError(
        absl::StrCat("interaction.kind: unknown value ", spec.interaction().kind()));
  }
  m.interaction = spec.interaction().kind() == v1::Interaction::KIND_DOT
                      ? v1::Interaction::KIND_DOT
                      : v1::Interaction::KIND_CONCAT;

  // Names: tables and layers share one namespace (a parameter is "<table or layer>/<name>").
  std::set<std::string> names;
  std::map<std::string, int> table_index;
  for (int i = 0; i < spec.tables_size(); ++i) {
    const v1::EmbeddingTable& t = spec.tables(i);
    if (!ValidLayerName(t.name())) {
      return TableError(i, t,
                        absl::StrCat("name: \"", t.name(),
                                     "\" must be 1 to 128 letters, digits, '_', '-' or '.'"));
    }
    if (!names.insert(t.name()).second) {
      return TableError(i, t, "name: used by an earlier table");
    }
    if (t.dim() <= 0 || t.dim() > kMaxRowWidth) {
      return TableError(i, t,
                        absl::StrCat("dim: must be in [1, ", kMaxRowWidth, "], got ", t.dim()));
    }
    const absl::Status init = CheckInitializer(0, t.name(), "initializer", t.initializer());
    if (!init.ok()) {
      return TableError(i, t, std::string(init.message().substr(init.message().find("): ") + 3)));
    }
    v1::WeightInitializer resolved = t.initializer();
    if (resolved.kind() == v1::WeightInitializer::KIND_UNSPECIFIED) {
      resolved.set_kind(v1::WeightInitializer::KIND_NORMAL);
      resolved.set_stddev(0.01f);
    }
    if (resolved.kind() == v1::WeightInitializer::KIND_GLOROT_UNIFORM ||
        resolved.kind() == v1::WeightInitializer::KIND_HE_NORMAL) {
      return TableError(
          i, t,
          absl::StrCat("initializer.kind: ", v1::WeightInitializer::Kind_Name(resolved.kind()),
                       " needs a row count; a table of hashed ids takes KIND_NORMAL, "
                       "KIND_ZEROS or KIND_CONSTANT"));
    }
    const absl::Status lifecycle = ValidateRowLifecycle(t.lifecycle(), "lifecycle");
    if (!lifecycle.ok()) return TableError(i, t, std::string(lifecycle.message()));
    TableShape table;
    table.name = t.name();
    table.embeddings = {"embeddings", {0, t.dim()}, resolved, 0, t.dim()};
    table.embeddings.sparse = true;
    table.embeddings.lifecycle = t.lifecycle();
    table_index[t.name()] = i;
    m.tables.push_back(std::move(table));
  }
  if (!spec.wide_table().empty()) {
    auto it = table_index.find(spec.wide_table());
    if (it == table_index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("wide_table: \"", spec.wide_table(), "\" is not in tables"));
    }
    m.wide_table = it->second;
    m.tables[it->second].wide = true;
  }
  if (spec.sparse_features_size() == 0) {
    return absl::InvalidArgumentError(
        "sparse_features: a multi-input model needs at least one (one per categorical field)");
  }
  for (int i = 0; i < spec.sparse_features_size(); ++i) {
    const v1::SparseFeature& f = spec.sparse_features(i);
    FieldShape field;
    field.name = f.name().empty() ? absl::StrCat("sparse_features[", i, "]") : f.name();
    const std::string where = absl::StrCat(
        "sparse_features[", i, "]", f.name().empty() ? "" : absl::StrCat(" (", f.name(), ")"));
    auto it = table_index.find(f.table());
    if (it == table_index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".table: \"", f.table(), "\" is not in tables"));
    }
    if (it->second == m.wide_table) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".table: \"", f.table(),
                       "\" is the wide_table, which every field reads already; name a deep table"));
    }
    if (!v1::EmbeddingBag::Combiner_IsValid(f.combiner())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".combiner: unknown value ", f.combiner()));
    }
    field.table = it->second;
    field.combiner = f.combiner() == v1::EmbeddingBag::COMBINER_MEAN
                         ? v1::EmbeddingBag::COMBINER_MEAN
                         : v1::EmbeddingBag::COMBINER_SUM;
    m.tables[it->second].fields.push_back(i);
    m.fields.push_back(std::move(field));
  }
  for (size_t t = 0; t < m.tables.size(); ++t) {
    if (m.tables[t].wide) {
      for (int f = 0; f < static_cast<int>(m.fields.size()); ++f) m.tables[t].fields.push_back(f);
      continue;
    }
    if (m.tables[t].fields.empty()) {
      return TableError(static_cast<int>(t), spec.tables(static_cast<int>(t)),
                        "no sparse_features[].table names it");
    }
    // One table pools all its fields with one combiner.
    for (int f : m.tables[t].fields) {
      if (m.fields[f].combiner != m.fields[m.tables[t].fields[0]].combiner) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sparse_features[", f, "].combiner: the fields of table \"", m.tables[t].name,
            "\" must share one combiner (sparse_features[", m.tables[t].fields[0], "] has ",
            v1::EmbeddingBag::Combiner_Name(m.fields[m.tables[t].fields[0]].combiner), ")"));
      }
    }
  }

  // The bottom layers, on the dense features.
  TESSERA_RETURN_IF_ERROR(ReserveLayerNames(spec.bottom_layers(), "bottom_layers", &names));
  TESSERA_RETURN_IF_ERROR(ReserveLayerNames(spec.layers(), "layers", &names));
  const std::vector<std::string> bottom_names =
      DefaultLayerNames(spec.bottom_layers(), "bottom_", &names);
  const std::vector<std::string> top_names = DefaultLayerNames(spec.layers(), "", &names);
  Shape shape = {m.dense_features};
  for (int i = 0; i < spec.bottom_layers_size(); ++i) {
    if (spec.bottom_layers(i).kind_case() == v1::Layer::kEmbeddingBag) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bottom_layers[", i, "] (", bottom_names[i],
          "): embedding_bag has no place in a multi-input model; declare tables instead"));
    }
    absl::StatusOr<LayerInfo> layer = InferLayer(spec.bottom_layers(i), i, bottom_names[i], shape);
    if (!layer.ok()) return AsBottom(layer.status());
    shape = layer->output_shape;
    m.bottom.push_back(*std::move(layer));
  }
  m.bottom_width = NumElements(shape);

  // The interaction.
  // [u, e_1, ..., e_F]; u is absent without dense features.
  const int64_t u_width = m.dense_features > 0 ? m.bottom_width : 0;
  m.concat_width = u_width;
  for (const FieldShape& f : m.fields) m.concat_width += m.tables[f.table].dim();
  m.interaction_width = m.concat_width;
  if (m.interaction == v1::Interaction::KIND_DOT) {
    const int64_t d = m.dense_features > 0 ? m.bottom_width : m.tables[m.fields[0].table].dim();
    for (size_t i = 0; i < m.fields.size(); ++i) {
      const TableShape& t = m.tables[m.fields[i].table];
      if (t.dim() != d) {
        return absl::InvalidArgumentError(absl::StrCat(
            "interaction.kind: KIND_DOT needs every vector as wide as ",
            m.dense_features > 0 ? "the bottom layers' output" : "the first field's table", " (", d,
            "), but sparse_features[", i, "] reads table \"", t.name, "\" of dim ", t.dim()));
      }
    }
    const int64_t vectors = static_cast<int64_t>(m.fields.size()) + (u_width > 0 ? 1 : 0);
    if (vectors < 2) {
      return absl::InvalidArgumentError(
          "interaction.kind: KIND_DOT needs at least two vectors (dense features and a field, or "
          "two fields)");
    }
    m.interaction_width = u_width + vectors * (vectors - 1) / 2;
  }
  if (m.interaction_width > kMaxElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("interaction: ", m.interaction_width, " values per example is too many"));
  }

  // The top layers.
  out->input_shape = {m.interaction_width};
  shape = out->input_shape;
  for (int i = 0; i < spec.layers_size(); ++i) {
    if (spec.layers(i).kind_case() == v1::Layer::kEmbeddingBag) {
      return LayerError(
          i, top_names[i],
          "embedding_bag has no place in a multi-input model; declare tables instead");
    }
    TESSERA_ASSIGN_OR_RETURN(LayerInfo layer, InferLayer(spec.layers(i), i, top_names[i], shape));
    shape = layer.output_shape;
    out->layers.push_back(std::move(layer));
  }
  out->output_dim = NumElements(shape);
  if (m.wide_table >= 0) {
    const TableShape& wide = m.tables[m.wide_table];
    if (wide.dim() != out->output_dim) {
      return absl::InvalidArgumentError(absl::StrCat("wide_table: \"", wide.name, "\" has dim ",
                                                     wide.dim(), ", but the model has ",
                                                     out->output_dim, " outputs"));
    }
    if (spec.layers(spec.layers_size() - 1).kind_case() != v1::Layer::kDense) {
      return absl::InvalidArgumentError(
          "wide_table: the wide part is added to the last layer's outputs, which must then be a "
          "dense layer's (logits)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelShapes> CheckOutputs(const v1::ModelSpec& spec, ModelShapes& out) {
  if (spec.loss() == v1::LOSS_SOFTMAX_CROSS_ENTROPY && out.output_dim < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss: LOSS_SOFTMAX_CROSS_ENTROPY needs at least 2 outputs, but the last layer (",
        out.layers.back().name, ") gives ", out.output_dim));
  }
  TESSERA_RETURN_IF_ERROR(CheckPipeline(spec, out));
  return std::move(out);
}

}  // namespace

absl::StatusOr<ModelShapes> InferModelShapes(const v1::ModelSpec& spec) {
  TESSERA_RETURN_IF_ERROR(CheckNoUnknownFields(spec, ""));
  TESSERA_RETURN_IF_ERROR(CheckLoss(spec.loss()));
  if (spec.layers_size() == 0) {
    return absl::InvalidArgumentError("layers: a model needs at least one layer");
  }
  if (spec.layers_size() > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("layers: a model has at most ", kMaxLayers,
                                                   " layers, got ", spec.layers_size()));
  }
  ModelShapes out;
  if (spec.tables_size() > 0) {
    out.multi_input = true;
    TESSERA_RETURN_IF_ERROR(InferMultiInput(spec, &out));
    return CheckOutputs(spec, out);
  }
  if (spec.dense_features() != 0 || spec.sparse_features_size() > 0 ||
      spec.bottom_layers_size() > 0 || spec.has_interaction() || !spec.wide_table().empty()) {
    return absl::InvalidArgumentError(
        "tables: dense_features, sparse_features, bottom_layers, interaction and wide_table "
        "belong to a multi-input model, which declares its embedding tables");
  }
  out.sparse_input = spec.layers(0).kind_case() == v1::Layer::kEmbeddingBag;
  if (!out.sparse_input) {
    TESSERA_ASSIGN_OR_RETURN(out.input_shape, DenseInputShape(spec));
  }
  TESSERA_ASSIGN_OR_RETURN(const std::vector<std::string> names, LayerNames(spec));
  Shape shape = out.input_shape;
  for (int i = 0; i < spec.layers_size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(LayerInfo layer, InferLayer(spec.layers(i), i, names[i], shape));
    shape = layer.output_shape;
    if (i == 0 && out.sparse_input) out.input_shape = layer.input_shape;
    out.layers.push_back(std::move(layer));
  }
  out.output_dim = NumElements(shape);
  return CheckOutputs(spec, out);
}

v1::Initializer RowInitializer(const ParameterShape& table, uint64_t model_seed,
                               absl::string_view name) {
  v1::Initializer out;
  const double rows = static_cast<double>(table.fan_in > 0 ? table.fan_in : 1);
  const double width = static_cast<double>(table.fan_out > 0 ? table.fan_out : 1);
  switch (table.init.kind()) {
    case v1::WeightInitializer::KIND_GLOROT_UNIFORM:
      out.set_kind(v1::Initializer::KIND_UNIFORM);
      out.set_scale(static_cast<float>(std::sqrt(6.0 / (rows + width))));
      break;
    case v1::WeightInitializer::KIND_HE_NORMAL:
      out.set_kind(v1::Initializer::KIND_NORMAL);
      out.set_scale(static_cast<float>(std::sqrt(2.0 / rows)));
      break;
    case v1::WeightInitializer::KIND_NORMAL:
      out.set_kind(v1::Initializer::KIND_NORMAL);
      out.set_scale(table.init.stddev() > 0 ? table.init.stddev() : 0.01f);
      break;
    case v1::WeightInitializer::KIND_CONSTANT:
      out.set_kind(v1::Initializer::KIND_CONSTANT);
      out.set_value(table.init.value());
      break;
    default:
      out.set_kind(v1::Initializer::KIND_ZEROS);
      break;
  }
  // FNV-1a of the name, mixed with the seed: each table of each job draws its own rows.
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  uint64_t z = model_seed + 0x9e3779b97f4a7c15ull * (h | 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  out.set_seed(z ^ (z >> 31));
  return out;
}

}  // namespace tessera::spec
