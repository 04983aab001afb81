#include "spec/job_spec.h"

#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/gradient_compression.h"
#include "common/status_macros.h"
#include "spec/dataset_spec.h"
#include "spec/device_spec.h"
#include "spec/model_spec.h"
#include "spec/optimizer_spec.h"
#include "spec/schedule_spec.h"

namespace tessera::spec {
namespace {

constexpr int32_t kMaxBatchSize = 1 << 20;
constexpr int kMaxWorkers = 1024;
constexpr int64_t kMinPartitionBytes = 1024;
constexpr int64_t kMaxPartitionBytes = int64_t{1} << 30;
// A Criteo row's integer and categorical features (worker/data/dataset.h reads them).
constexpr int64_t kCriteoDenseFeatures = 13;
constexpr int kCriteoCategoricalFields = 26;

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return false;
    }
  }
  return true;
}

// A multi-input model reads dense features and categorical fields: the Criteo layout.
absl::Status ValidateMultiInputData(const v1::JobSpec& spec, const ModelShapes& model) {
  const v1::DatasetSpec::Format format = spec.dataset().format();
  if (format != v1::DatasetSpec::FORMAT_CRITEO) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.format: a multi-input model (model.tables) reads dense features and categorical "
        "fields, which FORMAT_CRITEO data has; got ",
        v1::DatasetSpec::Format_Name(format)));
  }
  if (model.multi.dense_features != kCriteoDenseFeatures) {
    return absl::InvalidArgumentError(absl::StrCat("model.dense_features: FORMAT_CRITEO rows have ",
                                                   kCriteoDenseFeatures, " integer features, got ",
                                                   model.multi.dense_features));
  }
  if (static_cast<int>(model.multi.fields.size()) != kCriteoCategoricalFields) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.sparse_features: FORMAT_CRITEO rows have ", kCriteoCategoricalFields,
        " categorical fields, one sparse feature each; the model has ", model.multi.fields.size()));
  }
  return absl::OkStatus();
}

// The model, the dataset, and what ties them: one class per output for softmax, one target per
// example for the other losses, sparse examples exactly for a model that starts with an
// embedding_bag.
absl::Status ValidateModelAndData(const v1::JobSpec& spec, const ValidateOptions& options) {
  if (!spec.has_model()) return absl::InvalidArgumentError("model: must be set");
  absl::StatusOr<ModelShapes> model = InferModelShapes(spec.model());
  if (!model.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model.", model.status().message()));
  }
  if (!spec.has_dataset()) return absl::InvalidArgumentError("dataset: must be set");
  DatasetChecks checks;
  checks.check_files = options.check_files;
  checks.absolute_paths = options.distributed;
  checks.roots = options.dataset_roots;
  TESSERA_RETURN_IF_ERROR(ValidateDataset(spec.dataset(), checks));
  const int64_t outputs = model->output_dim;
  if (spec.model().loss() == v1::LOSS_SOFTMAX_CROSS_ENTROPY &&
      spec.dataset().num_classes() != outputs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.num_classes: softmax cross-entropy needs one class per model output (", outputs,
        "), got ", spec.dataset().num_classes()));
  }
  const v1::DatasetSpec::Format format = spec.dataset().format();
  if (model->multi_input) {
    TESSERA_RETURN_IF_ERROR(ValidateMultiInputData(spec, *model));
  }
  const bool sparse_model = model->sparse_input || model->multi_input;
  const bool sparse_data =
      format == v1::DatasetSpec::FORMAT_LIBSVM || format == v1::DatasetSpec::FORMAT_CRITEO;
  if (sparse_model != sparse_data) {
    return absl::InvalidArgumentError(absl::StrCat(
        sparse_model ? "dataset.format: a model that starts with an embedding_bag reads sparse "
                       "examples, so the dataset must be FORMAT_LIBSVM or FORMAT_CRITEO"
                     : absl::StrCat("dataset.format: ", v1::DatasetSpec::Format_Name(format),
                                    " examples are sparse, so the model must start with an "
                                    "embedding_bag layer")));
  }
  if (format == v1::DatasetSpec::FORMAT_CRITEO && !model->multi_input &&
      spec.model().layers(0).embedding_bag().num_rows() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.layers[0] (", model->layers[0].name,
                     "): embedding_bag.num_rows must be 0 (hashed "
                     "ids) for FORMAT_CRITEO data, whose ids are 63-bit hashes, got ",
                     spec.model().layers(0).embedding_bag().num_rows()));
  }
  if (sparse_model && spec.has_optimizer()) {
    // The shards apply the job's optimizer to the table's rows too.
    absl::Status sparse_optimizer = ValidateOptimizer(spec.optimizer(), /*sparse=*/true);
    if (!sparse_optimizer.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          sparse_optimizer.message(),
          model->multi_input ? std::string(" (the model's tables are sparse tables)")
                             : absl::StrCat(" (the model's table ", model->layers[0].name,
                                            "/embeddings is a sparse table)")));
    }
  }
  if (spec.model().loss() != v1::LOSS_SOFTMAX_CROSS_ENTROPY && outputs != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.loss: ", v1::Loss_Name(spec.model().loss()),
        " reads one target per example from the dataset, so the model needs 1 output, got ",
        outputs));
  }
  return absl::OkStatus();
}

