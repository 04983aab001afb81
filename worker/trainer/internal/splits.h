// What both trainers (standalone and distributed) do with a job spec's data: read a split, view a
// batch for the engine, and score a split. Private to worker/trainer.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_SPLITS_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_SPLITS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tessera/v1/job_spec.pb.h"
#include "worker/data/dataset.h"
#include "worker/engine/model.h"

namespace tessera::trainer::internal {

// The engine's view of a batch (no copy; valid while `b` lives).
engine::BatchView ViewOf(const data::Batch& b);

// Reads the training (`train`) or test split of spec.dataset, shard rank/world, laid out for
// spec.model (Criteo as fields for a multi-input model). REQUIRES: ValidateJobSpec(spec) is OK.
absl::StatusOr<std::shared_ptr<const data::Dataset>> ReadSplit(const v1::JobSpec& spec, bool train,
                                                               int rank, int world);

bool HasTestSplit(const v1::DatasetSpec& d);

// INVALID_ARGUMENT when a multi-input `model` cannot read `split` (the training split when
// `train`): its dense features and fields must be the model's dense_features and sparse
// features. OK for any other model (its trainer checks the input shape).
absl::Status CheckDataFitsModel(const engine::Model& model, const data::Dataset& split, bool train);

// spec.eval.batch_size, 0 -> 1000.
int64_t EvalBatchSize(const v1::JobSpec& spec);

// Makes the engine's view of a batch about to be scored; for a model with a sparse table it
// installs the rows the batch touches (engine::Model::SetRows) and maps its ids. The view may
// point into buffers of the function's own, valid until its next call.
using PrepareBatch = std::function<absl::StatusOr<engine::BatchView>(const data::Batch&)>;

// A split's score: the mean loss and the correct count, and for a binary task (sigmoid
// cross-entropy with one output, whose loss is then the log loss) the ROC AUC.
struct SplitScore {
  engine::StepResult result;
  std::optional<double> auc;
};

// Scores `model` over the whole of `split`, in order, in batches of `batch_size`. `check`
// (optional) runs before each batch; its error ends the scoring (cancel). `prepare` (optional;
// ViewOf when empty) makes each batch's view.
absl::StatusOr<SplitScore> EvaluateSplit(engine::Model& model,
                                         std::shared_ptr<const data::Dataset> split,
                                         int64_t batch_size,
                                         const std::function<absl::Status()>& check = {},
                                         const PrepareBatch& prepare = {});

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_SPLITS_H_
