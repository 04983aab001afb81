// Standalone training: one process, one device, the whole job spec (issue #3). The optimizer is
// the servers' own (kernels/optimizer.h through Backend::ApplyUpdate, kernels/schedule.h for the
// learning rate and global-norm clipping), so a standalone run is the single-device baseline for
// the distributed ones. A sparse table (an embedding_bag's) lives in a host row table
// (kernels/sparse_rows.h) as it would on a shard: each step installs in the model only the rows its
// batch touches, and applies the sparse optimizer to those rows alone.
//
// Life cycle: Create() validates the spec, loads both splits, builds the backend and the model
// (kNew -> kReady); Run() trains and evaluates (kReady -> kDone). Run() may be called once.
#ifndef TESSERA_WORKER_TRAINER_STANDALONE_TRAINER_H_
#define TESSERA_WORKER_TRAINER_STANDALONE_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/sparse_rows.h"
#include "tessera/v1/job_spec.pb.h"
#include "worker/data/dataset.h"
#include "worker/engine/model.h"
#include "worker/trainer/internal/batch_rows.h"
#include "worker/trainer/internal/splits.h"
#include "worker/trainer/internal/thread_tuner.h"
#include "worker/trainer/progress.h"

namespace tessera::trainer {

struct TrainerOptions {
  v1::JobSpec spec;
  // Overrides spec.device when not empty: "auto", "cpu" or "cuda".
  std::string device;
  // CPU threads for the backend; 0: measured on the first steps, the OpenMP default (every core)
  // against 1, keeping the faster (internal/thread_tuner.h).
  int num_threads = 0;
  // CPU backend: the memory the model, its optimizer state and a batch may use (0: the host's
  // physical memory). A job that needs more is RESOURCE_EXHAUSTED before it allocates.
  int64_t memory_limit_bytes = 0;
  // Overrides spec.epochs when >= 0.
  int epochs = -1;
  // Stop after the first evaluation whose test accuracy reaches this (0: never).
  double target_accuracy = 0;
  // Called after every step and at every epoch end, on the training thread (may be empty).
  std::function<void(const Progress&)> on_progress;
  // Called with a line about how the run is set up (the thread count chosen), on the training
  // thread (may be empty).
  std::function<void(const std::string&)> on_note;
};

struct EpochSummary {
  int epoch = 0;      // 1-based
  int64_t steps = 0;  // steps done in the run at the end of this epoch
  double train_loss = 0;
  double train_accuracy = 0;
  bool evaluated = false;
  double test_loss = 0;
  double test_accuracy = 0;
  std::optional<double> test_auc;  // binary tasks (one sigmoid output)
  double train_seconds = 0;        // training time of the run so far, without evaluation
  double elapsed_seconds = 0;      // wall time of the run so far, with evaluation
};

struct TrainResult {
  std::string device;  // the backend's name, "cpu" or "cuda:0"
  int epochs = 0;      // epochs started (the last may be cut short by max_steps)
  int64_t steps = 0;
  int64_t train_samples = 0;
  double train_seconds = 0;
  double samples_per_second = 0;  // train_samples / train_seconds
  double elapsed_seconds = 0;
  double train_loss = 0;  // of the last epoch
  double train_accuracy = 0;
  bool evaluated = false;  // false when the spec has no test split
  double test_loss = 0;
  double test_accuracy = 0;
  std::optional<double> test_auc;
  std::vector<EpochSummary> history;
};

// Not thread-safe: one thread calls Run().
class StandaloneTrainer {
 public:
  // INVALID_ARGUMENT naming the field for a bad spec or override; the readers' errors
  // (NOT_FOUND, DATA_LOSS, INVALID_ARGUMENT naming file and place) for bad data;
  // FAILED_PRECONDITION when CUDA is forced and absent.
  static absl::StatusOr<std::unique_ptr<StandaloneTrainer>> Create(TrainerOptions options);
  ~StandaloneTrainer();

  // Trains until spec.epochs (or the override) or spec.max_steps, evaluating the test split as
  // spec.eval says. FAILED_PRECONDITION when the loss stops being finite.
  absl::StatusOr<TrainResult> Run();

  const engine::Model& model() const { return *model_; }
  const kernels::Backend& backend() const { return *backend_; }
  const data::Dataset& train_data() const { return *train_; }
  // The rows of the model's sparse tables (model().sparse_tables() order).
  const std::vector<kernels::SparseRows>& tables() const { return tables_; }

  // Test loss, accuracy (and AUC for binary tasks) of the current weights (the whole test split).
  // FAILED_PRECONDITION when the spec has no test split.
  absl::StatusOr<internal::SplitScore> Evaluate();

 private:
  explicit StandaloneTrainer(TrainerOptions options) : options_(std::move(options)) {}
  absl::Status Init();
  absl::Status ApplyOptimizer();
  // Installs the rows `batch` touches in the model and returns its view with mapped ids (the
  // plain view for a dense model).
  absl::StatusOr<engine::BatchView> Prepare(const data::Batch& batch);

  TrainerOptions options_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<engine::Model> model_;
  std::shared_ptr<const data::Dataset> train_;
  std::shared_ptr<const data::Dataset> test_;
  kernels::OptimizerParams optimizer_;
  // Per trainable parameter (index into model_->parameters()), its optimizer slots.
  std::vector<int> trainable_;
  std::vector<std::vector<kernels::Tensor>> slots_;
  // Sparse tables: their rows, and the rows of the batch in flight.
  std::vector<kernels::SparseRows> tables_;
  internal::RowMapper mapper_;
  std::vector<internal::BatchRows> batch_rows_;  // per table
  std::vector<engine::SparseFieldView> field_uses_;
  std::vector<float> row_values_;
  int64_t updates_ = 0;
  bool ran_ = false;
  std::unique_ptr<internal::ThreadTuner> tuner_;
};

// One line of JSON (no newline) with the run's results: test_accuracy, test_loss, test_auc (null
// when nothing was evaluated, or not a binary task), train_loss, train_accuracy, epochs, steps,
// samples_per_second, train_seconds, elapsed_seconds, device, job, batch_size, and per-epoch
// history.
std::string TrainResultJson(const TrainResult& result, const v1::JobSpec& spec);

}  // namespace tessera::trainer

#endif  // TESSERA_WORKER_TRAINER_STANDALONE_TRAINER_H_
