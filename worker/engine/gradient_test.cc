// Central finite-difference checks of every layer's and every loss's gradient, through the Model
// on the CPU backend. Each case puts a parametrised layer in front of the layer under test, so the
// gradients of the first layer's parameters check the tested layer's input gradient as well.
// Numeric gradients are accumulated in double around float evaluations of the training loss
// (dropout masks are held fixed by resetting the dropout seed before every evaluation).
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/engine/model.h"

namespace tessera::engine {
namespace {

using kernels::Backend;

std::unique_ptr<Backend> CpuBackend() {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  auto b = kernels::CreateBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

// A host batch that owns its storage.
struct OwnedBatch {
  int64_t size = 0;
  std::vector<float> features, targets, values;
  std::vector<int32_t> labels;
  std::vector<int64_t> offsets, ids;
  BatchView View() const {
    BatchView v;
    v.size = size;
    v.features = features;
    v.targets = targets;
    v.labels = labels;
    v.sparse_offsets = offsets;
    v.sparse_ids = ids;
    v.sparse_values = values;
    return v;
  }
};

OwnedBatch RandomDenseBatch(const Model& m, int64_t n, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  OwnedBatch b;
  b.size = n;
  b.features.resize(static_cast<size_t>(n * m.input_dim()));
  for (float& f : b.features) f = normal(*rng);
  b.labels.resize(static_cast<size_t>(n));
  for (int32_t& l : b.labels) l = static_cast<int32_t>((*rng)() % m.output_dim());
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  b.targets.resize(static_cast<size_t>(n * m.output_dim()));
  for (float& t : b.targets) t = unit(*rng);
  return b;
}

struct CheckOptions {
  double eps = 3e-3;
  double atol = 2e-4;
  double rtol = 1e-2;
  double max_norm_rel_error = 2e-3;
  int max_elements_per_parameter = 24;
  // Standard deviation of the random parameter values (wide layers need smaller ones, or the
  // loss grows until float rounding swamps the differences).
  float weight_stddev = 0.5f;
  // Skip elements where the loss is not smooth within eps (see CheckGradients).
  bool skip_kinks = false;
};

// The mean loss of model.proto's definitions, in double, from the model's outputs.
double HostLoss(v1::Loss loss, const std::vector<float>& y, const BatchView& batch, int64_t k) {
  const int64_t n = batch.size;
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* yi = y.data() + i * k;
    if (loss == v1::LOSS_SOFTMAX_CROSS_ENTROPY) {
      double mx = yi[0], sum = 0;
      for (int64_t j = 1; j < k; ++j) mx = std::max(mx, static_cast<double>(yi[j]));
      for (int64_t j = 0; j < k; ++j) sum += std::exp(yi[j] - mx);
      total += -(yi[batch.labels[i]] - mx - std::log(sum));
      continue;
    }
    for (int64_t j = 0; j < k; ++j) {
      const double x = yi[j], t = batch.targets[i * k + j];
      total += loss == v1::LOSS_SIGMOID_CROSS_ENTROPY
                   ? std::max(x, 0.0) - x * t + std::log1p(std::exp(-std::fabs(x)))
                   : (x - t) * (x - t);
    }
  }
  return loss == v1::LOSS_SOFTMAX_CROSS_ENTROPY ? total / n : total / (n * k);
}

// Sets every trainable parameter to random values (so biases are not all zero and batch-norm
// scales differ), then compares TrainStep's gradients with central differences of the loss.
void CheckGradients(Model* model, v1::Loss loss, const BatchView& batch, uint32_t seed,
                    const CheckOptions& opt = {}) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, opt.weight_stddev);
  for (const Parameter& p : model->parameters()) {
    if (!p.trainable) continue;
    std::vector<float> v(static_cast<size_t>(kernels::NumElements(p.shape)));
    for (float& x : v) x = normal(rng);
    if (p.name.find("/gamma") != std::string::npos) {
      for (float& x : v) x += 1.0f;
    }
    ASSERT_TRUE(model->CopyValueFromHost(p.name, v).ok());
  }
  const uint64_t dropout_seed = model->dropout_seed();
  auto loss_at = [&]() {
    model->set_dropout_seed(dropout_seed);
    std::vector<float> y;
    absl::Status s = model->Forward(batch, /*training=*/true, &y);
    EXPECT_TRUE(s.ok()) << s;
    return HostLoss(loss, y, batch, model->output_dim());
  };
  model->set_dropout_seed(dropout_seed);
  auto step = model->TrainStep(batch);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(std::isfinite(step->loss));
  // The step's loss is the same loss, in float.
  const double host_loss = loss_at();
  EXPECT_NEAR(step->loss, host_loss, 1e-5 * std::max(1.0, std::fabs(host_loss)));
  model->set_dropout_seed(dropout_seed);
  step = model->TrainStep(batch);
  ASSERT_TRUE(step.ok()) << step.status();

