#include "worker/engine/model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/engine/initializers.h"
#include "worker/engine/internal/activations.h"
#include "worker/engine/internal/chain.h"
#include "worker/engine/internal/layers.h"

namespace tessera::engine {

using kernels::Backend;
using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

namespace {

kernels::LossKind LossKindOf(v1::Loss loss) {
  switch (loss) {
    case v1::LOSS_SIGMOID_CROSS_ENTROPY:
      return kernels::LossKind::kSigmoidCrossEntropy;
    case v1::LOSS_MEAN_SQUARED_ERROR:
      return kernels::LossKind::kMeanSquaredError;
    default:
      return kernels::LossKind::kSoftmaxCrossEntropy;
  }
}

constexpr size_t kMaxCachedBatchSizes = 4;

}  // namespace

using internal::Mix;
using internal::SaturatingAdd;
using internal::SaturatingProduct;
using internal::WithBatch;

Model::Model(Backend* backend, uint64_t seed)
    : backend_(backend), seed_(seed), dropout_seed_(Mix(seed, 0x5eed)) {}

Model::~Model() = default;

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const v1::ModelSpec& spec, Backend* backend,
                                                     uint64_t seed) {
  if (backend == nullptr) return absl::InvalidArgumentError("Model::Create: backend is null");
  std::unique_ptr<Model> model(new Model(backend, seed));
  TESSERA_RETURN_IF_ERROR(model->Build(spec));
  return model;
}

absl::Status Model::Build(const v1::ModelSpec& spec) {
  TESSERA_ASSIGN_OR_RETURN(spec::ModelShapes shapes, spec::InferModelShapes(spec));
  input_shape_ = shapes.input_shape;
  sparse_input_ = shapes.sparse_input;
  input_dim_ = kernels::NumElements(input_shape_);
  output_dim_ = shapes.output_dim;
  loss_ = LossKindOf(spec.loss());
  for (int i = 0; i < spec.layers_size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer,
                             MakeLayer(spec.layers(i), shapes.layers[i]));
    layers_.push_back(std::move(layer));
  }
  layer_infos_ = shapes.layers;
  if (shapes.multi_input) return BuildMultiInput(spec, std::move(shapes));

  TESSERA_RETURN_IF_ERROR(CheckParameterMemory({&layer_infos_}));
  // Trainable parameters first, then state, each in layer order.
  std::vector<std::vector<int>> index;
  TESSERA_RETURN_IF_ERROR(
      AddLayerParameters(layers_, layer_infos_, /*trainable=*/true, &layer_parameters_, &index));
  TESSERA_RETURN_IF_ERROR(
      AddLayerParameters(layers_, layer_infos_, /*trainable=*/false, &layer_parameters_, &index));
  BindLayers(layers_, index);
  forward_position_.assign(parameters_.size(), 0);
  for (size_t i = 0; i < index.size(); ++i) {
    for (int position : index[i]) {
      if (position >= 0) forward_position_[position] = static_cast<int>(i);
    }
  }
  TESSERA_ASSIGN_OR_RETURN(metrics_, backend_->Allocate({2}));
  host_metrics_.assign(2, 0.0f);
  return absl::OkStatus();
}

absl::Status Model::CheckParameterMemory(
    std::initializer_list<const std::vector<spec::LayerInfo>*> layer_lists) {
  // Refuse a model whose parameters cannot fit before allocating any of them (the host staging
  // buffer holds one parameter at a time).
  int64_t largest = 0;
  parameter_bytes_ = 0;
  for (const std::vector<spec::LayerInfo>* infos : layer_lists) {
    for (const spec::LayerInfo& info : *infos) {
      for (const spec::ParameterShape& d : info.parameters) {
        if (d.sparse) continue;  // rows installed per batch (SetRows)
        const int64_t bytes = SaturatingProduct(kernels::CheckedNumElements(d.shape), 4);
        largest = std::max(largest, bytes);
        parameter_bytes_ =
            SaturatingAdd(parameter_bytes_, SaturatingProduct(bytes, d.trainable ? 2 : 1));
      }
    }
  }
  const int64_t capacity = backend_->MemoryCapacityBytes();
  if (SaturatingAdd(parameter_bytes_, largest) > capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model: the parameters and their gradients need ", parameter_bytes_,
                     " bytes, more than the ", capacity, " bytes of memory of ", backend_->Name()));
  }
  return absl::OkStatus();
}

