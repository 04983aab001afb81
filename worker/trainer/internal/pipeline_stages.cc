#include "worker/trainer/internal/pipeline_stages.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "spec/device_spec.h"

namespace tessera::trainer::internal {

absl::StatusOr<std::unique_ptr<PipelineStages>> PipelineStages::Create(const v1::ModelSpec& spec,
                                                                       uint64_t seed,
                                                                       const Options& options) {
  TESSERA_ASSIGN_OR_RETURN(spec::PipelinePlan plan, spec::PlanPipeline(spec));
  const int stages = static_cast<int>(plan.stages.size());
  TESSERA_RETURN_IF_ERROR(spec::CheckDevicesFitModel(options.devices, spec));
  if (options.devices != stages) {  // one device: the trainer runs the model unsplit
    return absl::InvalidArgumentError(
        absl::StrCat("devices: a pipeline of ", stages, " stages needs ", stages, " devices"));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: each pipeline stage needs >= 1 thread, got ", options.threads));
  }
  std::unique_ptr<PipelineStages> p(new PipelineStages());
  p->plan_ = std::move(plan);
  p->devices_name_ = DescribeDevices(options, "devices");
  for (int s = 0; s < stages; ++s) {
    p->stages_.push_back(std::make_unique<Stage>());
    p->stages_[s]->plan = p->plan_.stages[s];
  }
  p->acts_.resize(stages - 1);
  p->grads_.resize(stages - 1);
  p->profile_.stages.resize(stages);
  PipelineStages* raw = p.get();
  TESSERA_ASSIGN_OR_RETURN(
      p->threads_,
      DeviceThreads::Start(stages, "pipeline stage", [raw, seed, &options](int s) -> absl::Status {
        Stage& self = *raw->stages_[s];
        TESSERA_ASSIGN_OR_RETURN(self.backend, DeviceBackend(options, s));
        // The seed initialises each parameter by its name: the stages start as the whole model.
        TESSERA_ASSIGN_OR_RETURN(self.model,
                                 engine::Model::Create(self.plan.spec, self.backend.get(), seed));
        return absl::OkStatus();
      }));
  return p;
}

PipelineStages::~PipelineStages() = default;

std::string PipelineStages::Describe() const {
  return absl::StrCat("runs the model as a pipeline of ", size(), " stages on ", devices_name_,
                      ", ", plan_.micro_batches, " micro-batches a batch");
}

absl::Status PipelineStages::MapOwners(absl::Span<const std::string> names) {
  if (owner_names_.size() == names.size() &&
      std::equal(owner_names_.begin(), owner_names_.end(), names.begin())) {
    return absl::OkStatus();
  }
  std::vector<int> owner(names.size(), -1);
  for (size_t k = 0; k < names.size(); ++k) {
    for (int s = 0; s < size(); ++s) {
      if (stages_[s]->model->FindParameter(names[k]) != nullptr) owner[k] = s;
    }
    if (owner[k] < 0) {
      return absl::InternalError(absl::StrCat("pipeline: no stage holds \"", names[k], "\""));
    }
  }
  owner_names_.assign(names.begin(), names.end());
  owner_ = std::move(owner);
  return absl::OkStatus();
}

absl::StatusOr<engine::StepResult> PipelineStages::TrainStep(const engine::BatchView& batch,
                                                             uint64_t dropout_seed,
                                                             absl::Span<const std::string> names,
                                                             const std::vector<bool>& state,
                                                             std::vector<std::vector<float>>* out) {
  if (batch.size <= 0) return absl::InvalidArgumentError("batch: empty");
  if (names.size() != state.size() || out->size() != names.size()) {
    return absl::InternalError("PipelineStages::TrainStep: names, state and out differ in size");
  }
  const absl::Time start = absl::Now();
  TESSERA_RETURN_IF_ERROR(MapOwners(names));
  const int stages = size();
  const int m_count = static_cast<int>(std::min<int64_t>(plan_.micro_batches, batch.size));
  // Micro-batch m is examples [begin[m], begin[m + 1]).
  const std::vector<int64_t> begin = SplitExamples(batch.size, m_count);
  for (int b = 0; b + 1 < stages; ++b) {
    acts_[b].resize(m_count);
    grads_[b].resize(m_count);
  }
  {
    absl::MutexLock lock(&mu_);
    forward_ready_.assign(stages, std::vector<bool>(m_count, false));
    backward_ready_.assign(stages, std::vector<bool>(m_count, false));
    failed_ = false;
    first_error_ = absl::OkStatus();
  }
  std::vector<absl::StatusOr<engine::StepResult>> results(m_count, engine::StepResult{});
  const std::function<absl::Status(int)> run = [&](int s) -> absl::Status {
    const absl::Status status =
        RunStage(s, batch, dropout_seed, begin, names, state, out, &results);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      if (first_error_.ok()) first_error_ = status;
      failed_ = true;
    }
    return absl::OkStatus();
  };
  TESSERA_RETURN_IF_ERROR(threads_->RunOnAll(run));
  {
    absl::MutexLock lock(&mu_);
    TESSERA_RETURN_IF_ERROR(first_error_);
  }
  engine::StepResult total;
  for (int m = 0; m < m_count; ++m) {
    const double share =
        static_cast<double>(begin[m + 1] - begin[m]) / static_cast<double>(batch.size);
    total.loss += share * results[m]->loss;
    total.correct += results[m]->correct;
    total.examples += results[m]->examples;
  }
  profile_.step = absl::ToDoubleSeconds(absl::Now() - start);
  profile_.micro_batches = m_count;
  return total;
}

