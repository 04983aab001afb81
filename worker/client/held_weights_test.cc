// A worker's copies under weight-delta pulls (worker/client/held_weights.h): FP32 answers replace
// a copy, TOPK deltas add to the copy they are from, and an answer that does not fit is INTERNAL
// and drops the copy, so that the next request asks for whole weights.
#include "worker/client/held_weights.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/gradient_compression.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::testing::HasSubstr;

v1::Slice Whole(const std::vector<float>& w, uint64_t id) {
  v1::Slice s;
  s.set_encoding(v1::ENCODING_FP32);
  s.mutable_data()->assign(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  s.set_weights_id(id);
  return s;
}

v1::Slice Delta(const std::vector<float>& change, size_t k, uint64_t id) {
  v1::Slice s;
  s.set_encoding(v1::ENCODING_TOPK);
  EncodeCompressed(v1::ENCODING_TOPK, change.data(), change.size(), k, s.mutable_data());
  s.set_weights_id(id);
  return s;
}

TEST(HeldWeightsTest, WholeWeightsThenDeltasOfTheCopyTheyAreFrom) {
  HeldWeights held;
  EXPECT_EQ(held.Id("w", 0), 0u);
  std::vector<float> out(4);
  ASSERT_TRUE(held.Accept("w", 0, 0, Whole({1, 2, 3, 4}, 7), out.data(), 4).ok());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(held.Id("w", 0), 7u);
  EXPECT_EQ(held.Id("w", 1), 0u);  // another partition holds nothing
  ASSERT_TRUE(held.Accept("w", 0, 7, Delta({0, 0.5f, 0, -8}, 2, 9), out.data(), 4).ok());
  EXPECT_EQ(out, (std::vector<float>{1, 2.5f, 3, -4}));
  EXPECT_EQ(held.Id("w", 0), 9u);
  // An empty delta: the copy as it is.
  std::vector<float> again(4, -1.0f);
  ASSERT_TRUE(held.Accept("w", 0, 9, Delta({0, 0, 0, 0}, 0, 9), again.data(), 4).ok());
  EXPECT_EQ(again, out);
}

// INT8 deltas add q * scale to the copy they are from; an empty one leaves it; a payload of the
// wrong size or with a negative scale is INTERNAL and drops the copy.
TEST(HeldWeightsTest, Int8DeltasAddToTheCopyAndBadOnesDropIt) {
  HeldWeights held;
  std::vector<float> out(4);
  ASSERT_TRUE(held.Accept("w", 0, 0, Whole({1, 2, 3, 4}, 7), out.data(), 4).ok());
  v1::Slice d;
  d.set_encoding(v1::ENCODING_INT8);
  const std::vector<float> change = {0.5f, -1.27f, 0, 0.01f};
  ASSERT_TRUE(EncodeInt8(change.data(), 4, d.mutable_data()));
  d.set_weights_id(9);
  ASSERT_TRUE(held.Accept("w", 0, 7, d, out.data(), 4).ok());
  // Scale 1.27 / 127 = 0.01: 0.5 is 50 steps, 0.01 one step.
  const float scale = 1.27f / 127.0f;
  EXPECT_EQ(out, (std::vector<float>{1 + 50 * scale, 2 - 127 * scale, 3, 4 + 1 * scale}));
  v1::Slice none;
  none.set_encoding(v1::ENCODING_INT8);
  none.set_weights_id(9);
  std::vector<float> again(4);
  ASSERT_TRUE(held.Accept("w", 0, 9, none, again.data(), 4).ok());
  EXPECT_EQ(again, out);
  // An empty delta that names other weights than the copy's: not "nothing changed".
  none.set_weights_id(10);
  absl::Status moved = held.Accept("w", 0, 9, none, again.data(), 4);
  EXPECT_EQ(moved.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(moved.message(), HasSubstr("an empty delta that moves weights 9 to 10"));
  ASSERT_TRUE(held.Accept("w", 0, 0, Whole({1, 2, 3, 4}, 7), out.data(), 4).ok());
  ASSERT_TRUE(held.Accept("w", 0, 7, d, out.data(), 4).ok());
  v1::Slice short_one = d;
  short_one.mutable_data()->pop_back();
  absl::Status s = held.Accept("w", 0, 9, short_one, out.data(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("expected 8 bytes of ENCODING_INT8"));
  EXPECT_EQ(held.Id("w", 0), 0u);
  ASSERT_TRUE(held.Accept("w", 0, 0, Whole({1, 2, 3, 4}, 7), out.data(), 4).ok());
  v1::Slice negative = d;
  const float minus = -1;
  std::memcpy(negative.mutable_data()->data(), &minus, 4);
  s = held.Accept("w", 0, 7, negative, out.data(), 4);
  EXPECT_THAT(s.message(), HasSubstr("block 0: scale -1"));
  EXPECT_EQ(held.Id("w", 0), 0u);
}

TEST(HeldWeightsTest, ADeltaThatDoesNotFitIsInternalAndDropsTheCopy) {
  HeldWeights held;
  std::vector<float> out(4);
  // A delta with nothing held.
  absl::Status s = held.Accept("w", 0, 0, Delta({1, 0, 0, 0}, 1, 3), out.data(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'w' partition 0"));
  ASSERT_TRUE(held.Accept("w", 0, 0, Whole({1, 2, 3, 4}, 7), out.data(), 4).ok());
  // A delta from other weights than the request named.
  s = held.Accept("w", 0, 5, Delta({1, 0, 0, 0}, 1, 8), out.data(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(held.Id("w", 0), 0u);
  // A malformed delta (an index past the partition).
  ASSERT_TRUE(held.Accept("w", 0, 0, Whole({1, 2, 3, 4}, 7), out.data(), 4).ok());
  v1::Slice bad = Delta({1, 0, 0, 0}, 1, 8);
  const uint32_t four = 4;
  std::memcpy(bad.mutable_data()->data(), &four, 4);
  s = held.Accept("w", 0, 7, bad, out.data(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("index 4"));
  EXPECT_EQ(held.Id("w", 0), 0u);
  // Whole weights of another size, or another encoding.
  s = held.Accept("w", 0, 0, Whole({1, 2, 3}, 7), out.data(), 4);
  EXPECT_THAT(s.message(), HasSubstr("expected 4 fp32 values"));
  v1::Slice bf16 = Whole({1, 2}, 7);
  bf16.set_encoding(v1::ENCODING_BF16);
  s = held.Accept("w", 0, 0, bf16, out.data(), 4);
  EXPECT_THAT(s.message(), HasSubstr("ENCODING_BF16"));
}

}  // namespace
}  // namespace tessera::client
