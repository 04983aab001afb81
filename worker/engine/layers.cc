#include "worker/engine/internal/layers.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/engine/internal/sync_batch_norm.h"

namespace tessera::engine {
namespace {

using kernels::Backend;
using kernels::Shape;
using kernels::Tensor;

// --- Dense ---------------------------------------------------------------------------------------
class DenseLayer final : public Model::Layer {
 public:
  explicit DenseLayer(const spec::LayerInfo& info) : Layer(info) {}

  bool BackwardIgnoresOutput() const override { return true; }
  bool AccumulatesGrads() const override { return true; }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    return backend->DenseForward(a.x, values_[0], values_[1], a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    return backend->DenseBackward(a.x, values_[0], a.dy, a.dx, grads_[0], grads_[1], a.accumulate);
  }
};

// --- Conv2D --------------------------------------------------------------------------------------
class Conv2DLayer final : public Model::Layer {
 public:
  explicit Conv2DLayer(const spec::LayerInfo& info) : Layer(info) {
    const spec::Window2D& w = info.window;
    g_.c = w.channels, g_.h = w.height, g_.w = w.width;
    g_.k = info.output_shape[0];
    g_.kh = w.kernel_h, g_.kw = w.kernel_w;
    g_.stride_h = w.stride_h, g_.stride_w = w.stride_w;
    g_.pad_h = w.pad_h, g_.pad_w = w.pad_w;
    g_.oh = w.out_h, g_.ow = w.out_w;
  }

  bool BackwardIgnoresOutput() const override { return true; }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    return backend->Conv2DForward(Geometry(a.n), a.x, values_[0], values_[1], a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    return backend->Conv2DBackward(Geometry(a.n), a.x, values_[0], a.dy, a.dx, grads_[0],
                                   grads_[1]);
  }

 private:
  kernels::Conv2DGeometry Geometry(int64_t n) const {
    kernels::Conv2DGeometry g = g_;
    g.n = n;
    return g;
  }
  kernels::Conv2DGeometry g_;
};

// --- Pool2D --------------------------------------------------------------------------------------
class Pool2DLayer final : public Model::Layer {
 public:
  Pool2DLayer(const spec::LayerInfo& info, kernels::PoolKind kind) : Layer(info) {
    const spec::Window2D& w = info.window;
    g_.kind = kind;
    g_.c = w.channels, g_.h = w.height, g_.w = w.width;
    g_.kh = w.kernel_h, g_.kw = w.kernel_w;
    g_.stride_h = w.stride_h, g_.stride_w = w.stride_w;
    g_.pad_h = w.pad_h, g_.pad_w = w.pad_w;
    g_.oh = w.out_h, g_.ow = w.out_w;
  }

  absl::StatusOr<std::vector<Tensor>> Scratch(Backend* backend, int64_t n) override {
    TESSERA_ASSIGN_OR_RETURN(Tensor ws, backend->PoolWorkspace(Geometry(n)));
    return std::vector<Tensor>{ws};
  }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    return backend->Pool2DForward(Geometry(a.n), a.x, a.y, (*a.scratch)[0], a.training);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    return backend->Pool2DBackward(Geometry(a.n), a.x, a.y, a.dy, (*a.scratch)[0], *a.dx);
  }

 private:
  kernels::Pool2DGeometry Geometry(int64_t n) const {
    kernels::Pool2DGeometry g = g_;
    g.n = n;
    return g;
  }
  kernels::Pool2DGeometry g_;
};

// --- Activations ---------------------------------------------------------------------------------
class ActivationLayer final : public Model::Layer {
 public:
  ActivationLayer(const spec::LayerInfo& info, kernels::Activation kind)
      : Layer(info), kind_(kind) {}

  bool CanRunInPlace() const override { return kind_ == kernels::Activation::kRelu; }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    return backend->ActivationForward(kind_, a.x, a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    return backend->ActivationBackward(kind_, a.x, a.y, a.dy, *a.dx);
  }

 private:
  kernels::Activation kind_;
};

// --- Dropout -------------------------------------------------------------------------------------
class DropoutLayer final : public Model::Layer {
 public:
  DropoutLayer(const spec::LayerInfo& info, float rate) : Layer(info), rate_(rate) {}

  absl::StatusOr<std::vector<Tensor>> Scratch(Backend* backend, int64_t n) override {
    Shape s = in_shape();
    s.insert(s.begin(), n);
    TESSERA_ASSIGN_OR_RETURN(Tensor mask, backend->Allocate(s));
    return std::vector<Tensor>{mask};
  }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    if (!a.training || rate_ == 0.0f) return backend->CopyDeviceToDevice(a.x, a.y);
    return backend->DropoutForward(rate_, a.dropout_seed, a.x, (*a.scratch)[0], a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    if (rate_ == 0.0f) return backend->CopyDeviceToDevice(a.dy, *a.dx);
    return backend->DropoutBackward(a.dy, (*a.scratch)[0], *a.dx);
  }

