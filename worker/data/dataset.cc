#include "worker/data/dataset.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::data {

std::shared_ptr<const Dataset> Dataset::FromBytes(std::vector<int64_t> example_shape,
                                                  std::vector<uint8_t> pixels,
                                                  std::vector<float> labels, int num_classes,
                                                  Normalization normalization,
                                                  int64_t total_examples) {
  std::shared_ptr<Dataset> d(new Dataset());
  d->feature_dim_ = 1;
  for (int64_t dim : example_shape) d->feature_dim_ *= dim;
  d->example_shape_ = std::move(example_shape);
  d->bytes_ = std::move(pixels);
  d->labels_ = std::move(labels);
  d->num_classes_ = num_classes;
  d->total_examples_ = total_examples;
  for (int v = 0; v < 256; ++v) {
    d->byte_table_[v] = (static_cast<float>(v) / normalization.divide_by - normalization.mean) /
                        normalization.stddev;
  }
  return d;
}

std::shared_ptr<const Dataset> Dataset::FromFloats(std::vector<int64_t> example_shape,
                                                   std::vector<float> features,
                                                   std::vector<float> labels, int num_classes,
                                                   int64_t total_examples) {
  std::shared_ptr<Dataset> d(new Dataset());
  d->feature_dim_ = 1;
  for (int64_t dim : example_shape) d->feature_dim_ *= dim;
  d->example_shape_ = std::move(example_shape);
  d->floats_ = std::move(features);
  d->labels_ = std::move(labels);
  d->num_classes_ = num_classes;
  d->total_examples_ = total_examples;
  return d;
}

std::shared_ptr<const Dataset> Dataset::FromSparse(
    int64_t feature_dim, std::vector<int64_t> offsets, std::vector<int64_t> ids,
    std::vector<float> values, std::vector<float> labels, int num_classes, int64_t total_examples) {
  std::shared_ptr<Dataset> d(new Dataset());
  d->sparse_ = true;
  d->feature_dim_ = feature_dim;
  d->example_shape_ = {feature_dim};
  d->offsets_ = std::move(offsets);
  d->ids_ = std::move(ids);
  d->values_ = std::move(values);
  d->labels_ = std::move(labels);
  d->num_classes_ = num_classes;
  d->total_examples_ = total_examples;
  return d;
}

std::shared_ptr<const Dataset> Dataset::FromFields(int64_t feature_dim, std::vector<float> features,
                                                   std::vector<FieldBatch> fields,
                                                   std::vector<float> labels, int num_classes,
                                                   int64_t total_examples) {
  std::shared_ptr<Dataset> d(new Dataset());
  d->feature_dim_ = feature_dim;
  d->example_shape_ = {feature_dim};
  d->floats_ = std::move(features);
  d->fields_ = std::move(fields);
  d->labels_ = std::move(labels);
  d->num_classes_ = num_classes;
  d->total_examples_ = total_examples;
  return d;
}

void Dataset::CopyFeatures(int64_t i, float* out) const {
  if (!bytes_.empty()) {
    const uint8_t* src = bytes_.data() + i * feature_dim_;
    for (int64_t j = 0; j < feature_dim_; ++j) out[j] = byte_table_[src[j]];
  } else {
    std::memcpy(out, floats_.data() + i * feature_dim_, feature_dim_ * sizeof(float));
  }
}

void Dataset::Gather(absl::Span<const int64_t> indices, Batch* batch) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  batch->size = n;
  batch->feature_dim = feature_dim_;
  batch->indices.assign(indices.begin(), indices.end());
  batch->targets.resize(n);
  batch->labels.resize(num_classes_ > 0 ? n : 0);
  for (int64_t b = 0; b < n; ++b) {
    batch->targets[b] = labels_[indices[b]];
    if (num_classes_ > 0) batch->labels[b] = label(indices[b]);
  }
  if (sparse_) {
    batch->features.clear();
    batch->sparse_offsets.resize(n + 1);
    batch->sparse_ids.clear();
    batch->sparse_values.clear();
    batch->sparse_offsets[0] = 0;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t lo = offsets_[indices[b]];
      const int64_t hi = offsets_[indices[b] + 1];
      batch->sparse_ids.insert(batch->sparse_ids.end(), ids_.begin() + lo, ids_.begin() + hi);
      batch->sparse_values.insert(batch->sparse_values.end(), values_.begin() + lo,
                                  values_.begin() + hi);
      batch->sparse_offsets[b + 1] = static_cast<int64_t>(batch->sparse_ids.size());
    }
  } else {
    batch->sparse_offsets.clear();
    batch->sparse_ids.clear();
    batch->sparse_values.clear();
    batch->features.resize(n * feature_dim_);
    for (int64_t b = 0; b < n; ++b) CopyFeatures(indices[b], &batch->features[b * feature_dim_]);
  }
  batch->fields.resize(fields_.size());
  for (size_t f = 0; f < fields_.size(); ++f) {
    const FieldBatch& from = fields_[f];
    FieldBatch& to = batch->fields[f];
    to.offsets.resize(n + 1);
    to.ids.clear();
    to.offsets[0] = 0;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t lo = from.offsets[indices[b]], hi = from.offsets[indices[b] + 1];
      to.ids.insert(to.ids.end(), from.ids.begin() + lo, from.ids.begin() + hi);
      to.offsets[b + 1] = static_cast<int64_t>(to.ids.size());
    }
  }
}

absl::Status ValidateReadOptions(const ReadOptions& options) {
  if (options.world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world: must be >= 1, got ", options.world));
  }
  if (options.rank < 0 || options.rank >= options.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, world=", options.world, "), got ", options.rank));
  }
  const Normalization& n = options.normalization;
  if (!std::isfinite(n.divide_by) || n.divide_by == 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "normalization.divide_by: must be a finite non-zero number, got ", n.divide_by));
  }
  if (!std::isfinite(n.mean)) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalization.mean: must be finite, got ", n.mean));
  }
  if (!std::isfinite(n.stddev) || n.stddev <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalization.stddev: must be a finite number > 0, got ", n.stddev));
  }
  if (options.num_classes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_classes: must be >= 0, got ", options.num_classes));
  }
  if (options.num_features < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_features: must be >= 0, got ", options.num_features));
  }
  if (options.label_column < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("label_column: must be >= 0, got ", options.label_column));
  }
  if (options.delimiter == '\n' || options.delimiter == '\r' || options.delimiter == '\0' ||
      options.delimiter == '"') {
    return absl::InvalidArgumentError("delimiter: must not be a newline, NUL or quote");
  }
  return absl::OkStatus();
}

}  // namespace tessera::data