// The optimizer, its schedule and clipping, the batch and the length of the run, the device and
// evaluation.
absl::Status ValidateTraining(const v1::JobSpec& spec) {
  if (!spec.has_optimizer()) return absl::InvalidArgumentError("optimizer: must be set");
  TESSERA_RETURN_IF_ERROR(ValidateOptimizer(spec.optimizer(), /*sparse=*/false));
  TESSERA_RETURN_IF_ERROR(ValidateSchedule(spec.schedule()));
  if (!std::isfinite(spec.clipping().max_global_norm()) || spec.clipping().max_global_norm() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("clipping.max_global_norm: must be a finite number >= 0, got ",
                     spec.clipping().max_global_norm()));
  }
  if (spec.batch_size() < 1 || spec.batch_size() > kMaxBatchSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size: must be in [1, ", kMaxBatchSize, "], got ", spec.batch_size()));
  }
  if (spec.epochs() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("epochs: must be >= 0, got ", spec.epochs()));
  }
  if (spec.max_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_steps: must be >= 0, got ", spec.max_steps()));
  }
  if (spec.epochs() == 0 && spec.max_steps() == 0) {
    return absl::InvalidArgumentError("epochs: epochs or max_steps must be > 0, both are 0");
  }
  if (!spec.device().empty() && !ParseDeviceChoice(spec.device()).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: must be \"auto\", \"cuda\" or \"cpu\", got \"",
                     absl::CEscape(spec.device()), "\""));
  }
  if (spec.eval().every_epochs() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("eval.every_epochs: must be >= 0, got ", spec.eval().every_epochs()));
  }
  if (spec.eval().batch_size() < 0 || spec.eval().batch_size() > kMaxBatchSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval.batch_size: must be in [0, ", kMaxBatchSize, "], got ", spec.eval().batch_size()));
  }
  return absl::OkStatus();
}

