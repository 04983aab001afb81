#include "worker/trainer/internal/splits.h"

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/binary_metrics.h"
#include "common/status_macros.h"
#include "worker/data/batch_prefetcher.h"
#include "worker/trainer/job_spec.h"

namespace tessera::trainer::internal {

engine::BatchView ViewOf(const data::Batch& b) {
  engine::BatchView v;
  v.size = b.size;
  v.features = b.features;
  v.sparse_offsets = b.sparse_offsets;
  v.sparse_ids = b.sparse_ids;
  v.sparse_values = b.sparse_values;
  v.labels = b.labels;
  v.targets = b.targets;
  return v;
}

absl::StatusOr<std::shared_ptr<const data::Dataset>> ReadSplit(const v1::JobSpec& spec, bool train,
                                                               int rank, int world) {
  const v1::DatasetSpec& d = spec.dataset();
  data::ReadOptions options = MakeReadOptions(d, rank, world);
  // A multi-input model reads Criteo rows as dense features and fields.
  options.criteo_fields = spec.model().tables_size() > 0;
  switch (d.format()) {
    case v1::DatasetSpec::FORMAT_IDX:
      return train ? data::ReadIdxDataset(d.train_images(), d.train_labels(), options)
                   : data::ReadIdxDataset(d.test_images(), d.test_labels(), options);
    case v1::DatasetSpec::FORMAT_LIBSVM:
      return data::ReadLibsvmDataset(train ? d.train_path() : d.test_path(), options);
    case v1::DatasetSpec::FORMAT_CRITEO:
      return data::ReadCriteoDataset(train ? d.train_path() : d.test_path(), options);
    default:
      return data::ReadCsvDataset(train ? d.train_path() : d.test_path(), options);
  }
}

absl::Status CheckDataFitsModel(const engine::Model& model, const data::Dataset& split,
                                bool train) {
  if (!model.multi_input()) return absl::OkStatus();
  const spec::MultiInputShapes& m = model.multi_input_shapes();
  const char* which = train ? "training" : "test";
  if (split.num_fields() != static_cast<int>(m.fields.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.sparse_features: the model has ", m.fields.size(), ", but the ", which,
                     " data has ", split.num_fields(), " categorical fields per example"));
  }
  if (split.feature_dim() != m.dense_features) {
    return absl::InvalidArgumentError(absl::StrCat("model.dense_features: the model takes ",
                                                   m.dense_features, ", but the ", which,
                                                   " data has ", split.feature_dim()));
  }
  return absl::OkStatus();
}

bool HasTestSplit(const v1::DatasetSpec& d) {
  return d.format() == v1::DatasetSpec::FORMAT_IDX ? !d.test_images().empty()
                                                   : !d.test_path().empty();
}

int64_t EvalBatchSize(const v1::JobSpec& spec) {
  return spec.eval().batch_size() > 0 ? spec.eval().batch_size() : 1000;
}

absl::StatusOr<SplitScore> EvaluateSplit(engine::Model& model,
                                         std::shared_ptr<const data::Dataset> split,
                                         int64_t batch_size,
                                         const std::function<absl::Status()>& check,
                                         const PrepareBatch& prepare) {
  data::BatchPrefetcher::Options o;
  o.batch_size = batch_size;
  o.shuffle = false;
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<data::BatchPrefetcher> batches,
                           data::BatchPrefetcher::Create(std::move(split), o));
  engine::StepResult total;
  double loss_sum = 0;
  const bool binary =
      model.output_dim() == 1 && model.loss() == kernels::LossKind::kSigmoidCrossEntropy;
  std::vector<float> outputs, scores, labels;
  while (std::optional<data::Batch> b = batches->Next()) {
    if (check) TESSERA_RETURN_IF_ERROR(check());
    engine::BatchView view;
    if (prepare) {
      TESSERA_ASSIGN_OR_RETURN(view, prepare(*b));
    } else {
      view = ViewOf(*b);
    }
    TESSERA_ASSIGN_OR_RETURN(engine::StepResult r,
                             model.Evaluate(view, binary ? &outputs : nullptr));
    if (binary) {
      scores.insert(scores.end(), outputs.begin(), outputs.end());
      labels.insert(labels.end(), b->targets.begin(), b->targets.end());
    }
    loss_sum += r.loss * static_cast<double>(r.examples);
    total.correct += r.correct;
    total.examples += r.examples;
    batches->Recycle(std::move(*b));
  }
  total.loss = total.examples > 0 ? loss_sum / static_cast<double>(total.examples) : 0;
  SplitScore score;
  score.result = total;
  if (binary) {
    // The logits rank the examples as the probabilities do.
    const double auc = RocAuc(scores, labels);
    if (std::isfinite(auc)) score.auc = auc;
  }
  return score;
}

}  // namespace tessera::trainer::internal
