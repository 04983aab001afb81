// Whole training steps on the CUDA backend against the CPU backend: the same spec and seed give
// the same initial weights, and one TrainStep on the same batch gives the same loss, accuracy and
// gradients to within FP32 rounding. Skipped where no CUDA device exists.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "spec/testing/example_models.h"
#include "worker/engine/model.h"

namespace tessera::engine {
namespace {

struct StepCase {
  std::string name;
  std::string spec;
  int64_t batch;
  double rtol;  // on gradients, relative to the largest gradient of the parameter
};

// Keeps test names (and ctest's listing) readable.
void PrintTo(const StepCase& c, std::ostream* os) { *os << c.name; }

const StepCase kCases[] = {
    {"FashionMlp", spec::examples::kFashionMlp, 64, 1e-3},
    {"FashionCnn", spec::examples::kFashionCnn, 16, 2e-3},
    {"StridedCnnWithBatchNorm", R"pb(
       input_shape: [ 3, 15, 13 ]
       layers {
         conv2d {
           filters: 8
           kernel_h: 3
           kernel_w: 5
           stride_h: 2
           stride_w: 1
           padding_h: 1
           padding_w: 2
         }
       }
       layers { batch_norm {} }
       layers { tanh {} }
       layers {
         avg_pool2d { pool_h: 3 pool_w: 3 stride_h: 2 stride_w: 2 padding_h: 1 padding_w: 1 }
       }
       layers { flatten {} }
       layers { dense { units: 20 } }
       layers { batch_norm {} }
       layers { sigmoid {} }
       layers { dense { units: 6 } }
       loss: LOSS_SOFTMAX_CROSS_ENTROPY
     )pb",
     12, 2e-3},
    {"MlpWithMeanSquaredError", R"pb(
       input_shape: [ 30 ]
       layers { dense { units: 40 } }
       layers { tanh {} }
       layers { dense { units: 3 } }
       loss: LOSS_MEAN_SQUARED_ERROR
     )pb",
     32, 1e-3},
    {"SparseSigmoid", R"pb(
       layers { embedding_bag { num_rows: 50 dim: 16 combiner: COMBINER_MEAN } }
       layers { dense { units: 8 } }
       layers { relu {} }
       layers { dense { units: 4 } }
       loss: LOSS_SIGMOID_CROSS_ENTROPY
     )pb",
     20, 1e-3},
};

class ModelCudaTest : public ::testing::TestWithParam<StepCase> {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << kernels::CudaUnavailableReason();
  }
};

