#include "worker/client/tensor_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/placement.h"

namespace tessera {
namespace client {

absl::StatusOr<DenseLayout> LayoutDenseTensor(absl::string_view job, absl::string_view name,
                                              const std::vector<int64_t>& shape,
                                              int64_t partition_bytes, int32_t num_shards) {
  if (name.empty()) return absl::InvalidArgumentError("tensor name is empty");
  if (partition_bytes < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition_bytes must be >= 4, got ", partition_bytes));
  }
  if (num_shards < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_shards must be >= 1, got ", num_shards));
  }
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': shape[", i, "] must be >= 1, got ", shape[i]));
    }
    if (n > (int64_t{1} << 40) / shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': more than 2^40 elements"));
    }
    n *= shape[i];
  }
  DenseLayout layout;
  layout.name = std::string(name);
  layout.shape = shape;
  layout.num_elements = n;
  const int64_t per = partition_bytes / 4;
  const uint32_t count = NumPartitions(n, partition_bytes);
  layout.partitions.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    PartitionSpan p;
    p.index = i;
    p.offset = static_cast<int64_t>(i) * per;
    p.num_elements = std::min(per, n - p.offset);
    p.shard = ShardOfPartition(job, name, i, num_shards);
    layout.partitions.push_back(p);
  }
  return layout;
}

}  // namespace client
}  // namespace tessera
