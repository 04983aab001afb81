// A trainable model built from a ModelSpec (proto/tessera/v1/model.proto) on one Backend.
//
// Model::Create() checks the whole spec and infers every shape with spec::InferModelShapes
// (spec/model_spec.h) before it allocates anything; a spec that does not fit is INVALID_ARGUMENT
// with a message that names the layer, e.g. "layers[3] (dense_2): dense.units must be > 0, got 0".
// Then it allocates the parameters, their gradients and the activations on the backend, and
// initialises the parameters from the seed (the same seed gives the same weights on every
// backend).
//
// A training step is TrainStep(): forward in training mode, the loss, and backward, which leaves
// the gradient of the mean loss in every parameter's `grad`. The caller applies the optimizer
// (Backend::ApplyUpdate, or pushes the gradients to the shards and pulls the weights back).
// Activations are cached for the few most recent batch sizes, so steady-state steps allocate
// nothing.
#ifndef TESSERA_WORKER_ENGINE_MODEL_H_
#define TESSERA_WORKER_ENGINE_MODEL_H_

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "spec/model_spec.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/cross_device_sum.h"

namespace tessera::engine {

// A tensor of the model, by stable name.
struct Parameter {
  std::string name;  // "dense_1/kernel"
  kernels::Shape shape;
  kernels::Tensor value;  // on the backend's device
  kernels::Tensor grad;   // same shape; written by TrainStep (empty for non-trainable state)
  bool trainable = true;
  // True for EmbeddingBag tables (sparse rows on the shards, DESIGN.md §2). Such a parameter
  // holds only the rows SetRows installed: shape [rows, dim], value and grad views of them (empty
  // while no row is installed), the gradient of row i being the sum over the batch of every use
  // of row i.
  bool sparse = false;
};

// A sparse table of a model: an embedding_bag layer's "embeddings". Its rows live outside the
// model (on the shards, or in the standalone trainer's row table); see Model::SetRows.
struct SparseTableInfo {
  std::string name;      // the parameter's, "embedding_bag_1/embeddings" or "<table>/embeddings"
  int parameter = 0;     // index into Model::parameters()
  int64_t dim = 0;       // values per row
  int64_t num_rows = 0;  // the spec's bound on the ids (0: hashed, any int64)
  // Multi-input models: the batch's fields (BatchView::fields) whose ids the table reads. Empty
  // for an embedding_bag first layer, which reads the batch's sparse_ids.
  std::vector<int> fields;
  spec::ParameterShape shape;  // as spec::InferModelShapes gave it (for spec::RowInitializer)
};

// One categorical field of a multi-input model's batch, as one table reads it: bag b holds ids
// [offsets[b], offsets[b+1]) (offsets has size + 1 entries), with per-id weights `values` (may
// be empty: all ones). As for sparse_ids, the ids are positions among the rows SetRows
// installed for the table.
struct SparseFieldView {
  absl::Span<const int64_t> offsets;
  absl::Span<const int64_t> ids;
  absl::Span<const float> values;
};

// One batch in host memory, as the data readers lay it out. Dense models read `features`
// (size x NumElements(input_shape) floats); models that start with an EmbeddingBag read the CSR
// triple (offsets has size + 1 entries starting at 0; values may be empty, meaning all ones),
// whose ids are positions among the rows SetRows installed, not the table's row ids (the
// trainers map them with trainer::internal::BatchRows).
// Multi-input models read `features` (size x dense_features floats) and `fields`: one
// SparseFieldView per (table, field) pair, table by table in sparse_tables() order and within a
// table in its `fields` order, each with the ids as positions among that table's rows (a field
// that a deep table and the wide table both read comes twice, once per table).
// Softmax cross-entropy reads `labels` (class ids); the other losses read `targets`
// (size x output_dim floats).
struct BatchView {
  int64_t size = 0;
  absl::Span<const float> features;
  absl::Span<const int64_t> sparse_offsets;
  absl::Span<const int64_t> sparse_ids;
  absl::Span<const float> sparse_values;
  absl::Span<const SparseFieldView> fields;
  absl::Span<const int32_t> labels;
  absl::Span<const float> targets;
};

struct StepResult {
  double loss = 0;      // mean loss over the batch
  int64_t correct = 0;  // examples predicted correctly (see model.proto's Loss)
  int64_t examples = 0;
};

// Not thread-safe: one thread drives a Model (and its Backend) at a time.
class Model {
 public:
  // Checks `spec` (spec::InferModelShapes: its INVALID_ARGUMENT as it is), allocates on `backend`
  // (not owned; must outlive the Model) and initialises the parameters from `seed`.
  // RESOURCE_EXHAUSTED when the parameters do not fit in the backend's memory.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const v1::ModelSpec& spec,
                                                       kernels::Backend* backend, uint64_t seed);
  ~Model();

  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Trainable parameters first (in layer order: kernel, bias, gamma, beta, embeddings), then
  // non-trainable state (batch-norm moving statistics). Stable across calls and backends; a
  // sparse table's entry changes shape with SetRows.
  const std::vector<Parameter>& parameters() const { return parameters_; }
  // The parameter called `name`, or nullptr.
  const Parameter* FindParameter(const std::string& name) const;
  // Per-layer shapes, as spec::InferModelShapes gave them.
  const std::vector<spec::LayerInfo>& layers() const { return layer_infos_; }
  const kernels::Shape& input_shape() const { return input_shape_; }
  // True when the first layer is an EmbeddingBag (the model reads sparse batches).
  bool sparse_input() const { return sparse_input_; }
  // Features per example (dense), or the spec's bound on the row ids (sparse; 0: hashed ids).
  int64_t input_dim() const { return input_dim_; }
  // True for a multi-input model (ModelSpec.tables): the batch holds dense features and fields.
  bool multi_input() const { return multi_input_; }
  // Multi-input models: the input side, as spec::InferModelShapes gave it.
  const spec::MultiInputShapes& multi_input_shapes() const { return multi_; }
  // The sparse tables: the embedding_bag first layer's, or a multi-input model's, spec order.
  const std::vector<SparseTableInfo>& sparse_tables() const { return sparse_tables_; }
  // Installs the rows of sparse table `table` that the next batches read: row i's dim values are
  // values[i * dim, (i + 1) * dim), and a batch's sparse id i means that row. The rows' gradients
  // come back through CopyGradToHost(name) after TrainStep, in the same order. Grows the table's
  // device buffers when needed (to twice their size), so steady-state steps allocate nothing.
  // INVALID_ARGUMENT for an unknown table or a size that is not count * dim; RESOURCE_EXHAUSTED
  // when the rows do not fit in the backend's memory.
  absl::Status SetRows(int table, int64_t count, absl::Span<const float> values);
  // The number of rows SetRows last installed for `table` (0 before).
  int64_t rows_installed(int table) const { return tables_[table].rows; }
  // Outputs per example (the loss's K).
  int64_t output_dim() const { return output_dim_; }
  kernels::LossKind loss() const { return loss_; }
  // Values of the dense trainable parameters (sparse tables have no fixed size).
  int64_t num_trainable_values() const;
  // RESOURCE_EXHAUSTED when the parameters, their gradients, the activations of a batch of
  // `batch_size` and `extra_bytes` more (optimizer state) would not fit in the backend's memory.
  absl::Status CheckMemory(int64_t batch_size, int64_t extra_bytes) const;
  kernels::Backend* backend() const { return backend_; }

