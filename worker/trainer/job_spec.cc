#include "worker/trainer/job_spec.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/schedule.h"
#include "worker/engine/model.h"

namespace tessera::trainer {
namespace {

constexpr int32_t kMaxBatchSize = 1 << 20;
// A spec is a few kilobytes; a larger file is not a spec.
constexpr int64_t kMaxSpecBytes = int64_t{16} << 20;

// Collects the first error of a textproto parse with its position (1-based).
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (!has_error_) {
      has_error_ = true;
      // The parser counts from 0.
      error_ = absl::StrCat(line + 1, ":", column + 1, ": ", message);
    }
  }
  void AddWarning(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
  bool has_error() const { return has_error_; }
  const std::string& error() const { return error_; }

 private:
  bool has_error_ = false;
  std::string error_;
};

// Line and column (1-based) of byte `offset` in `text`.
std::string Position(absl::string_view text, size_t offset) {
  int line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return absl::StrCat(line, ":", column);
}

// protobuf's JSON parser reports errors as a message followed by the text around the error and a
// '^' under it ("Unexpected token.\n  \"x\": bad\n         ^"); finds that place in `text`.
absl::optional<size_t> JsonErrorOffset(absl::string_view text, absl::string_view message) {
  // message = summary '\n' context '\n' spaces '^', where the context is a window of the input
  // (it may span lines) and the caret's column is an offset into that window.
  const size_t first = message.find('\n');
  const size_t last = message.rfind('\n');
  if (first == absl::string_view::npos || last <= first) return absl::nullopt;
  absl::string_view context = message.substr(first + 1, last - first - 1);
  absl::string_view caret = message.substr(last + 1);
  const size_t col = caret.find('^');
  if (col == absl::string_view::npos || context.empty()) return absl::nullopt;
  const size_t at = text.find(context);
  if (at == absl::string_view::npos || text.find(context, at + 1) != absl::string_view::npos) {
    return absl::nullopt;
  }
  return at + col;
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') {
      return false;
    }
  }
  return true;
}

absl::Status CheckFile(const char* field, const std::string& path, bool required,
                       const ValidateOptions& options) {
  if (path.empty()) {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("dataset.", field, ": must be set"));
  }
  if (path.size() >= PATH_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.", field, ": a path of ", path.size(),
                                                   " bytes, more than PATH_MAX (", PATH_MAX, ")"));
  }
  if (!options.check_files) return absl::OkStatus();
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.", field, ": file not found: ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.", field, ": not a regular file: ", path));
  }
  if (::access(path.c_str(), R_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.", field, ": file is not readable: ", path));
  }
  return absl::OkStatus();
}