std::unique_ptr<kernels::Backend> MakeBackend(kernels::DeviceChoice device) {
  kernels::BackendOptions options;
  options.device = device;
  auto b = kernels::CreateBackend(options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(b).value() : nullptr;
}

TEST_P(ModelCudaTest, TrainStepMatchesCpu) {
  const StepCase& c = GetParam();
  v1::ModelSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(c.spec, &spec)) << c.spec;
  std::unique_ptr<kernels::Backend> cpu = MakeBackend(kernels::DeviceChoice::kCpu);
  std::unique_ptr<kernels::Backend> gpu = MakeBackend(kernels::DeviceChoice::kCuda);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(gpu->IsCuda());
  auto cpu_model = Model::Create(spec, cpu.get(), /*seed=*/42);
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  auto gpu_model = Model::Create(spec, gpu.get(), /*seed=*/42);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  Model& cm = **cpu_model;
  Model& gm = **gpu_model;
  ASSERT_EQ(cm.parameters().size(), gm.parameters().size());

  // The batch.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = c.batch;
  std::vector<float> features;
  std::vector<int64_t> offsets, ids;
  std::vector<float> values;
  std::vector<int32_t> labels;
  std::vector<float> targets;
  if (cm.sparse_input()) {
    std::uniform_int_distribution<int64_t> row(0, cm.input_dim() - 1);
    std::uniform_int_distribution<int> count(0, 5);
    offsets.push_back(0);
    for (int64_t b = 0; b < n; ++b) {
      const int k = count(rng);
      for (int j = 0; j < k; ++j) ids.push_back(row(rng));
      offsets.push_back(static_cast<int64_t>(ids.size()));
    }
  } else {
    features.resize(static_cast<size_t>(n * cm.input_dim()));
    for (float& v : features) v = normal(rng);
  }
  if (spec.loss() == v1::LOSS_SOFTMAX_CROSS_ENTROPY) {
    std::uniform_int_distribution<int32_t> cls(0, static_cast<int32_t>(cm.output_dim() - 1));
    for (int64_t i = 0; i < n; ++i) labels.push_back(cls(rng));
  } else {
    std::bernoulli_distribution coin(0.5);
    for (int64_t i = 0; i < n * cm.output_dim(); ++i) {
      targets.push_back(spec.loss() == v1::LOSS_SIGMOID_CROSS_ENTROPY ? (coin(rng) ? 1.0f : 0.0f)
                                                                      : normal(rng));
    }
  }
  BatchView batch;
  batch.size = n;
  batch.features = features;
  batch.sparse_offsets = offsets;
  batch.sparse_ids = ids;
  batch.sparse_values = values;
  batch.labels = labels;
  batch.targets = targets;

  // A sparse table's rows live outside the model: the same rows installed on both devices, the
  // ids being positions among them.
  if (cm.sparse_input()) {
    std::vector<float> rows(static_cast<size_t>(cm.input_dim() * cm.sparse_tables()[0].dim));
    for (float& v : rows) v = 0.1f * normal(rng);
    ASSERT_TRUE(cm.SetRows(0, cm.input_dim(), rows).ok());
    ASSERT_TRUE(gm.SetRows(0, gm.input_dim(), rows).ok());
  }

  // Same seed, same initial weights on both devices.
  for (const Parameter& p : cm.parameters()) {
    std::vector<float> cv(static_cast<size_t>(kernels::NumElements(p.shape)));
    std::vector<float> gv(cv.size());
    ASSERT_TRUE(cm.CopyValueToHost(p.name, &cv).ok());
    ASSERT_TRUE(gm.CopyValueToHost(p.name, &gv).ok());
    ASSERT_EQ(cv, gv) << p.name;
  }

  cm.set_dropout_seed(1234);
  gm.set_dropout_seed(1234);
  auto cs = cm.TrainStep(batch);
  ASSERT_TRUE(cs.ok()) << cs.status();
  auto gs = gm.TrainStep(batch);
  ASSERT_TRUE(gs.ok()) << gs.status();
  EXPECT_NEAR(gs->loss, cs->loss, 1e-4 * std::fabs(cs->loss) + 1e-6);
  EXPECT_EQ(gs->correct, cs->correct);
  EXPECT_EQ(gs->examples, cs->examples);

  for (const Parameter& p : cm.parameters()) {
    std::vector<float> cv(static_cast<size_t>(kernels::NumElements(p.shape)));
    std::vector<float> gv(cv.size());
    if (p.trainable) {
      ASSERT_TRUE(cm.CopyGradToHost(p.name, &cv).ok()) << p.name;
      ASSERT_TRUE(gm.CopyGradToHost(p.name, &gv).ok()) << p.name;
    } else {  // batch-norm moving statistics, updated by the step
      ASSERT_TRUE(cm.CopyValueToHost(p.name, &cv).ok()) << p.name;
      ASSERT_TRUE(gm.CopyValueToHost(p.name, &gv).ok()) << p.name;
    }
    float scale = 0;
    for (float v : cv) scale = std::max(scale, std::fabs(v));
    const double tol = c.rtol * std::max(scale, 1e-6f);
    int bad = 0;
    for (size_t i = 0; i < cv.size(); ++i) {
      if (!(std::fabs(static_cast<double>(cv[i]) - gv[i]) <= tol)) {
        if (++bad <= 5)
          ADD_FAILURE() << p.name << "[" << i << "]: cpu " << cv[i] << " cuda " << gv[i];
      }
    }
    EXPECT_EQ(bad, 0) << p.name << ": " << bad << " of " << cv.size() << " beyond " << tol;
  }

  // Evaluation mode agrees too (dropout off, batch norm on the moving statistics).
  auto ce = cm.Evaluate(batch);
  auto ge = gm.Evaluate(batch);
  ASSERT_TRUE(ce.ok() && ge.ok());
  EXPECT_NEAR(ge->loss, ce->loss, 1e-4 * std::fabs(ce->loss) + 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Models, ModelCudaTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<StepCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace tessera::engine