absl::Status PipelineStages::RunStage(int s, const engine::BatchView& batch, uint64_t dropout_seed,
                                      absl::Span<const int64_t> begin,
                                      absl::Span<const std::string> names,
                                      const std::vector<bool>& state,
                                      std::vector<std::vector<float>>* out,
                                      std::vector<absl::StatusOr<engine::StepResult>>* results) {
  const int stages = size();
  const int m_count = static_cast<int>(begin.size()) - 1;
  const bool last = s + 1 == stages;
  engine::Model& model = *stages_[s]->model;
  StageTime& time = profile_.stages[s];
  time = StageTime{};
  TESSERA_RETURN_IF_ERROR(model.UseAccumulatedGrads());  // a failed step's, if one is open
  // Micro-batch m as this stage sees it: its input from the batch or the stage before, and
  // its labels or targets on the last stage only.
  const auto part = [&](int m) {
    engine::BatchView v = SliceBatch(batch, begin[m], begin[m + 1], /*fields=*/nullptr);
    if (s > 0) v.features = acts_[s - 1][m];
    if (!last) {
      v.labels = {};
      v.targets = {};
    }
    return v;
  };
  const auto share = [&](int m) {
    return static_cast<float>(begin[m + 1] - begin[m]) / static_cast<float>(batch.size);
  };
  // Hands micro-batch m on: its output to the next stage, or its input's gradient back.
  const auto signal = [&](std::vector<std::vector<bool>>& ready, int stage, int m) {
    absl::MutexLock lock(&mu_);
    ready[stage][m] = true;
  };
  int next_forward = 0;
  int next_backward = 0;
  while (next_backward < m_count) {
    bool forward = false;
    {
      const absl::Time waited = absl::Now();
      absl::MutexLock lock(&mu_);
      const auto can_forward = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return next_forward < m_count && (s == 0 || forward_ready_[s][next_forward]);
      };
      const auto runnable = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return failed_ || can_forward() ||
               (!last && next_backward < next_forward && backward_ready_[s][next_backward]);
      };
      mu_.Await(absl::Condition(&runnable));
      if (failed_) return absl::OkStatus();  // the failing stage reports its error
      // GPipe: forward passes first, so that the later stages get their inputs early.
      forward = can_forward();
      time.wait += absl::ToDoubleSeconds(absl::Now() - waited);
    }
    const absl::Time computed = absl::Now();
    const int m = forward ? next_forward++ : next_backward++;
    std::vector<float>* input_grad = s > 0 ? &grads_[s - 1][m] : nullptr;
    if (forward) {
      model.set_dropout_seed(dropout_seed +
                             0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(m * stages + s + 1));
    }
    if (forward && !last) {
      TESSERA_RETURN_IF_ERROR(model.StageForward(m, part(m), &acts_[s][m]));
      time.compute += absl::ToDoubleSeconds(absl::Now() - computed);
      signal(forward_ready_, s + 1, m);
      continue;
    }
    if (forward) {  // the last stage: forward, loss and backward at once
      (*results)[m] = model.StageTrain(m, part(m), share(m), input_grad);
      TESSERA_RETURN_IF_ERROR((*results)[m].status());
      ++next_backward;
    } else {
      TESSERA_RETURN_IF_ERROR(model.StageBackward(m, grads_[s][m], input_grad));
    }
    TESSERA_RETURN_IF_ERROR(model.AccumulateGrads(/*first=*/m == 0));
    time.compute += absl::ToDoubleSeconds(absl::Now() - computed);
    if (s > 0) signal(backward_ready_, s - 1, m);
  }
  // This stage's tensors: the accumulated gradients, and the state as the last micro-batch left
  // it.
  const absl::Time copied = absl::Now();
  TESSERA_RETURN_IF_ERROR(model.UseAccumulatedGrads());
  for (size_t k = 0; k < names.size(); ++k) {
    if (owner_[k] != s) continue;
    TESSERA_RETURN_IF_ERROR(state[k] ? model.CopyValueToHost(names[k], &(*out)[k])
                                     : model.CopyGradToHost(names[k], &(*out)[k]));
  }
  time.copy = absl::ToDoubleSeconds(absl::Now() - copied);
  return absl::OkStatus();
}

absl::Status PipelineStages::Install(absl::Span<const std::string> names,
                                     absl::Span<const std::vector<float>> values) {
  if (names.size() != values.size()) {
    return absl::InternalError("PipelineStages::Install: names and values differ in size");
  }
  TESSERA_RETURN_IF_ERROR(MapOwners(names));
  return threads_->RunOnAll([&](int s) -> absl::Status {
    for (size_t k = 0; k < names.size(); ++k) {
      if (owner_[k] != s) continue;
      TESSERA_RETURN_IF_ERROR(stages_[s]->model->CopyValueFromHost(names[k], values[k]));
    }
    return absl::OkStatus();
  });
}

// spec::PlanPipeline refuses models with sparse tables, so no stage holds one.
absl::Status PipelineStages::SetRows(int table, int64_t, absl::Span<const float>) {
  return absl::FailedPreconditionError(absl::StrCat(
      "PipelineStages::SetRows: a pipeline holds no sparse table (table ", table, ")"));
}

absl::Status PipelineStages::CopyRowGrads(int table, std::vector<float>*) const {
  return absl::FailedPreconditionError(absl::StrCat(
      "PipelineStages::CopyRowGrads: a pipeline holds no sparse table (table ", table, ")"));
}

}  // namespace tessera::trainer::internal
