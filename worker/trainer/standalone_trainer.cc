#include "worker/trainer/standalone_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/schedule.h"
#include "spec/job_spec.h"
#include "spec/model_spec.h"
#include "worker/data/batch_prefetcher.h"
#include "worker/trainer/internal/splits.h"
#include "worker/trainer/job_spec.h"

namespace tessera::trainer {
namespace {

using internal::EvalBatchSize;
using internal::EvaluateSplit;
using internal::HasTestSplit;
using internal::ReadSplit;
using internal::ViewOf;

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

absl::StatusOr<std::unique_ptr<StandaloneTrainer>> StandaloneTrainer::Create(
    TrainerOptions options) {
  std::unique_ptr<StandaloneTrainer> t(new StandaloneTrainer(std::move(options)));
  TESSERA_RETURN_IF_ERROR(t->Init());
  return t;
}

StandaloneTrainer::~StandaloneTrainer() = default;

absl::Status StandaloneTrainer::Init() {
  v1::JobSpec& spec = options_.spec;
  if (options_.epochs >= 0) {
    spec.set_epochs(options_.epochs);
    if (options_.epochs > 0) spec.set_max_steps(0);
  }
  if (!options_.device.empty()) spec.set_device(options_.device);
  if (options_.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: must be >= 0, got ", options_.num_threads));
  }
  if (!(options_.target_accuracy >= 0 && options_.target_accuracy <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_accuracy: must be in [0, 1], got ", options_.target_accuracy));
  }
  TESSERA_RETURN_IF_ERROR(spec::ValidateJobSpec(spec));
  optimizer_ = kernels::MakeOptimizerParams(spec.optimizer());

  // Data first: it is the most likely to fail, and it fails before any device work.
  TESSERA_ASSIGN_OR_RETURN(train_, ReadSplit(spec, /*train=*/true, 0, 1));
  if (HasTestSplit(spec.dataset())) {
    TESSERA_ASSIGN_OR_RETURN(test_, ReadSplit(spec, /*train=*/false, 0, 1));
  }

  kernels::BackendOptions backend_options;
  TESSERA_ASSIGN_OR_RETURN(backend_options.device,
                           ParseDeviceChoice(spec.device().empty() ? "auto" : spec.device()));
  backend_options.num_threads = options_.num_threads;
  backend_options.memory_limit_bytes = options_.memory_limit_bytes;
  TESSERA_ASSIGN_OR_RETURN(backend_, kernels::CreateBackend(backend_options));
  tuner_ = std::make_unique<internal::ThreadTuner>(backend_.get(), options_.num_threads);
  TESSERA_ASSIGN_OR_RETURN(model_,
                           engine::Model::Create(spec.model(), backend_.get(), spec.seed()));

  for (const auto& split : {train_, test_}) {
    if (split == nullptr) continue;
    TESSERA_RETURN_IF_ERROR(internal::CheckDataFitsModel(*model_, *split, split == train_));
  }
  for (const auto& split : {train_, test_}) {
    if (split == nullptr || model_->multi_input()) continue;
    // A hashed table (input_dim 0) takes any id.
    const bool fits = model_->sparse_input()
                          ? model_->input_dim() == 0 || split->feature_dim() <= model_->input_dim()
                          : split->feature_dim() == model_->input_dim();
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.input_shape: ", kernels::ShapeString(model_->input_shape()), " takes ",
          model_->input_dim(), model_->sparse_input() ? " embedding rows" : " features",
          " but the ", split == train_ ? "training" : "test", " data has ", split->feature_dim(),
          " features per example"));
    }
  }

