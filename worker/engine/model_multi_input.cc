// The input side of a multi-input model (ModelSpec.tables; see proto/tessera/v1/model.proto):
// the bottom layers on the dense features, one embedding_bag per table over its fields' bags,
// the interaction, and the wide table added to the outputs. The top layers run as any model's
// layers do (worker/engine/model.cc), on the interaction's output.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/engine/internal/activations.h"
#include "worker/engine/internal/chain.h"
#include "worker/engine/internal/layers.h"
#include "worker/engine/model.h"

namespace tessera::engine {

using internal::SaturatingAdd;
using internal::SaturatingProduct;
using kernels::DType;
using kernels::Tensor;

namespace {

// Bags per example of a table: one per field (deep), or one (wide).
int64_t BagsPerExample(const spec::TableShape& t) {
  return t.wide ? 1 : static_cast<int64_t>(t.fields.size());
}

// The position of field `f` among the fields of its table.
int64_t PositionInTable(const spec::TableShape& t, int f) {
  return std::find(t.fields.begin(), t.fields.end(), f) - t.fields.begin();
}

// Grows `storage` to hold at least `count` elements (to twice its size), on `backend`.
absl::Status Reserve(kernels::Backend* backend, int64_t count, DType dtype, Tensor* storage) {
  const int64_t capacity = std::max<int64_t>(count, 1);
  if (!storage->empty() && storage->dim(0) >= capacity) return absl::OkStatus();
  const int64_t grown = std::max<int64_t>(capacity, storage->empty() ? 0 : 2 * storage->dim(0));
  *storage = Tensor();
  TESSERA_ASSIGN_OR_RETURN(*storage, backend->Allocate({grown}, dtype));
  return absl::OkStatus();
}

// Checks field `f` of a batch of `n` examples: offsets [n + 1] that do not decrease, ids (and
// values, when given) for every bag.
absl::Status CheckField(const SparseFieldView& field, int f, int64_t n) {
  if (static_cast<int64_t>(field.offsets.size()) != n + 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch.fields[", f, "].offsets: expected ",
                                                   n + 1, " entries, got ", field.offsets.size()));
  }
  for (int64_t b = 1; b <= n; ++b) {
    if (field.offsets[b] < field.offsets[b - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch.fields[", f, "].offsets[", b, "]: offsets must not decrease"));
    }
  }
  if (field.offsets[0] < 0 || field.offsets[n] > static_cast<int64_t>(field.ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat("batch.fields[", f, "].ids: the offsets need [",
                                                   field.offsets[0], ", ", field.offsets[n],
                                                   "), got ", field.ids.size(), " ids"));
  }
  if (!field.values.empty() && field.offsets[n] > static_cast<int64_t>(field.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("batch.fields[", f,
                                                   "].values: the offsets need ", field.offsets[n],
                                                   " values, got ", field.values.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Model::BuildMultiInput(const v1::ModelSpec& spec, spec::ModelShapes shapes) {
  multi_input_ = true;
  multi_ = std::move(shapes.multi);
  for (int i = 0; i < spec.bottom_layers_size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer,
                             MakeLayer(spec.bottom_layers(i), multi_.bottom[i]));
    bottom_.push_back(std::move(layer));
  }
  std::vector<spec::LayerInfo> bag_infos;
  for (const spec::TableShape& t : multi_.tables) {
    v1::Layer bag;
    bag.mutable_embedding_bag()->set_combiner(t.wide ? v1::EmbeddingBag::COMBINER_SUM
                                                     : multi_.fields[t.fields[0]].combiner);
    spec::LayerInfo info;
    info.name = t.name;
    info.type = "embedding_bag";
    info.input_shape = {0};
    info.output_shape = {t.dim()};
    info.parameters = {t.embeddings};
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, MakeLayer(bag, info));
    bags_.push_back(std::move(layer));
    bag_infos.push_back(std::move(info));
  }

  TESSERA_RETURN_IF_ERROR(CheckParameterMemory({&multi_.bottom, &layer_infos_}));
  // Trainable: bottom, top, tables; then the state of bottom and top.
  std::vector<std::vector<int>> bottom_index, top_index, bag_index, bag_parameters;
  TESSERA_RETURN_IF_ERROR(
      AddLayerParameters(bottom_, multi_.bottom, true, &bottom_parameters_, &bottom_index));
  TESSERA_RETURN_IF_ERROR(
      AddLayerParameters(layers_, layer_infos_, true, &layer_parameters_, &top_index));
  TESSERA_RETURN_IF_ERROR(AddLayerParameters(bags_, bag_infos, true, &bag_parameters, &bag_index));
  TESSERA_RETURN_IF_ERROR(
      AddLayerParameters(bottom_, multi_.bottom, false, &bottom_parameters_, &bottom_index));
  TESSERA_RETURN_IF_ERROR(
      AddLayerParameters(layers_, layer_infos_, false, &layer_parameters_, &top_index));
  BindLayers(bottom_, bottom_index);
  BindLayers(layers_, top_index);
  BindLayers(bags_, bag_index);
  for (size_t t = 0; t < multi_.tables.size(); ++t)
    sparse_tables_[t].fields = multi_.tables[t].fields;
  TESSERA_ASSIGN_OR_RETURN(metrics_, backend_->Allocate({2}));
  host_metrics_.assign(2, 0.0f);
  return absl::OkStatus();
}

int64_t Model::MultiInputBytesPerExample() const {
  // The dense features and their gradient, the bottom layers, each table's pooled vectors and
  // their gradients with their ids and offsets, the concatenation and the interaction (values
  // and gradients).
  int64_t floats = 2 * multi_.dense_features;
  for (const spec::TableShape& t : multi_.tables) {
    floats = SaturatingAdd(floats, SaturatingProduct(2 * BagsPerExample(t), t.dim()));
    floats = SaturatingAdd(floats, 4 * BagsPerExample(t));  // int64 offsets and ids
  }
  floats = SaturatingAdd(floats, 2 * multi_.concat_width);
  if (multi_.interaction == v1::Interaction::KIND_DOT) {
    floats = SaturatingAdd(floats, 2 * multi_.interaction_width);
  }
  return SaturatingAdd(SaturatingProduct(floats, 4), internal::ChainBytesPerExample(bottom_));
}

absl::Status Model::AllocateMultiInput(int64_t n, Activations* a) {
  internal::MultiInputBuffers& m = a->multi;
  if (multi_.dense_features > 0) {
    TESSERA_ASSIGN_OR_RETURN(m.dense, backend_->Allocate({n, multi_.dense_features}));
  }
  if (!bottom_.empty()) {
    TESSERA_RETURN_IF_ERROR(internal::AllocateChain(backend_, bottom_, n, m.dense, &m.bottom));
    if (bottom_[0]->WritesInputGrad()) {
      TESSERA_ASSIGN_OR_RETURN(m.dense_grad, backend_->Allocate({n, multi_.dense_features}));
    }
  }
  m.tables.resize(multi_.tables.size());
  for (size_t t = 0; t < multi_.tables.size(); ++t) {
    const spec::TableShape& shape = multi_.tables[t];
    const int64_t bags = n * BagsPerExample(shape);
    internal::TableBuffers& tb = m.tables[t];
    TESSERA_ASSIGN_OR_RETURN(tb.out, backend_->Allocate({bags, shape.dim()}));
    if (!shape.wide) {
      TESSERA_ASSIGN_OR_RETURN(tb.dout, backend_->Allocate({bags, shape.dim()}));
    }
    TESSERA_ASSIGN_OR_RETURN(tb.sparse.offsets, backend_->Allocate({bags + 1}, DType::kInt64));
  }
  TESSERA_ASSIGN_OR_RETURN(m.concat, backend_->Allocate({n, multi_.concat_width}));
  TESSERA_ASSIGN_OR_RETURN(m.dconcat, backend_->Allocate({n, multi_.concat_width}));
  if (multi_.interaction == v1::Interaction::KIND_DOT) {
    TESSERA_ASSIGN_OR_RETURN(a->input, backend_->Allocate({n, multi_.interaction_width}));
    TESSERA_ASSIGN_OR_RETURN(a->input_grad, backend_->Allocate({n, multi_.interaction_width}));
  } else {
    a->input = m.concat;
    a->input_grad = m.dconcat;
  }
  return absl::OkStatus();
}

absl::Status Model::LoadMultiInput(const BatchView& batch, Activations* a) {
  internal::MultiInputBuffers& m = a->multi;
  const int64_t n = batch.size;
  const int64_t dense = multi_.dense_features;
  if (static_cast<int64_t>(batch.features.size()) != n * dense) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch.features: expected ", n, " x ", dense, " = ", n * dense,
                     " floats (dense_features), got ", batch.features.size()));
  }
  if (dense > 0) TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(batch.features.data(), m.dense));
  size_t uses = 0;
  for (const spec::TableShape& t : multi_.tables) uses += t.fields.size();
  if (batch.fields.size() != uses) {
    return absl::InvalidArgumentError(absl::StrCat("batch.fields: the model's tables read ", uses,
                                                   " (table, field) pairs, got ",
                                                   batch.fields.size()));
  }
  bool has_values = false;
  for (size_t u = 0; u < batch.fields.size(); ++u) {
    TESSERA_RETURN_IF_ERROR(CheckField(batch.fields[u], static_cast<int>(u), n));
    has_values = has_values || !batch.fields[u].values.empty();
  }
  size_t first_use = 0;
  for (size_t t = 0; t < multi_.tables.size(); ++t) {
    const spec::TableShape& shape = multi_.tables[t];
    internal::TableBuffers& tb = m.tables[t];
    const int64_t rows = tables_[t].rows;
    tb.host_offsets.assign(1, 0);
    tb.host_ids.clear();
    tb.host_values.clear();
    // Appends bag b of use u; with `close`, ends the table's bag.
    auto append = [&](size_t u, int64_t b, bool close) -> absl::Status {
      const SparseFieldView& field = batch.fields[u];
      for (int64_t j = field.offsets[b]; j < field.offsets[b + 1]; ++j) {
        const int64_t id = field.ids[j];
        if (id < 0 || id >= rows) {
          return absl::InvalidArgumentError(
              absl::StrCat("batch.fields[", u, "].ids[", j, "]: position ", id, " is outside the ",
                           rows, " rows of ", sparse_tables_[t].name, " installed by SetRows"));
        }
        tb.host_ids.push_back(id);
        if (has_values) tb.host_values.push_back(field.values.empty() ? 1.0f : field.values[j]);
      }
      if (close) tb.host_offsets.push_back(static_cast<int64_t>(tb.host_ids.size()));
      return absl::OkStatus();
    };
    for (int64_t b = 0; b < n; ++b) {
      for (size_t k = 0; k < shape.fields.size(); ++k) {
        const bool close = !shape.wide || k + 1 == shape.fields.size();
        TESSERA_RETURN_IF_ERROR(append(first_use + k, b, close));
      }
    }
    first_use += shape.fields.size();
    const int64_t nnz = static_cast<int64_t>(tb.host_ids.size());
    TESSERA_RETURN_IF_ERROR(Reserve(backend_, nnz, DType::kInt64, &tb.ids_storage));
    TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(tb.host_offsets.data(), tb.sparse.offsets));
    tb.sparse.ids = tb.ids_storage.LeadingRows(std::max<int64_t>(nnz, 1));
    if (nnz > 0) {
      TESSERA_RETURN_IF_ERROR(
          backend_->CopyToDevice(tb.host_ids.data(), tb.ids_storage.LeadingRows(nnz)));
    }
    tb.sparse.values = Tensor();
    if (has_values) {
      TESSERA_RETURN_IF_ERROR(Reserve(backend_, nnz, DType::kFloat32, &tb.values_storage));
      tb.sparse.values = tb.values_storage.LeadingRows(std::max<int64_t>(nnz, 1));
      if (nnz > 0) {
        TESSERA_RETURN_IF_ERROR(
            backend_->CopyToDevice(tb.host_values.data(), tb.values_storage.LeadingRows(nnz)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Model::ForwardMultiInput(Activations* a, bool training) {
  internal::MultiInputBuffers& m = a->multi;
  const int64_t n = a->n;
  if (!bottom_.empty()) {
    TESSERA_RETURN_IF_ERROR(internal::ForwardChain(backend_, bottom_, n, m.dense, m.bottom, nullptr,
                                                   training, dropout_seed_, 1000));
  }
  for (size_t t = 0; t < bags_.size(); ++t) {
    internal::TableBuffers& tb = m.tables[t];
    ForwardArgs args;
    args.n = tb.out.dim(0);
    args.y = tb.out;
    args.sparse = &tb.sparse;
    args.training = training;
    TESSERA_RETURN_IF_ERROR(bags_[t]->Forward(backend_, args));
  }
  // The concatenation [u, e_1, ..., e_F].
  int64_t offset = 0;
  if (multi_.dense_features > 0) {
    const Tensor& u = bottom_.empty() ? m.dense : m.bottom.y.back();
    TESSERA_RETURN_IF_ERROR(backend_->CopyColumns(u, 0, m.concat, 0, multi_.bottom_width, false));
    offset = multi_.bottom_width;
  }
  for (size_t f = 0; f < multi_.fields.size(); ++f) {
    const spec::TableShape& shape = multi_.tables[multi_.fields[f].table];
    const Tensor& out = m.tables[multi_.fields[f].table].out;
    const int64_t dim = shape.dim();
    const Tensor pooled = out.Reshaped({n, BagsPerExample(shape) * dim});
    TESSERA_RETURN_IF_ERROR(backend_->CopyColumns(
        pooled, PositionInTable(shape, static_cast<int>(f)) * dim, m.concat, offset, dim, false));
    offset += dim;
  }
  if (multi_.interaction != v1::Interaction::KIND_DOT) return absl::OkStatus();
  const int64_t skip = multi_.dense_features > 0 ? multi_.bottom_width : 0;
  if (skip > 0) {
    TESSERA_RETURN_IF_ERROR(backend_->CopyColumns(m.concat, 0, a->input, 0, skip, false));
  }
  const int64_t d = multi_.tables[multi_.fields[0].table].dim();
  return backend_->DotInteractionForward(m.concat.Reshaped({n, multi_.concat_width / d, d}),
                                         a->input, skip);
}

absl::Status Model::AddWide(Activations* a) {
  if (multi_.wide_table < 0) return absl::OkStatus();
  return backend_->Axpy(1.0f, a->multi.tables[multi_.wide_table].out, a->top.y.back());
}

absl::Status Model::BackwardWide(Activations* a, const std::function<void(int)>& on_grad_ready) {
  if (multi_.wide_table < 0) return absl::OkStatus();
  internal::TableBuffers& tb = a->multi.tables[multi_.wide_table];
  BackwardArgs args;
  args.n = a->n;
  args.dy = a->top.dy.back();
  args.sparse = &tb.sparse;
  TESSERA_RETURN_IF_ERROR(bags_[multi_.wide_table]->Backward(backend_, args));
  if (on_grad_ready) on_grad_ready(sparse_tables_[multi_.wide_table].parameter);
  return absl::OkStatus();
}

absl::Status Model::BackwardMultiInput(Activations* a,
                                       const std::function<void(int)>& on_grad_ready) {
  internal::MultiInputBuffers& m = a->multi;
  const int64_t n = a->n;
  if (multi_.interaction == v1::Interaction::KIND_DOT) {
    const int64_t skip = multi_.dense_features > 0 ? multi_.bottom_width : 0;
    const int64_t d = multi_.tables[multi_.fields[0].table].dim();
    const int64_t vectors = multi_.concat_width / d;
    TESSERA_RETURN_IF_ERROR(backend_->DotInteractionBackward(m.concat.Reshaped({n, vectors, d}),
                                                             a->input_grad, skip,
                                                             m.dconcat.Reshaped({n, vectors, d})));
    if (skip > 0) {
      TESSERA_RETURN_IF_ERROR(backend_->CopyColumns(a->input_grad, 0, m.dconcat, 0, skip, true));
    }
  }
  // Split the concatenation's gradient into the fields' pooled vectors.
  int64_t offset = multi_.dense_features > 0 ? multi_.bottom_width : 0;
  for (size_t f = 0; f < multi_.fields.size(); ++f) {
    const spec::TableShape& shape = multi_.tables[multi_.fields[f].table];
    const int64_t dim = shape.dim();
    const Tensor pooled =
        m.tables[multi_.fields[f].table].dout.Reshaped({n, BagsPerExample(shape) * dim});
    TESSERA_RETURN_IF_ERROR(backend_->CopyColumns(
        m.dconcat, offset, pooled, PositionInTable(shape, static_cast<int>(f)) * dim, dim, false));
    offset += dim;
  }
  for (size_t t = 0; t < bags_.size(); ++t) {
    if (multi_.tables[t].wide) continue;
    internal::TableBuffers& tb = m.tables[t];
    BackwardArgs args;
    args.n = tb.dout.dim(0);
    args.dy = tb.dout;
    args.sparse = &tb.sparse;
    TESSERA_RETURN_IF_ERROR(bags_[t]->Backward(backend_, args));
    if (on_grad_ready) on_grad_ready(sparse_tables_[t].parameter);
  }
  if (bottom_.empty()) return absl::OkStatus();
  TESSERA_RETURN_IF_ERROR(
      backend_->CopyColumns(m.dconcat, 0, m.bottom.dy.back(), 0, multi_.bottom_width, false));
  return internal::BackwardChain(backend_, bottom_, multi_.bottom, bottom_parameters_, n, m.dense,
                                 bottom_[0]->WritesInputGrad() ? &m.dense_grad : nullptr, m.bottom,
                                 nullptr, /*accumulate=*/false, on_grad_ready);
}

}  // namespace tessera::engine