absl::Status Model::AddLayerParameters(const std::vector<std::unique_ptr<Layer>>& layers,
                                       const std::vector<spec::LayerInfo>& infos, bool trainable,
                                       std::vector<std::vector<int>>* layer_parameters,
                                       std::vector<std::vector<int>>* index) {
  if (index->size() != layers.size()) {
    index->assign(layers.size(), {});
    layer_parameters->assign(layers.size(), {});
    for (size_t i = 0; i < layers.size(); ++i) {
      (*index)[i].assign(infos[i].parameters.size(), -1);
    }
  }
  std::vector<float> host;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<spec::ParameterShape>& decls = infos[i].parameters;
    for (size_t j = 0; j < decls.size(); ++j) {
      const spec::ParameterShape& d = decls[j];
      if (d.trainable != trainable) continue;
      Parameter p;
      p.name = absl::StrCat(layers[i]->name(), "/", d.suffix);
      p.shape = d.shape;
      p.trainable = d.trainable;
      p.sparse = d.sparse;
      const int position = static_cast<int>(parameters_.size());
      (*index)[i][j] = position;
      parameter_index_[p.name] = position;
      if (d.trainable) (*layer_parameters)[i].push_back(position);
      if (d.sparse) {
        // No rows until SetRows; the ids a batch reads are positions among those rows.
        p.shape = {0, d.shape[1]};
        SparseTableInfo info;
        info.name = p.name;
        info.parameter = position;
        info.dim = d.shape[1];
        info.num_rows = d.shape[0];
        info.shape = d;
        sparse_tables_.push_back(std::move(info));
        TableState table;
        table.layer = layers[i].get();
        table.position = static_cast<int>(j);
        tables_.push_back(std::move(table));
        parameters_.push_back(std::move(p));
        continue;
      }
      TESSERA_ASSIGN_OR_RETURN(p.value, backend_->Allocate(d.shape));
      if (d.trainable) {
        TESSERA_ASSIGN_OR_RETURN(p.grad, backend_->Allocate(d.shape));
        TESSERA_RETURN_IF_ERROR(backend_->Fill(p.grad, 0.0f));
      }
      host.assign(static_cast<size_t>(kernels::NumElements(d.shape)), 0.0f);
      InitializeValues(d.init, d.fan_in, d.fan_out, seed_, p.name, &host);
      TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(host.data(), p.value));
      parameters_.push_back(std::move(p));
    }
  }
  return absl::OkStatus();
}

void Model::BindLayers(const std::vector<std::unique_ptr<Layer>>& layers,
                       const std::vector<std::vector<int>>& index) {
  bindings_.resize(parameters_.size(), {nullptr, 0});
  for (size_t i = 0; i < layers.size(); ++i) {
    std::vector<Tensor> values, grads;
    for (size_t j = 0; j < index[i].size(); ++j) {
      values.push_back(parameters_[index[i][j]].value);
      grads.push_back(parameters_[index[i][j]].grad);
      bindings_[index[i][j]] = {layers[i].get(), j};
    }
    layers[i]->Bind(std::move(values), std::move(grads));
  }
}

void Model::set_cross_device_sum(CrossDeviceSum* sum) {
  for (const auto* layers : {&layers_, &bottom_}) {
    for (const std::unique_ptr<Layer>& layer : *layers) layer->SetCrossDeviceSum(sum);
  }
}

const Parameter* Model::FindParameter(const std::string& name) const {
  auto it = parameter_index_.find(name);
  return it == parameter_index_.end() ? nullptr : &parameters_[it->second];
}