  const int num_slots = kernels::NumSlots(optimizer_.kind);
  // Refuse a batch that cannot fit before the first step allocates it. A batch never holds more
  // examples than its split.
  int64_t largest_batch = std::min<int64_t>(spec.batch_size(), train_->size());
  if (test_ != nullptr) {
    largest_batch =
        std::max<int64_t>(largest_batch, std::min<int64_t>(EvalBatchSize(spec), test_->size()));
  }
  const int64_t slot_values = kernels::CheckedProduct(model_->num_trainable_values(), num_slots);
  TESSERA_RETURN_IF_ERROR(
      model_->CheckMemory(std::max<int64_t>(largest_batch, 1),
                          slot_values < 0 ? INT64_MAX : kernels::CheckedProduct(slot_values, 4)));
  const std::vector<engine::Parameter>& params = model_->parameters();
  for (const engine::SparseTableInfo& t : model_->sparse_tables()) {
    tables_.emplace_back(static_cast<uint32_t>(t.dim),
                         spec::RowInitializer(t.shape, spec.seed(), t.name), optimizer_,
                         t.shape.lifecycle);
  }
  batch_rows_.resize(tables_.size());
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    if (!params[i].trainable || params[i].sparse) continue;
    trainable_.push_back(i);
    std::vector<kernels::Tensor> slots;
    for (int s = 0; s < num_slots; ++s) {
      TESSERA_ASSIGN_OR_RETURN(kernels::Tensor slot, backend_->Allocate(params[i].shape));
      TESSERA_RETURN_IF_ERROR(backend_->Fill(slot, kernels::SlotInitialValue(optimizer_, s)));
      slots.push_back(std::move(slot));
    }
    slots_.push_back(std::move(slots));
  }
  return absl::OkStatus();
}

absl::Status StandaloneTrainer::ApplyOptimizer() {
  const v1::JobSpec& spec = options_.spec;
  const std::vector<engine::Parameter>& params = model_->parameters();
  float scale = 1.0f;
  if (spec.clipping().max_global_norm() > 0) {
    double sum = 0;
    for (int i : trainable_) {
      TESSERA_ASSIGN_OR_RETURN(double s, backend_->SquaredNorm(params[i].grad));
      sum += s;
    }
    for (const engine::SparseTableInfo& t : model_->sparse_tables()) {
      if (params[t.parameter].grad.empty()) continue;  // no row this batch
      TESSERA_ASSIGN_OR_RETURN(double s, backend_->SquaredNorm(params[t.parameter].grad));
      sum += s;
    }
    scale = kernels::ClipScale(sum, spec.clipping().max_global_norm());
  }
  const float lr =
      kernels::ScheduledLearningRate(spec.schedule(), optimizer_.learning_rate, updates_);
  ++updates_;
  for (size_t k = 0; k < trainable_.size(); ++k) {
    const engine::Parameter& p = params[trainable_[k]];
    TESSERA_RETURN_IF_ERROR(
        backend_->ApplyUpdate(optimizer_, lr, updates_, scale, p.grad, p.value, slots_[k]));
  }
  // The rows the batch touched, each once, with the sum of its uses' gradients.
  for (size_t t = 0; t < tables_.size(); ++t) {
    const engine::SparseTableInfo& info = model_->sparse_tables()[t];
    TESSERA_RETURN_IF_ERROR(model_->CopyGradToHost(info.name, &row_values_));
    // The table's clock is the step, as a shard's version is under BSP.
    tables_[t].Apply(updates_, lr, scale, batch_rows_[t].rows, row_values_.data());
  }
  return absl::OkStatus();
}

absl::StatusOr<engine::BatchView> StandaloneTrainer::Prepare(const data::Batch& batch) {
  if (tables_.empty()) return ViewOf(batch);
  for (size_t t = 0; t < tables_.size(); ++t) {
    const engine::SparseTableInfo& info = model_->sparse_tables()[t];
    TESSERA_RETURN_IF_ERROR(mapper_.Map(batch, info, &batch_rows_[t]));
    const int64_t count = static_cast<int64_t>(batch_rows_[t].rows.size());
    row_values_.resize(static_cast<size_t>(count * info.dim));
    tables_[t].Gather(batch_rows_[t].rows, row_values_.data());
    TESSERA_RETURN_IF_ERROR(model_->SetRows(static_cast<int>(t), count, row_values_));
  }
  return internal::ViewWithRows(batch, *model_, batch_rows_, &field_uses_);
}

absl::StatusOr<internal::SplitScore> StandaloneTrainer::Evaluate() {
  if (test_ == nullptr) {
    return absl::FailedPreconditionError("the job spec has no test split to evaluate");
  }
  return EvaluateSplit(*model_, test_, EvalBatchSize(options_.spec), {},
                       [this](const data::Batch& b) { return Prepare(b); });
}

