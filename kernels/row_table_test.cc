#include "kernels/row_table.h"

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

TEST(RowTableTest, GatherReadsUntouchedRowsFromTheInitializerWithoutCreatingThem) {
  RowTable table(4, Normal(0.1f, 3), Params(v1::OPTIMIZER_KIND_SGD, 0.5f));
  std::vector<float> out(8), want(4);
  table.Gather({-7, 1LL << 62}, absl::MakeSpan(out));
  EXPECT_EQ(table.size(), 0);
  InitializeRow(Normal(0.1f, 3), 1LL << 62, want.data(), 4);
  EXPECT_EQ(std::vector<float>(out.begin() + 4, out.end()), want);
}

TEST(RowTableTest, SgdMovesOnlyTheRowsPushedAndAdamCountsUpdatesPerRow) {
  v1::Initializer zeros;
  RowTable sgd(2, zeros, Params(v1::OPTIMIZER_KIND_SGD, 0.5f));
  sgd.Apply(0.5f, 2.0f, {10, 20}, {1, 2, 3, 4});
  std::vector<float> out(6);
  sgd.Gather({10, 20, 30}, absl::MakeSpan(out));
  EXPECT_EQ(out, (std::vector<float>{-1, -2, -3, -4, 0, 0}));
  EXPECT_EQ(sgd.size(), 2);
  std::map<int64_t, std::vector<float>> seen;
  sgd.ForEach([&](int64_t id, absl::Span<const float> w) {
    seen[id] = std::vector<float>(w.begin(), w.end());
  });
  EXPECT_EQ(seen, (std::map<int64_t, std::vector<float>>{{10, {-1, -2}}, {20, {-3, -4}}}));

  // Adam's bias correction uses each row's own update count: row 1 updated twice, row 2 once
  // equals a fresh row updated once.
  RowTable adam(1, zeros, Params(v1::OPTIMIZER_KIND_ADAM, 0.1f));
  adam.Apply(0.1f, 1.0f, {1}, {1.0f});
  adam.Apply(0.1f, 1.0f, {1, 2}, {1.0f, 1.0f});
  std::vector<float> w(2);
  adam.Gather({1, 2}, absl::MakeSpan(w));
  // First Adam step with bias correction moves by lr * sign(g) (up to epsilon).
  EXPECT_NEAR(w[1], -0.1f, 1e-5f);
  EXPECT_NEAR(w[0], -0.2f, 1e-5f);
}

}  // namespace
}  // namespace tessera::kernels
