// How a dense tensor is cut into partitions and where each partition lives (DESIGN.md §2).
#ifndef TESSERA_WORKER_CLIENT_TENSOR_LAYOUT_H_
#define TESSERA_WORKER_CLIENT_TENSOR_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tessera {
namespace client {

// Elements [offset, offset + num_elements) of a tensor, stored as partition `index` on `shard`.
struct PartitionSpan {
  uint32_t index = 0;
  int64_t offset = 0;
  int64_t num_elements = 0;
  int32_t shard = 0;
};

struct DenseLayout {
  std::string name;
  std::vector<int64_t> shape;
  int64_t num_elements = 0;
  // In index order; they tile [0, num_elements) without gaps or overlap.
  std::vector<PartitionSpan> partitions;
};

// Cuts tensor `name` of `shape` (fp32) into partitions of at most partition_bytes / 4 elements
// (the last one takes the rest) and places each with ShardOfPartition(job, name, index, shards).
// An empty shape is a scalar. INVALID_ARGUMENT, naming the field and value, for an empty name, a
// dimension < 1, partition_bytes < 4 or num_shards < 1.
absl::StatusOr<DenseLayout> LayoutDenseTensor(absl::string_view job, absl::string_view name,
                                              const std::vector<int64_t>& shape,
                                              int64_t partition_bytes, int32_t num_shards);

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_TENSOR_LAYOUT_H_