int64_t Model::num_trainable_values() const {
  int64_t total = 0;
  for (const Parameter& p : parameters_) {
    if (p.trainable && !p.sparse) total += kernels::NumElements(p.shape);
  }
  return total;
}

absl::Status Model::SetRows(int table, int64_t count, absl::Span<const float> values) {
  if (table < 0 || table >= static_cast<int>(tables_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("SetRows: the model has ", tables_.size(),
                                                   " sparse tables, got table ", table));
  }
  const SparseTableInfo& info = sparse_tables_[table];
  TableState& t = tables_[table];
  if (count < 0 || static_cast<int64_t>(values.size()) != SaturatingProduct(count, info.dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetRows ", info.name, ": ", count, " rows of dim ", info.dim, " need ",
                     SaturatingProduct(count, info.dim), " values, got ", values.size()));
  }
  const int64_t capacity = std::max<int64_t>(count, 1);
  if (t.values.empty() || t.values.dim(0) < capacity) {
    const int64_t grown = std::max<int64_t>(capacity, t.values.empty() ? 0 : 2 * t.values.dim(0));
    const int64_t bytes = SaturatingProduct(SaturatingProduct(grown, info.dim), 8);
    if (bytes > backend_->MemoryCapacityBytes()) {
      return absl::ResourceExhaustedError(
          absl::StrCat(info.name, ": ", grown, " rows of dim ", info.dim, " and their gradients ",
                       "need ", bytes, " bytes, more than the memory of ", backend_->Name()));
    }
    // Drop the old buffers first: both sets are never held at once.
    t.values = Tensor();
    t.grads = Tensor();
    t.layer->Rebind(t.position, Tensor(), Tensor());
    TESSERA_ASSIGN_OR_RETURN(t.values, backend_->Allocate({grown, info.dim}));
    TESSERA_ASSIGN_OR_RETURN(t.grads, backend_->Allocate({grown, info.dim}));
    TESSERA_RETURN_IF_ERROR(backend_->Fill(t.grads, 0.0f));
  }
  // The layer always sees at least one row, so its kernels never get an empty table.
  const Tensor bound_values = t.values.LeadingRows(capacity);
  const Tensor bound_grads = t.grads.LeadingRows(capacity);
  if (count > 0) TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(values.data(), bound_values));
  t.layer->Rebind(t.position, bound_values, bound_grads);
  t.rows = count;
  Parameter& p = parameters_[info.parameter];
  p.shape = {count, info.dim};
  p.value = count > 0 ? bound_values : Tensor();
  p.grad = count > 0 ? bound_grads : Tensor();
  return absl::OkStatus();
}

int64_t Model::ActivationBytes(int64_t n) const {
  // Per example: the input (and its gradient), each layer's output and output gradient (views
  // and in-place layers share them), a mask or workspace of the output size, and the labels.
  int64_t per_example = 0;
  if (multi_input_) {
    per_example = MultiInputBytesPerExample();
  } else {
    per_example = SaturatingProduct(sparse_input_ ? 2 : input_dim_, 4);
    if (layers_[0]->WritesInputGrad()) {
      per_example = SaturatingAdd(per_example, SaturatingProduct(input_dim_, 4));
    }
  }
  per_example = SaturatingAdd(per_example, internal::ChainBytesPerExample(layers_));
  per_example = SaturatingAdd(
      per_example,
      SaturatingProduct(loss_ == kernels::LossKind::kSoftmaxCrossEntropy ? 1 : output_dim_, 4));
  return SaturatingProduct(per_example, n);
}

