#include "common/placement.h"

namespace tessera {
namespace {

uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(uint64_t h, absl::string_view bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;

}  // namespace

int32_t JumpConsistentHash(uint64_t key, int32_t num_buckets) {
  int64_t b = -1;
  int64_t j = 0;
  while (j < num_buckets) {
    b = j;
    key = key * 2862933555777941757ULL + 1;
    j = static_cast<int64_t>((b + 1) *
                             (static_cast<double>(1LL << 31) / static_cast<double>((key >> 33) + 1)));
  }
  return static_cast<int32_t>(b);
}

uint64_t StableHash(absl::string_view bytes) { return Mix64(Fnv1a(kFnvOffset, bytes)); }

int32_t ShardOfPartition(absl::string_view job, absl::string_view tensor, uint32_t index,
                         int32_t num_shards) {
  uint64_t h = Fnv1a(kFnvOffset, job);
  h = Fnv1a(h ^ 0xff, tensor);
  return JumpConsistentHash(Mix64(h ^ (static_cast<uint64_t>(index) << 1)), num_shards);
}

int32_t ShardOfSparseRow(absl::string_view job, absl::string_view table, int64_t row,
                         int32_t num_shards) {
  uint64_t h = Fnv1a(kFnvOffset, job);
  h = Fnv1a(h ^ 0xfe, table);
  return JumpConsistentHash(Mix64(h ^ Mix64(static_cast<uint64_t>(row))), num_shards);
}

uint32_t NumPartitions(int64_t num_elements, int64_t partition_bytes) {
  const int64_t per = partition_bytes / 4;
  if (num_elements <= 0) return 1;
  return static_cast<uint32_t>((num_elements + per - 1) / per);
}

}  // namespace tessera