  // Forward in training mode, loss, backward: every trainable parameter's grad holds the gradient
  // of the mean loss. `on_grad_ready` (may be empty) is called with an index into parameters()
  // as soon as that gradient is enqueued, last layer first (for pipelined pushes; on CUDA the
  // values are ready once the stream reaches that point, e.g. after a CopyToHost). Synchronises
  // once, to read the loss. INVALID_ARGUMENT when the batch does not fit the model (sizes, label
  // or id ranges).
  //
  // `before_layer` (may be empty) lets the caller install fresh weights while the forward pass
  // runs (the trainer's overlap of pulls with forward): it is called with position i before the
  // i-th step of the forward pass, and parameter p is first read after the call with
  // ForwardPosition(p). A single-input model calls it before each of layers(), in order; a
  // multi-input model once, with 0, before anything runs. An error from it ends the step with
  // that error.
  using BeforeLayer = std::function<absl::Status(int position)>;
  absl::StatusOr<StepResult> TrainStep(const BatchView& batch,
                                       const std::function<void(int)>& on_grad_ready = {},
                                       const BeforeLayer& before_layer = {});
  // TrainStep of one replica's part of a batch (trainer/internal/local_replicas.h): the gradient
  // of the loss scaled by `weight`, in (0, 1] (the part's share of the batch), so that the parts'
  // gradients sum to the whole batch's; the loss reported is not scaled. Any model, sparse tables
  // and several inputs included (StageTrain takes dense single-input stages only). Does not
  // advance dropout_seed(); the caller sets it per part.
  absl::StatusOr<StepResult> TrainPart(const BatchView& batch, float weight);
  // The position of TrainStep's before_layer call after which parameter p (an index into
  // parameters()) is first read: its layer's index, or 0 in a multi-input model.
  int ForwardPosition(int parameter) const;

  // Forward in evaluation mode and the loss; no gradients. With `outputs`, the last layer's
  // outputs ([size, output_dim], before the loss) are copied there too.
  absl::StatusOr<StepResult> Evaluate(const BatchView& batch,
                                      std::vector<float>* outputs = nullptr);