absl::Status Model::CheckMemory(int64_t batch_size, int64_t extra_bytes) const {
  const int64_t capacity = backend_->MemoryCapacityBytes();
  const int64_t activations = ActivationBytes(batch_size);
  const int64_t total = SaturatingAdd(SaturatingAdd(parameter_bytes_, activations), extra_bytes);
  if (total > capacity) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "batch_size: a batch of ", batch_size, " needs about ", activations,
        " bytes of activations, which with the model's ", parameter_bytes_, " bytes",
        extra_bytes > 0 ? absl::StrCat(" and ", extra_bytes, " bytes of optimizer state") : "",
        " is more than the ", capacity, " bytes of memory of ", backend_->Name()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Model::Activations*> Model::ActivationsFor(int slot, int64_t n) {
  ++activation_clock_;
  auto found = activations_.find({slot, n});
  if (found != activations_.end()) {
    found->second->last_used = activation_clock_;
    return found->second.get();
  }
  TESSERA_RETURN_IF_ERROR(CheckMemory(n, 0));
  // Keep the buffers of a few batch sizes per slot (training, the last partial batch,
  // evaluation); drop the slot's least recently used beyond that.
  for (;;) {
    auto oldest = activations_.end();
    size_t in_slot = 0;
    for (auto it = activations_.begin(); it != activations_.end(); ++it) {
      if (it->first.first != slot) continue;
      ++in_slot;
      if (oldest == activations_.end() || it->second->last_used < oldest->second->last_used) {
        oldest = it;
      }
    }
    if (in_slot < kMaxCachedBatchSizes) break;
    activations_.erase(oldest);
  }
  auto a = std::make_unique<Activations>();
  a->last_used = activation_clock_;
  a->n = n;
  if (multi_input_) {
    TESSERA_RETURN_IF_ERROR(AllocateMultiInput(n, a.get()));
  } else if (!sparse_input_) {
    TESSERA_ASSIGN_OR_RETURN(a->input, backend_->Allocate(WithBatch(n, input_shape_)));
  } else {
    TESSERA_ASSIGN_OR_RETURN(a->sparse.offsets, backend_->Allocate({n + 1}, DType::kInt64));
  }
  if (!multi_input_ && layers_[0]->WritesInputGrad()) {
    TESSERA_ASSIGN_OR_RETURN(a->input_grad, backend_->Allocate(WithBatch(n, input_shape_)));
  }
  TESSERA_RETURN_IF_ERROR(internal::AllocateChain(backend_, layers_, n, a->input, &a->top));
  if (loss_ == kernels::LossKind::kSoftmaxCrossEntropy) {
    TESSERA_ASSIGN_OR_RETURN(a->labels, backend_->Allocate({n}, DType::kInt32));
  } else {
    TESSERA_ASSIGN_OR_RETURN(a->labels, backend_->Allocate({n, output_dim_}));
  }
  Activations* raw = a.get();
  activations_[{slot, n}] = std::move(a);
  return raw;
}

absl::Status Model::LoadBatch(const BatchView& batch, bool need_labels, Activations* a) {
  const int64_t n = batch.size;
  if (multi_input_) {
    TESSERA_RETURN_IF_ERROR(LoadMultiInput(batch, a));
  } else if (!sparse_input_) {
    if (static_cast<int64_t>(batch.features.size()) != n * input_dim_) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch.features: expected ", n, " x ", input_dim_, " = ", n * input_dim_,
                       " floats for input_shape ", kernels::ShapeString(input_shape_), ", got ",
                       batch.features.size()));
    }
    TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(batch.features.data(), a->input));
  } else {
    if (static_cast<int64_t>(batch.sparse_offsets.size()) != n + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch.sparse_offsets: expected ", n + 1, " entries, got ", batch.sparse_offsets.size()));
    }
    const int64_t base = batch.sparse_offsets[0];
    a->host_offsets.resize(static_cast<size_t>(n + 1));
    for (int64_t b = 0; b <= n; ++b) {
      const int64_t o = batch.sparse_offsets[b] - base;
      if (o < 0 || (b > 0 && o < a->host_offsets[b - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("batch.sparse_offsets[", b, "]: offsets must not decrease"));
      }
      a->host_offsets[b] = o;
    }
    const int64_t nnz = a->host_offsets[n];
    if (static_cast<int64_t>(batch.sparse_ids.size()) < base + nnz) {
      return absl::InvalidArgumentError(absl::StrCat("batch.sparse_ids: the offsets need ",
                                                     base + nnz, " ids, got ",
                                                     batch.sparse_ids.size()));
    }
    const bool has_values = !batch.sparse_values.empty();
    if (has_values && static_cast<int64_t>(batch.sparse_values.size()) < base + nnz) {
      return absl::InvalidArgumentError(absl::StrCat("batch.sparse_values: the offsets need ",
                                                     base + nnz, " values, got ",
                                                     batch.sparse_values.size()));
    }
    const int64_t rows = tables_[0].rows;
    for (int64_t j = base; j < base + nnz; ++j) {
      const int64_t id = batch.sparse_ids[j];
      if (id < 0 || id >= rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("batch.sparse_ids[", j, "]: position ", id, " is outside the ", rows,
                         " rows of ", sparse_tables_[0].name, " installed by SetRows"));
      }
    }
    const int64_t capacity = std::max<int64_t>(nnz, 1);
    if (a->ids_storage.empty() || a->ids_storage.dim(0) < capacity) {
      const int64_t grown =
          std::max<int64_t>(capacity, a->ids_storage.empty() ? 0 : 2 * a->ids_storage.dim(0));
      TESSERA_ASSIGN_OR_RETURN(a->ids_storage, backend_->Allocate({grown}, DType::kInt64));
      TESSERA_ASSIGN_OR_RETURN(a->values_storage, backend_->Allocate({grown}));
    }
    TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(a->host_offsets.data(), a->sparse.offsets));
    a->sparse.ids = a->ids_storage.LeadingRows(capacity);
    if (nnz > 0) {
      TESSERA_RETURN_IF_ERROR(
          backend_->CopyToDevice(batch.sparse_ids.data() + base, a->ids_storage.LeadingRows(nnz)));
    }
    a->sparse.values = Tensor();
    if (has_values) {
      a->sparse.values = a->values_storage.LeadingRows(capacity);
      if (nnz > 0) {
        TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(batch.sparse_values.data() + base,
                                                       a->values_storage.LeadingRows(nnz)));
      }
    }
  }
  if (!need_labels) return absl::OkStatus();
  if (loss_ == kernels::LossKind::kSoftmaxCrossEntropy) {
    if (static_cast<int64_t>(batch.labels.size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch.labels: expected ", n, " class ids, got ", batch.labels.size()));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (batch.labels[i] < 0 || batch.labels[i] >= output_dim_) {
        return absl::InvalidArgumentError(absl::StrCat("batch.labels[", i, "]: ", batch.labels[i],
                                                       " is outside [0, ", output_dim_, ")"));
      }
    }
    return backend_->CopyToDevice(batch.labels.data(), a->labels);
  }
  if (static_cast<int64_t>(batch.targets.size()) != n * output_dim_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch.targets: expected ", n, " x ", output_dim_, " floats, got ", batch.targets.size()));
  }
  return backend_->CopyToDevice(batch.targets.data(), a->labels);
}