absl::StatusOr<TrainResult> StandaloneTrainer::Run() {
  if (ran_) return absl::FailedPreconditionError("StandaloneTrainer::Run() was already called");
  ran_ = true;
  const v1::JobSpec& spec = options_.spec;
  const int64_t batch_size = spec.batch_size();
  const int64_t steps_per_epoch = (train_->size() + batch_size - 1) / batch_size;
  if (steps_per_epoch == 0) {
    return absl::FailedPreconditionError("the training split has no examples");
  }
  int epochs = spec.epochs();
  int64_t total_steps = static_cast<int64_t>(epochs) * steps_per_epoch;
  if (spec.max_steps() > 0) {
    if (epochs == 0 || spec.max_steps() < total_steps) total_steps = spec.max_steps();
    const int64_t needed =
        total_steps / steps_per_epoch + (total_steps % steps_per_epoch != 0 ? 1 : 0);
    if (needed > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_steps: ", total_steps, " steps of ", steps_per_epoch, " per epoch take ", needed,
          " epochs, more than ", std::numeric_limits<int>::max()));
    }
    epochs = static_cast<int>(needed);
  }
  const int eval_every = spec.eval().every_epochs() > 0 ? spec.eval().every_epochs() : 1;

  TrainResult result;
  result.device = backend_->Name();
  const Clock::time_point run_start = Clock::now();
  Clock::duration train_time{};
  int64_t step = 0;
  for (int epoch = 0; epoch < epochs && step < total_steps; ++epoch) {
    data::BatchPrefetcher::Options o;
    o.batch_size = batch_size;
    o.seed = spec.seed();
    o.epoch = epoch;
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<data::BatchPrefetcher> batches,
                             data::BatchPrefetcher::Create(train_, o));
    const Clock::time_point epoch_start = Clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0, step_in_epoch = 0;
    while (step < total_steps) {
      std::optional<data::Batch> b = batches->Next();
      if (!b.has_value()) break;
      TESSERA_ASSIGN_OR_RETURN(const engine::BatchView view, Prepare(*b));
      tuner_->BeforeStep();
      const Clock::time_point step_start = Clock::now();
      TESSERA_ASSIGN_OR_RETURN(engine::StepResult r, model_->TrainStep(view));
      if (!std::isfinite(r.loss)) {
        return absl::FailedPreconditionError(
            absl::StrCat("training diverged: the loss is ", r.loss, " at step ", step + 1,
                         "; lower optimizer.learning_rate or set clipping.max_global_norm"));
      }
      TESSERA_RETURN_IF_ERROR(ApplyOptimizer());
      if (std::optional<std::string> note = tuner_->AfterStep(Seconds(Clock::now() - step_start));
          note.has_value() && options_.on_note) {
        options_.on_note(*note);
      }
      ++step;
      ++step_in_epoch;
      loss_sum += r.loss * static_cast<double>(r.examples);
      correct += r.correct;
      seen += r.examples;
      result.train_samples += r.examples;
      batches->Recycle(std::move(*b));
      if (options_.on_progress) {
        const double elapsed = Seconds(train_time + (Clock::now() - epoch_start));
        Progress p;
        p.epoch = epoch + 1;
        p.epochs = epochs;
        p.step_in_epoch = step_in_epoch;
        p.steps_per_epoch = std::min(steps_per_epoch, total_steps - (step - step_in_epoch));
        p.step = step;
        p.total_steps = total_steps;
        p.loss = loss_sum / static_cast<double>(seen);
        p.accuracy = static_cast<double>(correct) / static_cast<double>(seen);
        p.samples_per_second = elapsed > 0 ? result.train_samples / elapsed : 0;
        p.eta_seconds = elapsed / step * (total_steps - step);
        options_.on_progress(p);
      }
    }
    train_time += Clock::now() - epoch_start;

    EpochSummary summary;
    summary.epoch = epoch + 1;
    summary.steps = step;
    summary.train_loss = seen > 0 ? loss_sum / static_cast<double>(seen) : 0;
    summary.train_accuracy = seen > 0 ? static_cast<double>(correct) / seen : 0;
    const bool last = epoch + 1 == epochs || step >= total_steps;
    if (test_ != nullptr && ((epoch + 1) % eval_every == 0 || last)) {
      TESSERA_ASSIGN_OR_RETURN(internal::SplitScore score, Evaluate());
      const engine::StepResult& eval = score.result;
      summary.test_auc = score.auc;
      summary.evaluated = true;
      summary.test_loss = eval.loss;
      summary.test_accuracy =
          eval.examples > 0 ? static_cast<double>(eval.correct) / eval.examples : 0;
    }
    summary.train_seconds = Seconds(train_time);
    summary.elapsed_seconds = Seconds(Clock::now() - run_start);
    result.history.push_back(summary);
    result.epochs = epoch + 1;
    if (options_.on_progress) {
      Progress p;
      p.epoch_end = true;
      p.epoch = epoch + 1;
      p.epochs = epochs;
      p.step = step;
      p.total_steps = total_steps;
      p.step_in_epoch = step_in_epoch;
      p.steps_per_epoch = step_in_epoch;
      p.loss = summary.train_loss;
      p.accuracy = summary.train_accuracy;
      p.samples_per_second =
          summary.train_seconds > 0 ? result.train_samples / summary.train_seconds : 0;
      p.evaluated = summary.evaluated;
      p.test_loss = summary.test_loss;
      p.test_accuracy = summary.test_accuracy;
      p.test_auc = summary.test_auc;
      p.epoch_seconds = Seconds(Clock::now() - epoch_start);
      options_.on_progress(p);
    }
    if (summary.evaluated && options_.target_accuracy > 0 &&
        summary.test_accuracy >= options_.target_accuracy) {
      break;
    }
  }

  result.steps = step;
  result.train_seconds = Seconds(train_time);
  result.samples_per_second =
      result.train_seconds > 0 ? result.train_samples / result.train_seconds : 0;
  result.elapsed_seconds = Seconds(Clock::now() - run_start);
  if (!result.history.empty()) {
    const EpochSummary& last = result.history.back();
    result.train_loss = last.train_loss;
    result.train_accuracy = last.train_accuracy;
    for (auto it = result.history.rbegin(); it != result.history.rend(); ++it) {
      if (!it->evaluated) continue;
      result.evaluated = true;
      result.test_loss = it->test_loss;
      result.test_accuracy = it->test_accuracy;
      result.test_auc = it->test_auc;
      break;
    }
  }
  return result;
}