  for (const Parameter& p : model->parameters()) {
    if (!p.trainable) continue;
    std::vector<float> analytic, values;
    ASSERT_TRUE(model->CopyGradToHost(p.name, &analytic).ok());
    ASSERT_TRUE(model->CopyValueToHost(p.name, &values).ok());
    const int64_t count = static_cast<int64_t>(values.size());
    std::vector<int64_t> picks;
    if (count <= opt.max_elements_per_parameter) {
      for (int64_t i = 0; i < count; ++i) picks.push_back(i);
    } else {
      for (int i = 0; i < opt.max_elements_per_parameter; ++i) picks.push_back(rng() % count);
    }
    double diff2 = 0, norm2 = 0;
    int checked = 0;
    for (int64_t i : picks) {
      const float original = values[i];
      auto central = [&](double eps) {
        values[i] = static_cast<float>(original + eps);
        EXPECT_TRUE(model->CopyValueFromHost(p.name, values).ok());
        const double up = loss_at();
        values[i] = static_cast<float>(original - eps);
        EXPECT_TRUE(model->CopyValueFromHost(p.name, values).ok());
        const double down = loss_at();
        values[i] = original;
        EXPECT_TRUE(model->CopyValueFromHost(p.name, values).ok());
        return (up - down) / (2.0 * eps);
      };
      const double numeric = central(opt.eps);
      const double a = analytic[i];
      const double tol = opt.atol + opt.rtol * std::max(std::fabs(a), std::fabs(numeric));
      // Where a ReLU or max-pooling kink lies within eps, the loss is not smooth and the central
      // difference is wrong by construction; two step sizes disagree there. Skip such elements.
      if (opt.skip_kinks && std::fabs(central(opt.eps / 2) - numeric) > tol) continue;
      ++checked;
      EXPECT_NEAR(a, numeric, tol) << p.name << "[" << i << "]";
      diff2 += (a - numeric) * (a - numeric);
      norm2 += numeric * numeric;
    }
    EXPECT_GE(checked, static_cast<int>(picks.size() * 3 / 4))
        << p.name << ": too many non-smooth points skipped";
    // A gradient that is zero in exact arithmetic (a bias before batch norm) is float noise in
    // both; compare norms only where the gradient is clearly above that noise.
    if (norm2 > 1e-6 * static_cast<double>(picks.size())) {
      EXPECT_LT(std::sqrt(diff2 / norm2), opt.max_norm_rel_error) << p.name;
    }
    EXPECT_GT(norm2, 0.0) << p.name << ": all sampled gradients are zero, the check proves nothing";
  }
}

v1::Layer DenseLayer(int64_t units) {
  v1::Layer l;
  l.mutable_dense()->set_units(units);
  return l;
}

v1::Layer ConvLayer(int64_t filters, int64_t kh, int64_t kw, int64_t stride, int64_t pad) {
  v1::Layer l;
  v1::Conv2D* c = l.mutable_conv2d();
  c->set_filters(filters);
  c->set_kernel_h(kh);
  c->set_kernel_w(kw);
  c->set_stride_h(stride);
  c->set_stride_w(stride);
  c->set_padding_h(pad);
  c->set_padding_w(pad);
  return l;
}

