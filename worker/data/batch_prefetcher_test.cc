#include "worker/data/batch_prefetcher.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::data {
namespace {

using ::testing::HasSubstr;

// n dense examples of 3 features; example i has features {i, i + 0.5, -i} and target i.
std::shared_ptr<const Dataset> Counting(int64_t n) {
  std::vector<float> features;
  std::vector<float> labels;
  for (int64_t i = 0; i < n; ++i) {
    features.insert(features.end(), {float(i), float(i) + 0.5f, -float(i)});
    labels.push_back(float(i));
  }
  return Dataset::FromFloats({3}, std::move(features), std::move(labels), 0, n);
}

bool IsPermutation(const std::vector<int64_t>& order, int64_t n) {
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> iota(n);
  std::iota(iota.begin(), iota.end(), 0);
  return sorted == iota;
}

TEST(EpochOrderTest, DeterministicPerSeedAndDifferentPerEpochAndSeed) {
  const std::vector<int64_t> a = EpochOrder(1000, 42, 0);
  EXPECT_TRUE(IsPermutation(a, 1000));
  EXPECT_EQ(a, EpochOrder(1000, 42, 0));
  EXPECT_NE(a, EpochOrder(1000, 42, 1));
  EXPECT_NE(a, EpochOrder(1000, 43, 0));
  EXPECT_NE(EpochOrder(1000, 42, 1), EpochOrder(1000, 42, 2));
  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(a, identity);
  // Every position receives different elements across epochs: a real shuffle, not a rotation.
  int fixed_points = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed_points += a[i] == i;
  EXPECT_LT(fixed_points, 10);
  EXPECT_TRUE(EpochOrder(0, 1, 0).empty());
  EXPECT_EQ(EpochOrder(1, 1, 5), (std::vector<int64_t>{0}));
}

TEST(EpochOrderTest, FirstPositionIsRoughlyUniform) {
  std::vector<int> counts(4);
  for (int64_t epoch = 0; epoch < 4000; ++epoch) ++counts[EpochOrder(4, 7, epoch)[0]];
  for (int c : counts) {
    EXPECT_GT(c, 850);
    EXPECT_LT(c, 1150);
  }
}

TEST(BatchPrefetcherTest, OneEpochVisitsEveryExampleOnceInEpochOrder) {
  auto ds = Counting(10);
  BatchPrefetcher::Options o;
  o.batch_size = 4;
  o.seed = 9;
  o.epoch = 3;
  auto p = BatchPrefetcher::Create(ds, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->num_batches(), 3);
  std::vector<int64_t> seen;
  std::vector<int64_t> sizes;
  while (std::optional<Batch> b = (*p)->Next()) {
    sizes.push_back(b->size);
    ASSERT_EQ(b->features.size(), static_cast<size_t>(b->size * 3));
    for (int64_t k = 0; k < b->size; ++k) {
      const int64_t i = b->indices[k];
      EXPECT_EQ(b->targets[k], float(i));
      EXPECT_EQ(b->features[k * 3 + 1], float(i) + 0.5f);
      EXPECT_EQ(b->features[k * 3 + 2], -float(i));
      seen.push_back(i);
    }
    (*p)->Recycle(std::move(*b));
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(seen, EpochOrder(10, 9, 3));
  EXPECT_FALSE((*p)->Next().has_value());
}

TEST(BatchPrefetcherTest, FirstBatchSkipsTheEarlierBatchesOfTheSameOrder) {
  BatchPrefetcher::Options o;
  o.batch_size = 3;
  o.seed = 5;
  o.epoch = 2;
  const std::vector<int64_t> order = EpochOrder(11, 5, 2);
  for (int64_t first : {0, 1, 3, 4, 9}) {
    o.first_batch = first;
    auto p = BatchPrefetcher::Create(Counting(11), o);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)->num_batches(), 4);
    std::vector<int64_t> seen;
    while (std::optional<Batch> b = (*p)->Next()) {
      seen.insert(seen.end(), b->indices.begin(), b->indices.end());
    }
    const std::vector<int64_t> expected(order.begin() + std::min<int64_t>(11, first * 3),
                                        order.end());
    EXPECT_EQ(seen, expected) << "first_batch " << first;
  }
  o.first_batch = -1;
  auto bad = BatchPrefetcher::Create(Counting(3), o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("first_batch"));
}

TEST(BatchPrefetcherTest, UnshuffledAndDropLast) {
  BatchPrefetcher::Options o;
  o.batch_size = 4;
  o.shuffle = false;
  o.drop_last = true;
  auto p = BatchPrefetcher::Create(Counting(10), o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->num_batches(), 2);
  std::vector<int64_t> seen;
  while (std::optional<Batch> b = (*p)->Next()) {
    seen.insert(seen.end(), b->indices.begin(), b->indices.end());
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(BatchPrefetcherTest, DestroyingWithAFullQueueJoins) {
  BatchPrefetcher::Options o;
  o.batch_size = 1;
  o.queue_depth = 1;
  for (int i = 0; i < 20; ++i) {
    auto p = BatchPrefetcher::Create(Counting(100), o);
    ASSERT_TRUE(p.ok());
    if (i % 2 == 0) {
      ASSERT_TRUE((*p)->Next().has_value());
    }
  }
}

TEST(BatchPrefetcherTest, BadOptionsNameTheField) {
  BatchPrefetcher::Options o;
  o.batch_size = 0;
  auto p = BatchPrefetcher::Create(Counting(3), o);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("batch_size"));
  o.batch_size = 1;
  o.queue_depth = 0;
  EXPECT_THAT(std::string(BatchPrefetcher::Create(Counting(3), o).status().message()),
              HasSubstr("queue_depth"));
}

TEST(BatchPrefetcherTest, EmptyDatasetHasNoBatches) {
  auto p = BatchPrefetcher::Create(Counting(0), BatchPrefetcher::Options());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->num_batches(), 0);
  EXPECT_FALSE((*p)->Next().has_value());
}

}  // namespace
}  // namespace tessera::data