absl::Status ValidateDistributedFields(const v1::JobSpec& spec) {
  if (spec.num_workers() < 1 || spec.num_workers() > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers: must be in [1, ", kMaxWorkers, "], got ", spec.num_workers()));
  }
  const std::string mode = absl::AsciiStrToLower(spec.consistency());
  if (!mode.empty() && mode != "bsp" && mode != "ssp" && mode != "asp" && mode != "hybrid") {
    return absl::InvalidArgumentError(
        absl::StrCat("consistency: must be \"bsp\", \"ssp\", \"asp\" or \"hybrid\", got \"",
                     absl::CEscape(spec.consistency()), "\""));
  }
  const bool stale = mode == "ssp" || mode == "hybrid";
  if (stale && (spec.staleness() < 1 || spec.staleness() > 1000000)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staleness: ", mode, " needs a staleness in [1, 1000000], got ", spec.staleness()));
  }
  if (!stale && spec.staleness() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("staleness: only ssp and hybrid take a staleness, got ", spec.staleness(),
                     " with ", mode.empty() ? "bsp" : mode));
  }
  if (mode == "hybrid") {
    // (A model that does not infer gets its own error from the model's checks.)
    absl::StatusOr<ModelShapes> model = InferModelShapes(spec.model());
    if (model.ok() && !model->sparse_input && !model->multi_input) {
      return absl::InvalidArgumentError(
          "consistency: hybrid keeps the dense parameters synchronous and lets the embedding "
          "tables lag; the model has no embedding table (use bsp or ssp)");
    }
  }
  if (spec.partition_bytes() != 0 && (spec.partition_bytes() < kMinPartitionBytes ||
                                      spec.partition_bytes() > kMaxPartitionBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("partition_bytes: must be 0 (4 MiB) or in [",
                                                   kMinPartitionBytes, ", ", kMaxPartitionBytes,
                                                   "], got ", spec.partition_bytes()));
  }
  const std::string encoding = absl::AsciiStrToLower(spec.wire_encoding());
  if (!encoding.empty() && encoding != "fp32" && encoding != "bf16" && encoding != "fp16" &&
      encoding != "sign1" && encoding != "topk") {
    return absl::InvalidArgumentError(absl::StrCat(
        "wire_encoding: must be \"fp32\", \"bf16\", \"fp16\", \"sign1\" or \"topk\", got \"",
        absl::CEscape(spec.wire_encoding()), "\""));
  }
  if (spec.topk_fraction() != 0 && encoding != "topk") {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_fraction: set to ", spec.topk_fraction(), " but wire_encoding is \"",
                     absl::CEscape(spec.wire_encoding()), "\"; it applies to \"topk\" only"));
  }
  if (!(spec.topk_fraction() >= 0 && spec.topk_fraction() <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk_fraction: must be in (0, 1] (or 0 for 0.01), got ", spec.topk_fraction()));
  }
  const std::string pull = absl::AsciiStrToLower(spec.pull_encoding());
  const bool delta = pull == "delta_topk" || pull == "delta_int8";
  if (!pull.empty() && pull != "fp32" && pull != "bf16" && pull != "fp16" && !delta) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull_encoding: must be \"fp32\", \"bf16\", \"fp16\", \"delta_topk\" or "
                     "\"delta_int8\", got \"",
                     absl::CEscape(spec.pull_encoding()), "\""));
  }
  if (delta && !mode.empty() && mode != "bsp" && mode != "hybrid") {
    // A delta is of the weights every worker holds, which they share only when they pull in
    // step: under SSP and ASP most pulls would fall back to whole weights.
    return absl::InvalidArgumentError(absl::StrCat(
        "pull_encoding: \"", pull, "\" needs consistency \"bsp\" or \"hybrid\", got \"",
        absl::CEscape(spec.consistency()), "\""));
  }
  if (spec.pull_topk_fraction() != 0 && pull != "delta_topk") {
    return absl::InvalidArgumentError(absl::StrCat(
        "pull_topk_fraction: set to ", spec.pull_topk_fraction(), " but pull_encoding is \"",
        absl::CEscape(spec.pull_encoding()), "\"; it applies to \"delta_topk\" only"));
  }
  if (!(spec.pull_topk_fraction() >= 0 && spec.pull_topk_fraction() <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pull_topk_fraction: must be in (0, 1] (or 0 for 0.1), got ", spec.pull_topk_fraction()));
  }
  if (spec.checkpoint_every_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_every_steps: must be >= 0, got ", spec.checkpoint_every_steps()));
  }
  if (spec.stall_timeout_seconds() != 0 &&
      (spec.stall_timeout_seconds() < kMinStallTimeoutSeconds ||
       spec.stall_timeout_seconds() > kMaxStallTimeoutSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stall_timeout_seconds: must be 0 (", kDefaultStallTimeoutSeconds,
                     " s) or in [", kMinStallTimeoutSeconds, ", ", kMaxStallTimeoutSeconds,
                     "], got ", spec.stall_timeout_seconds()));
  }
  const std::string policy = absl::AsciiStrToLower(spec.stall_policy());
  if (!policy.empty() && policy != "warn" && policy != "evict") {
    return absl::InvalidArgumentError(
        absl::StrCat("stall_policy: must be \"warn\" or \"evict\", got \"",
                     absl::CEscape(spec.stall_policy()), "\""));
  }
  if (spec.replication() < 0 || spec.replication() > kMaxReplication) {
    return absl::InvalidArgumentError(
        absl::StrCat("replication: must be 0 or 1 (one copy) or 2 (a primary and a backup), got ",
                     spec.replication()));
  }
  if (spec.keep_checkpoints() < 0 || spec.keep_checkpoints() > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keep_checkpoints: must be in [0, 1000] (0 means 3), got ", spec.keep_checkpoints()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const v1::JobSpec& spec, const ValidateOptions& options) {
  if (!ValidName(spec.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: must be 1 to 128 letters, digits, '_', '-' or '.', got \"",
                     absl::CEscape(spec.name()), "\""));
  }
  TESSERA_RETURN_IF_ERROR(ValidateModelAndData(spec, options));
  TESSERA_RETURN_IF_ERROR(ValidateTraining(spec));
  if (options.distributed) TESSERA_RETURN_IF_ERROR(ValidateDistributedFields(spec));
  return absl::OkStatus();
}