v1::Layer Simple(const std::string& kind) {
  v1::Layer l;
  if (kind == "relu") l.mutable_relu();
  if (kind == "tanh") l.mutable_tanh();
  if (kind == "sigmoid") l.mutable_sigmoid();
  if (kind == "flatten") l.mutable_flatten();
  return l;
}

v1::ModelSpec Spec(std::vector<int64_t> input, std::vector<v1::Layer> layers, v1::Loss loss) {
  v1::ModelSpec s;
  for (int64_t d : input) s.add_input_shape(d);
  for (auto& l : layers) *s.add_layers() = l;
  s.set_loss(loss);
  return s;
}

void RunDenseCase(const v1::ModelSpec& spec, int64_t n, uint32_t seed,
                  const CheckOptions& opt = {}) {
  auto backend = CpuBackend();
  auto model = Model::Create(spec, backend.get(), seed);
  ASSERT_TRUE(model.ok()) << model.status();
  std::mt19937 rng(seed);
  OwnedBatch b = RandomDenseBatch(**model, n, &rng);
  CheckGradients(model->get(), spec.loss(), b.View(), seed, opt);
}

TEST(GradientTest, DenseWithActivationsAndSoftmax) {
  RunDenseCase(Spec({7},
                    {DenseLayer(6), Simple("tanh"), DenseLayer(5), Simple("sigmoid"), DenseLayer(4),
                     Simple("relu"), DenseLayer(3)},
                    v1::LOSS_SOFTMAX_CROSS_ENTROPY),
               4, 1);
}

TEST(GradientTest, SigmoidCrossEntropy) {
  RunDenseCase(
      Spec({5}, {DenseLayer(4), Simple("tanh"), DenseLayer(3)}, v1::LOSS_SIGMOID_CROSS_ENTROPY), 3,
      2);
  RunDenseCase(Spec({5}, {DenseLayer(1)}, v1::LOSS_SIGMOID_CROSS_ENTROPY), 4, 3);
}

TEST(GradientTest, MeanSquaredError) {
  RunDenseCase(
      Spec({6}, {DenseLayer(5), Simple("sigmoid"), DenseLayer(2)}, v1::LOSS_MEAN_SQUARED_ERROR), 3,
      4);
  RunDenseCase(Spec({3}, {DenseLayer(1)}, v1::LOSS_MEAN_SQUARED_ERROR), 5, 5);
}

struct ConvCase {
  int64_t c, h, w, filters, kh, kw, stride, pad;
};

class ConvGradientTest : public ::testing::TestWithParam<ConvCase> {};

TEST_P(ConvGradientTest, MatchesFiniteDifferences) {
  const ConvCase k = GetParam();
  // A 1x1 convolution first, so its gradient checks the tested convolution's data gradient.
  RunDenseCase(Spec({k.c, k.h, k.w},
                    {ConvLayer(k.c, 1, 1, 1, 0), ConvLayer(k.filters, k.kh, k.kw, k.stride, k.pad),
                     Simple("tanh"), Simple("flatten"), DenseLayer(3)},
                    v1::LOSS_SOFTMAX_CROSS_ENTROPY),
               2, 10 + static_cast<uint32_t>(k.kh * 7 + k.stride * 3 + k.pad));
}

INSTANTIATE_TEST_SUITE_P(Geometries, ConvGradientTest,
                         ::testing::Values(ConvCase{2, 6, 6, 3, 3, 3, 1, 0},
                                           ConvCase{2, 7, 6, 3, 3, 3, 2, 1},
                                           ConvCase{1, 6, 6, 2, 5, 5, 1, 2},
                                           ConvCase{3, 8, 7, 2, 3, 2, 2, 0},
                                           ConvCase{2, 5, 5, 4, 2, 2, 3, 1}));

