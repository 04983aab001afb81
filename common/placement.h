// Placement of partitions and sparse rows on shards (DESIGN.md §2).
#ifndef TESSERA_COMMON_PLACEMENT_H_
#define TESSERA_COMMON_PLACEMENT_H_

#include <cstdint>
#include "absl/strings/string_view.h"

namespace tessera {

// Lamping & Veach, "A Fast, Minimal Memory, Consistent Hash Algorithm" (2014).
// REQUIRES: num_buckets >= 1. Returns a bucket in [0, num_buckets).
int32_t JumpConsistentHash(uint64_t key, int32_t num_buckets);

// 64-bit FNV-1a over the bytes, then a SplitMix64 finaliser. Stable across builds and hosts.
uint64_t StableHash(absl::string_view bytes);

// The shard of dense partition (job, tensor, index).
int32_t ShardOfPartition(absl::string_view job, absl::string_view tensor, uint32_t index,
                         int32_t num_shards);

// The shard of row `row` of sparse table (job, table).
int32_t ShardOfSparseRow(absl::string_view job, absl::string_view table, int64_t row,
                         int32_t num_shards);

// Number of partitions of a dense tensor of num_elements fp32 values cut at partition_bytes.
// REQUIRES: partition_bytes >= 4.
uint32_t NumPartitions(int64_t num_elements, int64_t partition_bytes);

}  // namespace tessera

#endif  // TESSERA_COMMON_PLACEMENT_H_
