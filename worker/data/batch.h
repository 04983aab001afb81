// A batch of training or test examples, laid out for the compute engine.
#ifndef TESSERA_WORKER_DATA_BATCH_H_
#define TESSERA_WORKER_DATA_BATCH_H_

#include <cstdint>
#include <vector>

namespace tessera::data {

// One categorical field of a batch: example b's ids are ids[offsets[b], offsets[b+1]) (offsets
// has size + 1 entries starting at 0).
struct FieldBatch {
  std::vector<int64_t> offsets;
  std::vector<int64_t> ids;
};

// `size` examples. Dense datasets fill `features` (size x feature_dim floats, row-major, already
// normalised); sparse datasets fill the CSR triple instead. `targets` always holds each example's
// label as a float; `labels` holds the class ids when the dataset is a classification one.
struct Batch {
  int64_t size = 0;
  int64_t feature_dim = 0;
  std::vector<float> features;
  // Sparse examples: example b's features are ids/values [sparse_offsets[b], sparse_offsets[b+1]).
  std::vector<int64_t> sparse_offsets;
  std::vector<int64_t> sparse_ids;
  std::vector<float> sparse_values;
  // Field datasets (multi-input models): `features` holds size x feature_dim dense features,
  // and each categorical field its bags here.
  std::vector<FieldBatch> fields;
  std::vector<int32_t> labels;
  std::vector<float> targets;
  // Shard-local index of each example, in batch order.
  std::vector<int64_t> indices;
};

}  // namespace tessera::data

#endif  // TESSERA_WORKER_DATA_BATCH_H_