// Two convolutions of one geometry share the backend's cached primitives and scratch buffers.
TEST(GradientTest, RepeatedConvGeometry) {
  CheckOptions opt;
  opt.weight_stddev = 0.1f;
  // 16 channels, so that oneDNN picks blocked layouts and reorders through its scratch buffers.
  RunDenseCase(Spec({16, 4, 4},
                    {ConvLayer(16, 3, 3, 1, 1), Simple("tanh"), ConvLayer(16, 3, 3, 1, 1),
                     Simple("flatten"), DenseLayer(2)},
                    v1::LOSS_SOFTMAX_CROSS_ENTROPY),
               2, 30, opt);
}

// 16 and 32 channels: the CPU backend keeps convolution outputs in oneDNN's blocked layout
// through ReLU and pooling into the next convolution.
TEST(GradientTest, BlockedConvReluPoolChain) {
  v1::Layer max_pool, avg_pool;
  max_pool.mutable_max_pool2d();
  v1::Pool2D* avg = avg_pool.mutable_avg_pool2d();
  avg->set_pool_h(3);
  avg->set_pool_w(3);
  avg->set_stride_h(2);
  avg->set_stride_w(2);
  avg->set_padding_h(1);
  avg->set_padding_w(1);
  CheckOptions opt;
  opt.weight_stddev = 0.1f;
  // Every first-layer weight moves all 128 positions of its channel, so some ReLU or max-pooling
  // kink is usually within eps of one of them.
  opt.skip_kinks = true;
  opt.max_norm_rel_error = 1e-2;
  RunDenseCase(Spec({2, 8, 8},
                    {ConvLayer(16, 3, 3, 1, 1), Simple("relu"), max_pool, ConvLayer(32, 3, 3, 1, 1),
                     Simple("sigmoid"), avg_pool, Simple("flatten"), DenseLayer(3)},
                    v1::LOSS_SOFTMAX_CROSS_ENTROPY),
               2, 31, opt);
}

// A blocked convolution output read by ops that need NCHW (dropout, batch norm, dense).
TEST(GradientTest, BlockedConvIntoDropoutAndBatchNorm) {
  v1::Layer drop, bn;
  drop.mutable_dropout()->set_rate(0.3f);
  bn.mutable_batch_norm();
  CheckOptions opt;
  opt.weight_stddev = 0.1f;
  RunDenseCase(
      Spec({3, 5, 5},
           {ConvLayer(16, 3, 3, 1, 1), drop, bn, Simple("tanh"), Simple("flatten"), DenseLayer(3)},
           v1::LOSS_SOFTMAX_CROSS_ENTROPY),
      3, 32, opt);
}

struct PoolCase {
  bool max;
  int64_t h, w, pool, stride, pad;
};

class PoolGradientTest : public ::testing::TestWithParam<PoolCase> {};

TEST_P(PoolGradientTest, MatchesFiniteDifferences) {
  const PoolCase k = GetParam();
  v1::Layer pool;
  v1::Pool2D* p = k.max ? pool.mutable_max_pool2d() : pool.mutable_avg_pool2d();
  p->set_pool_h(k.pool);
  p->set_pool_w(k.pool);
  p->set_stride_h(k.stride);
  p->set_stride_w(k.stride);
  p->set_padding_h(k.pad);
  p->set_padding_w(k.pad);
  RunDenseCase(
      Spec({2, k.h, k.w}, {ConvLayer(2, 1, 1, 1, 0), pool, Simple("flatten"), DenseLayer(3)},
           v1::LOSS_SOFTMAX_CROSS_ENTROPY),
      2, 40 + static_cast<uint32_t>(k.pool * 5 + k.stride + k.pad));
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, PoolGradientTest,
    ::testing::Values(PoolCase{true, 6, 6, 2, 2, 0}, PoolCase{true, 7, 5, 3, 2, 1},
                      PoolCase{true, 5, 5, 2, 1, 0}, PoolCase{false, 6, 6, 2, 2, 0},
                      PoolCase{false, 7, 5, 3, 2, 1}, PoolCase{false, 5, 6, 3, 1, 1},
                      // Odd sizes: the last row and column fall outside every window.
                      PoolCase{true, 7, 7, 2, 2, 0}, PoolCase{false, 7, 5, 2, 2, 0}));