absl::Status Model::RunForward(Activations* a, bool training, const BeforeLayer& before_layer) {
  if (multi_input_) {
    if (before_layer) TESSERA_RETURN_IF_ERROR(before_layer(0));
    TESSERA_RETURN_IF_ERROR(ForwardMultiInput(a, training));
  }
  TESSERA_RETURN_IF_ERROR(internal::ForwardChain(backend_, layers_, a->n, a->input, a->top,
                                                 &a->sparse, training, dropout_seed_, 0,
                                                 multi_input_ ? BeforeLayer() : before_layer));
  return multi_input_ ? AddWide(a) : absl::OkStatus();
}

absl::StatusOr<StepResult> Model::TrainStep(const BatchView& batch,
                                            const std::function<void(int)>& on_grad_ready,
                                            const BeforeLayer& before_layer) {
  absl::StatusOr<StepResult> r = TrainSlot(0, batch, 1.0f, on_grad_ready, nullptr, before_layer);
  if (r.ok()) dropout_seed_ = Mix(dropout_seed_, 0xd20);
  return r;
}

int Model::ForwardPosition(int parameter) const {
  if (parameter < 0 || static_cast<size_t>(parameter) >= forward_position_.size()) return 0;
  return forward_position_[parameter];
}

absl::StatusOr<StepResult> Model::TrainSlot(int slot, const BatchView& batch, float weight,
                                            const std::function<void(int)>& on_grad_ready,
                                            std::vector<float>* input_grad,
                                            const BeforeLayer& before_layer) {
  if (batch.size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch.size: must be > 0, got ", batch.size));
  }
  TESSERA_ASSIGN_OR_RETURN(Activations * a, ActivationsFor(slot, batch.size));
  TESSERA_RETURN_IF_ERROR(LoadBatch(batch, /*need_labels=*/true, a));
  TESSERA_RETURN_IF_ERROR(RunForward(a, /*training=*/true, before_layer));
  TESSERA_RETURN_IF_ERROR(backend_->LossForwardBackward(loss_, a->top.y.back(), a->labels,
                                                        &a->top.dy.back(), metrics_));
  if (weight != 1.0f) TESSERA_RETURN_IF_ERROR(backend_->Scale(weight, a->top.dy.back()));
  if (multi_input_) {
    // The wide part reads the output gradient before the top layers' backward pass.
    TESSERA_RETURN_IF_ERROR(BackwardWide(a, on_grad_ready));
  }
  TESSERA_RETURN_IF_ERROR(BackwardFromOutput(a, on_grad_ready, input_grad));
  TESSERA_RETURN_IF_ERROR(backend_->CopyToHost(metrics_, host_metrics_.data()));
  return StepResult{host_metrics_[0], static_cast<int64_t>(host_metrics_[1]), batch.size};
}