absl::Status ValidateDataset(const v1::DatasetSpec& d, const ValidateOptions& options) {
  switch (d.format()) {
    case v1::DatasetSpec::FORMAT_IDX:
      TESSERA_RETURN_IF_ERROR(CheckFile("train_images", d.train_images(), true, options));
      TESSERA_RETURN_IF_ERROR(CheckFile("train_labels", d.train_labels(), true, options));
      if (d.test_images().empty() != d.test_labels().empty()) {
        return absl::InvalidArgumentError(
            d.test_images().empty() ? "dataset.test_images: must be set with test_labels"
                                    : "dataset.test_labels: must be set with test_images");
      }
      TESSERA_RETURN_IF_ERROR(CheckFile("test_images", d.test_images(), false, options));
      TESSERA_RETURN_IF_ERROR(CheckFile("test_labels", d.test_labels(), false, options));
      if (!d.train_path().empty() || !d.test_path().empty()) {
        return absl::InvalidArgumentError(
            "dataset.train_path: FORMAT_IDX reads train_images/train_labels and "
            "test_images/test_labels, not train_path/test_path");
      }
      break;
    case v1::DatasetSpec::FORMAT_LIBSVM:
    case v1::DatasetSpec::FORMAT_CSV:
      TESSERA_RETURN_IF_ERROR(CheckFile("train_path", d.train_path(), true, options));
      TESSERA_RETURN_IF_ERROR(CheckFile("test_path", d.test_path(), false, options));
      if (!d.train_images().empty() || !d.train_labels().empty() || !d.test_images().empty() ||
          !d.test_labels().empty()) {
        return absl::InvalidArgumentError(
            "dataset.train_images: only FORMAT_IDX reads image/label files; LIBSVM and CSV read "
            "train_path/test_path");
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.format: must be FORMAT_IDX, FORMAT_LIBSVM or FORMAT_CSV, got ",
                       v1::DatasetSpec::Format_Name(d.format()).empty()
                           ? std::to_string(d.format())
                           : v1::DatasetSpec::Format_Name(d.format())));
  }
  if (d.num_classes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.num_classes: must be >= 0, got ", d.num_classes()));
  }
  if (d.num_features() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.num_features: must be >= 0, got ", d.num_features()));
  }
  if (d.label_column() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.label_column: must be >= 0, got ", d.label_column()));
  }
  if (d.delimiter().size() > 1 || d.delimiter() == "\n" || d.delimiter() == "\"") {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.delimiter: must be one character other than newline and quote, got \"",
        absl::CEscape(d.delimiter()), "\""));
  }
  const v1::Normalization& n = d.normalization();
  if (!std::isfinite(n.divide_by())) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.normalization.divide_by: must be finite, got ", n.divide_by()));
  }
  if (!std::isfinite(n.mean())) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.normalization.mean: must be finite, got ", n.mean()));
  }
  if (!std::isfinite(n.stddev()) || n.stddev() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.normalization.stddev: must be a finite number > 0 (0 means 1), got ", n.stddev()));
  }
  if (d.format() == v1::DatasetSpec::FORMAT_LIBSVM && n.mean() != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.normalization.mean: must be 0 for sparse LIBSVM data, got ", n.mean()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source) {
  v1::JobSpec spec;
  absl::string_view body = absl::StripLeadingAsciiWhitespace(text);
  if (!body.empty() && body.front() == '{') {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const auto status = google::protobuf::util::JsonStringToMessage(
        google::protobuf::StringPiece(text.data(), text.size()), &spec, options);
    if (!status.ok()) {
      const std::string message(status.message().data(), status.message().size());
      absl::optional<size_t> offset = JsonErrorOffset(text, message);
      const std::string first_line = message.substr(0, message.find('\n'));
      return absl::InvalidArgumentError(
          absl::StrCat(source, offset.has_value() ? absl::StrCat(":", Position(text, *offset)) : "",
                       ": invalid JSON job spec: ", first_line));
    }
    return spec;
  }
  google::protobuf::TextFormat::Parser parser;
  FirstErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &spec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ":", errors.has_error() ? errors.error() : "invalid textproto job spec"));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("job spec file not found: ", path));
  }
  // A directory opens and reads as empty, which would parse as an empty spec.
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("job spec file is not a regular file: ", path));
  }
  if (st.st_size > kMaxSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("job spec file ", path, " holds ", st.st_size,
                                                   " bytes, more than ", kMaxSpecBytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat("cannot read job spec file: ", path));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read job spec file: ", path));
  return ParseJobSpec(buffer.str(), path);
}