TEST(GradientTest, BatchNormDense) {
  v1::Layer bn;
  bn.mutable_batch_norm();
  RunDenseCase(
      Spec({4}, {DenseLayer(5), bn, Simple("tanh"), DenseLayer(3)}, v1::LOSS_SOFTMAX_CROSS_ENTROPY),
      6, 60);
}

TEST(GradientTest, BatchNormConv) {
  v1::Layer bn;
  bn.mutable_batch_norm()->set_epsilon(1e-3f);
  RunDenseCase(
      Spec({2, 4, 3},
           {ConvLayer(3, 1, 1, 1, 0), bn, Simple("sigmoid"), Simple("flatten"), DenseLayer(2)},
           v1::LOSS_SOFTMAX_CROSS_ENTROPY),
      3, 61);
}

TEST(GradientTest, DropoutWithFixedMask) {
  v1::Layer drop;
  drop.mutable_dropout()->set_rate(0.4f);
  RunDenseCase(Spec({6}, {DenseLayer(8), drop, DenseLayer(3)}, v1::LOSS_SOFTMAX_CROSS_ENTROPY), 4,
               70);
}

struct EmbeddingCase {
  bool mean;
  bool with_values;
};

class EmbeddingGradientTest : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(EmbeddingGradientTest, MatchesFiniteDifferences) {
  const EmbeddingCase k = GetParam();
  v1::Layer emb;
  v1::EmbeddingBag* e = emb.mutable_embedding_bag();
  e->set_num_rows(9);
  e->set_dim(4);
  e->set_combiner(k.mean ? v1::EmbeddingBag::COMBINER_MEAN : v1::EmbeddingBag::COMBINER_SUM);
  v1::ModelSpec spec =
      Spec({}, {emb, Simple("tanh"), DenseLayer(3)}, v1::LOSS_SOFTMAX_CROSS_ENTROPY);
  auto backend = CpuBackend();
  auto model = Model::Create(spec, backend.get(), 80);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->sparse_input());
  // The table's rows live outside the model: install all 9 (ids are positions among them).
  std::mt19937 rng(79);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> rows(9 * 4);
  for (float& v : rows) v = normal(rng);
  ASSERT_TRUE((*model)->SetRows(0, 9, rows).ok());
  OwnedBatch b;
  b.size = 4;
  // Bags: {1, 3, 3}, {}, {0, 8}, {5}: a repeated id, an empty bag, the last row.
  b.offsets = {0, 3, 3, 5, 6};
  b.ids = {1, 3, 3, 0, 8, 5};
  if (k.with_values) b.values = {0.5f, -1.25f, 2.0f, 1.5f, 0.75f, -0.5f};
  b.labels = {0, 2, 1, 2};
  CheckGradients(model->get(), spec.loss(), b.View(), 81);
  // Rows never touched have a zero gradient.
  std::vector<float> g;
  ASSERT_TRUE((*model)->CopyGradToHost("embedding_bag_1/embeddings", &g).ok());
  for (int row : {2, 4, 6, 7}) {
    for (int d = 0; d < 4; ++d) EXPECT_EQ(g[row * 4 + d], 0.0f) << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Combiners, EmbeddingGradientTest,
                         ::testing::Values(EmbeddingCase{false, false}, EmbeddingCase{true, false},
                                           EmbeddingCase{false, true}, EmbeddingCase{true, true}));