absl::Status Model::BackwardFromOutput(Activations* a,
                                       const std::function<void(int)>& on_grad_ready,
                                       std::vector<float>* input_grad) {
  // A first layer that is a view (Flatten) leaves the input's gradient in its own dy.
  const bool view = !multi_input_ && !sparse_input_ && layers_[0]->IsView();
  const bool wanted = input_grad != nullptr && !view;
  if (wanted && a->input_grad.empty()) {
    TESSERA_ASSIGN_OR_RETURN(a->input_grad, backend_->Allocate(WithBatch(a->n, input_shape_)));
  }
  const bool writes_input_grad = multi_input_ || layers_[0]->WritesInputGrad() || wanted;
  TESSERA_RETURN_IF_ERROR(
      internal::BackwardChain(backend_, layers_, layer_infos_, layer_parameters_, a->n, a->input,
                              writes_input_grad ? &a->input_grad : nullptr, a->top, &a->sparse,
                              accumulating_, on_grad_ready));
  if (multi_input_) TESSERA_RETURN_IF_ERROR(BackwardMultiInput(a, on_grad_ready));
  if (input_grad == nullptr) return absl::OkStatus();
  input_grad->resize(static_cast<size_t>(a->n * input_dim_));
  return backend_->CopyToHost(view ? a->top.dy[0] : a->input_grad, input_grad->data());
}

namespace {

absl::Status CheckStage(bool multi_input, bool sparse_input, int slot, const char* what) {
  if (multi_input || sparse_input) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": only dense single-input models run as pipeline stages"));
  }
  if (slot < 0 || slot >= Model::kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slot must be in [0, ", Model::kMaxSlots, "), got ", slot));
  }
  return absl::OkStatus();
}

absl::Status CheckWeight(float weight, const char* what) {
  if (weight > 0.0f && weight <= 1.0f) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": weight must be in (0, 1], got ", weight));
}

}  // namespace

