// In-memory datasets and the readers that fill them (DESIGN.md §5, "Data").
//
// A Dataset holds one split (train or test) of one worker: only the examples of its shard, the
// ones whose position p in the file has p % world == rank. Shards of the same file are disjoint
// and together cover it. Readers parse the whole file (so every worker reports the same error for
// a bad file) and keep only their shard.
//
// Readers:
//   ReadIdxDataset     IDX image and label files (MNIST, Fashion-MNIST), gzip or plain.
//   ReadLibsvmDataset  LIBSVM sparse text: "label index:value index:value ...".
//   ReadCsvDataset     CSV with one label column, every other column a dense feature.
//   ReadCriteoDataset  Criteo TSV click logs, as one bag of hashed ids per example.
// Errors name the file and the place: a byte offset for IDX ("at byte 16"), a line (and column for
// CSV) for text. A missing file is NOT_FOUND, a file that ends early or fails its gzip check is
// DATA_LOSS, and anything else malformed is INVALID_ARGUMENT.
#ifndef TESSERA_WORKER_DATA_DATASET_H_
#define TESSERA_WORKER_DATA_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/data/batch.h"

namespace tessera::data {

// x' = (x / divide_by - mean) / stddev, applied to every dense feature and sparse value.
struct Normalization {
  float divide_by = 1.0f;
  float mean = 0.0f;
  float stddev = 1.0f;
};

struct ReadOptions {
  // This worker's shard: examples at positions p with p % world == rank.
  int rank = 0;
  int world = 1;
  Normalization normalization;
  // > 0: labels are class ids in [0, num_classes) (LIBSVM's -1 becomes 0 when num_classes is 2).
  // 0: labels are real-valued targets.
  int num_classes = 0;
  // LIBSVM: the feature count; 0 infers it as the largest index + 1 seen in the file.
  int64_t num_features = 0;
  // LIBSVM: indices start at 0 instead of LIBSVM's usual 1.
  bool zero_based = false;
  // CSV: the column (0-based) that holds the label, whether the first line is a header, and the
  // field separator.
  int label_column = 0;
  bool has_header = false;
  char delimiter = ',';
  // Criteo: lay each example out as fields (a multi-input model's input) rather than as one bag.
  bool criteo_fields = false;
};

// Immutable after construction; safe to read from several threads.
class Dataset {
 public:
  // Dense examples whose raw values are bytes (IDX ubyte): `pixels` holds size x feature_dim bytes.
  static std::shared_ptr<const Dataset> FromBytes(std::vector<int64_t> example_shape,
                                                  std::vector<uint8_t> pixels,
                                                  std::vector<float> labels, int num_classes,
                                                  Normalization normalization,
                                                  int64_t total_examples);
  // Dense examples as floats, already normalised: size x feature_dim floats.
  static std::shared_ptr<const Dataset> FromFloats(std::vector<int64_t> example_shape,
                                                   std::vector<float> features,
                                                   std::vector<float> labels, int num_classes,
                                                   int64_t total_examples);
  // Sparse examples in CSR form (offsets has size + 1 entries), values already normalised.
  static std::shared_ptr<const Dataset> FromSparse(int64_t feature_dim,
                                                   std::vector<int64_t> offsets,
                                                   std::vector<int64_t> ids,
                                                   std::vector<float> values,
                                                   std::vector<float> labels, int num_classes,
                                                   int64_t total_examples);

  // Examples as dense features (size x feature_dim floats, already normalised) and categorical
  // fields, each in CSR form (offsets with size + 1 entries).
  static std::shared_ptr<const Dataset> FromFields(int64_t feature_dim, std::vector<float> features,
                                                   std::vector<FieldBatch> fields,
                                                   std::vector<float> labels, int num_classes,
                                                   int64_t total_examples);

  // Examples in this shard.
  int64_t size() const { return static_cast<int64_t>(labels_.size()); }
  // Examples in the whole file, across all shards.
  int64_t total_examples() const { return total_examples_; }
  // Features per example (dense), or the id space (sparse).
  int64_t feature_dim() const { return feature_dim_; }
  // The shape of one dense example, e.g. {28, 28} for Fashion-MNIST; {feature_dim} otherwise.
  const std::vector<int64_t>& example_shape() const { return example_shape_; }
  bool sparse() const { return sparse_; }
  // The categorical fields of a field dataset (FromFields), 0 otherwise.
  int num_fields() const { return static_cast<int>(fields_.size()); }
  int num_classes() const { return num_classes_; }