// The loss values follow model.proto's definitions, computed here in double.
TEST(LossTest, ValuesAndGradientsMatchDoubleFormulas) {
  auto backend = CpuBackend();
  const int64_t n = 3, k = 4;
  std::mt19937 rng(90);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(n * k), targets(n * k);
  for (float& x : logits) x = normal(rng);
  for (float& t : targets) t = std::uniform_real_distribution<float>(0, 1)(rng);
  std::vector<int32_t> labels = {1, 3, 0};
  auto t_logits = *backend->Allocate({n, k});
  auto t_grad = *backend->Allocate({n, k});
  auto t_metrics = *backend->Allocate({2});
  auto t_labels = *backend->Allocate({n}, kernels::DType::kInt32);
  auto t_targets = *backend->Allocate({n, k});
  ASSERT_TRUE(backend->CopyToDevice(logits.data(), t_logits).ok());
  ASSERT_TRUE(backend->CopyToDevice(labels.data(), t_labels).ok());
  ASSERT_TRUE(backend->CopyToDevice(targets.data(), t_targets).ok());
  float metrics[2];
  std::vector<float> grad(n * k);

  // Softmax cross-entropy, mean over n.
  ASSERT_TRUE(backend
                  ->LossForwardBackward(kernels::LossKind::kSoftmaxCrossEntropy, t_logits, t_labels,
                                        &t_grad, t_metrics)
                  .ok());
  ASSERT_TRUE(backend->CopyToHost(t_metrics, metrics).ok());
  ASSERT_TRUE(backend->CopyToHost(t_grad, grad.data()).ok());
  double expect = 0;
  int correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    double mx = -1e30, sum = 0;
    int64_t best = 0;
    for (int64_t j = 0; j < k; ++j) {
      mx = std::max(mx, static_cast<double>(logits[i * k + j]));
      if (logits[i * k + j] > logits[i * k + best]) best = j;
    }
    for (int64_t j = 0; j < k; ++j) sum += std::exp(logits[i * k + j] - mx);
    expect += -(logits[i * k + labels[i]] - mx - std::log(sum));
    if (best == labels[i]) ++correct;
    for (int64_t j = 0; j < k; ++j) {
      const double p = std::exp(logits[i * k + j] - mx) / sum;
      EXPECT_NEAR(grad[i * k + j], (p - (j == labels[i] ? 1.0 : 0.0)) / n, 1e-6);
    }
  }
  EXPECT_NEAR(metrics[0], expect / n, 1e-5);
  EXPECT_EQ(metrics[1], correct);

  // Sigmoid cross-entropy, mean over n * k.
  ASSERT_TRUE(backend
                  ->LossForwardBackward(kernels::LossKind::kSigmoidCrossEntropy, t_logits,
                                        t_targets, &t_grad, t_metrics)
                  .ok());
  ASSERT_TRUE(backend->CopyToHost(t_metrics, metrics).ok());
  ASSERT_TRUE(backend->CopyToHost(t_grad, grad.data()).ok());
  expect = 0;
  for (int64_t i = 0; i < n * k; ++i) {
    const double x = logits[i], t = targets[i], s = 1.0 / (1.0 + std::exp(-x));
    expect += -(t * std::log(s) + (1 - t) * std::log(1 - s));
    EXPECT_NEAR(grad[i], (s - t) / (n * k), 1e-6);
  }
  EXPECT_NEAR(metrics[0], expect / (n * k), 1e-5);

  // Mean squared error, mean over n * k.
  ASSERT_TRUE(backend
                  ->LossForwardBackward(kernels::LossKind::kMeanSquaredError, t_logits, t_targets,
                                        &t_grad, t_metrics)
                  .ok());
  ASSERT_TRUE(backend->CopyToHost(t_metrics, metrics).ok());
  ASSERT_TRUE(backend->CopyToHost(t_grad, grad.data()).ok());
  expect = 0;
  for (int64_t i = 0; i < n * k; ++i) {
    const double d = static_cast<double>(logits[i]) - targets[i];
    expect += d * d;
    EXPECT_NEAR(grad[i], 2 * d / (n * k), 1e-6);
  }
  EXPECT_NEAR(metrics[0], expect / (n * k), 1e-4);
}

}  // namespace
}  // namespace tessera::engine
