#include "kernels/sparse_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::kernels {
namespace {

v1::Initializer Normal(float scale, uint64_t seed) {
  v1::Initializer init;
  init.set_kind(v1::Initializer::KIND_NORMAL);
  init.set_scale(scale);
  init.set_seed(seed);
  return init;
}

OptimizerParams Params(v1::OptimizerKind kind, float lr) {
  OptimizerParams p;
  p.kind = kind;
  p.learning_rate = lr;
  return p;
}

TEST(InitializeRowTest, RowsAreAFunctionOfSeedAndIdAndFollowTheirDistribution) {
  const v1::Initializer init = Normal(0.5f, 17);
  std::vector<float> a(64), b(64), c(64);
  InitializeRow(init, 123456789012345LL, a.data(), 64);
  InitializeRow(init, 123456789012345LL, b.data(), 64);
  InitializeRow(init, 123456789012346LL, c.data(), 64);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // 4096 rows of 64 values: mean 0, standard deviation 0.5.
  double sum = 0, squares = 0;
  std::vector<float> row(64);
  for (int64_t r = -2048; r < 2048; ++r) {
    InitializeRow(init, r * 7919, row.data(), 64);
    for (float v : row) {
      sum += v;
      squares += static_cast<double>(v) * v;
    }
  }
  const double n = 4096.0 * 64;
  EXPECT_NEAR(sum / n, 0.0, 0.005);
  EXPECT_NEAR(std::sqrt(squares / n), 0.5, 0.005);
  v1::Initializer constant;
  constant.set_kind(v1::Initializer::KIND_CONSTANT);
  constant.set_value(0.25f);
  InitializeRow(constant, 5, row.data(), 3);
  EXPECT_THAT(std::vector<float>(row.begin(), row.begin() + 3), ::testing::Each(0.25f));
}

v1::RowLifecycle Lifecycle(uint32_t admit_after, int64_t evict_after) {
  v1::RowLifecycle l;
  l.set_admit_after(admit_after);
  l.set_evict_after(evict_after);
  return l;
}

// The ids of the rows held, sorted.
std::vector<int64_t> Held(const SparseRows& t) {
  std::vector<int64_t> ids;
  for (const auto& [id, row] : t.rows()) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

TEST(SparseRowsTest, GatherReadsUntouchedRowsFromTheInitializerWithoutCreatingThem) {
  SparseRows table(4, Normal(0.1f, 3), Params(v1::OPTIMIZER_KIND_SGD, 0.5f), {});
  std::vector<float> out(8), want(4);
  table.Gather({-7, 1LL << 62}, out.data());
  EXPECT_EQ(table.size(), 0);
  InitializeRow(Normal(0.1f, 3), 1LL << 62, want.data(), 4);
  EXPECT_EQ(std::vector<float>(out.begin() + 4, out.end()), want);
}

TEST(SparseRowsTest, SgdMovesOnlyTheRowsPushedAndAdamCountsUpdatesPerRow) {
  v1::Initializer zeros;
  SparseRows sgd(2, zeros, Params(v1::OPTIMIZER_KIND_SGD, 0.5f), {});
  const std::vector<float> g = {1, 2, 3, 4};
  EXPECT_EQ(sgd.Apply(1, 0.5f, 2.0f, {10, 20}, g.data()), 2 * sgd.RowBytes());
  std::vector<float> out(6);
  sgd.Gather({10, 20, 30}, out.data());
  EXPECT_EQ(out, (std::vector<float>{-1, -2, -3, -4, 0, 0}));
  EXPECT_EQ(sgd.size(), 2);
  EXPECT_EQ(sgd.counts().admitted(), 2);
  std::map<int64_t, std::vector<float>> seen;
  for (const auto& [id, row] : sgd.rows()) {
    seen[id] = std::vector<float>(row.values.begin(), row.values.begin() + 2);
  }
  EXPECT_EQ(seen, (std::map<int64_t, std::vector<float>>{{10, {-1, -2}}, {20, {-3, -4}}}));

  // Adam's bias correction uses each row's own update count: row 1 updated twice, row 2 once
  // equals a fresh row updated once.
  SparseRows adam(1, zeros, Params(v1::OPTIMIZER_KIND_ADAM, 0.1f), {});
  const std::vector<float> ones = {1.0f, 1.0f};
  adam.Apply(1, 0.1f, 1.0f, {1}, ones.data());
  adam.Apply(2, 0.1f, 1.0f, {1, 2}, ones.data());
  std::vector<float> w(2);
  adam.Gather({1, 2}, w.data());
  // First Adam step with bias correction moves by lr * sign(g) (up to epsilon).
  EXPECT_NEAR(w[1], -0.1f, 1e-5f);
  EXPECT_NEAR(w[0], -0.2f, 1e-5f);
}

TEST(SparseRowsTest, AdmissionCreatesARowOnItsNthSightingAndDropsTheGradientsBefore) {
  // Constant initializer 0.5, SGD at lr 1: an admitted row holds 0.5 - (the gradients applied).
  v1::Initializer half;
  half.set_kind(v1::Initializer::KIND_CONSTANT);
  half.set_value(0.5f);
  SparseRows t(1, half, Params(v1::OPTIMIZER_KIND_SGD, 1.0f), Lifecycle(3, 0));
  const std::vector<float> g = {0.125f, 0.25f};
  std::vector<float> out(2);
  // Clock 1: ids 7 and 8 seen once each; pending, read as zeros (not the initializer).
  EXPECT_EQ(t.Apply(1, 1.0f, 1.0f, {7, 8}, g.data()), 2 * SparseRows::PendingBytes());
  t.Gather({7, 8}, out.data());
  EXPECT_EQ(out, (std::vector<float>{0, 0}));
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.pending_size(), 2);
  // Clock 2: 7 a second time.
  EXPECT_EQ(t.Apply(2, 1.0f, 1.0f, {7}, g.data()), 0);
  EXPECT_EQ(t.pending().at(7).sightings, 2u);
  EXPECT_EQ(t.pending().at(7).last_clock, 2);
  // Clock 3: 7's third sighting admits it, with this update's gradient only: 0.5 - 0.25.
  EXPECT_EQ(t.Apply(3, 1.0f, 1.0f, {8, 7}, g.data()), t.RowBytes() - SparseRows::PendingBytes());
  EXPECT_EQ(Held(t), (std::vector<int64_t>{7}));
  t.Gather({7, 8}, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.25f, 0.0f}));
  EXPECT_EQ(t.Find(7)->updates, 1);
  EXPECT_EQ(t.pending().at(8).sightings, 2u);
  // Clock 4: 8's third; 7 is a row and trains on.
  t.Apply(4, 1.0f, 1.0f, {7, 8}, g.data());
  t.Gather({7, 8}, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.125f, 0.25f}));
  EXPECT_EQ(t.pending_size(), 0);
  EXPECT_EQ(t.counts().admitted(), 2);
  // Dropped: 7 at clocks 1 and 2, 8 at 1 and 3.
  EXPECT_EQ(t.counts().dropped_gradients(), 4);
  EXPECT_EQ(t.BytesHeld(), 2 * t.RowBytes());
}

