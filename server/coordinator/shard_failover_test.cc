// When a replicated job may run on without a shard (internal/shard_failover.h).
#include "server/coordinator/internal/shard_failover.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator::internal {
namespace {

using ::testing::ElementsAre;

v1::Job JobWithShards(int n, int replication) {
  v1::Job job;
  job.mutable_spec()->set_replication(replication);
  for (int i = 0; i < n; ++i) job.add_shard_addresses("127.0.0.1:" + std::to_string(4000 + i));
  return job;
}

TEST(ShardFailoverTest, OneCopyNeverFailsOver) {
  EXPECT_FALSE(CanFailOver(JobWithShards(3, 0), 1));
  EXPECT_FALSE(CanFailOver(JobWithShards(3, 1), 1));
  EXPECT_TRUE(CanFailOver(JobWithShards(3, 2), 1));
}

TEST(ShardFailoverTest, ANeighbourOfADownShardCannotGoToo) {
  v1::Job job = JobWithShards(4, 2);
  job.add_down_shards(1);
  // Shard 2 holds the copies of shard 1's partitions, shard 0 holds shard 1's copies of shard 0's.
  EXPECT_FALSE(CanFailOver(job, 0));
  EXPECT_FALSE(CanFailOver(job, 2));
  EXPECT_TRUE(CanFailOver(job, 3));   // its neighbours 2 and 0 are live
  EXPECT_FALSE(CanFailOver(job, 4));  // out of range
  v1::Job two = JobWithShards(2, 2);
  two.add_down_shards(1);
  EXPECT_FALSE(CanFailOver(two, 0));  // the last copy
}

TEST(ShardFailoverTest, ServingAddressesBlankTheDownShards) {
  v1::Job job = JobWithShards(3, 2);
  job.add_down_shards(1);
  EXPECT_THAT(ServingAddresses(job), ElementsAre("127.0.0.1:4000", "", "127.0.0.1:4002"));
}

}  // namespace
}  // namespace tessera::coordinator::internal
