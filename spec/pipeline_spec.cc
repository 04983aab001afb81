#include "spec/pipeline_spec.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera::spec {

absl::Status CheckPipeline(const v1::ModelSpec& spec, const ModelShapes& shapes) {
  if (!spec.has_pipeline()) return absl::OkStatus();
  const v1::Pipeline& p = spec.pipeline();
  if (shapes.multi_input || shapes.sparse_input) {
    return absl::InvalidArgumentError(
        "pipeline: only dense single-input models can be split into stages; this model has "
        "sparse tables, whose rows travel per batch");
  }
  if (p.stage_starts_size() < 1) {
    return absl::InvalidArgumentError(
        "pipeline.stage_starts: name at least one layer that begins a stage (a pipeline of one "
        "stage is the model itself: leave pipeline out)");
  }
  if (p.stage_starts_size() > kMaxPipelineStages - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline.stage_starts: at most ", kMaxPipelineStages - 1, " names (",
                     kMaxPipelineStages, " stages), got ", p.stage_starts_size()));
  }
  if (p.micro_batches() < 0 || p.micro_batches() > kMaxMicroBatches) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline.micro_batches: must be in [0, ",
                                                   kMaxMicroBatches, "] (0: 2 per stage), got ",
                                                   p.micro_batches()));
  }
  int previous = 0;
  for (int i = 0; i < p.stage_starts_size(); ++i) {
    const std::string& name = p.stage_starts(i);
    int index = -1;
    for (size_t l = 0; l < shapes.layers.size(); ++l) {
      if (shapes.layers[l].name == name) index = static_cast<int>(l);
    }
    const std::string field = absl::StrCat("pipeline.stage_starts[", i, "]: ");
    if (index < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, "no layer is called \"", name, "\""));
    }
    if (index == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "\"", name, "\" is the first layer, where the first stage already begins"));
    }
    if (index <= previous) {
      return absl::InvalidArgumentError(absl::StrCat(field, "\"", name, "\" must come after \"",
                                                     shapes.layers[previous].name,
                                                     "\", which begins the stage before"));
    }
    previous = index;
  }
  return absl::OkStatus();
}

absl::StatusOr<PipelinePlan> PlanPipeline(const v1::ModelSpec& spec) {
  if (!spec.has_pipeline()) {
    return absl::InvalidArgumentError("pipeline: the model has none (it is one stage)");
  }
  TESSERA_ASSIGN_OR_RETURN(const ModelShapes shapes, InferModelShapes(spec));
  std::vector<int> begins = {0};
  for (const std::string& name : spec.pipeline().stage_starts()) {
    for (size_t l = 0; l < shapes.layers.size(); ++l) {
      if (shapes.layers[l].name == name) begins.push_back(static_cast<int>(l));
    }
  }
  begins.push_back(spec.layers_size());
  PipelinePlan plan;
  const int stages = static_cast<int>(begins.size()) - 1;
  plan.micro_batches = spec.pipeline().micro_batches() > 0 ? spec.pipeline().micro_batches()
                                                           : kMicroBatchesPerStage * stages;
  for (int s = 0; s < stages; ++s) {
    PipelineStage stage;
    stage.begin = begins[s];
    stage.end = begins[s + 1];
    const Shape& in = shapes.layers[stage.begin].input_shape;
    for (int64_t d : in) stage.spec.add_input_shape(d);
    for (int l = stage.begin; l < stage.end; ++l) {
      v1::Layer* layer = stage.spec.add_layers();
      *layer = spec.layers(l);
      layer->set_name(shapes.layers[l].name);
    }
    stage.spec.set_loss(s + 1 == stages ? spec.loss() : v1::LOSS_MEAN_SQUARED_ERROR);
    plan.stages.push_back(std::move(stage));
  }
  return plan;
}

double PipelineBubble(int stages, int micro_batches) {
  if (stages < 1 || micro_batches < 1) return 0;
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

}  // namespace tessera::spec
