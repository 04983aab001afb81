#include "worker/engine/internal/layers.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera::engine {
namespace {

using kernels::Backend;
using kernels::Shape;
using kernels::Tensor;

// Sizes beyond this per example are refused (they would overflow the 32-bit indexing of the
// libraries, and no model here needs them).
constexpr int64_t kMaxElements = int64_t{1} << 31;

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

// [C, H, W] view of a rank-2 or rank-3 example shape.
bool AsImage(const Shape& s, int64_t* c, int64_t* h, int64_t* w) {
  if (s.size() == 3) {
    *c = s[0], *h = s[1], *w = s[2];
    return true;
  }
  if (s.size() == 2) {
    *c = 1, *h = s[0], *w = s[1];
    return true;
  }
  return false;
}

// --- Dense ---------------------------------------------------------------------------------------
class DenseLayer final : public Model::Layer {
 public:
  DenseLayer(std::string name, Shape in, int64_t units, const v1::Dense& spec)
      : Layer(std::move(name), "dense", in, {units}), spec_(spec) {}

  std::vector<ParameterDecl> Parameters() const override {
    const int64_t in = kernels::NumElements(in_shape()), out = out_shape()[0];
    return {
        {"kernel",
         {out, in},
         Resolve(spec_.kernel_initializer(), v1::WeightInitializer::KIND_GLOROT_UNIFORM),
         in,
         out},
        {"bias",
         {out},
         Resolve(spec_.bias_initializer(), v1::WeightInitializer::KIND_ZEROS),
         in,
         out},
    };
  }

  bool BackwardIgnoresOutput() const override { return true; }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    return backend->DenseForward(a.x, values_[0], values_[1], a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    return backend->DenseBackward(a.x, values_[0], a.dy, a.dx, grads_[0], grads_[1]);
  }

 private:
  v1::Dense spec_;
};

// --- Conv2D --------------------------------------------------------------------------------------
class Conv2DLayer final : public Model::Layer {
 public:
  Conv2DLayer(std::string name, Shape in, Shape out, kernels::Conv2DGeometry g,
              const v1::Conv2D& spec)
      : Layer(std::move(name), "conv2d", std::move(in), std::move(out)), g_(g), spec_(spec) {}

  std::vector<ParameterDecl> Parameters() const override {
    const int64_t fan_in = g_.c * g_.kh * g_.kw, fan_out = g_.k * g_.kh * g_.kw;
    return {
        {"kernel",
         {g_.k, g_.c, g_.kh, g_.kw},
         Resolve(spec_.kernel_initializer(), v1::WeightInitializer::KIND_GLOROT_UNIFORM),
         fan_in,
         fan_out},
        {"bias",
         {g_.k},
         Resolve(spec_.bias_initializer(), v1::WeightInitializer::KIND_ZEROS),
         fan_in,
         fan_out},
    };
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
  v1::Conv2D spec_;
};

// --- Pool2D --------------------------------------------------------------------------------------
class Pool2DLayer final : public Model::Layer {
 public:
  Pool2DLayer(std::string name, Shape in, Shape out, kernels::Pool2DGeometry g)
      : Layer(std::move(name), g.kind == kernels::PoolKind::kMax ? "max_pool2d" : "avg_pool2d",
              std::move(in), std::move(out)),
        g_(g) {}

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
  ActivationLayer(std::string name, std::string type, Shape shape, kernels::Activation kind)
      : Layer(std::move(name), std::move(type), shape, shape), kind_(kind) {}

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
  DropoutLayer(std::string name, Shape shape, float rate)
      : Layer(std::move(name), "dropout", shape, shape), rate_(rate) {}

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
  FlattenLayer(std::string name, Shape in)
      : Layer(std::move(name), "flatten", in, {kernels::NumElements(in)}) {}
  bool IsView() const override { return true; }
  absl::Status Forward(Backend*, const ForwardArgs&) override { return absl::OkStatus(); }
  absl::Status Backward(Backend*, const BackwardArgs&) override { return absl::OkStatus(); }
};

// --- BatchNorm -----------------------------------------------------------------------------------
class BatchNormLayer final : public Model::Layer {
 public:
  BatchNormLayer(std::string name, Shape shape, int64_t channels, int64_t spatial, float momentum,
                 float epsilon)
      : Layer(std::move(name), "batch_norm", shape, shape) {
    g_.c = channels;
    g_.spatial = spatial;
    g_.momentum = momentum;
    g_.epsilon = epsilon;
  }