TEST(SparseRowsTest, EvictionDropsRowsIdleForTheWindowAtEachMultipleAndTheyStartOver) {
  v1::Initializer zeros;
  SparseRows t(1, zeros, Params(v1::OPTIMIZER_KIND_SGD, 1.0f), Lifecycle(0, 4));
  const std::vector<float> g = {1, 1, 1};
  t.Apply(1, 1.0f, 1.0f, {1, 2, 3}, g.data());  // all three at clock 1
  t.Apply(2, 1.0f, 1.0f, {2}, g.data());
  t.Apply(3, 1.0f, 1.0f, {3}, g.data());
  // Clock 4 is the first check: row 1 (last at 1) is 3 ticks old, under 4: nothing goes.
  EXPECT_EQ(t.Apply(4, 1.0f, 1.0f, {3}, g.data()), 0);
  EXPECT_EQ(Held(t), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(t.counts().last_sweep_clock(), 4);
  // Clocks 5-7 check nothing; row 1 is idle 4 at clock 5 but stays until the next multiple.
  for (int64_t c = 5; c <= 7; ++c) EXPECT_EQ(t.Apply(c, 1.0f, 1.0f, {3}, g.data()), 0);
  EXPECT_EQ(t.counts().evicted(), 0);
  // Clock 9 (8 skipped: an update of the table without this table's rows) is past the multiple
  // 8: rows 1 (idle 8) and 2 (idle 7) go, 3 (updated now) stays.
  EXPECT_EQ(t.Apply(9, 1.0f, 1.0f, {3}, g.data()), -2 * t.RowBytes());
  EXPECT_EQ(Held(t), (std::vector<int64_t>{3}));
  EXPECT_EQ(t.counts().evicted(), 2);
  EXPECT_EQ(t.counts().last_sweep_clock(), 9);
  // Row 1 comes back from its initializer, a fresh row (its own update count from 1).
  t.Apply(10, 1.0f, 1.0f, {1}, g.data());
  std::vector<float> out(1);
  t.Gather({1}, out.data());
  EXPECT_EQ(out[0], -1.0f);
  EXPECT_EQ(t.Find(1)->updates, 1);
  EXPECT_EQ(t.counts().admitted(), 4);
}

TEST(SparseRowsTest, PendingIdsAreEvictedToo) {
  v1::Initializer zeros;
  SparseRows t(1, zeros, Params(v1::OPTIMIZER_KIND_SGD, 1.0f), Lifecycle(2, 2));
  const std::vector<float> g = {1, 1};
  t.Apply(1, 1.0f, 1.0f, {5, 6}, g.data());  // both pending
  t.Apply(2, 1.0f, 1.0f, {6}, g.data());     // 6 admitted; check at 2: 5 idle 1, stays
  EXPECT_EQ(t.pending_size(), 1);
  EXPECT_EQ(Held(t), (std::vector<int64_t>{6}));
  // Clock 4: 5 (last 1) and 6 (last 2) are idle 3 and 2: both go.
  EXPECT_EQ(t.Apply(4, 1.0f, 1.0f, {}, g.data()), -t.RowBytes() - SparseRows::PendingBytes());
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.pending_size(), 0);
  EXPECT_EQ(t.counts().evicted(), 1);
  EXPECT_EQ(t.counts().pending_evicted(), 1);
  // 5 counts from zero again: one sighting does not admit it.
  t.Apply(5, 1.0f, 1.0f, {5}, g.data());
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.pending().at(5).sightings, 1u);
}

TEST(SparseRowsTest, RestoreRefusesDuplicatesWrongWidthsAndCountsAdmissionWouldHaveAdmitted) {
  v1::Initializer zeros;
  SparseRows t(2, zeros, Params(v1::OPTIMIZER_KIND_ADAGRAD, 1.0f), Lifecycle(3, 0));
  const std::vector<float> row = {1, 2, 3, 4};  // 2 weights, 2 accumulator values
  EXPECT_TRUE(t.RestoreRow(1, 5, 9, row).ok());
  EXPECT_FALSE(t.RestoreRow(1, 5, 9, row).ok());
  EXPECT_FALSE(t.RestoreRow(2, 5, 9, {1, 2}).ok());
  EXPECT_TRUE(t.RestorePending(3, 2, 8).ok());
  EXPECT_FALSE(t.RestorePending(4, 3, 8).ok());  // 3 sightings would have admitted it
  EXPECT_FALSE(t.RestorePending(1, 1, 8).ok());  // a row already
  EXPECT_EQ(t.Find(1)->updates, 5);
  EXPECT_EQ(t.Find(1)->last_clock, 9);
  EXPECT_EQ(t.pending().at(3).sightings, 2u);
}

}  // namespace
}  // namespace tessera::kernels