  // Forward only; copies the last layer's outputs ([size, output_dim] floats, before the loss)
  // to `out`. Training mode uses batch statistics (and updates the moving ones) and the current
  // dropout seed's masks, without advancing it.
  absl::Status Forward(const BatchView& batch, bool training, std::vector<float>* out);
  // Forward(batch, /*training=*/false, out).
  absl::Status Predict(const BatchView& batch, std::vector<float>* out) {
    return Forward(batch, false, out);
  }

  // SyncBN (batch_norm.sync): the collective that the model's synchronised BatchNorm layers sum
  // their batch statistics with, across the devices that train each batch together (not owned;
  // must outlive the model or be reset). Null (the default): every layer normalises by its own
  // batch, as on one device. With it set, every device of the group must run its training steps
  // together, or the others wait.
  void set_cross_device_sum(CrossDeviceSum* sum);

  // --- Pipeline stages (model parallelism; worker/trainer/internal/pipeline_stages.h) ---------
  // A stage is a Model built from a range of a bigger model's layers (spec::PlanPipeline), whose
  // input is the previous stage's output. Several micro-batches are in flight in a stage at once,
  // each in the activations of its own `slot` (>= 0, < kMaxSlots; TrainStep, Evaluate and Forward
  // use slot 0). Dropout masks derive from dropout_seed(), which these do not advance.
  static constexpr int kMaxSlots = 1024;
  // Forward in training mode of `batch` (features: the stage's input) into `slot`'s buffers,
  // which StageBackward reads; the outputs ([size, output_dim]) go to `out`.
  absl::Status StageForward(int slot, const BatchView& batch, std::vector<float>* out);
  // Backward of `slot`'s last StageForward from the gradient of its outputs (`output_grad`,
  // [size, output_dim]): every trainable parameter's grad is then that micro-batch's, and
  // `input_grad` (when not null) gets the gradient of the stage's input ([size, input_dim]).
  absl::Status StageBackward(int slot, absl::Span<const float> output_grad,
                             std::vector<float>* input_grad);
  // The last stage: forward, loss and backward of `batch` in `slot`, as TrainStep, with the
  // gradient of the loss scaled by `weight` (a micro-batch's share of the batch: every stage's
  // gradients of that micro-batch are then weighted, and sum to the batch's), and the gradient of
  // the stage's input into `input_grad` (when not null). The loss reported is not scaled.
  absl::StatusOr<StepResult> StageTrain(int slot, const BatchView& batch, float weight,
                                        std::vector<float>* input_grad);
  // Gradient accumulation over micro-batches, on the device: after a micro-batch's backward
  // pass, `first` keeps its gradients and opens an accumulation: the backward passes after it add
  // their gradients to the kept ones, inside the kernel where a layer can (Dense, in its GEMM),
  // otherwise in AccumulateGrads (the grads moved to a second buffer at `first`, no copy; Axpy).
  // UseAccumulatedGrads makes the grads the sum and closes the accumulation (call it before a
  // step, too, to close one that a failed step left open).
  absl::Status AccumulateGrads(bool first);
  absl::Status UseAccumulatedGrads();

  // Host copies of one parameter's value or gradient. NOT_FOUND for an unknown name;
  // INVALID_ARGUMENT when `values` has the wrong size.
  absl::Status CopyValueToHost(const std::string& name, std::vector<float>* values) const;
  absl::Status CopyValueFromHost(const std::string& name, absl::Span<const float> values);
  absl::Status CopyGradToHost(const std::string& name, std::vector<float>* values) const;
  // Overwrites a gradient (used by the tests and by callers that aggregate gradients elsewhere).
  absl::Status CopyGradFromHost(const std::string& name, absl::Span<const float> values);

  // The seed that the next training step's dropout masks derive from (advanced by every step).
  uint64_t dropout_seed() const { return dropout_seed_; }
  void set_dropout_seed(uint64_t seed) { dropout_seed_ = seed; }

  class Layer;  // internal (worker/engine/layers.h)

 private:
  struct Activations;