  std::vector<ParameterDecl> Parameters() const override {
    v1::WeightInitializer ones, zeros;
    ones.set_kind(v1::WeightInitializer::KIND_CONSTANT);
    ones.set_value(1.0f);
    zeros.set_kind(v1::WeightInitializer::KIND_ZEROS);
    return {
        {"gamma", {g_.c}, ones, g_.c, g_.c},
        {"beta", {g_.c}, zeros, g_.c, g_.c},
        {"moving_mean", {g_.c}, zeros, g_.c, g_.c, /*trainable=*/false},
        {"moving_variance", {g_.c}, ones, g_.c, g_.c, /*trainable=*/false},
    };
  }
  bool WritesInputGrad() const override { return true; }

  absl::StatusOr<std::vector<Tensor>> Scratch(Backend* backend, int64_t n) override {
    TESSERA_ASSIGN_OR_RETURN(Tensor mean, backend->Allocate({g_.c}));
    TESSERA_ASSIGN_OR_RETURN(Tensor var, backend->Allocate({g_.c}));
    return std::vector<Tensor>{mean, var};
  }
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const kernels::BatchNormGeometry g = Geometry(a.n);
    if (a.training) {
      return backend->BatchNormForwardTraining(g, a.x, values_[0], values_[1], a.y, values_[2],
                                               values_[3], (*a.scratch)[0], (*a.scratch)[1]);
    }
    return backend->BatchNormForwardInference(g, a.x, values_[0], values_[1], values_[2],
                                              values_[3], a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
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
};

// --- EmbeddingBag --------------------------------------------------------------------------------
class EmbeddingBagLayer final : public Model::Layer {
 public:
  EmbeddingBagLayer(std::string name, const v1::EmbeddingBag& spec)
      : Layer(std::move(name), "embedding_bag", {spec.num_rows()}, {spec.dim()}), spec_(spec) {}

  std::vector<ParameterDecl> Parameters() const override {
    v1::WeightInitializer init = spec_.embeddings_initializer();
    if (init.kind() == v1::WeightInitializer::KIND_UNSPECIFIED) {
      init.set_kind(v1::WeightInitializer::KIND_NORMAL);
      init.set_stddev(0.01f);
    }
    ParameterDecl d{
        "embeddings", {spec_.num_rows(), spec_.dim()}, init, spec_.num_rows(), spec_.dim()};
    d.sparse = true;
    return {d};
  }

  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const Tensor* values = a.sparse->values.empty() ? nullptr : &a.sparse->values;
    return backend->EmbeddingBagForward(Combine(), values_[0], a.sparse->ids, a.sparse->offsets,
                                        values, a.y);
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    const Tensor* values = a.sparse->values.empty() ? nullptr : &a.sparse->values;
    return backend->EmbeddingBagBackward(Combine(), a.sparse->ids, a.sparse->offsets, values, a.dy,
                                         grads_[0]);
  }

