// Model parallelism in one worker: a model cut into stages over cpu:S, with M micro-batches,
// gives the gradient, loss and correct count that the unsplit model computes on one device with
// the whole batch (even and uneven micro-batches, more micro-batches than examples, stages that
// begin with a view, a regression loss); BatchNorm state with one micro-batch is the unsplit
// model's; Install reaches every stage; the engine's stage API refuses what it cannot run; and
// LocalDevices::Create picks replicas or stages from the spec.
#include "worker/trainer/internal/pipeline_stages.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "worker/trainer/internal/local_devices.h"
#include "worker/trainer/testing/one_device.h"

namespace tessera::trainer::internal {
namespace {

using namespace ::tessera::trainer::testing_devices;  // NOLINT: the tests' shared helpers

using ::testing::HasSubstr;

constexpr char kBatchNormMlp[] = R"pb(
  input_shape: [ 3 ]
  layers { dense { units: 4 } }
  layers { batch_norm {} }
  layers { relu {} }
  layers { dense { units: 2 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
  pipeline { stage_starts: "batch_norm_1" micro_batches: 1 }
)pb";

constexpr char kRegression[] = R"pb(
  input_shape: [ 4 ]
  layers { dense { units: 6 } }
  layers { sigmoid {} }
  layers { dense { units: 2 } }
  loss: LOSS_MEAN_SQUARED_ERROR
  pipeline { stage_starts: "sigmoid_1" micro_batches: 3 }
)pb";

v1::ModelSpec Cut(const std::vector<std::string>& starts, int micro_batches) {
  v1::ModelSpec spec = Parse(kSmallCnn);
  for (const std::string& s : starts) spec.mutable_pipeline()->add_stage_starts(s);
  spec.mutable_pipeline()->set_micro_batches(micro_batches);
  return spec;
}

// On `devices` CPU devices, or on `gpus` (one stage each; a GPU may hold several stages).
std::unique_ptr<PipelineStages> Stages(const v1::ModelSpec& spec, int devices,
                                       const std::vector<int>& gpus = {}) {
  LocalDevices::Options o;
  o.devices = devices;
  o.threads = 1;
  o.cuda_devices = gpus;
  auto p = PipelineStages::Create(spec, 11, o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

// Trains `batch` on the unsplit model (one CPU device) and through the stages (on the CPU, or on
// `gpus`); expects the same gradients, to `tolerance` (relative, plus a tenth of it absolute).
void ExpectSameStep(const v1::ModelSpec& spec, const Batch& batch,
                    const std::vector<int>& gpus = {}, float tolerance = 1e-4f) {
  Reference one = OneDevice(spec);
  absl::StatusOr<engine::StepResult> expected = one.model->TrainStep(batch.View());
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::unique_ptr<PipelineStages> stages =
      Stages(spec, spec.pipeline().stage_starts_size() + 1, gpus);
  ASSERT_NE(stages, nullptr);
  const std::vector<std::string> names = TrainableNames(*one.model);
  std::vector<std::vector<float>> want(names.size()), got(names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    ASSERT_TRUE(one.model->CopyGradToHost(names[k], &want[k]).ok());
    got[k].assign(want[k].size(), NAN);
  }
  const std::vector<bool> no_state(names.size(), false);
  // Twice: the second step reuses every slot's buffers and must not see the first's gradients.
  for (int step = 0; step < 2; ++step) {
    absl::StatusOr<engine::StepResult> r =
        stages->TrainStep(batch.View(), 0, names, no_state, &got);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->examples, batch.View().size);
    if (gpus.empty()) {
      EXPECT_EQ(r->correct, expected->correct);
    }
    EXPECT_NEAR(r->loss, expected->loss, tolerance / 10);
    double norm = 0;
    for (size_t k = 0; k < names.size(); ++k) {
      ASSERT_EQ(got[k].size(), want[k].size()) << names[k];
      for (size_t e = 0; e < want[k].size(); ++e) {
        norm += std::abs(want[k][e]);
        EXPECT_NEAR(got[k][e], want[k][e], tolerance / 10 + tolerance * std::abs(want[k][e]))
            << names[k] << "[" << e << "] step " << step;
      }
    }
    EXPECT_GT(norm, 1e-3) << "a zero gradient would compare equal to anything";
  }
  const PipelineStages::Profile& profile = stages->last_profile();
  EXPECT_EQ(profile.micro_batches, std::min<int64_t>(stages->micro_batches(), batch.View().size));
  ASSERT_EQ(profile.stages.size(), static_cast<size_t>(stages->size()));
  for (const PipelineStages::StageTime& t : profile.stages) {
    EXPECT_GT(t.compute, 0);
    EXPECT_LE(t.compute + t.wait + t.copy, profile.step * 1.01 + 1e-4);
  }
}

TEST(PipelineStagesTest, StagesGiveTheGradientOfTheUnsplitModel) {
  // Cuts after a view (flatten_1 begins a stage), before a dense layer, three stages; one
  // micro-batch, several, uneven (12 over 5: 3, 3, 2, 2, 2), and more than examples (16 > 12).
  const std::vector<std::pair<std::vector<std::string>, int>> cases = {
      {{"dense_1"}, 1},      {{"dense_1"}, 4},           {{"flatten_1"}, 2},
      {{"max_pool2d_1"}, 5}, {{"relu_1", "dense_2"}, 3}, {{"max_pool2d_1", "tanh_1"}, 16}};
  for (const auto& [starts, micro] : cases) {
    SCOPED_TRACE(testing::Message() << starts.front() << " (" << starts.size() + 1 << " stages), "
                                    << micro << " micro-batches");
    ExpectSameStep(Cut(starts, micro), RandomBatch(12, 36, 3, 7));
  }
}

// Two stages on two GPUs (both on cuda:0 where there is one), host buffers between them.
TEST(PipelineStagesTest, StagesOnGpusGiveTheGradientOfTheUnsplitModelOnTheCpu) {
  const int count = kernels::CudaDeviceCount();
  if (count < 1) GTEST_SKIP() << "no CUDA device: " << kernels::CudaUnavailableReason();
  ExpectSameStep(Cut({"flatten_1"}, 3), RandomBatch(12, 36, 3, 9), {0, std::min(count - 1, 1)},
                 1e-3f);
}

TEST(PipelineStagesTest, RegressionTargetsAreSplitWithTheirExamples) {
  ExpectSameStep(Parse(kRegression), WithTargets(RandomBatch(7, 4, 2, 3), 9));
}

TEST(PipelineStagesTest, BatchNormStateWithOneMicroBatchIsTheUnsplitModels) {
  const v1::ModelSpec spec = Parse(kBatchNormMlp);
  const Batch batch = RandomBatch(8, 3, 2, 5);
  ExpectSameStep(spec, batch);
  Reference one = OneDevice(spec);
  ASSERT_TRUE(one.model->TrainStep(batch.View()).ok());
  std::unique_ptr<PipelineStages> stages = Stages(spec, 2);
  ASSERT_NE(stages, nullptr);
  const std::vector<std::string> names = {"batch_norm_1/moving_mean",
                                          "batch_norm_1/moving_variance", "dense_2/bias"};
  const std::vector<bool> state = {true, true, false};
  std::vector<std::vector<float>> out = {std::vector<float>(4), std::vector<float>(4),
                                         std::vector<float>(2)};
  ASSERT_TRUE(stages->TrainStep(batch.View(), 0, names, state, &out).ok());
  for (int k = 0; k < 2; ++k) {
    std::vector<float> want;
    ASSERT_TRUE(one.model->CopyValueToHost(names[k], &want).ok());
    ASSERT_EQ(out[k].size(), want.size());
    for (size_t c = 0; c < want.size(); ++c) {
      EXPECT_NEAR(out[k][c], want[c], 1e-6) << names[k] << "[" << c << "]";
    }
    EXPECT_NE(want, std::vector<float>(4, k == 0 ? 0.0f : 1.0f)) << "the step moved nothing";
  }
}

TEST(PipelineStagesTest, StagesStartAsTheWholeModelAndInstallReachesTheStageThatHoldsATensor) {
  const v1::ModelSpec spec = Cut({"dense_1"}, 2);
  Reference one = OneDevice(spec);
  std::unique_ptr<PipelineStages> stages = Stages(spec, 2);
  ASSERT_NE(stages, nullptr);
  for (const auto& [stage, name] : {std::pair{0, "conv2d_1/kernel"}, {1, "dense_2/kernel"}}) {
    std::vector<float> want, got;
    ASSERT_TRUE(one.model->CopyValueToHost(name, &want).ok());
    ASSERT_TRUE(stages->model(stage).CopyValueToHost(name, &got).ok()) << name;
    EXPECT_EQ(got, want) << name;
    EXPECT_EQ(stages->model(1 - stage).FindParameter(name), nullptr) << name;
  }
  std::vector<float> conv(4 * 9), dense(3 * 5);
  for (size_t i = 0; i < conv.size(); ++i) conv[i] = 0.01f * static_cast<float>(i);
  for (size_t i = 0; i < dense.size(); ++i) dense[i] = -0.02f * static_cast<float>(i);
  ASSERT_TRUE(stages->Install({"conv2d_1/kernel", "dense_2/kernel"}, {conv, dense}).ok());
  std::vector<float> got;
  ASSERT_TRUE(stages->model(0).CopyValueToHost("conv2d_1/kernel", &got).ok());
  EXPECT_EQ(got, conv);
  ASSERT_TRUE(stages->model(1).CopyValueToHost("dense_2/kernel", &got).ok());
  EXPECT_EQ(got, dense);
  // A tensor no stage holds is an error, and the stages serve on.
  EXPECT_EQ(stages->Install({"nope/kernel"}, {conv}).code(), absl::StatusCode::kInternal);
  const Batch batch = RandomBatch(4, 36, 3, 1);
  std::vector<std::vector<float>> out = {std::vector<float>(dense.size())};
  EXPECT_TRUE(stages->TrainStep(batch.View(), 0, {"dense_2/kernel"}, {false}, &out).ok());
}

TEST(PipelineStagesTest, AFailingStageFailsTheStepWithItsErrorAndTheNextStepRuns) {
  const v1::ModelSpec spec = Cut({"dense_1"}, 3);
  std::unique_ptr<PipelineStages> stages = Stages(spec, 2);
  ASSERT_NE(stages, nullptr);
  Batch batch = RandomBatch(6, 36, 3, 2);
  batch.labels[4] = 7;  // outside the 3 classes: the last stage refuses micro-batch 2
  std::vector<std::vector<float>> out = {std::vector<float>(15)};
  const absl::StatusOr<engine::StepResult> r =
      stages->TrainStep(batch.View(), 0, {"dense_2/kernel"}, {false}, &out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("batch.labels"));
  batch.labels[4] = 1;
  // The next step's gradients owe nothing to the failed one's (whose accumulation was left
  // open): they are those of stages that never failed.
  const std::vector<std::string> names = {"conv2d_1/kernel", "dense_1/kernel", "dense_2/kernel"};
  const std::vector<bool> no_state(names.size(), false);
  std::vector<std::vector<float>> after(names.size()), fresh(names.size());
  ASSERT_TRUE(stages->TrainStep(batch.View(), 0, names, no_state, &after).ok());
  std::unique_ptr<PipelineStages> clean = Stages(spec, 2);
  ASSERT_NE(clean, nullptr);
  ASSERT_TRUE(clean->TrainStep(batch.View(), 0, names, no_state, &fresh).ok());
  for (size_t k = 0; k < names.size(); ++k) {
    ASSERT_EQ(after[k].size(), fresh[k].size()) << names[k];
    for (size_t e = 0; e < fresh[k].size(); ++e) {
      EXPECT_NEAR(after[k][e], fresh[k][e], 1e-6f + 1e-5f * std::abs(fresh[k][e]))
          << names[k] << "[" << e << "]";
    }
  }
}

TEST(PipelineStagesTest, DevicesMustMatchTheStagesAndCreatePicksStagesOrReplicas) {
  LocalDevices::Options o;
  o.devices = 3;
  auto refused = PipelineStages::Create(Cut({"dense_1"}, 2), 1, o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "devices: the model's pipeline has 2 stages, one per device, but the worker drives 3 "
            "(use --devices cpu:2, or one device to train the model unsplit)");
  auto refused_too = LocalDevices::Create(Cut({"dense_1"}, 2), 1, o);
  EXPECT_EQ(refused_too.status().code(), absl::StatusCode::kInvalidArgument);
  o.devices = 2;
  auto stages = LocalDevices::Create(Cut({"dense_1"}, 2), 1, o);
  ASSERT_TRUE(stages.ok()) << stages.status();
  EXPECT_EQ((*stages)->Describe(),
            "runs the model as a pipeline of 2 stages on 2 CPU devices, 2 micro-batches a batch");
  auto replicas = LocalDevices::Create(Parse(kSmallCnn), 1, o);
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  EXPECT_EQ((*replicas)->Describe(), "splits each batch over 2 CPU replicas");
  // A bad cut is the spec's error.
  auto bad = LocalDevices::Create(Cut({"dense_9"}, 2), 1, o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("pipeline.stage_starts[0]"));
}

TEST(PipelineStagesTest, TheEngineStageApiRefusesWhatItCannotRun) {
  Reference one = OneDevice(Parse(kSmallCnn));
  std::vector<float> grad;
  // A backward pass needs the slot's forward pass first.
  EXPECT_EQ(one.model->StageBackward(2, std::vector<float>(3 * 4), &grad).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(one.model->StageBackward(0, std::vector<float>(5), &grad).code(),
            absl::StatusCode::kInvalidArgument);
  const Batch batch = RandomBatch(4, 36, 3, 1);
  std::vector<float> out;
  EXPECT_EQ(one.model->StageForward(engine::Model::kMaxSlots, batch.View(), &out).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(one.model->StageForward(3, batch.View(), &out).ok());
  EXPECT_EQ(out.size(), 4u * 3u);
  ASSERT_TRUE(one.model->StageBackward(3, std::vector<float>(4 * 3, 0.5f), &grad).ok());
  EXPECT_EQ(grad.size(), 4u * 36u);
  v1::ModelSpec sparse = Parse(R"pb(
    layers { embedding_bag { num_rows: 100 dim: 4 } }
    layers { dense { units: 2 } }
    loss: LOSS_SOFTMAX_CROSS_ENTROPY
  )pb");
  Reference s = OneDevice(sparse);
  EXPECT_EQ(s.model->StageForward(0, batch.View(), &out).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tessera::trainer::internal
