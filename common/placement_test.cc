#include "common/placement.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(PlacementTest, JumpHashIsInRangeAndMonotone) {
  EXPECT_EQ(JumpConsistentHash(0, 1), 0);
  EXPECT_EQ(JumpConsistentHash(12345, 1), 0);
  for (uint64_t key : {1ULL, 2ULL, 1000ULL, 0xdeadbeefULL}) {
    for (int n = 1; n < 64; ++n) {
      const int32_t b = JumpConsistentHash(key, n);
      ASSERT_GE(b, 0);
      ASSERT_LT(b, n);
      // Monotone: growing the bucket count moves a key only to the new bucket.
      const int32_t next = JumpConsistentHash(key, n + 1);
      EXPECT_TRUE(next == b || next == n) << key << " " << n;
    }
  }
}

TEST(PlacementTest, PartitionsSpreadEvenly) {
  constexpr int kShards = 4;
  std::vector<int> counts(kShards, 0);
  for (uint32_t t = 0; t < 100; ++t) {
    for (uint32_t i = 0; i < 40; ++i) {
      ++counts[ShardOfPartition("job", absl::StrCat("layer_", t, "/kernel"), i, kShards)];
    }
  }
  for (int c : counts) {
    EXPECT_GT(c, 800);
    EXPECT_LT(c, 1200);
  }
  EXPECT_EQ(ShardOfPartition("a", "b", 3, 4), ShardOfPartition("a", "b", 3, 4));
}

TEST(PlacementTest, NumPartitions) {
  EXPECT_EQ(NumPartitions(1, 4 << 20), 1u);
  EXPECT_EQ(NumPartitions(1 << 20, 4 << 20), 1u);
  EXPECT_EQ(NumPartitions((1 << 20) + 1, 4 << 20), 2u);
  EXPECT_EQ(NumPartitions(10, 8), 5u);
}

}  // namespace
}  // namespace tessera
