#include "common/binary_metrics.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

// The definition, over every (positive, negative) pair.
double PairwiseAuc(const std::vector<float>& s, const std::vector<float>& y) {
  double wins = 0, pairs = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    for (size_t j = 0; j < s.size(); ++j) {
      if (y[i] > 0.5f && y[j] <= 0.5f) {
        pairs += 1;
        wins += s[i] > s[j] ? 1.0 : s[i] == s[j] ? 0.5 : 0.0;
      }
    }
  }
  return wins / pairs;
}

TEST(RocAucTest, MatchesThePairwiseDefinitionWithTies) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> level(0, 9);  // many ties
  std::bernoulli_distribution coin(0.3);
  std::vector<float> scores(500), labels(500);
  for (size_t i = 0; i < scores.size(); ++i) {
    labels[i] = coin(rng) ? 1.0f : 0.0f;
    scores[i] = static_cast<float>(level(rng)) + labels[i];  // informative, not perfect
  }
  const double auc = RocAuc(scores, labels);
  EXPECT_NEAR(auc, PairwiseAuc(scores, labels), 1e-12);
  EXPECT_GT(auc, 0.5);
  EXPECT_DOUBLE_EQ(RocAuc({1, 2, 3, 4}, {0, 0, 1, 1}), 1.0);
  EXPECT_DOUBLE_EQ(RocAuc({4, 3, 2, 1}, {0, 0, 1, 1}), 0.0);
  EXPECT_DOUBLE_EQ(RocAuc({1, 1, 1, 1}, {0, 1, 0, 1}), 0.5);
  EXPECT_TRUE(std::isnan(RocAuc({1, 2}, {1, 1})));
}

TEST(LogLossTest, IsTheMeanNegativeLogLikelihoodWithClamping) {
  EXPECT_NEAR(LogLoss({0.5, 0.5}, {1, 0}), std::log(2.0), 1e-12);
  EXPECT_NEAR(LogLoss({0.9, 0.2}, {1, 0}), -(std::log(0.9) + std::log(0.8)) / 2, 1e-12);
  EXPECT_NEAR(LogLoss({0.0}, {1}), -std::log(1e-7), 1e-9);
  EXPECT_EQ(LogLoss({}, {}), 0.0);
}

}  // namespace
}  // namespace tessera
