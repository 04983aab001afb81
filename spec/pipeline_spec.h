// Model parallelism inside one worker (ModelSpec.pipeline, DESIGN.md §5): checking a spec's
// pipeline and cutting the model into the specs of its stages.
#ifndef TESSERA_SPEC_PIPELINE_SPEC_H_
#define TESSERA_SPEC_PIPELINE_SPEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spec/model_spec.h"
#include "tessera/v1/model.pb.h"

namespace tessera::spec {

// The most stages a pipeline has (ModelSpec.pipeline.stage_starts holds one fewer names).
inline constexpr int kMaxPipelineStages = 64;
// The most micro-batches a batch is split into.
inline constexpr int kMaxMicroBatches = 1024;
// Micro-batches per stage when the spec says 0. GPipe suggests 4 or more on GPUs; on these CPUs
// (docs/benchmarks.md, "Pipelines") each extra micro-batch costs a pass over the stage's weight
// gradients, and 2 per stage was the fastest or close to it for every model measured.
inline constexpr int kMicroBatchesPerStage = 2;

// One stage of a pipelined model: layers [begin, end) of the whole model, as a model of its own.
struct PipelineStage {
  int begin = 0;
  int end = 0;
  // input_shape: the stage's input (the previous stage's output); layers: the range, each with
  // its name set to the whole model's (so parameters keep their names); the last stage keeps the
  // model's loss, the others carry LOSS_MEAN_SQUARED_ERROR, which no one computes (an earlier
  // stage's output gradient comes from the next stage). No pipeline.
  v1::ModelSpec spec;
};

struct PipelinePlan {
  std::vector<PipelineStage> stages;  // >= 2
  int micro_batches = 0;              // resolved: >= 1
};

// The number of stages of the spec's model: 1 without a pipeline. Pure.
inline int PipelineStageCount(const v1::ModelSpec& spec) {
  return spec.has_pipeline() ? spec.pipeline().stage_starts_size() + 1 : 1;
}

// Checks spec.pipeline against the model's layers (InferModelShapes calls it). INVALID_ARGUMENT
// naming the field: "pipeline.stage_starts[1]: no layer is called \"dense_9\"", "...: must come
// after the stage that \"conv2d_2\" starts", a model with sparse tables, micro_batches out of
// range. Pure; thread-safe.
absl::Status CheckPipeline(const v1::ModelSpec& spec, const ModelShapes& shapes);

// The stages of a spec that has a pipeline (InferModelShapes' errors as they are;
// INVALID_ARGUMENT "pipeline: ..." without one). Pure; thread-safe.
absl::StatusOr<PipelinePlan> PlanPipeline(const v1::ModelSpec& spec);

// The fraction of a step the stages idle in the GPipe schedule of `stages` equal stages and
// `micro_batches` micro-batches: (S - 1) / (M + S - 1). Pure.
double PipelineBubble(int stages, int micro_batches);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_PIPELINE_SPEC_H_