absl::Duration StallTimeout(const v1::JobSpec& spec) {
  return absl::Seconds(spec.stall_timeout_seconds() > 0 ? spec.stall_timeout_seconds()
                                                        : kDefaultStallTimeoutSeconds);
}

int Replicas(const v1::JobSpec& spec) { return spec.replication() >= 2 ? 2 : 1; }

bool EvictsStalledRanks(const v1::JobSpec& spec) {
  return absl::AsciiStrToLower(spec.stall_policy()) == "evict";
}

v1::JobConfig MakeJobConfig(const v1::JobSpec& spec) {
  v1::JobConfig config;
  const std::string mode = absl::AsciiStrToLower(spec.consistency());
  if (mode == "ssp") {
    config.set_consistency(v1::CONSISTENCY_SSP);
    config.set_staleness(static_cast<uint32_t>(spec.staleness()));
  } else if (mode == "hybrid") {
    config.set_consistency(v1::CONSISTENCY_HYBRID);
    config.set_staleness(static_cast<uint32_t>(spec.staleness()));
  } else if (mode == "asp") {
    config.set_consistency(v1::CONSISTENCY_ASP);
  } else {
    config.set_consistency(v1::CONSISTENCY_BSP);
  }
  config.set_num_workers(static_cast<uint32_t>(NumWorkers(spec)));
  *config.mutable_optimizer() = spec.optimizer();
  *config.mutable_schedule() = spec.schedule();
  config.set_checkpoint_every_steps(spec.checkpoint_every_steps());
  if (PullEncoding(spec) == v1::ENCODING_TOPK)
    config.set_pull_topk_fraction(PullTopKFraction(spec));
  return config;
}

v1::Encoding PushEncoding(const v1::JobSpec& spec) {
  const std::string e = absl::AsciiStrToLower(spec.wire_encoding());
  if (e == "bf16") return v1::ENCODING_BF16;
  if (e == "fp16") return v1::ENCODING_FP16;
  if (e == "sign1") return v1::ENCODING_SIGN1;
  if (e == "topk") return v1::ENCODING_TOPK;
  return v1::ENCODING_FP32;
}

v1::Encoding PullEncoding(const v1::JobSpec& spec) {
  const std::string e = absl::AsciiStrToLower(spec.pull_encoding());
  if (e == "fp32") return v1::ENCODING_FP32;
  if (e == "bf16") return v1::ENCODING_BF16;
  if (e == "fp16") return v1::ENCODING_FP16;
  if (e == "delta_topk") return v1::ENCODING_TOPK;
  if (e == "delta_int8") return v1::ENCODING_INT8;
  const v1::Encoding push = PushEncoding(spec);
  return IsCompressed(push) ? v1::ENCODING_BF16 : push;
}

double PullTopKFraction(const v1::JobSpec& spec) {
  return spec.pull_topk_fraction() == 0 ? 0.1 : spec.pull_topk_fraction();
}

double TopKFraction(const v1::JobSpec& spec) {
  return spec.topk_fraction() == 0 ? 0.01 : spec.topk_fraction();
}

int64_t PartitionBytes(const v1::JobSpec& spec) {
  return spec.partition_bytes() == 0 ? int64_t{4} << 20 : spec.partition_bytes();
}

int NumWorkers(const v1::JobSpec& spec) { return spec.num_workers() == 0 ? 1 : spec.num_workers(); }

}  // namespace tessera::spec