 private:
  float rate_;
};

// --- Flatten -------------------------------------------------------------------------------------
class FlattenLayer final : public Model::Layer {
 public:
  explicit FlattenLayer(const spec::LayerInfo& info) : Layer(info) {}
  bool IsView() const override { return true; }
  absl::Status Forward(Backend*, const ForwardArgs&) override { return absl::OkStatus(); }
  absl::Status Backward(Backend*, const BackwardArgs&) override { return absl::OkStatus(); }
};

// --- BatchNorm -----------------------------------------------------------------------------------
class BatchNormLayer final : public Model::Layer {
 public:
  explicit BatchNormLayer(const spec::LayerInfo& info) : Layer(info) {
    g_.c = info.batch_norm.channels;
    g_.spatial = info.batch_norm.spatial;
    g_.momentum = info.batch_norm.momentum;
    g_.epsilon = info.batch_norm.epsilon;
    sync_ = info.batch_norm.sync;
  }

  bool WritesInputGrad() const override { return true; }
  void SetCrossDeviceSum(CrossDeviceSum* sum) override { sum_ = sync_ ? sum : nullptr; }

  absl::StatusOr<std::vector<Tensor>> Scratch(Backend* backend, int64_t n) override {
    TESSERA_ASSIGN_OR_RETURN(Tensor mean, backend->Allocate({g_.c}));
    TESSERA_ASSIGN_OR_RETURN(Tensor var, backend->Allocate({g_.c}));
    return std::vector<Tensor>{mean, var};
  }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const kernels::BatchNormGeometry g = Geometry(a.n);
    if (a.training && sum_ != nullptr) {
      return internal::SyncBatchNormForward(backend, g, a.x, values_[0], values_[1], a.y,
                                            values_[2], values_[3], (*a.scratch)[0],
                                            (*a.scratch)[1], sum_, &host_);
    }
    if (a.training) {
      return backend->BatchNormForwardTraining(g, a.x, values_[0], values_[1], a.y, values_[2],
                                               values_[3], (*a.scratch)[0], (*a.scratch)[1]);
    }
    return backend->BatchNormForwardInference(g, a.x, values_[0], values_[1], values_[2],
                                              values_[3], a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    if (sum_ != nullptr) {
      return internal::SyncBatchNormBackward(backend, Geometry(a.n), a.x, values_[0],
                                             (*a.scratch)[0], (*a.scratch)[1], a.dy, *a.dx,
                                             grads_[0], grads_[1], sum_, &host_);
    }
    return backend->BatchNormBackward(Geometry(a.n), a.x, values_[0], (*a.scratch)[0],
                                      (*a.scratch)[1], a.dy, *a.dx, grads_[0], grads_[1]);
  }

 private:
  kernels::BatchNormGeometry Geometry(int64_t n) const {
    kernels::BatchNormGeometry g = g_;
    g.n = n;
    return g;
  }
  kernels::BatchNormGeometry g_;
  bool sync_ = false;
  CrossDeviceSum* sum_ = nullptr;  // set (SyncBN) when several devices train a batch together
  internal::SyncBatchNormBuffers host_;
};

// --- EmbeddingBag --------------------------------------------------------------------------------
class EmbeddingBagLayer final : public Model::Layer {
 public:
  EmbeddingBagLayer(const spec::LayerInfo& info, v1::EmbeddingBag::Combiner combiner)
      : Layer(info),
        combiner_(combiner == v1::EmbeddingBag::COMBINER_MEAN ? kernels::Combiner::kMean
                                                              : kernels::Combiner::kSum) {}

  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const Tensor* values = a.sparse->values.empty() ? nullptr : &a.sparse->values;
    return backend->EmbeddingBagForward(combiner_, values_[0], a.sparse->ids, a.sparse->offsets,
                                        values, a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    const Tensor* values = a.sparse->values.empty() ? nullptr : &a.sparse->values;
    return backend->EmbeddingBagBackward(combiner_, a.sparse->ids, a.sparse->offsets, values, a.dy,
                                         grads_[0]);
  }

 private:
  kernels::Combiner combiner_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model::Layer>> MakeLayer(const v1::Layer& layer,
                                                        const spec::LayerInfo& info) {
  using LayerPtr = std::unique_ptr<Model::Layer>;
  switch (layer.kind_case()) {
    case v1::Layer::kDense:
      return LayerPtr(new DenseLayer(info));
    case v1::Layer::kConv2D:
      return LayerPtr(new Conv2DLayer(info));
    case v1::Layer::kMaxPool2D:
      return LayerPtr(new Pool2DLayer(info, kernels::PoolKind::kMax));
    case v1::Layer::kAvgPool2D:
      return LayerPtr(new Pool2DLayer(info, kernels::PoolKind::kAvg));
    case v1::Layer::kRelu:
      return LayerPtr(new ActivationLayer(info, kernels::Activation::kRelu));
    case v1::Layer::kTanh:
      return LayerPtr(new ActivationLayer(info, kernels::Activation::kTanh));
    case v1::Layer::kSigmoid:
      return LayerPtr(new ActivationLayer(info, kernels::Activation::kSigmoid));
    case v1::Layer::kDropout:
      return LayerPtr(new DropoutLayer(info, layer.dropout().rate()));
    case v1::Layer::kFlatten:
      return LayerPtr(new FlattenLayer(info));
    case v1::Layer::kBatchNorm:
      return LayerPtr(new BatchNormLayer(info));
    case v1::Layer::kEmbeddingBag:
      return LayerPtr(new EmbeddingBagLayer(info, layer.embedding_bag().combiner()));
    case v1::Layer::KIND_NOT_SET:
      break;
  }
  return absl::InternalError(
      absl::StrCat("MakeLayer: ", info.name, " has no layer kind; shape inference refuses it"));
}

}  // namespace tessera::engine
