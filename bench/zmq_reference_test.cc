// The ZeroMQ reference of tessera-bench does the work it is compared for: every push reaches the
// server that owns its slice, is applied once (w -= lr * g), and the answer is the weights after
// it.
#include "bench/zmq_reference.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace tessera::bench {
namespace {

// Every client's gradient is 1e-3 everywhere (zmq_reference.cc); w starts at 0.
constexpr float kGradient = 1e-3f;

TEST(ZmqReferenceTest, EachIterationAppliesSgdOnceOnEverySlice) {
  // 1001 floats over 2 servers: slices of 501 and 500.
  auto ref = ZmqReference::Start(2, 4 * 1001, 0.5f);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ((*ref)->endpoints().size(), 2u);
  auto seconds = (*ref)->Run(1, 9);  // + 1 warm-up iteration
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_GT(*seconds, 0);
  const std::vector<float>& w = (*ref)->last_weights();
  ASSERT_EQ(w.size(), 1001u);
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_NEAR(w[i], -10 * 0.5f * kGradient, 1e-6f) << "element " << i;
  }
  // The servers keep their weights across runs: 4 + 1 more updates.
  ASSERT_TRUE((*ref)->Run(1, 4).ok());
  EXPECT_NEAR((*ref)->last_weights().front(), -15 * 0.5f * kGradient, 1e-6f);
  EXPECT_NEAR((*ref)->last_weights().back(), -15 * 0.5f * kGradient, 1e-6f);
}

TEST(ZmqReferenceTest, TwoClientsShareTheServersWeights) {
  auto ref = ZmqReference::Start(1, 4 * 64, 0.5f);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE((*ref)->Run(2, 10).ok());  // 10 iterations + 2 warm-ups in all
  // Client 0 finished before or after client 1: it saw between its own 6 and all 12 updates.
  const float w = (*ref)->last_weights()[0];
  EXPECT_LE(w, -6 * 0.5f * kGradient + 1e-6f);
  EXPECT_GE(w, -12 * 0.5f * kGradient - 1e-6f);
  ASSERT_TRUE((*ref)->Run(1, 0).ok());  // the warm-up alone: one more update, seen at once
  EXPECT_NEAR((*ref)->last_weights()[0], -13 * 0.5f * kGradient, 1e-6f);
}

TEST(ZmqReferenceTest, RefusesWhatItCannotSplit) {
  EXPECT_FALSE(ZmqReference::Start(0, 4096, 0.1f).ok());
  EXPECT_FALSE(ZmqReference::Start(1, 4097, 0.1f).ok());
  EXPECT_FALSE(ZmqReference::Start(4, 8, 0.1f).ok());  // 2 floats for 4 servers
}

}  // namespace
}  // namespace tessera::bench
