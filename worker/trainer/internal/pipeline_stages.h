// Model parallelism inside one worker (DESIGN.md §5, ModelSpec.pipeline): a model cut into S
// stages (spec::PlanPipeline), stage s on local device s, each device driven by its own thread: a
// oneDNN backend with its own OpenMP threads (`--devices cpu:S`) or a CUDA backend on one GPU
// (`--devices cuda:0,cuda:1`). Activations and their gradients cross between stages through host
// buffers on either kind (docs/decisions.md says why not peer copies between GPUs yet).
//
// A step splits the batch into M micro-batches (the first B mod M one example larger; at most
// one per example) and runs the GPipe schedule: stage 0 runs the forward pass of every
// micro-batch in turn and hands each output to stage 1 through a host buffer; a middle stage runs
// a micro-batch's forward pass as soon as its input has arrived and its backward pass as soon as
// the gradient of its output has; the last stage runs forward, loss and backward of each
// micro-batch as it arrives and hands the gradient of its input back. While stage 1 runs
// micro-batch m, stage 0 runs m + 1. Each stage keeps every micro-batch's activations in their own
// slot (engine::Model's stage API) until its backward pass. The last stage scales micro-batch
// m's loss gradient by its share of the batch, so every stage's gradients of m come out weighted
// and a stage sums them on its device; the step's gradient is then the whole batch's mean
// loss's, as the unsplit model would compute it (to float rounding; BatchNorm normalises each
// micro-batch by its own statistics, as in GPipe).
//
// With S equal stages the schedule idles a fraction (S - 1) / (M + S - 1) of the step (the
// bubble, spec::PipelineBubble); last_profile() says how long each stage computed and waited.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_PIPELINE_STAGES_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_PIPELINE_STAGES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "spec/pipeline_spec.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/model.h"
#include "worker/trainer/internal/device_threads.h"
#include "worker/trainer/internal/local_devices.h"

namespace tessera::trainer::internal {

class PipelineStages final : public LocalDevices {
 public:
  // Builds the stages of `spec`'s pipeline, one per device. INVALID_ARGUMENT naming `devices`
  // when options.devices is not the number of stages; the spec's errors as
  // spec::PlanPipeline and engine::Model::Create give them.
  static absl::StatusOr<std::unique_ptr<PipelineStages>> Create(const v1::ModelSpec& spec,
                                                                uint64_t seed,
                                                                const Options& options);
  ~PipelineStages() override;
  PipelineStages(const PipelineStages&) = delete;
  PipelineStages& operator=(const PipelineStages&) = delete;

  int size() const override { return static_cast<int>(stages_.size()); }
  std::string Describe() const override;
  // Micro-batches per batch (a smaller batch has one per example).
  int micro_batches() const { return plan_.micro_batches; }
  // Stage s's model, for reading (tests). Not to be driven while a step runs.
  const engine::Model& model(int s) const { return *stages_[s]->model; }

  absl::StatusOr<engine::StepResult> TrainStep(const engine::BatchView& batch,
                                               uint64_t dropout_seed,
                                               absl::Span<const std::string> names,
                                               const std::vector<bool>& state,
                                               std::vector<std::vector<float>>* out) override;
  absl::Status Install(absl::Span<const std::string> names,
                       absl::Span<const std::vector<float>> values) override;
  // FAILED_PRECONDITION: a pipelined model has no sparse tables (spec::PlanPipeline).
  absl::Status SetRows(int table, int64_t count, absl::Span<const float> values) override;
  absl::Status CopyRowGrads(int table, std::vector<float>* out) const override;

  // Where the last TrainStep's time went, per stage (wall seconds).
  struct StageTime {
    double compute = 0;  // forward and backward passes, loss, gradient accumulation
    double wait = 0;     // waiting for an input or an output gradient (the bubble)
    double copy = 0;     // the gradients and state to the host, at the end
  };
  struct Profile {
    double step = 0;  // the whole TrainStep
    int micro_batches = 0;
    std::vector<StageTime> stages;
  };
  const Profile& last_profile() const { return profile_; }

 private:
  struct Stage {
    spec::PipelineStage plan;
    std::unique_ptr<kernels::Backend> backend;
    std::unique_ptr<engine::Model> model;
  };
  PipelineStages() = default;
  // Stage s's part of a step (on its own thread).
  absl::Status RunStage(int s, const engine::BatchView& batch, uint64_t dropout_seed,
                        absl::Span<const int64_t> begin, absl::Span<const std::string> names,
                        const std::vector<bool>& state, std::vector<std::vector<float>>* out,
                        std::vector<absl::StatusOr<engine::StepResult>>* results);
  // Which stage holds each tensor of `names` (cached for the last list).
  absl::Status MapOwners(absl::Span<const std::string> names);

  spec::PipelinePlan plan_;
  std::string devices_name_;  // "2 CPU devices", "2 GPU devices (cuda:0,cuda:1)"
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<std::string> owner_names_;
  std::vector<int> owner_;  // per name: its stage
  // Per boundary b (between stages b and b + 1) and micro-batch m: the activations going forward
  // and their gradients coming back.
  std::vector<std::vector<std::vector<float>>> acts_, grads_;
  absl::Mutex mu_;
  // Per stage s and micro-batch m: its input has arrived (forward_ready_) / the gradient of its
  // output has (backward_ready_).
  std::vector<std::vector<bool>> forward_ready_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<bool>> backward_ready_ ABSL_GUARDED_BY(mu_);
  bool failed_ ABSL_GUARDED_BY(mu_) = false;  // a stage failed: the others stop waiting
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  Profile profile_;
  std::unique_ptr<DeviceThreads> threads_;  // last: stops before the rest goes
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_PIPELINE_STAGES_H_
