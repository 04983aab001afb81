// A batch of training or test examples, laid out for the compute engine.
#ifndef TESSERA_WORKER_DATA_BATCH_H_
#define TESSERA_WORKER_DATA_BATCH_H_

#include <cstdint>
#include <vector>

namespace tessera::data {

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
  std::vector<int32_t> labels;
  std::vector<float> targets;
  // Shard-local index of each example, in batch order.
  std::vector<int64_t> indices;
};

}  // namespace tessera::data

#endif  // TESSERA_WORKER_DATA_BATCH_H_
