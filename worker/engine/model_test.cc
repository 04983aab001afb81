// Model construction, refused specs, parameters and forward values (against naive double-precision
// references) on the CPU backend.
#include "worker/engine/model.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "spec/model_spec.h"
#include "spec/testing/example_models.h"

namespace tessera::engine {
namespace {

using spec::examples::kFashionCnn;
using spec::examples::kFashionMlp;

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::unique_ptr<kernels::Backend> CpuBackend() {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  auto b = kernels::CreateBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

v1::ModelSpec Parse(const std::string& text) {
  v1::ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

// --- Validation ----------------------------------------------------------------------------------

struct BadSpec {
  std::string name;
  std::string text;
  std::string message;  // a substring the error must contain
};

class BadSpecTest : public ::testing::TestWithParam<BadSpec> {};

TEST_P(BadSpecTest, IsInvalidArgumentNamingTheProblem) {
  const BadSpec& c = GetParam();
  v1::ModelSpec spec = Parse(c.text);
  auto infos = spec::InferModelShapes(spec);
  ASSERT_FALSE(infos.ok());
  EXPECT_EQ(infos.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(infos.status().message()), HasSubstr(c.message));
  // Create refuses the same spec before allocating anything.
  auto backend = CpuBackend();
  auto model = Model::Create(spec, backend.get(), 1);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status(), infos.status());
}

INSTANTIATE_TEST_SUITE_P(
    Specs, BadSpecTest,
    ::testing::Values(
        BadSpec{"DenseInFeaturesVsFlatten",
                R"pb(input_shape: [ 2, 4, 4 ]
                     layers { flatten {} }
                     layers { dense { units: 3 in_features: 30 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[1] (dense_1): dense.in_features is 30 but the input of this layer has 32"},
        BadSpec{"ZeroUnits",
                R"pb(input_shape: [ 4 ]
                     layers { dense { units: 3 } }
                     layers {
                       name: "head"
                       dense { units: 0 }
                     }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[1] (head): dense.units must be > 0, got 0"},
        BadSpec{"NegativeFilters",
                R"pb(input_shape: [ 1, 8, 8 ]
                     layers { conv2d { filters: -2 kernel_h: 3 kernel_w: 3 } }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (conv2d_1): conv2d.filters must be > 0, got -2"},
        BadSpec{"NoLayerKind",
                R"pb(input_shape: [ 4 ]
                     layers { dense { units: 3 } }
                     layers { name: "mystery" }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[1] (mystery): no layer type set"},
        BadSpec{"ConvOnVector",
                R"pb(input_shape: [ 16 ]
                     layers { conv2d { filters: 2 kernel_h: 3 kernel_w: 3 } }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (conv2d_1): conv2d needs a [channels, height, width] input, got [16]"},
        BadSpec{"KernelLargerThanInput",
                R"pb(input_shape: [ 1, 4, 4 ]
                     layers { conv2d { filters: 2 kernel_h: 7 kernel_w: 3 } }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (conv2d_1): conv2d kernel 7x3 is larger than the padded input 4x4"},
        BadSpec{"PoolPadding",
                R"pb(input_shape: [ 1, 4, 4 ]
                     layers { max_pool2d { pool_h: 2 pool_w: 2 padding_h: 2 } }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (max_pool2d_1): max_pool2d.padding_h must be in [0, pool_h = 2)"},
        BadSpec{"DropoutRate",
                R"pb(input_shape: [ 4 ]
                     layers { dense { units: 3 } }
                     layers { dropout { rate: 1.0 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[1] (dropout_1): dropout.rate must be in [0, 1), got 1"},
        BadSpec{"EmbeddingNotFirst",
                R"pb(input_shape: [ 4 ]
                     layers { dense { units: 3 } }
                     layers { embedding_bag { num_rows: 10 dim: 2 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[1] (embedding_bag_1): embedding_bag must be the first layer"},
        BadSpec{"EmbeddingRows",
                R"pb(layers { embedding_bag { num_rows: -1 dim: 2 } }
                     layers { dense { units: 3 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[0] (embedding_bag_1): embedding_bag.num_rows must be > 0, got -1"},
        BadSpec{"HashedTableWithGlorot",
                R"pb(layers {
                       embedding_bag {
                         dim: 2
                         embeddings_initializer { kind: KIND_GLOROT_UNIFORM }
                       }
                     }
                     layers { dense { units: 3 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[0] (embedding_bag_1): embedding_bag.embeddings_initializer.kind: "
                "KIND_GLOROT_UNIFORM needs the table's row count"},
        BadSpec{"BatchNormMomentum",
                R"pb(input_shape: [ 4 ]
                     layers { batch_norm { momentum: 1.5 } }
                     layers { dense { units: 3 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[0] (batch_norm_1): batch_norm.momentum must be in (0, 1], got 1.5"},
        BadSpec{"DuplicateName",
                R"pb(input_shape: [ 4 ]
                     layers {
                       name: "a"
                       dense { units: 3 }
                     }
                     layers {
                       name: "a"
                       dense { units: 3 }
                     }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers[1].name: \"a\" is used by an earlier layer"},
        BadSpec{"NoLoss",
                R"pb(input_shape: [ 4 ]
                     layers { dense { units: 3 } })pb",
                "loss: must be LOSS_SOFTMAX_CROSS_ENTROPY"},
        BadSpec{"SoftmaxOneOutput",
                R"pb(input_shape: [ 4 ]
                     layers { dense { units: 1 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "needs at least 2 outputs, but the last layer (dense_1) gives 1"},
        BadSpec{"NoInputShape",
                R"pb(layers { dense { units: 3 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "input_shape: must have 1 to 3 dimensions"},
        BadSpec{"NegativeInput",
                R"pb(input_shape: [ 3, -1 ]
                     layers { dense { units: 3 } }
                     loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "input_shape[1]: must be in [1, 2^31], got -1"},
        // Shape products that overflow int64 must not wrap around into a small, accepted size.
        BadSpec{"InputShapeProductOverflows",
                R"pb(input_shape: [ 2147483648, 2147483648, 4 ]
                     layers { relu {} }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "input_shape: [2147483648, 2147483648, 4] is too large"},
        BadSpec{"ConvPaddingOverflows",
                R"pb(input_shape: [ 1, 4, 4 ]
                     layers {
                       conv2d {
                         filters: 1
                         kernel_h: 1
                         kernel_w: 1
                         padding_h: 2305843009213693952
                         padding_w: 2305843009213693952
                       }
                     }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (conv2d_1): conv2d.padding_h and padding_w must be in [0, 2147483648]"},
        BadSpec{"ConvOutputTooLarge",
                R"pb(input_shape: [ 1, 4, 4 ]
                     layers {
                       conv2d {
                         filters: 2147483648
                         kernel_h: 1
                         kernel_w: 1
                         padding_h: 2147483648
                         padding_w: 2147483648
                       }
                     }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (conv2d_1): conv2d output [2147483648, 4294967300, 4294967300]"},
        BadSpec{"PoolOutputTooLarge",
                R"pb(input_shape: [ 1, 4, 4 ]
                     layers {
                       max_pool2d {
                         pool_h: 2147483648
                         pool_w: 2147483648
                         padding_h: 2147483647
                         padding_w: 2147483647
                         stride_h: 1
                         stride_w: 1
                       }
                     }
                     loss: LOSS_MEAN_SQUARED_ERROR)pb",
                "layers[0] (max_pool2d_1): max_pool2d output [1, 2147483651, 2147483651] has "
                "more than 2147483648 elements"},
        BadSpec{"NoLayers", R"pb(input_shape: [ 3 ]
                                 loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb",
                "layers: a model needs at least one layer"}),
    [](const ::testing::TestParamInfo<BadSpec>& info) { return info.param.name; });

std::unique_ptr<kernels::Backend> CpuBackendWithMemory(int64_t bytes) {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  o.memory_limit_bytes = bytes;
  auto b = kernels::CreateBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

TEST(ModelMemoryTest, ParametersThatCannotFitAreRefusedBeforeAllocating) {
  // The MLP's 247,766 parameters and their gradients need 1,982,128 bytes.
  auto small = CpuBackendWithMemory(1 << 20);
  auto model = Model::Create(Parse(kFashionMlp), small.get(), 1);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(model.status().message()),
              HasSubstr("model: the parameters and their gradients need 1982128 bytes, more than "
                        "the 1048576 bytes of memory of cpu"));
  auto enough = CpuBackendWithMemory(64 << 20);
  EXPECT_TRUE(Model::Create(Parse(kFashionMlp), enough.get(), 1).ok());
}

TEST(ModelMemoryTest, BatchesThatCannotFitAreRefusedBeforeAllocating) {
  auto backend = CpuBackendWithMemory(64 << 20);
  auto model = Model::Create(Parse(kFashionMlp), backend.get(), 1);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->CheckMemory(64, 0).ok());
  // Optimizer state counts too.
  EXPECT_EQ((*model)->CheckMemory(64, 64 << 20).code(), absl::StatusCode::kResourceExhausted);
  // 100,000 examples need far more than 64 MiB of activations; so does a batch whose size in
  // bytes does not fit in an int64. Both are refused without allocating (or overflowing).
  for (const int64_t n : {int64_t{100000}, int64_t{1} << 62}) {
    const absl::Status status = (*model)->CheckMemory(n, 0);
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << n;
    EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("a batch of ", n)));
    BatchView batch;
    batch.size = n;
    auto step = (*model)->TrainStep(batch);
    ASSERT_FALSE(step.ok());
    EXPECT_EQ(step.status(), status);
  }
}

// --- Parameters
// ------------------------------------------------------------------------------------

TEST(ModelTest, ParameterNamesShapesAndOrder) {
  auto backend = CpuBackend();
  auto model = Model::Create(Parse(kFashionCnn), backend.get(), 7);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::string> names;
  for (const Parameter& p : (*model)->parameters()) names.push_back(p.name);
  EXPECT_THAT(names,
              ElementsAre("conv2d_1/kernel", "conv2d_1/bias", "conv2d_2/kernel", "conv2d_2/bias",
                          "dense_1/kernel", "dense_1/bias", "dense_2/kernel", "dense_2/bias"));
  EXPECT_THAT((*model)->FindParameter("conv2d_1/kernel")->shape, ElementsAre(32, 1, 5, 5));
  EXPECT_THAT((*model)->FindParameter("dense_1/kernel")->shape, ElementsAre(1024, 3136));
  EXPECT_EQ((*model)->FindParameter("dense_9/kernel"), nullptr);
  EXPECT_EQ((*model)->num_trainable_values(),
            32 * 25 + 32 + 64 * 32 * 25 + 64 + 1024 * 3136 + 1024 + 10 * 1024 + 10);
}

TEST(ModelTest, BatchNormStateComesAfterTrainableParameters) {
  auto backend = CpuBackend();
  auto model = Model::Create(Parse(R"pb(input_shape: [ 4 ]
                                        layers { dense { units: 3 } }
                                        layers {
                                          name: "bn"
                                          batch_norm {}
                                        }
                                        layers { dense { units: 2 } }
                                        loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb"),
                             backend.get(), 7);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::string> names;
  std::vector<bool> trainable;
  for (const Parameter& p : (*model)->parameters()) {
    names.push_back(p.name);
    trainable.push_back(p.trainable);
  }
  EXPECT_THAT(names,
              ElementsAre("dense_1/kernel", "dense_1/bias", "bn/gamma", "bn/beta", "dense_2/kernel",
                          "dense_2/bias", "bn/moving_mean", "bn/moving_variance"));
  EXPECT_THAT(trainable, ElementsAre(true, true, true, true, true, true, false, false));
  std::vector<float> v;
  ASSERT_TRUE((*model)->CopyValueToHost("bn/moving_variance", &v).ok());
  EXPECT_THAT(v, ElementsAre(1.0f, 1.0f, 1.0f));
  EXPECT_EQ((*model)->CopyGradToHost("bn/moving_mean", &v).code(),
            absl::StatusCode::kFailedPrecondition);
}

// before_layer runs before each layer, in order; a weight installed there is the one that layer
// computes with; its error ends the step. ForwardPosition names the layer that reads a parameter,
// BatchNorm's state included.
TEST(ModelTest, TrainStepCallsBeforeLayerBeforeEachLayer) {
  const v1::ModelSpec spec = Parse(R"pb(input_shape: [ 4 ]
                                        layers { dense { units: 3 } }
                                        layers {
                                          name: "bn"
                                          batch_norm {}
                                        }
                                        layers { dense { units: 2 } }
                                        loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb");
  auto backend = CpuBackend();
  auto a = Model::Create(spec, backend.get(), 7);
  auto b = Model::Create(spec, backend.get(), 7);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<int> positions;
  for (int i = 0; i < static_cast<int>((*a)->parameters().size()); ++i) {
    positions.push_back((*a)->ForwardPosition(i));
  }
  EXPECT_THAT(positions, ElementsAre(0, 0, 1, 1, 2, 2, 1, 1));

  const std::vector<float> features = {0.5f, -1, 2, 0.25f, 1, 1, -0.5f, 3};
  const std::vector<int32_t> labels = {1, 0};
  BatchView batch;
  batch.size = 2;
  batch.features = features;
  batch.labels = labels;
  const std::vector<float> kernel = {0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f};
  ASSERT_TRUE((*a)->CopyValueFromHost("dense_2/kernel", kernel).ok());
  auto want = (*a)->TrainStep(batch);
  ASSERT_TRUE(want.ok()) << want.status();

  std::vector<int> calls;
  auto got = (*b)->TrainStep(batch, {}, [&](int position) {
    calls.push_back(position);
    return position == 2 ? (*b)->CopyValueFromHost("dense_2/kernel", kernel) : absl::OkStatus();
  });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(calls, ElementsAre(0, 1, 2));
  EXPECT_EQ(got->loss, want->loss) << "the last layer computed with the weight installed before it";
  std::vector<float> ga, gb;
  ASSERT_TRUE((*a)->CopyGradToHost("dense_1/kernel", &ga).ok());
  ASSERT_TRUE((*b)->CopyGradToHost("dense_1/kernel", &gb).ok());
  EXPECT_EQ(ga, gb);

  auto failed = (*b)->TrainStep(batch, {}, [](int position) {
    return position == 1 ? absl::UnavailableError("weights lost") : absl::OkStatus();
  });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(failed.status().message(), HasSubstr("weights lost"));
}

TEST(ModelTest, SeededInitialization) {
  auto backend = CpuBackend();
  auto a = Model::Create(Parse(kFashionMlp), backend.get(), 42);
  auto b = Model::Create(Parse(kFashionMlp), backend.get(), 42);
  auto c = Model::Create(Parse(kFashionMlp), backend.get(), 43);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::vector<float> va, vb, vc, bias;
  ASSERT_TRUE((*a)->CopyValueToHost("dense_1/kernel", &va).ok());
  ASSERT_TRUE((*b)->CopyValueToHost("dense_1/kernel", &vb).ok());
  ASSERT_TRUE((*c)->CopyValueToHost("dense_1/kernel", &vc).ok());
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vc);
  // Glorot uniform: |w| <= sqrt(6 / (784 + 256)), mean ~0, variance a^2 / 3.
  const double bound = std::sqrt(6.0 / (784 + 256));
  double sum = 0, sum2 = 0;
  for (float w : va) {
    EXPECT_LE(std::fabs(w), bound);
    sum += w;
    sum2 += static_cast<double>(w) * w;
  }
  const double n = static_cast<double>(va.size());
  EXPECT_NEAR(sum / n, 0.0, 0.01 * bound);
  EXPECT_NEAR(sum2 / n, bound * bound / 3, 0.02 * bound * bound / 3);
  ASSERT_TRUE((*a)->CopyValueToHost("dense_1/bias", &bias).ok());
  EXPECT_EQ(bias, std::vector<float>(256, 0.0f));
  // Two tensors of one model draw different values.
  std::vector<float> v2;
  ASSERT_TRUE((*a)->CopyValueToHost("dense_2/kernel", &v2).ok());
  EXPECT_NE(va[0], v2[0]);
}

TEST(ModelTest, HeNormalAndNormalInitializers) {
  auto backend = CpuBackend();
  auto model = Model::Create(Parse(R"pb(input_shape: [ 500 ]
                                        layers {
                                          dense {
                                            units: 400
                                            kernel_initializer { kind: KIND_HE_NORMAL }
                                            bias_initializer { kind: KIND_NORMAL stddev: 0.5 }
                                          }
                                        }
                                        loss: LOSS_MEAN_SQUARED_ERROR)pb"),
                             backend.get(), 3);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<float> k, b;
  ASSERT_TRUE((*model)->CopyValueToHost("dense_1/kernel", &k).ok());
  ASSERT_TRUE((*model)->CopyValueToHost("dense_1/bias", &b).ok());
  double s2 = 0;
  for (float w : k) s2 += static_cast<double>(w) * w;
  EXPECT_NEAR(s2 / k.size(), 2.0 / 500, 0.03 * 2.0 / 500);
  s2 = 0;
  for (float w : b) s2 += static_cast<double>(w) * w;
  EXPECT_NEAR(s2 / b.size(), 0.25, 0.05);
}

TEST(ModelTest, CopyValuesByName) {
  auto backend = CpuBackend();
  auto model = Model::Create(Parse(kFashionMlp), backend.get(), 1);
  ASSERT_TRUE(model.ok());
  std::vector<float> v(10);
  for (int i = 0; i < 10; ++i) v[i] = 0.5f * i;
  ASSERT_TRUE((*model)->CopyValueFromHost("dense_4/bias", v).ok());
  std::vector<float> back;
  ASSERT_TRUE((*model)->CopyValueToHost("dense_4/bias", &back).ok());
  EXPECT_EQ(back, v);
  EXPECT_EQ((*model)->CopyValueFromHost("nope/bias", v).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*model)->CopyValueFromHost("dense_1/bias", v).code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Forward values
// --------------------------------------------------------------------------------

struct Fixture {
  std::unique_ptr<kernels::Backend> backend = CpuBackend();
  std::unique_ptr<Model> model;
  std::mt19937 rng{5};

  void Build(const std::string& text) {
    auto m = Model::Create(Parse(text), backend.get(), 11);
    ASSERT_TRUE(m.ok()) << m.status();
    model = std::move(m).value();
    // Random biases, so that a missing bias shows.
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const Parameter& p : model->parameters()) {
      if (!p.trainable) continue;
      std::vector<float> v(kernels::NumElements(p.shape));
      for (float& x : v) x = normal(rng);
      ASSERT_TRUE(model->CopyValueFromHost(p.name, v).ok());
    }
  }
  std::vector<float> Value(const std::string& name) {
    std::vector<float> v;
    EXPECT_TRUE(model->CopyValueToHost(name, &v).ok());
    return v;
  }
  std::vector<float> RandomInput(int64_t n) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(n * model->input_dim());
    for (float& f : x) f = normal(rng);
    return x;
  }
  std::vector<float> Predict(const std::vector<float>& x, int64_t n) {
    BatchView b;
    b.size = n;
    b.features = x;
    std::vector<float> out;
    absl::Status s = model->Predict(b, &out);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
};

TEST(ForwardTest, DenseMatchesReference) {
  Fixture f;
  f.Build(R"pb(input_shape: [ 2, 3 ]
               layers { dense { units: 4 } }
               loss: LOSS_MEAN_SQUARED_ERROR)pb");
  const int64_t n = 3;
  auto x = f.RandomInput(n);
  auto w = f.Value("dense_1/kernel");
  auto b = f.Value("dense_1/bias");
  auto y = f.Predict(x, n);
  for (int64_t i = 0; i < n; ++i) {
    for (int o = 0; o < 4; ++o) {
      double acc = b[o];
      for (int j = 0; j < 6; ++j) acc += static_cast<double>(x[i * 6 + j]) * w[o * 6 + j];
      EXPECT_NEAR(y[i * 4 + o], acc, 1e-4);
    }
  }
}

struct ConvForwardCase {
  int64_t n, c, h, w, k, kh, kw, sh, sw, ph, pw;
};

class ConvForwardTest : public ::testing::TestWithParam<ConvForwardCase> {};

TEST_P(ConvForwardTest, MatchesReference) {
  const ConvForwardCase g = GetParam();
  Fixture f;
  f.Build(absl::StrCat(
      "input_shape: [", g.c, ", ", g.h, ", ", g.w, "] layers { conv2d { filters: ", g.k,
      " kernel_h: ", g.kh, " kernel_w: ", g.kw, " stride_h: ", g.sh, " stride_w: ", g.sw,
      " padding_h: ", g.ph, " padding_w: ", g.pw, " } } loss: LOSS_MEAN_SQUARED_ERROR"));
  const int64_t oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1, ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  ASSERT_EQ(f.model->output_dim(), g.k * oh * ow);
  auto x = f.RandomInput(g.n);
  auto wt = f.Value("conv2d_1/kernel");
  auto b = f.Value("conv2d_1/bias");
  auto y = f.Predict(x, g.n);
  for (int64_t i = 0; i < g.n; ++i)
    for (int64_t o = 0; o < g.k; ++o)
      for (int64_t r = 0; r < oh; ++r)
        for (int64_t s = 0; s < ow; ++s) {
          double acc = b[o];
          for (int64_t ch = 0; ch < g.c; ++ch)
            for (int64_t u = 0; u < g.kh; ++u)
              for (int64_t v = 0; v < g.kw; ++v) {
                const int64_t yy = r * g.sh - g.ph + u, xx = s * g.sw - g.pw + v;
                if (yy < 0 || yy >= g.h || xx < 0 || xx >= g.w) continue;
                acc += static_cast<double>(x[((i * g.c + ch) * g.h + yy) * g.w + xx]) *
                       wt[((o * g.c + ch) * g.kh + u) * g.kw + v];
              }
          ASSERT_NEAR(y[((i * g.k + o) * oh + r) * ow + s], acc, 1e-3 + 1e-5 * std::fabs(acc))
              << i << " " << o << " " << r << " " << s;
        }
}

// Small channel counts run on plain layouts; 16 and more on oneDNN's blocked ones with reorders.
INSTANTIATE_TEST_SUITE_P(Geometries, ConvForwardTest,
                         ::testing::Values(ConvForwardCase{2, 2, 7, 6, 3, 3, 2, 2, 1, 1, 1},
                                           ConvForwardCase{3, 16, 9, 9, 32, 5, 5, 1, 1, 2, 2},
                                           ConvForwardCase{2, 1, 12, 12, 32, 5, 5, 2, 2, 2, 2}));

TEST(ForwardTest, PoolingMatchesReference) {
  for (bool max : {true, false}) {
    Fixture f;
    f.Build(absl::StrCat("input_shape: [2, 5, 6] layers { ", max ? "max_pool2d" : "avg_pool2d",
                         " { pool_h: 3 pool_w: 2 stride_h: 2 stride_w: 2 padding_h: 1 } }",
                         " loss: LOSS_MEAN_SQUARED_ERROR"));
    const int64_t n = 2, c = 2, h = 5, w = 6, oh = 3, ow = 3;
    ASSERT_EQ(f.model->output_dim(), c * oh * ow);
    auto x = f.RandomInput(n);
    auto y = f.Predict(x, n);
    for (int64_t i = 0; i < n * c; ++i)
      for (int64_t r = 0; r < oh; ++r)
        for (int64_t s = 0; s < ow; ++s) {
          double best = -1e30, sum = 0;
          int count = 0;
          for (int64_t u = 0; u < 3; ++u)
            for (int64_t v = 0; v < 2; ++v) {
              const int64_t yy = r * 2 - 1 + u, xx = s * 2 + v;
              if (yy < 0 || yy >= h || xx < 0 || xx >= w) continue;
              const double val = x[(i * h + yy) * w + xx];
              best = std::max(best, val);
              sum += val;
              ++count;
            }
          EXPECT_NEAR(y[(i * oh + r) * ow + s], max ? best : sum / count, 1e-5)
              << (max ? "max" : "avg") << " " << i << " " << r << " " << s;
        }
  }
}

// A 32-channel convolution followed by ReLU and max pooling (the CPU backend runs these on its
// blocked layout) against the same convolution alone, with ReLU and pooling done here.
TEST(ForwardTest, ConvReluPoolChainMatchesReference) {
  const char* conv = "conv2d { filters: 32 kernel_h: 3 kernel_w: 3 padding_h: 1 padding_w: 1 }";
  Fixture chain, alone;
  chain.Build(absl::StrCat("input_shape: [3, 6, 6] layers { ", conv,
                           " } layers { relu {} } layers { max_pool2d {} }"
                           " loss: LOSS_MEAN_SQUARED_ERROR"));
  alone.Build(
      absl::StrCat("input_shape: [3, 6, 6] layers { ", conv, " } loss: LOSS_MEAN_SQUARED_ERROR"));
  for (const char* name : {"conv2d_1/kernel", "conv2d_1/bias"}) {
    ASSERT_TRUE(alone.model->CopyValueFromHost(name, chain.Value(name)).ok());
  }
  const int64_t n = 2;
  auto x = chain.RandomInput(n);
  auto y = chain.Predict(x, n);
  auto c = alone.Predict(x, n);
  ASSERT_EQ(y.size(), static_cast<size_t>(n * 32 * 3 * 3));
  for (int64_t p = 0; p < n * 32; ++p)
    for (int r = 0; r < 3; ++r)
      for (int s = 0; s < 3; ++s) {
        float best = 0.0f;  // relu
        for (int u = 0; u < 2; ++u)
          for (int v = 0; v < 2; ++v) best = std::max(best, c[(p * 6 + 2 * r + u) * 6 + 2 * s + v]);
        ASSERT_EQ(y[(p * 3 + r) * 3 + s], best) << p << " " << r << " " << s;
      }
}

TEST(ForwardTest, ActivationsMatchFormulas) {
  for (const char* act : {"relu", "tanh", "sigmoid"}) {
    Fixture f;
    f.Build(std::string("input_shape: [ 9 ] layers { ") + act +
            " {} } loss: LOSS_MEAN_SQUARED_ERROR");
    auto x = f.RandomInput(2);
    auto y = f.Predict(x, 2);
    for (size_t i = 0; i < x.size(); ++i) {
      const double v = x[i];
      const double e = std::string(act) == "relu"   ? std::max(v, 0.0)
                       : std::string(act) == "tanh" ? std::tanh(v)
                                                    : 1.0 / (1.0 + std::exp(-v));
      EXPECT_NEAR(y[i], e, 1e-6) << act;
    }
  }
}

TEST(ForwardTest, DropoutMasksInTrainingOnly) {
  auto backend = CpuBackend();
  const int64_t n = 20000;
  auto x = *backend->Allocate({n});
  auto mask = *backend->Allocate({n});
  auto y = *backend->Allocate({n});
  std::vector<float> hx(n, 3.0f);
  ASSERT_TRUE(backend->CopyToDevice(hx.data(), x).ok());
  ASSERT_TRUE(backend->DropoutForward(0.25f, 99, x, mask, y).ok());
  std::vector<float> hm(n), hy(n);
  ASSERT_TRUE(backend->CopyToHost(mask, hm.data()).ok());
  ASSERT_TRUE(backend->CopyToHost(y, hy.data()).ok());
  int64_t dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = kernels::DropoutUniform(99, i) >= 0.25f;
    ASSERT_EQ(hm[i], keep ? 1.0f / 0.75f : 0.0f) << i;
    ASSERT_FLOAT_EQ(hy[i], keep ? 3.0f / 0.75f : 0.0f) << i;
    if (!keep) ++dropped;
  }
  EXPECT_NEAR(static_cast<double>(dropped) / n, 0.25, 0.015);

  // In evaluation a dropout layer is the identity.
  Fixture f;
  f.Build("input_shape: [ 50 ] layers { dropout { rate: 0.5 } } loss: LOSS_MEAN_SQUARED_ERROR");
  auto in = f.RandomInput(2);
  EXPECT_EQ(f.Predict(in, 2), in);
}

TEST(ForwardTest, BatchNormUpdatesMovingStatisticsAndUsesThemInEvaluation) {
  Fixture f;
  f.Build(R"pb(input_shape: [ 2 ]
               layers {
                 name: "bn"
                 batch_norm { momentum: 0.5 epsilon: 0.001 }
               }
               loss: LOSS_MEAN_SQUARED_ERROR)pb");
  std::vector<float> gamma = {2.0f, 0.5f}, beta = {1.0f, -1.0f};
  ASSERT_TRUE(f.model->CopyValueFromHost("bn/gamma", gamma).ok());
  ASSERT_TRUE(f.model->CopyValueFromHost("bn/beta", beta).ok());
  // Feature 0: {1, 2, 3, 6} (mean 3, biased var 3.5, unbiased 14/3); feature 1: {0, 0, 4, 4}.
  std::vector<float> x = {1, 0, 2, 0, 3, 4, 6, 4};
  std::vector<float> t(8, 0.0f);
  BatchView b;
  b.size = 4;
  b.features = x;
  b.targets = t;
  auto r = f.model->TrainStep(b);
  ASSERT_TRUE(r.ok()) << r.status();
  auto mean = f.Value("bn/moving_mean");
  auto var = f.Value("bn/moving_variance");
  EXPECT_NEAR(mean[0], 0.5 * 3, 1e-5);
  EXPECT_NEAR(mean[1], 0.5 * 2, 1e-5);
  EXPECT_NEAR(var[0], 0.5 + 0.5 * 14.0 / 3, 1e-4);
  EXPECT_NEAR(var[1], 0.5 + 0.5 * 16.0 / 3, 1e-4);
  // Training output: (x - mean) / sqrt(var + eps) * gamma + beta; loss is its mean square.
  double loss = 0;
  const double m0 = 3, v0 = 3.5, m1 = 2, v1 = 4;
  for (int i = 0; i < 4; ++i) {
    const double y0 = (x[2 * i] - m0) / std::sqrt(v0 + 1e-3) * 2 + 1;
    const double y1 = (x[2 * i + 1] - m1) / std::sqrt(v1 + 1e-3) * 0.5 - 1;
    loss += y0 * y0 + y1 * y1;
  }
  EXPECT_NEAR(r->loss, loss / 8, 1e-4);
  // Evaluation uses the moving statistics.
  auto y = f.Predict(x, 4);
  EXPECT_NEAR(y[0], (1 - mean[0]) / std::sqrt(var[0] + 1e-3) * 2 + 1, 1e-4);
  EXPECT_NEAR(y[7], (4 - mean[1]) / std::sqrt(var[1] + 1e-3) * 0.5 - 1, 1e-4);
}

TEST(ForwardTest, EmbeddingBagSumAndMean) {
  for (bool mean : {false, true}) {
    Fixture f;
    f.Build(std::string(R"pb(layers { embedding_bag { num_rows: 5 dim: 3 combiner:)pb") +
            (mean ? "COMBINER_MEAN" : "COMBINER_SUM") + R"pb(}
                                                             }
                 loss: LOSS_MEAN_SQUARED_ERROR)pb");
    // The model holds only the rows SetRows installs; a batch's ids are positions among them.
    EXPECT_TRUE(f.Value("embedding_bag_1/embeddings").empty());
    std::vector<float> table(15);
    for (size_t i = 0; i < table.size(); ++i) table[i] = 0.1f * static_cast<float>(i) - 0.6f;
    ASSERT_TRUE(f.model->SetRows(0, 5, table).ok());
    EXPECT_EQ(f.Value("embedding_bag_1/embeddings"), table);
    std::vector<int64_t> offsets = {0, 2, 2, 5}, ids = {4, 1, 0, 0, 3};
    std::vector<float> values = {2.0f, -1.0f, 1.0f, 0.5f, 3.0f};
    BatchView b;
    b.size = 3;
    b.sparse_offsets = offsets;
    b.sparse_ids = ids;
    b.sparse_values = values;
    std::vector<float> out;
    ASSERT_TRUE(f.model->Predict(b, &out).ok());
    ASSERT_EQ(out.size(), 9u);
    for (int d = 0; d < 3; ++d) {
      const double bag0 = 2.0 * table[12 + d] - table[3 + d];
      const double bag2 = 1.5 * table[d] + 3.0 * table[9 + d];
      EXPECT_NEAR(out[d], mean ? bag0 / 2 : bag0, 1e-5);
      EXPECT_EQ(out[3 + d], 0.0f);
      EXPECT_NEAR(out[6 + d], mean ? bag2 / 3 : bag2, 1e-5);
    }
    // Positions outside the installed rows are refused.
    std::vector<int64_t> bad_ids = {4, 1, 0, 0, 5};
    b.sparse_ids = bad_ids;
    absl::Status s = f.model->Predict(b, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("batch.sparse_ids[4]: position 5 is outside the 5 rows"));
    // Fewer rows installed later: the same buffers, a smaller view.
    ASSERT_TRUE(f.model->SetRows(0, 2, absl::MakeConstSpan(table.data() + 9, 6)).ok());
    std::vector<int64_t> two = {1, 0, 0, 0, 1};
    b.sparse_ids = two;
    ASSERT_TRUE(f.model->Predict(b, &out).ok());
    for (int d = 0; d < 3; ++d) {
      const double bag2 = 1.5 * table[9 + d] + 3.0 * table[12 + d];
      EXPECT_NEAR(out[6 + d], mean ? bag2 / 3 : bag2, 1e-5);
    }
    EXPECT_EQ(f.model->SetRows(0, 2, table).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(f.model->SetRows(1, 0, {}).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ForwardTest, HashedTableRowGradientsAreSummedPerRow) {
  Fixture f;
  f.Build(R"pb(layers { embedding_bag { dim: 2 } }
               loss: LOSS_MEAN_SQUARED_ERROR)pb");
  EXPECT_EQ(f.model->input_dim(), 0);
  ASSERT_EQ(f.model->sparse_tables().size(), 1u);
  EXPECT_EQ(f.model->sparse_tables()[0].num_rows, 0);
  EXPECT_EQ(f.model->num_trainable_values(), 0);
  // Two rows; row 0 is used by both examples, row 1 by the second only.
  std::vector<float> rows = {1, 2, 3, 4};
  ASSERT_TRUE(f.model->SetRows(0, 2, rows).ok());
  std::vector<int64_t> offsets = {0, 1, 3}, ids = {0, 0, 1};
  std::vector<float> targets = {0, 0, 0, 0};
  BatchView b;
  b.size = 2;
  b.sparse_offsets = offsets;
  b.sparse_ids = ids;
  b.targets = targets;
  ASSERT_TRUE(f.model->TrainStep(b).ok());
  std::vector<float> g;
  ASSERT_TRUE(f.model->CopyGradToHost("embedding_bag_1/embeddings", &g).ok());
  // Outputs: example 0 = (1, 2), example 1 = (4, 6); MSE over 4 values: dy = y / 2.
  // Row 0 gets both examples' dy, row 1 the second's.
  ASSERT_EQ(g.size(), 4u);
  EXPECT_NEAR(g[0], 0.5 + 2.0, 1e-5);
  EXPECT_NEAR(g[1], 1.0 + 3.0, 1e-5);
  EXPECT_NEAR(g[2], 2.0, 1e-5);
  EXPECT_NEAR(g[3], 3.0, 1e-5);
}

TEST(ModelTest, BadBatchesAreRefused) {
  Fixture f;
  f.Build(kFashionMlp);
  std::vector<float> x(2 * 784, 0.1f);
  std::vector<int32_t> labels = {3, 10};
  BatchView b;
  b.size = 2;
  b.features = x;
  b.labels = labels;
  auto r = f.model->TrainStep(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("batch.labels[1]: 10"));
  b.size = 3;
  r = f.model->TrainStep(b);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("batch.features: expected 3 x 784"));
}

// A few SGD steps through Backend::ApplyUpdate lower the loss of a learnable problem, and the
// gradient callback reports every trainable parameter once, last layer first.
TEST(ModelTest, TrainingStepsLowerTheLoss) {
  Fixture f;
  f.Build(R"pb(input_shape: [ 1, 6, 6 ]
               layers { conv2d { filters: 4 kernel_h: 3 kernel_w: 3 padding_h: 1 padding_w: 1 } }
               layers { relu {} }
               layers { max_pool2d {} }
               layers { flatten {} }
               layers { dense { units: 3 } }
               loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb");
  // Rescale the random weights the fixture set.
  for (const Parameter& p : f.model->parameters()) {
    auto v = f.Value(p.name);
    for (float& w : v) w *= 0.1f;
    ASSERT_TRUE(f.model->CopyValueFromHost(p.name, v).ok());
  }
  const int64_t n = 12;
  std::vector<float> x(n * 36, 0.0f);
  std::vector<int32_t> labels(n);
  for (int64_t i = 0; i < n; ++i) {
    labels[i] = static_cast<int32_t>(i % 3);
    for (int j = 0; j < 12; ++j) x[i * 36 + labels[i] * 12 + j] = 1.0f;  // class = bright rows
  }
  BatchView b;
  b.size = n;
  b.features = x;
  b.labels = labels;
  kernels::OptimizerParams sgd;
  sgd.kind = v1::OPTIMIZER_KIND_SGD;
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    std::vector<int> order;
    auto r = f.model->TrainStep(b, [&](int i) { order.push_back(i); });
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(order, ElementsAre(2, 3, 0, 1));
    if (step == 0) first = r->loss;
    last = r->loss;
    for (const Parameter& p : f.model->parameters()) {
      ASSERT_TRUE(f.backend->ApplyUpdate(sgd, 0.5f, step + 1, 1.0f, p.grad, p.value, {}).ok());
    }
  }
  EXPECT_LT(last, 0.25 * first);
  auto eval = f.model->Evaluate(b);
  ASSERT_TRUE(eval.ok());
  EXPECT_EQ(eval->correct, n);
}

// Each training step draws new dropout masks; resetting the seed replays a step exactly.
TEST(ModelTest, DropoutSeedAdvancesEveryStepAndReplays) {
  Fixture f;
  f.Build(R"pb(input_shape: [ 20 ]
               layers { dense { units: 30 } }
               layers { dropout { rate: 0.5 } }
               layers { dense { units: 4 } }
               loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb");
  auto x = f.RandomInput(8);
  std::vector<int32_t> labels = {0, 1, 2, 3, 0, 1, 2, 3};
  BatchView b;
  b.size = 8;
  b.features = x;
  b.labels = labels;
  const uint64_t seed = f.model->dropout_seed();
  auto first = f.model->TrainStep(b);
  auto second = f.model->TrainStep(b);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(f.model->dropout_seed(), seed);
  EXPECT_NE(first->loss, second->loss);
  f.model->set_dropout_seed(seed);
  auto replay = f.model->TrainStep(b);
  ASSERT_TRUE(replay.ok());
  EXPECT_EQ(replay->loss, first->loss);
  // Evaluation does not depend on the masks.
  auto e1 = f.model->Evaluate(b);
  auto e2 = f.model->Evaluate(b);
  ASSERT_TRUE(e1.ok() && e2.ok());
  EXPECT_EQ(e1->loss, e2->loss);
}

TEST(ModelTest, ManyBatchSizesGiveConsistentResults) {
  Fixture f;
  f.Build(kFashionCnn);
  auto x = f.RandomInput(7);
  std::vector<int32_t> labels = {1, 2, 3, 4, 5, 6, 7};
  auto eval = [&](int64_t n) {
    BatchView b;
    b.size = n;
    b.features = absl::MakeConstSpan(x).subspan(0, n * 784);
    b.labels = absl::MakeConstSpan(labels).subspan(0, n);
    auto r = f.model->Evaluate(b);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->loss : -1.0;
  };
  const double first = eval(3);
  double sizes_total = 0;
  for (int64_t n = 1; n <= 7; ++n) sizes_total += eval(n);
  EXPECT_GT(sizes_total, 0.0);
  EXPECT_NEAR(eval(3), first, 1e-5 * std::fabs(first));
}

// The CPU backend flushes denormals (as TensorFlow does): 1e-20 * 1e-20 becomes 0, not 1e-40.
TEST(BackendTest, CpuFlushesDenormals) {
  auto backend = CpuBackend();
  auto t = *backend->Allocate({4});
  ASSERT_TRUE(backend->Fill(t, 1e-20f).ok());
  ASSERT_TRUE(backend->Scale(1e-20f, t).ok());
  float out[4];
  ASSERT_TRUE(backend->CopyToHost(t, out).ok());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

// Conv2DBackward's three outputs against naive double-precision sums, on plain and on blocked
// (16 or more channels) layouts.
TEST(BackendTest, ConvBackwardMatchesReference) {
  struct Case {
    int64_t n, c, h, w, k, kh, kw, s, p;
  };
  for (const Case& q : {Case{2, 2, 8, 8, 16, 3, 3, 1, 1}, Case{2, 2, 5, 5, 3, 3, 3, 1, 1},
                        Case{2, 16, 6, 6, 32, 3, 3, 1, 1}, Case{3, 1, 9, 9, 32, 5, 5, 2, 2}}) {
    SCOPED_TRACE(::testing::Message() << "c=" << q.c << " k=" << q.k << " kh=" << q.kh);
    auto backend = CpuBackend();
    kernels::Conv2DGeometry g;
    g.n = q.n, g.c = q.c, g.h = q.h, g.w = q.w, g.k = q.k, g.kh = q.kh, g.kw = q.kw;
    g.stride_h = g.stride_w = q.s;
    g.pad_h = g.pad_w = q.p;
    g.oh = (q.h + 2 * q.p - q.kh) / q.s + 1;
    g.ow = (q.w + 2 * q.p - q.kw) / q.s + 1;
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto random = [&](int64_t count) {
      std::vector<float> v(count);
      for (float& f : v) f = normal(rng);
      return v;
    };
    auto hx = random(q.n * q.c * q.h * q.w), hw = random(q.k * q.c * q.kh * q.kw), hb = random(q.k),
         hdy = random(q.n * q.k * g.oh * g.ow);
    auto x = *backend->Allocate({q.n, q.c, q.h, q.w});
    auto w = *backend->Allocate({q.k, q.c, q.kh, q.kw});
    auto b = *backend->Allocate({q.k});
    auto y = *backend->Allocate({q.n, q.k, g.oh, g.ow});
    auto dy = *backend->Allocate({q.n, q.k, g.oh, g.ow});
    auto dx = *backend->Allocate({q.n, q.c, q.h, q.w});
    auto dw = *backend->Allocate({q.k, q.c, q.kh, q.kw});
    auto db = *backend->Allocate({q.k});
    ASSERT_TRUE(backend->CopyToDevice(hx.data(), x).ok());
    ASSERT_TRUE(backend->CopyToDevice(hw.data(), w).ok());
    ASSERT_TRUE(backend->CopyToDevice(hb.data(), b).ok());
    ASSERT_TRUE(backend->CopyToDevice(hdy.data(), dy).ok());
    ASSERT_TRUE(backend->Conv2DForward(g, x, w, b, y).ok());
    ASSERT_TRUE(backend->Conv2DBackward(g, x, w, dy, &dx, dw, db).ok());
    std::vector<float> gdx(dx.num_elements()), gdw(dw.num_elements()), gdb(q.k);
    ASSERT_TRUE(backend->CopyToHost(dx, gdx.data()).ok());
    ASSERT_TRUE(backend->CopyToHost(dw, gdw.data()).ok());
    ASSERT_TRUE(backend->CopyToHost(db, gdb.data()).ok());
    std::vector<double> rdx(gdx.size(), 0.0), rdw(gdw.size(), 0.0), rdb(q.k, 0.0);
    for (int64_t i = 0; i < q.n; ++i)
      for (int64_t o = 0; o < q.k; ++o)
        for (int64_t r = 0; r < g.oh; ++r)
          for (int64_t t = 0; t < g.ow; ++t) {
            const double d = hdy[((i * q.k + o) * g.oh + r) * g.ow + t];
            rdb[o] += d;
            for (int64_t ch = 0; ch < q.c; ++ch)
              for (int64_t u = 0; u < q.kh; ++u)
                for (int64_t v = 0; v < q.kw; ++v) {
                  const int64_t yy = r * q.s - q.p + u, xx = t * q.s - q.p + v;
                  if (yy < 0 || yy >= q.h || xx < 0 || xx >= q.w) continue;
                  const int64_t xi = ((i * q.c + ch) * q.h + yy) * q.w + xx;
                  const int64_t wi = ((o * q.c + ch) * q.kh + u) * q.kw + v;
                  rdw[wi] += d * hx[xi];
                  rdx[xi] += d * hw[wi];
                }
          }
    for (size_t i = 0; i < rdw.size(); ++i) ASSERT_NEAR(gdw[i], rdw[i], 1e-3) << "dw " << i;
    for (size_t i = 0; i < rdx.size(); ++i) ASSERT_NEAR(gdx[i], rdx[i], 1e-3) << "dx " << i;
    for (int64_t i = 0; i < q.k; ++i) ASSERT_NEAR(gdb[i], rdb[i], 1e-3) << "db " << i;
  }
}

// The device strings are spec/'s (spec/device_spec_test.cc).
TEST(BackendTest, DeviceChoice) {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kAuto;
  auto b = kernels::CreateBackend(o);
  ASSERT_TRUE(b.ok());
  if (kernels::CudaDeviceCount() == 0) {
    EXPECT_EQ((*b)->Name(), "cpu");
    o.device = kernels::DeviceChoice::kCuda;
    EXPECT_EQ(kernels::CreateBackend(o).status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace tessera::engine
