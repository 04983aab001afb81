#include "worker/client/tensor_layout.h"

#include <set>
#include <vector>

#include "common/placement.h"
#include "gtest/gtest.h"

namespace tessera {
namespace client {
namespace {

struct LayoutCase {
  std::vector<int64_t> shape;
  int64_t partition_bytes;
  std::vector<int64_t> expected_sizes;
};

TEST(TensorLayoutTest, ExactPartitionSizes) {
  const std::vector<LayoutCase> cases = {
      {{10}, 16, {4, 4, 2}},
      {{3, 4}, 16, {4, 4, 4}},
      {{1}, 4 << 20, {1}},
      {{}, 8, {1}},
      {{5}, 7, {1, 1, 1, 1, 1}},  // 7 bytes hold one fp32 value
      {{1 << 20}, 1 << 20, {1 << 18, 1 << 18, 1 << 18, 1 << 18}},
      {{(1 << 20) + 1}, 4 << 20, {1 << 20, 1}},
  };
  for (const LayoutCase& c : cases) {
    auto layout = LayoutDenseTensor("job", "w", c.shape, c.partition_bytes, 3);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<int64_t> sizes;
    for (const PartitionSpan& p : layout->partitions) sizes.push_back(p.num_elements);
    EXPECT_EQ(sizes, c.expected_sizes) << "partition_bytes " << c.partition_bytes;
  }
}

TEST(TensorLayoutTest, PartitionsTileTheTensorAndFollowPlacement) {
  const int64_t n = 12345;
  for (int32_t shards : {1, 2, 3, 4, 7}) {
    auto layout = LayoutDenseTensor("job-7", "embedding", {n}, 400, shards);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->num_elements, n);
    EXPECT_EQ(layout->partitions.size(), 124u);  // ceil(12345 / 100)
    std::vector<int> covered(n, 0);
    std::set<int32_t> used;
    for (size_t i = 0; i < layout->partitions.size(); ++i) {
      const PartitionSpan& p = layout->partitions[i];
      EXPECT_EQ(p.index, i);
      EXPECT_LE(p.num_elements, 100);
      EXPECT_EQ(p.shard, ShardOfPartition("job-7", "embedding", p.index, shards));
      ASSERT_GE(p.shard, 0);
      ASSERT_LT(p.shard, shards);
      used.insert(p.shard);
      for (int64_t e = p.offset; e < p.offset + p.num_elements; ++e) ++covered[e];
    }
    for (int64_t e = 0; e < n; ++e) ASSERT_EQ(covered[e], 1) << "element " << e;
    EXPECT_EQ(static_cast<int32_t>(used.size()), shards) << "124 partitions use every shard";
  }
}

TEST(TensorLayoutTest, RejectsBadArguments) {
  EXPECT_EQ(LayoutDenseTensor("j", "", {4}, 16, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto zero_dim = LayoutDenseTensor("j", "w", {4, 0}, 16, 1);
  EXPECT_EQ(zero_dim.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero_dim.status().message().find("shape[1]"), absl::string_view::npos);
  auto small = LayoutDenseTensor("j", "w", {4}, 3, 1);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("partition_bytes"), absl::string_view::npos);
  EXPECT_EQ(LayoutDenseTensor("j", "w", {4}, 16, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace client
}  // namespace tessera