absl::Status Model::StageForward(int slot, const BatchView& batch, std::vector<float>* out) {
  TESSERA_RETURN_IF_ERROR(CheckStage(multi_input_, sparse_input_, slot, "StageForward"));
  if (batch.size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch.size: must be > 0, got ", batch.size));
  }
  TESSERA_ASSIGN_OR_RETURN(Activations * a, ActivationsFor(slot, batch.size));
  TESSERA_RETURN_IF_ERROR(LoadBatch(batch, /*need_labels=*/false, a));
  TESSERA_RETURN_IF_ERROR(RunForward(a, /*training=*/true));
  out->resize(static_cast<size_t>(batch.size * output_dim_));
  return backend_->CopyToHost(a->top.y.back(), out->data());
}

absl::Status Model::StageBackward(int slot, absl::Span<const float> output_grad,
                                  std::vector<float>* input_grad) {
  TESSERA_RETURN_IF_ERROR(CheckStage(multi_input_, sparse_input_, slot, "StageBackward"));
  const int64_t size = static_cast<int64_t>(output_grad.size());
  if (size == 0 || size % output_dim_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("StageBackward: output_grad must hold n x ",
                                                   output_dim_, " floats with n > 0, got ", size));
  }
  const int64_t n = size / output_dim_;
  auto found = activations_.find({slot, n});
  if (found == activations_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("StageBackward: slot ", slot, " holds no forward pass of ", n, " examples"));
  }
  Activations* a = found->second.get();
  TESSERA_RETURN_IF_ERROR(backend_->CopyToDevice(output_grad.data(), a->top.dy.back()));
  return BackwardFromOutput(a, {}, input_grad);
}

absl::StatusOr<StepResult> Model::StageTrain(int slot, const BatchView& batch, float weight,
                                             std::vector<float>* input_grad) {
  TESSERA_RETURN_IF_ERROR(CheckStage(multi_input_, sparse_input_, slot, "StageTrain"));
  TESSERA_RETURN_IF_ERROR(CheckWeight(weight, "StageTrain"));
  return TrainSlot(slot, batch, weight, {}, input_grad);
}

absl::StatusOr<StepResult> Model::TrainPart(const BatchView& batch, float weight) {
  TESSERA_RETURN_IF_ERROR(CheckWeight(weight, "TrainPart"));
  return TrainSlot(0, batch, weight, {}, nullptr);
}

void Model::SwapAccumulated(size_t i) {
  Parameter& p = parameters_[i];
  std::swap(p.grad, accumulated_[i]);
  bindings_[i].first->Rebind(bindings_[i].second, p.value, p.grad);
}

absl::Status Model::AccumulateGrads(bool first) {
  accumulated_.resize(parameters_.size());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Parameter& p = parameters_[i];
    if (!p.trainable || p.sparse || bindings_[i].first == nullptr) continue;
    // Such a layer adds the next micro-batches' gradients itself (accumulating_).
    if (bindings_[i].first->AccumulatesGrads()) continue;
    if (first) {
      // Every backward pass writes the whole gradient, so the next one may go to any buffer.
      if (accumulated_[i].empty()) {
        TESSERA_ASSIGN_OR_RETURN(accumulated_[i], backend_->Allocate(p.shape));
      }
      SwapAccumulated(i);
    } else {
      TESSERA_RETURN_IF_ERROR(backend_->Axpy(1.0f, p.grad, accumulated_[i]));
    }
  }
  accumulating_ = true;
  return absl::OkStatus();
}