namespace {

// A JSON number; null for NaN and infinities, which JSON cannot hold.
std::string Num(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.6g", v);
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace

std::string TrainResultJson(const TrainResult& r, const v1::JobSpec& spec) {
  std::string json = absl::StrCat(
      "{\"job\":", JsonString(spec.name()), ",\"device\":", JsonString(r.device),
      ",\"test_accuracy\":", r.evaluated ? Num(r.test_accuracy) : "null",
      ",\"test_loss\":", r.evaluated ? Num(r.test_loss) : "null",
      ",\"test_auc\":", r.test_auc.has_value() ? Num(*r.test_auc) : "null",
      ",\"train_loss\":", Num(r.train_loss), ",\"train_accuracy\":", Num(r.train_accuracy),
      ",\"epochs\":", r.epochs, ",\"steps\":", r.steps, ",\"batch_size\":", spec.batch_size(),
      ",\"train_samples\":", r.train_samples, ",\"samples_per_second\":", Num(r.samples_per_second),
      ",\"train_seconds\":", Num(r.train_seconds), ",\"elapsed_seconds\":", Num(r.elapsed_seconds),
      ",\"history\":[");
  for (size_t i = 0; i < r.history.size(); ++i) {
    const EpochSummary& e = r.history[i];
    absl::StrAppend(&json, i > 0 ? "," : "", "{\"epoch\":", e.epoch, ",\"steps\":", e.steps,
                    ",\"train_loss\":", Num(e.train_loss),
                    ",\"train_accuracy\":", Num(e.train_accuracy),
                    ",\"test_loss\":", e.evaluated ? Num(e.test_loss) : "null",
                    ",\"test_accuracy\":", e.evaluated ? Num(e.test_accuracy) : "null",
                    ",\"test_auc\":", e.test_auc.has_value() ? Num(*e.test_auc) : "null",
                    ",\"train_seconds\":", Num(e.train_seconds),
                    ",\"elapsed_seconds\":", Num(e.elapsed_seconds), "}");
  }
  json += "]}";
  return json;
}

}  // namespace tessera::trainer