  Model(kernels::Backend* backend, uint64_t seed);
  absl::Status Build(const v1::ModelSpec& spec);
  // Sums the dense parameters' bytes (values and gradients) of the layer lists into
  // parameter_bytes_; RESOURCE_EXHAUSTED when they cannot fit in the backend's memory.
  absl::Status CheckParameterMemory(
      std::initializer_list<const std::vector<spec::LayerInfo>*> layer_lists);
  // Creates, initialises and binds the parameters of `layers` (`infos`), trainable ones when
  // `trainable`, else the state; layer_parameters gets each layer's trainable indices.
  absl::Status AddLayerParameters(const std::vector<std::unique_ptr<Layer>>& layers,
                                  const std::vector<spec::LayerInfo>& infos, bool trainable,
                                  std::vector<std::vector<int>>* layer_parameters,
                                  std::vector<std::vector<int>>* index);
  void BindLayers(const std::vector<std::unique_ptr<Layer>>& layers,
                  const std::vector<std::vector<int>>& index);
  // Parts of a multi-input model (worker/engine/model_multi_input.cc).
  absl::Status BuildMultiInput(const v1::ModelSpec& spec, spec::ModelShapes shapes);
  absl::Status AllocateMultiInput(int64_t n, Activations* a);
  int64_t MultiInputBytesPerExample() const;
  absl::Status LoadMultiInput(const BatchView& batch, Activations* a);
  absl::Status ForwardMultiInput(Activations* a, bool training);
  // Adds the wide table's pooled ids to the top layers' outputs.
  absl::Status AddWide(Activations* a);
  // The wide table's gradient, from the output gradient; then the rest below the top layers.
  absl::Status BackwardWide(Activations* a, const std::function<void(int)>& on_grad_ready);
  absl::Status BackwardMultiInput(Activations* a, const std::function<void(int)>& on_grad_ready);
  absl::StatusOr<Activations*> ActivationsFor(int slot, int64_t batch_size);
  // Forward, loss and backward of `batch` in `slot` (TrainStep, StageTrain).
  absl::StatusOr<StepResult> TrainSlot(int slot, const BatchView& batch, float weight,
                                       const std::function<void(int)>& on_grad_ready,
                                       std::vector<float>* input_grad,
                                       const BeforeLayer& before_layer = {});
  // Swaps parameter i's grad with accumulated_[i], rebinding its layer.
  void SwapAccumulated(size_t i);
  // Backward from a->top.dy.back(); with `input_grad`, the stage input's gradient copied there.
  absl::Status BackwardFromOutput(Activations* a, const std::function<void(int)>& on_grad_ready,
                                  std::vector<float>* input_grad);
  // An estimate of the bytes ActivationsFor(n) allocates (saturating at the int64 maximum).
  int64_t ActivationBytes(int64_t n) const;
  absl::Status LoadBatch(const BatchView& batch, bool need_labels, Activations* acts);
  absl::Status RunForward(Activations* acts, bool training, const BeforeLayer& before_layer = {});

  kernels::Backend* backend_;
  uint64_t seed_;
  uint64_t dropout_seed_;
  kernels::LossKind loss_ = kernels::LossKind::kSoftmaxCrossEntropy;
  kernels::Shape input_shape_;
  bool sparse_input_ = false;
  int64_t input_dim_ = 0;
  int64_t output_dim_ = 0;
  int64_t parameter_bytes_ = 0;  // values and gradients
  std::vector<spec::LayerInfo> layer_infos_;
  std::vector<std::unique_ptr<Layer>> layers_;  // a multi-input model's top layers
  bool multi_input_ = false;
  spec::MultiInputShapes multi_;
  std::vector<std::unique_ptr<Layer>> bottom_;  // multi-input: bottom layers
  std::vector<std::vector<int>> bottom_parameters_;
  std::vector<std::unique_ptr<Layer>> bags_;  // multi-input: one embedding_bag per table
  // Indices into parameters_ of each layer's trainable parameters.
  std::vector<std::vector<int>> layer_parameters_;
  std::vector<Parameter> parameters_;
  // Per sparse table: where its parameter is bound, and its device buffers.
  struct TableState {
    Layer* layer = nullptr;         // the embedding_bag layer that reads the table
    int position = 0;               // the parameter's position among the layer's parameters
    int64_t rows = 0;               // installed
    kernels::Tensor values, grads;  // [capacity, dim]
  };
  std::vector<SparseTableInfo> sparse_tables_;
  std::vector<TableState> tables_;
  std::map<std::string, int> parameter_index_;
  // By (slot, batch size).
  std::map<std::pair<int, int64_t>, std::unique_ptr<Activations>> activations_;
  std::vector<kernels::Tensor> accumulated_;  // AccumulateGrads, per parameter (or empty)
  // Per parameter: the layer its tensors are bound to, and their position there.
  std::vector<std::pair<Layer*, size_t>> bindings_;
  // Per parameter: ForwardPosition (single-input models; empty for multi-input ones).
  std::vector<int> forward_position_;
  // Between AccumulateGrads(first) and UseAccumulatedGrads: the other layers' buffers are
  // swapped, and the layers that AccumulatesGrads add theirs.
  bool accumulating_ = false;
  uint64_t activation_clock_ = 0;
  kernels::Tensor metrics_;
  std::vector<float> host_metrics_;
};

}  // namespace tessera::engine

#endif  // TESSERA_WORKER_ENGINE_MODEL_H_