 private:
  kernels::Combiner Combine() const {
    return spec_.combiner() == v1::EmbeddingBag::COMBINER_MEAN ? kernels::Combiner::kMean
                                                               : kernels::Combiner::kSum;
  }
  v1::EmbeddingBag spec_;
};

absl::Status CheckSize(int index, const std::string& name, const char* field, int64_t value) {
  if (value <= 0) {
    return LayerError(index, name, absl::StrCat(field, " must be > 0, got ", value));
  }
  if (value > kMaxElements) {
    return LayerError(index, name,
                      absl::StrCat(field, " must be <= ", kMaxElements, ", got ", value));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model::Layer>> MakePool(const v1::Pool2D& p, kernels::PoolKind kind,
                                                       int index, const std::string& name,
                                                       const Shape& in) {
  const char* type = kind == kernels::PoolKind::kMax ? "max_pool2d" : "avg_pool2d";
  kernels::Pool2DGeometry g;
  g.kind = kind;
  if (!AsImage(in, &g.c, &g.h, &g.w)) {
    return LayerError(index, name,
                      absl::StrCat(type, " needs a [channels, height, width] input, got ",
                                   kernels::ShapeString(in)));
  }
  g.kh = p.pool_h() == 0 ? 2 : p.pool_h();
  g.kw = p.pool_w() == 0 ? 2 : p.pool_w();
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, absl::StrCat(type, ".pool_h").c_str(), g.kh));
  TESSERA_RETURN_IF_ERROR(CheckSize(index, name, absl::StrCat(type, ".pool_w").c_str(), g.kw));
  g.stride_h = p.stride_h() == 0 ? g.kh : p.stride_h();
  g.stride_w = p.stride_w() == 0 ? g.kw : p.stride_w();
  TESSERA_RETURN_IF_ERROR(
      CheckSize(index, name, absl::StrCat(type, ".stride_h").c_str(), g.stride_h));
  TESSERA_RETURN_IF_ERROR(
      CheckSize(index, name, absl::StrCat(type, ".stride_w").c_str(), g.stride_w));
  g.pad_h = p.padding_h();
  g.pad_w = p.padding_w();
  if (g.pad_h < 0 || g.pad_h >= g.kh) {
    return LayerError(
        index, name,
        absl::StrCat(type, ".padding_h must be in [0, pool_h = ", g.kh, "), got ", g.pad_h));
  }
  if (g.pad_w < 0 || g.pad_w >= g.kw) {
    return LayerError(
        index, name,
        absl::StrCat(type, ".padding_w must be in [0, pool_w = ", g.kw, "), got ", g.pad_w));
  }
  if (g.h + 2 * g.pad_h < g.kh || g.w + 2 * g.pad_w < g.kw) {
    return LayerError(index, name,
                      absl::StrCat(type, " window ", g.kh, "x", g.kw, " is larger than the padded ",
                                   "input ", g.h + 2 * g.pad_h, "x", g.w + 2 * g.pad_w));
  }
  g.oh = (g.h + 2 * g.pad_h - g.kh) / g.stride_h + 1;
  g.ow = (g.w + 2 * g.pad_w - g.kw) / g.stride_w + 1;
  Shape out{g.c, g.oh, g.ow};
  const int64_t out_elements = kernels::CheckedNumElements(out);
  if (out_elements < 0 || out_elements > kMaxElements) {
    return LayerError(index, name,
                      absl::StrCat(type, " output ", kernels::ShapeString(out), " has more than ",
                                   kMaxElements, " elements"));
  }
  return std::unique_ptr<Model::Layer>(new Pool2DLayer(name, in, out, g));
}

}  // namespace

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

absl::StatusOr<std::unique_ptr<Model::Layer>> MakeLayer(const v1::Layer& spec, int index,
                                                        const std::string& name, const Shape& in) {
  using LayerPtr = std::unique_ptr<Model::Layer>;
  switch (spec.kind_case()) {
    case v1::Layer::kDense: {
      const v1::Dense& d = spec.dense();
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "dense.units", d.units()));
      const int64_t in_features = kernels::NumElements(in);
      if (d.in_features() != 0 && d.in_features() != in_features) {
        return LayerError(index, name,
                          absl::StrCat("dense.in_features is ", d.in_features(),
                                       " but the input of this layer has ", in_features,
                                       " features (shape ", kernels::ShapeString(in), ")"));
      }
      TESSERA_RETURN_IF_ERROR(
          CheckInitializer(index, name, "dense.kernel_initializer", d.kernel_initializer()));
      TESSERA_RETURN_IF_ERROR(
          CheckInitializer(index, name, "dense.bias_initializer", d.bias_initializer()));
      const int64_t kernel_elements = kernels::CheckedProduct(in_features, d.units());
      if (kernel_elements < 0 || kernel_elements > kMaxElements) {
        return LayerError(
            index, name,
            absl::StrCat("dense kernel of ", d.units(), " x ", in_features, " is too large"));
      }
      return LayerPtr(new DenseLayer(name, in, d.units(), d));
    }
    case v1::Layer::kConv2D: {
      const v1::Conv2D& c = spec.conv2d();
      kernels::Conv2DGeometry g;
      if (!AsImage(in, &g.c, &g.h, &g.w)) {
        return LayerError(index, name,
                          absl::StrCat("conv2d needs a [channels, height, width] input, got ",
                                       kernels::ShapeString(in)));
      }
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.filters", c.filters()));
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.kernel_h", c.kernel_h()));
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.kernel_w", c.kernel_w()));
      g.k = c.filters();
      g.kh = c.kernel_h();
      g.kw = c.kernel_w();
      g.stride_h = c.stride_h() == 0 ? 1 : c.stride_h();
      g.stride_w = c.stride_w() == 0 ? 1 : c.stride_w();
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.stride_h", g.stride_h));
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "conv2d.stride_w", g.stride_w));
      if (c.padding_h() < 0 || c.padding_w() < 0 || c.padding_h() > kMaxElements ||
          c.padding_w() > kMaxElements) {
        return LayerError(
            index, name,
            absl::StrCat("conv2d.padding_h and padding_w must be in [0, ", kMaxElements, "], got ",
                         c.padding_h(), " and ", c.padding_w()));
      }
      g.pad_h = c.padding_h();
      g.pad_w = c.padding_w();
      if (g.h + 2 * g.pad_h < g.kh || g.w + 2 * g.pad_w < g.kw) {
        return LayerError(
            index, name,
            absl::StrCat("conv2d kernel ", g.kh, "x", g.kw, " is larger than the padded input ",
                         g.h + 2 * g.pad_h, "x", g.w + 2 * g.pad_w));
      }
      TESSERA_RETURN_IF_ERROR(
          CheckInitializer(index, name, "conv2d.kernel_initializer", c.kernel_initializer()));
      TESSERA_RETURN_IF_ERROR(
          CheckInitializer(index, name, "conv2d.bias_initializer", c.bias_initializer()));
      g.oh = (g.h + 2 * g.pad_h - g.kh) / g.stride_h + 1;
      g.ow = (g.w + 2 * g.pad_w - g.kw) / g.stride_w + 1;
      const int64_t out_elements = kernels::CheckedNumElements({g.k, g.oh, g.ow});
      const int64_t kernel_elements = kernels::CheckedNumElements({g.k, g.c, g.kh, g.kw});
      if (out_elements < 0 || out_elements > kMaxElements || kernel_elements < 0 ||
          kernel_elements > kMaxElements) {
        return LayerError(index, name,
                          absl::StrCat("conv2d output [", g.k, ", ", g.oh, ", ", g.ow,
                                       "] or kernel [", g.k, ", ", g.c, ", ", g.kh, ", ", g.kw,
                                       "] has more than ", kMaxElements, " elements"));
      }
      Shape out{g.k, g.oh, g.ow};
      return LayerPtr(new Conv2DLayer(name, in, out, g, c));
    }
    case v1::Layer::kMaxPool2D:
      return MakePool(spec.max_pool2d(), kernels::PoolKind::kMax, index, name, in);
    case v1::Layer::kAvgPool2D:
      return MakePool(spec.avg_pool2d(), kernels::PoolKind::kAvg, index, name, in);
    case v1::Layer::kRelu:
      return LayerPtr(new ActivationLayer(name, "relu", in, kernels::Activation::kRelu));
    case v1::Layer::kTanh:
      return LayerPtr(new ActivationLayer(name, "tanh", in, kernels::Activation::kTanh));
    case v1::Layer::kSigmoid:
      return LayerPtr(new ActivationLayer(name, "sigmoid", in, kernels::Activation::kSigmoid));
    case v1::Layer::kDropout: {
      const float rate = spec.dropout().rate();
      if (!(rate >= 0.0f && rate < 1.0f)) {
        return LayerError(index, name, absl::StrCat("dropout.rate must be in [0, 1), got ", rate));
      }
      return LayerPtr(new DropoutLayer(name, in, rate));
    }
    case v1::Layer::kFlatten:
      return LayerPtr(new FlattenLayer(name, in));
    case v1::Layer::kBatchNorm: {
      const v1::BatchNorm& b = spec.batch_norm();
      const float momentum = b.momentum() == 0.0f ? 0.1f : b.momentum();
      const float epsilon = b.epsilon() == 0.0f ? 1e-5f : b.epsilon();
      if (!(momentum > 0.0f && momentum <= 1.0f)) {
        return LayerError(
            index, name, absl::StrCat("batch_norm.momentum must be in (0, 1], got ", b.momentum()));
      }
      if (!(epsilon > 0.0f) || !std::isfinite(epsilon)) {
        return LayerError(index, name,
                          absl::StrCat("batch_norm.epsilon must be > 0, got ", b.epsilon()));
      }
      int64_t c = 0, h = 0, w = 0;
      if (in.size() == 1) {
        return LayerPtr(new BatchNormLayer(name, in, in[0], 1, momentum, epsilon));
      }
      if (in.size() == 3 && AsImage(in, &c, &h, &w)) {
        return LayerPtr(new BatchNormLayer(name, in, c, h * w, momentum, epsilon));
      }
      return LayerError(index, name,
                        absl::StrCat("batch_norm needs a [features] or [channels, height, width] ",
                                     "input, got ", kernels::ShapeString(in)));
    }
    case v1::Layer::kEmbeddingBag: {
      const v1::EmbeddingBag& e = spec.embedding_bag();
      if (index != 0) {
        return LayerError(index, name,
                          "embedding_bag must be the first layer (it reads the "
                          "sparse input)");
      }
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "embedding_bag.num_rows", e.num_rows()));
      TESSERA_RETURN_IF_ERROR(CheckSize(index, name, "embedding_bag.dim", e.dim()));
      if (!v1::EmbeddingBag::Combiner_IsValid(e.combiner())) {
        return LayerError(index, name,
                          absl::StrCat("embedding_bag.combiner: unknown value ", e.combiner()));
      }
      TESSERA_RETURN_IF_ERROR(CheckInitializer(index, name, "embedding_bag.embeddings_initializer",
                                               e.embeddings_initializer()));
      if (e.num_rows() * e.dim() > kMaxElements * 4) {
        return LayerError(index, name, "embedding_bag table is too large");
      }
      return LayerPtr(new EmbeddingBagLayer(name, e));
    }
    case v1::Layer::KIND_NOT_SET:
      break;
  }
  return LayerError(index, name,
                    "no layer type set (expected one of dense, conv2d, max_pool2d, avg_pool2d, "
                    "relu, tanh, sigmoid, dropout, flatten, batch_norm, embedding_bag)");
}

}  // namespace tessera::engine