absl::Status Model::UseAccumulatedGrads() {
  if (!accumulating_) return absl::OkStatus();
  for (size_t i = 0; i < accumulated_.size(); ++i) {
    if (!accumulated_[i].empty()) SwapAccumulated(i);
  }
  accumulating_ = false;
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Model::Evaluate(const BatchView& batch, std::vector<float>* outputs) {
  if (batch.size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch.size: must be > 0, got ", batch.size));
  }
  TESSERA_ASSIGN_OR_RETURN(Activations * a, ActivationsFor(0, batch.size));
  TESSERA_RETURN_IF_ERROR(LoadBatch(batch, /*need_labels=*/true, a));
  TESSERA_RETURN_IF_ERROR(RunForward(a, /*training=*/false));
  TESSERA_RETURN_IF_ERROR(
      backend_->LossForwardBackward(loss_, a->top.y.back(), a->labels, nullptr, metrics_));
  if (outputs != nullptr) {
    outputs->resize(static_cast<size_t>(batch.size * output_dim_));
    TESSERA_RETURN_IF_ERROR(backend_->CopyToHost(a->top.y.back(), outputs->data()));
  }
  TESSERA_RETURN_IF_ERROR(backend_->CopyToHost(metrics_, host_metrics_.data()));
  return StepResult{host_metrics_[0], static_cast<int64_t>(host_metrics_[1]), batch.size};
}

absl::Status Model::Forward(const BatchView& batch, bool training, std::vector<float>* out) {
  if (batch.size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch.size: must be > 0, got ", batch.size));
  }
  TESSERA_ASSIGN_OR_RETURN(Activations * a, ActivationsFor(0, batch.size));
  TESSERA_RETURN_IF_ERROR(LoadBatch(batch, /*need_labels=*/false, a));
  TESSERA_RETURN_IF_ERROR(RunForward(a, training));
  out->resize(static_cast<size_t>(batch.size * output_dim_));
  return backend_->CopyToHost(a->top.y.back(), out->data());
}

namespace {

absl::StatusOr<const Parameter*> Lookup(const Model& model, const std::string& name) {
  const Parameter* p = model.FindParameter(name);
  if (p == nullptr) {
    return absl::NotFoundError(absl::StrCat("parameter \"", name, "\" is not in the model"));
  }
  return p;
}

absl::Status CheckSize(const Parameter& p, size_t size) {
  if (static_cast<int64_t>(size) != kernels::NumElements(p.shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter \"", p.name, "\" has shape ", kernels::ShapeString(p.shape), " (",
                     kernels::NumElements(p.shape), " values), got ", size));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Model::CopyValueToHost(const std::string& name, std::vector<float>* values) const {
  TESSERA_ASSIGN_OR_RETURN(const Parameter* p, Lookup(*this, name));
  values->resize(static_cast<size_t>(kernels::NumElements(p->shape)));
  if (values->empty()) return absl::OkStatus();  // a sparse table without rows
  return backend_->CopyToHost(p->value, values->data());
}

absl::Status Model::CopyValueFromHost(const std::string& name, absl::Span<const float> values) {
  TESSERA_ASSIGN_OR_RETURN(const Parameter* p, Lookup(*this, name));
  TESSERA_RETURN_IF_ERROR(CheckSize(*p, values.size()));
  if (values.empty()) return absl::OkStatus();
  return backend_->CopyToDevice(values.data(), p->value);
}

absl::Status Model::CopyGradToHost(const std::string& name, std::vector<float>* values) const {
  TESSERA_ASSIGN_OR_RETURN(const Parameter* p, Lookup(*this, name));
  if (!p->trainable) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter \"", name, "\" is not trainable and has no gradient"));
  }
  values->resize(static_cast<size_t>(kernels::NumElements(p->shape)));
  if (values->empty()) return absl::OkStatus();
  return backend_->CopyToHost(p->grad, values->data());
}

absl::Status Model::CopyGradFromHost(const std::string& name, absl::Span<const float> values) {
  TESSERA_ASSIGN_OR_RETURN(const Parameter* p, Lookup(*this, name));
  if (!p->trainable) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter \"", name, "\" is not trainable and has no gradient"));
  }
  TESSERA_RETURN_IF_ERROR(CheckSize(*p, values.size()));
  if (values.empty()) return absl::OkStatus();
  return backend_->CopyToDevice(values.data(), p->grad);
}

}  // namespace tessera::engine