  float target(int64_t i) const { return labels_[i]; }
  int32_t label(int64_t i) const { return static_cast<int32_t>(labels_[i]); }
  // Writes example i's normalised dense features to out[0, feature_dim). REQUIRES: !sparse().
  void CopyFeatures(int64_t i, float* out) const;

  // Replaces the contents of *batch with the examples at `indices` (shard-local), reusing its
  // buffers' capacity.
  void Gather(absl::Span<const int64_t> indices, Batch* batch) const;

 private:
  Dataset() = default;

  std::vector<int64_t> example_shape_;
  int64_t feature_dim_ = 0;
  int64_t total_examples_ = 0;
  int num_classes_ = 0;
  bool sparse_ = false;
  // Dense storage: bytes with a 256-entry normalisation table, or floats.
  std::vector<uint8_t> bytes_;
  float byte_table_[256] = {};
  std::vector<float> floats_;
  // Sparse storage (CSR).
  std::vector<int64_t> offsets_;
  std::vector<int64_t> ids_;
  std::vector<float> values_;
  // Field storage (dense features in floats_).
  std::vector<FieldBatch> fields_;
  std::vector<float> labels_;
};

// Reads an IDX image file (ubyte, or any IDX element type, converted to float) and its IDX label
// file. The first dimension counts examples; the rest is example_shape. The counts must match.
absl::StatusOr<std::shared_ptr<const Dataset>> ReadIdxDataset(const std::string& images_path,
                                                              const std::string& labels_path,
                                                              const ReadOptions& options);

// Reads a LIBSVM file (plain or gzip). Blank lines and '#' comments are skipped; indices must be
// strictly increasing within a line.
absl::StatusOr<std::shared_ptr<const Dataset>> ReadLibsvmDataset(const std::string& path,
                                                                 const ReadOptions& options);

// Criteo TSV: a label, 13 integer features (I1..I13) and 26 categorical fields (C1..C26, hex
// strings), tab-separated, any of the 39 features empty. With options.criteo_fields, each
// example is 13 dense features, log(1 + x) of I1..I13 (0 for x <= 0 and empty ones), and 26
// fields of the one id CriteoFeatureId(13 + c - 1, v) of C_c = v (no id when empty). Otherwise
// each example is one bag of hashed ids:
// categorical field C_c with value v gives id CriteoFeatureId(12 + c, v) with value 1; integer
// feature I_i with value x > 0 gives id CriteoFeatureId(i - 1, 0) with value log(1 + x) (the
// DLRM reference's transform; x <= 0 and empty features add nothing). feature_dim() is 0 (hashed
// ids). Unlike the other readers, a worker parses only its own byte range of the file,
// [rank * size / world, (rank + 1) * size / world), each line belonging to the range its first
// byte lies in, so its shard is a contiguous run of lines; the whole file is only scanned for
// newlines, so total_examples() is the file's line count on every rank. Errors name the line
// (lines outside the range are not checked). A gzip file is decompressed whole first.
inline constexpr int kCriteoIntegerFields = 13;
inline constexpr int kCriteoCategoricalFields = 26;
inline constexpr int kCriteoFields = 1 + kCriteoIntegerFields + kCriteoCategoricalFields;
absl::StatusOr<std::shared_ptr<const Dataset>> ReadCriteoDataset(const std::string& path,
                                                                 const ReadOptions& options);
// The row id of feature `field` (0-12: I1..I13, 13-38: C1..C26) with value `value`: a SplitMix64
// mix of both, in [0, 2^63). Stable across builds and hosts.
int64_t CriteoFeatureId(int field, uint64_t value);

// Reads a CSV file (plain or gzip); every row must have the same number of fields.
absl::StatusOr<std::shared_ptr<const Dataset>> ReadCsvDataset(const std::string& path,
                                                              const ReadOptions& options);

// INVALID_ARGUMENT naming the field when rank/world, normalisation or num_classes are out of range.
absl::Status ValidateReadOptions(const ReadOptions& options);

}  // namespace tessera::data

#endif  // TESSERA_WORKER_DATA_DATASET_H_