namespace {

constexpr int kMaxWorkers = 1024;
constexpr int64_t kMinPartitionBytes = 1024;
constexpr int64_t kMaxPartitionBytes = int64_t{1} << 30;

absl::Status ValidateDistributedFields(const v1::JobSpec& spec) {
  if (spec.num_workers() < 1 || spec.num_workers() > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers: must be in [1, ", kMaxWorkers, "], got ", spec.num_workers()));
  }
  const std::string mode = absl::AsciiStrToLower(spec.consistency());
  if (!mode.empty() && mode != "bsp" && mode != "ssp" && mode != "asp") {
    return absl::InvalidArgumentError(
        absl::StrCat("consistency: must be \"bsp\", \"ssp\" or \"asp\", got \"",
                     absl::CEscape(spec.consistency()), "\""));
  }
  if (mode == "ssp" && (spec.staleness() < 1 || spec.staleness() > 1000000)) {
    return absl::InvalidArgumentError(
        absl::StrCat("staleness: ssp needs a staleness in [1, 1000000], got ", spec.staleness()));
  }
  if (mode != "ssp" && spec.staleness() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("staleness: only ssp takes a staleness, got ",
                                                   spec.staleness(), " with ",
                                                   mode.empty() ? "bsp" : mode));
  }
  if (spec.partition_bytes() != 0 && (spec.partition_bytes() < kMinPartitionBytes ||
                                      spec.partition_bytes() > kMaxPartitionBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("partition_bytes: must be 0 (4 MiB) or in [",
                                                   kMinPartitionBytes, ", ", kMaxPartitionBytes,
                                                   "], got ", spec.partition_bytes()));
  }
  const std::string encoding = absl::AsciiStrToLower(spec.wire_encoding());
  if (!encoding.empty() && encoding != "fp32" && encoding != "bf16" && encoding != "fp16") {
    return absl::InvalidArgumentError(
        absl::StrCat("wire_encoding: must be \"fp32\", \"bf16\" or \"fp16\", got \"",
                     absl::CEscape(spec.wire_encoding()), "\""));
  }
  if (spec.checkpoint_every_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_every_steps: must be >= 0, got ", spec.checkpoint_every_steps()));
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
  if (!spec.has_model()) return absl::InvalidArgumentError("model: must be set");
  absl::StatusOr<std::vector<engine::LayerInfo>> layers = engine::ValidateModelSpec(spec.model());
  if (!layers.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model.", layers.status().message()));
  }
  if (!spec.has_dataset()) return absl::InvalidArgumentError("dataset: must be set");
  TESSERA_RETURN_IF_ERROR(ValidateDataset(spec.dataset(), options));
  const int64_t outputs = layers->empty() ? 0 : kernels::NumElements(layers->back().output_shape);
  if (spec.model().loss() == v1::LOSS_SOFTMAX_CROSS_ENTROPY &&
      spec.dataset().num_classes() != outputs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.num_classes: softmax cross-entropy needs one class per model output (", outputs,
        "), got ", spec.dataset().num_classes()));
  }
  const bool sparse_model =
      spec.model().layers_size() > 0 && spec.model().layers(0).has_embedding_bag();
  const bool sparse_data = spec.dataset().format() == v1::DatasetSpec::FORMAT_LIBSVM;
  if (sparse_model != sparse_data) {
    return absl::InvalidArgumentError(
        sparse_model ? "dataset.format: a model that starts with an embedding_bag reads sparse "
                       "examples, so the dataset must be FORMAT_LIBSVM"
                     : "dataset.format: FORMAT_LIBSVM examples are sparse, so the model must "
                       "start with an embedding_bag layer");
  }
  if (spec.model().loss() != v1::LOSS_SOFTMAX_CROSS_ENTROPY && outputs != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.loss: ", v1::Loss_Name(spec.model().loss()),
        " reads one target per example from the dataset, so the model needs 1 output, got ",
        outputs));
  }
  if (!spec.has_optimizer()) return absl::InvalidArgumentError("optimizer: must be set");
  TESSERA_RETURN_IF_ERROR(kernels::MakeOptimizerParams(spec.optimizer(), false).status());
  TESSERA_RETURN_IF_ERROR(kernels::ValidateSchedule(spec.schedule()));
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
  if (!spec.device().empty()) {
    absl::StatusOr<kernels::DeviceChoice> device = kernels::ParseDeviceChoice(spec.device());
    if (!device.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device: must be \"auto\", \"cuda\" or \"cpu\", got \"",
                       absl::CEscape(spec.device()), "\""));
    }
  }
  if (spec.eval().every_epochs() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("eval.every_epochs: must be >= 0, got ", spec.eval().every_epochs()));
  }
  if (spec.eval().batch_size() < 0 || spec.eval().batch_size() > kMaxBatchSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval.batch_size: must be in [0, ", kMaxBatchSize, "], got ", spec.eval().batch_size()));
  }
  if (options.distributed) TESSERA_RETURN_IF_ERROR(ValidateDistributedFields(spec));
  return absl::OkStatus();
}

v1::JobConfig MakeJobConfig(const v1::JobSpec& spec) {
  v1::JobConfig config;
  const std::string mode = absl::AsciiStrToLower(spec.consistency());
  if (mode == "ssp") {
    config.set_consistency(v1::CONSISTENCY_SSP);
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
  return config;
}

v1::Encoding WireEncoding(const v1::JobSpec& spec) {
  const std::string e = absl::AsciiStrToLower(spec.wire_encoding());
  if (e == "bf16") return v1::ENCODING_BF16;
  if (e == "fp16") return v1::ENCODING_FP16;
  return v1::ENCODING_FP32;
}

int64_t PartitionBytes(const v1::JobSpec& spec) {
  return spec.partition_bytes() == 0 ? int64_t{4} << 20 : spec.partition_bytes();
}

int NumWorkers(const v1::JobSpec& spec) { return spec.num_workers() == 0 ? 1 : spec.num_workers(); }

data::ReadOptions MakeReadOptions(const v1::DatasetSpec& dataset, int rank, int world) {
  data::ReadOptions o;
  o.rank = rank;
  o.world = world;
  const v1::Normalization& n = dataset.normalization();
  o.normalization.divide_by = n.divide_by() == 0.0f ? 1.0f : n.divide_by();
  o.normalization.mean = n.mean();
  o.normalization.stddev = n.stddev() == 0.0f ? 1.0f : n.stddev();
  o.num_classes = dataset.num_classes();
  o.num_features = dataset.num_features();
  o.zero_based = dataset.zero_based();
  o.label_column = dataset.label_column();
  o.has_header = dataset.has_header();
  o.delimiter = dataset.delimiter().empty() ? ',' : dataset.delimiter()[0];
  return o;
}

}  // namespace tessera::trainer
