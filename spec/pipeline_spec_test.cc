// ModelSpec.pipeline: which cuts are accepted (with the field named when not), and the stage
// specs a plan cuts the model into.
#include "spec/pipeline_spec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/model_spec.h"
#include "spec/testing/example_models.h"

namespace tessera::spec {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::ModelSpec Cnn(const std::string& pipeline) {
  v1::ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
      absl::StrCat(examples::kFashionCnn, " pipeline { ", pipeline, " }"), &spec));
  return spec;
}

std::string Error(const v1::ModelSpec& spec) {
  return std::string(InferModelShapes(spec).status().message());
}

TEST(PipelineSpecTest, CutsTheCnnIntoStagesThatKeepTheNames) {
  const v1::ModelSpec spec = Cnn("stage_starts: 'conv2d_2' stage_starts: 'dense_1'");
  ASSERT_TRUE(InferModelShapes(spec).ok()) << InferModelShapes(spec).status();
  EXPECT_EQ(PipelineStageCount(spec), 3);
  absl::StatusOr<PipelinePlan> plan = PlanPipeline(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->stages.size(), 3u);
  EXPECT_EQ(plan->micro_batches, 6);  // 2 per stage by default
  EXPECT_EQ(plan->stages[0].begin, 0);
  EXPECT_EQ(plan->stages[0].end, 3);
  EXPECT_EQ(plan->stages[1].begin, 3);
  EXPECT_EQ(plan->stages[1].end, 7);
  EXPECT_EQ(plan->stages[2].begin, 7);
  EXPECT_EQ(plan->stages[2].end, 11);
  // Each stage reads the one before's output, and its layers keep the whole model's names.
  EXPECT_THAT(plan->stages[0].spec.input_shape(), ElementsAre(1, 28, 28));
  EXPECT_THAT(plan->stages[1].spec.input_shape(), ElementsAre(32, 14, 14));
  EXPECT_THAT(plan->stages[2].spec.input_shape(), ElementsAre(3136));  // flatten_1's output
  EXPECT_EQ(plan->stages[1].spec.layers(0).name(), "conv2d_2");
  EXPECT_EQ(plan->stages[1].spec.layers(1).name(), "relu_2");
  ASSERT_EQ(plan->stages[2].spec.layers_size(), 4);
  EXPECT_EQ(plan->stages[2].spec.layers(2).name(), "dropout_1");
  EXPECT_EQ(plan->stages[2].spec.layers(3).name(), "dense_2");
  EXPECT_EQ(plan->stages[2].spec.loss(), v1::LOSS_SOFTMAX_CROSS_ENTROPY);
  EXPECT_EQ(plan->stages[0].spec.loss(), v1::LOSS_MEAN_SQUARED_ERROR);
  EXPECT_FALSE(plan->stages[1].spec.has_pipeline());
  // Every stage is a model of its own, and together they hold the model's parameters.
  int parameters = 0;
  for (const PipelineStage& stage : plan->stages) {
    absl::StatusOr<ModelShapes> shapes = InferModelShapes(stage.spec);
    ASSERT_TRUE(shapes.ok()) << shapes.status();
    for (const LayerInfo& l : shapes->layers) parameters += static_cast<int>(l.parameters.size());
  }
  const absl::StatusOr<ModelShapes> all = InferModelShapes(spec);
  ASSERT_TRUE(all.ok()) << all.status();
  int whole = 0;
  for (const LayerInfo& l : all->layers) whole += static_cast<int>(l.parameters.size());
  EXPECT_EQ(parameters, whole);
  EXPECT_EQ(whole, 8);
}

TEST(PipelineSpecTest, MicroBatchesAsGiven) {
  absl::StatusOr<PipelinePlan> plan = PlanPipeline(Cnn("stage_starts: 'dense_1' micro_batches: 5"));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stages.size(), 2u);
  EXPECT_EQ(plan->micro_batches, 5);
}

TEST(PipelineSpecTest, RefusesBadCutsNamingTheField) {
  EXPECT_EQ(Error(Cnn("stage_starts: 'dense_9'")),
            "pipeline.stage_starts[0]: no layer is called \"dense_9\"");
  EXPECT_EQ(Error(Cnn("stage_starts: 'conv2d_1'")),
            "pipeline.stage_starts[0]: \"conv2d_1\" is the first layer, where the first stage "
            "already begins");
  EXPECT_EQ(Error(Cnn("stage_starts: 'dense_1' stage_starts: 'conv2d_2'")),
            "pipeline.stage_starts[1]: \"conv2d_2\" must come after \"dense_1\", which begins "
            "the stage before");
  EXPECT_EQ(Error(Cnn("stage_starts: 'dense_1' stage_starts: 'dense_1'")),
            "pipeline.stage_starts[1]: \"dense_1\" must come after \"dense_1\", which begins the "
            "stage before");
  EXPECT_THAT(Error(Cnn("")), HasSubstr("pipeline.stage_starts: name at least one layer"));
  EXPECT_EQ(Error(Cnn("stage_starts: 'dense_1' micro_batches: -1")),
            "pipeline.micro_batches: must be in [0, 1024] (0: 2 per stage), got -1");
  EXPECT_EQ(Error(Cnn("stage_starts: 'dense_1' micro_batches: 1025")),
            "pipeline.micro_batches: must be in [0, 1024] (0: 2 per stage), got 1025");
  EXPECT_TRUE(InferModelShapes(Cnn("stage_starts: 'dense_1' micro_batches: 1024")).ok());
  std::string many;
  for (int i = 0; i < kMaxPipelineStages; ++i) many += " stage_starts: 'dense_1'";
  EXPECT_THAT(Error(Cnn(many)), HasSubstr("pipeline.stage_starts: at most 63 names"));
}

TEST(PipelineSpecTest, SparseModelsAreRefused) {
  v1::ModelSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(
        layers { embedding_bag { num_rows: 100 dim: 8 } }
        layers { dense { units: 2 } }
        loss: LOSS_SOFTMAX_CROSS_ENTROPY
        pipeline { stage_starts: "dense_1" }
      )pb",
      &spec));
  EXPECT_THAT(Error(spec), HasSubstr("pipeline: only dense single-input models"));
  EXPECT_EQ(PlanPipeline(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PipelineSpecTest, WithoutAPipelineTheModelIsOneStage) {
  v1::ModelSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(examples::kFashionCnn, &spec));
  EXPECT_EQ(PipelineStageCount(spec), 1);
  EXPECT_EQ(PlanPipeline(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PipelineSpecTest, Bubble) {
  EXPECT_DOUBLE_EQ(PipelineBubble(2, 1), 0.5);
  EXPECT_DOUBLE_EQ(PipelineBubble(2, 4), 0.2);
  EXPECT_DOUBLE_EQ(PipelineBubble(4, 13), 0.1875);
  EXPECT_DOUBLE_EQ(PipelineBubble(1, 8), 0.0);
}

}  // namespace
}  // namespace tessera::spec
