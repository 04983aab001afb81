#include "common/gradient_compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

std::vector<float> Decode(v1::Encoding e, const std::string& bytes, size_t n) {
  EXPECT_TRUE(CheckCompressed(e, bytes, n).ok()) << CheckCompressed(e, bytes, n);
  std::vector<float> out(n, 123.0f);
  DecodeCompressed(e, bytes, out.data(), n);
  return out;
}

TEST(GradientCompressionTest, Sign1KeepsTheSignsAndTheMeanMagnitude) {
  const std::vector<float> x = {1.0f, -3.0f, 0.5f, -0.5f, 2.0f, -1.0f, 0.0f, 4.0f, -2.0f, 1.0f};
  std::string bytes;
  EncodeCompressed(v1::ENCODING_SIGN1, x.data(), x.size(), 0, &bytes);
  ASSERT_EQ(bytes.size(), 4u + 2u);
  EXPECT_EQ(Sign1Bytes(10), 6u);
  float scale;
  std::memcpy(&scale, bytes.data(), 4);
  EXPECT_FLOAT_EQ(scale, 15.0f / 10.0f);
  // Negative at 1, 3, 5, 8: byte 0 = 0b00101010, byte 1 = 0b01.
  EXPECT_EQ(static_cast<unsigned char>(bytes[4]), 0x2a);
  EXPECT_EQ(static_cast<unsigned char>(bytes[5]), 0x01);
  const std::vector<float> out = Decode(v1::ENCODING_SIGN1, bytes, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(out[i], std::signbit(x[i]) ? -1.5f : 1.5f) << i;
  }
}

TEST(GradientCompressionTest, TopKKeepsTheLargestMagnitudesInIndexOrder) {
  const std::vector<float> x = {0.1f, -5.0f, 0.2f, 3.0f, -0.3f, 3.0f, 0.0f};
  EXPECT_EQ(TopKCount(7, 0.4), 3u);
  EXPECT_EQ(TopKCount(7, 1e-9), 1u);
  EXPECT_EQ(TopKCount(0, 0.5), 0u);
  std::string bytes;
  EncodeCompressed(v1::ENCODING_TOPK, x.data(), x.size(), 3, &bytes);
  ASSERT_EQ(bytes.size(), 24u);
  uint32_t first;
  std::memcpy(&first, bytes.data(), 4);
  EXPECT_EQ(first, 1u);
  const std::vector<float> out = Decode(v1::ENCODING_TOPK, bytes, x.size());
  EXPECT_EQ(out, (std::vector<float>{0, -5.0f, 0, 3.0f, 0, 3.0f, 0}));
  // All of them: the payload is the whole gradient.
  EncodeCompressed(v1::ENCODING_TOPK, x.data(), x.size(), x.size(), &bytes);
  EXPECT_EQ(Decode(v1::ENCODING_TOPK, bytes, x.size()), x);
}

// The vectorised encoders and decoder against the definitions, one value at a time, over sizes
// on and off a multiple of 8, with ties, zeros, negative zeros and a NaN among the values.
TEST(GradientCompressionTest, EncodersMatchTheDefinitionAtEverySize) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(-4, 4);
  for (size_t n : {1u, 7u, 8u, 9u, 63u, 64u, 65u, 1000u, 4099u}) {
    std::vector<float> x(n);
    for (float& v : x) v = 0.5f * static_cast<float>(level(rng));  // many ties
    if (n > 2) x[1] = -0.0f;
    if (n > 5) x[n / 2] = NAN;
    // SIGN1: scale = mean |x| over the finite values' sum (NaN makes it NaN), bit = sign bit.
    std::string bytes;
    EncodeCompressed(v1::ENCODING_SIGN1, x.data(), n, 0, &bytes);
    ASSERT_EQ(bytes.size(), Sign1Bytes(n));
    double l1 = 0;
    for (float v : x) l1 += std::fabs(v);
    float scale;
    std::memcpy(&scale, bytes.data(), 4);
    if (std::isnan(l1)) {
      EXPECT_TRUE(std::isnan(scale)) << n;
    } else {
      EXPECT_FLOAT_EQ(scale, static_cast<float>(l1 / n)) << n;
      std::vector<float> out(n);
      DecodeCompressed(v1::ENCODING_SIGN1, bytes, out.data(), n);
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(out[i], std::signbit(x[i]) ? -scale : scale) << n << " " << i;
        EXPECT_EQ(std::signbit(out[i]), std::signbit(x[i])) << n << " " << i;
      }
    }
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ((static_cast<unsigned char>(bytes[4 + i / 8]) >> (i % 8)) & 1u,
                std::signbit(x[i]) ? 1u : 0u)
          << n << " " << i;
    }
    // TOPK: the k of largest magnitude, NaN first, ties to the lower index, in index order.
    for (size_t k : {size_t{1}, (n + 3) / 4, n}) {
      std::vector<size_t> order(n);
      for (size_t i = 0; i < n; ++i) order[i] = i;
      auto rank = [](float v) { return std::isnan(v) ? INFINITY : std::fabs(v); };
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return rank(x[a]) > rank(x[b]); });
      order.resize(k);
      std::sort(order.begin(), order.end());
      EncodeCompressed(v1::ENCODING_TOPK, x.data(), n, k, &bytes);
      ASSERT_EQ(bytes.size(), 8 * k) << n << " " << k;
      for (size_t j = 0; j < k; ++j) {
        uint32_t index;
        float value;
        std::memcpy(&index, bytes.data() + 8 * j, 4);
        std::memcpy(&value, bytes.data() + 8 * j + 4, 4);
        EXPECT_EQ(index, order[j]) << n << " " << k << " " << j;
        EXPECT_EQ(std::memcmp(&value, &x[order[j]], 4), 0) << n << " " << k << " " << j;
      }
    }
  }
}

// Large partitions select among the values a strided sample bounds (gradient_compression.cc's
// KthLargestKey); whatever the sample saw, the payload is the definition's. Values: smooth
// random ones, a few large ones sitting exactly where a sample of every 64th value looks (so the
// sample's bound is too high and the encoder must fall back), all equal, mostly zeros, and tiny
// values exactly where the sample looks (a bound far too low). Each case is encoded twice with
// one scratch, as the error feedback reuses it, and once without.
TEST(GradientCompressionTest, TopKOfALargePartitionIsExactWhateverTheSampleSaw) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = 262144;  // 64 x the sample of 4096
  std::vector<std::vector<float>> cases(5, std::vector<float>(n));
  for (float& v : cases[0]) v = normal(rng);
  for (size_t i = 0; i < n; ++i) cases[1][i] = i % 64 == 0 ? 100.0f + i % 7 : normal(rng) * 1e-3f;
  std::fill(cases[2].begin(), cases[2].end(), -0.25f);
  for (size_t i = 0; i < n; i += 97) cases[3][i] = normal(rng);
  // The sample sees only tiny values, so nearly every value passes its bound: more candidates
  // than the buffer's room, which must fall back too.
  for (size_t i = 0; i < n; ++i) cases[4][i] = i % 64 == 0 ? 1e-6f : 1.0f + normal(rng);
  cases[0][12345] = NAN;
  TopKScratch scratch;  // shared by every case, as an encoder's is across steps
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::vector<float>& x = cases[c];
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    auto rank = [](float v) { return std::isnan(v) ? INFINITY : std::fabs(v); };
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return rank(x[a]) > rank(x[b]); });
    for (size_t k : {size_t{1}, n / 1000, n / 64, n / 10, n / 2}) {
      std::vector<size_t> expected(order.begin(), order.begin() + static_cast<ptrdiff_t>(k));
      std::sort(expected.begin(), expected.end());
      std::string bytes, again, alone;
      EncodeCompressed(v1::ENCODING_TOPK, x.data(), n, k, &bytes, &scratch);
      EncodeCompressed(v1::ENCODING_TOPK, x.data(), n, k, &again, &scratch);
      EncodeCompressed(v1::ENCODING_TOPK, x.data(), n, k, &alone);
      EXPECT_EQ(again, bytes) << c << " " << k;
      EXPECT_EQ(alone, bytes) << c << " " << k;
      ASSERT_EQ(bytes.size(), 8 * k) << c << " " << k;
      size_t wrong = 0;
      for (size_t j = 0; j < k; ++j) {
        uint32_t index;
        float value;
        std::memcpy(&index, bytes.data() + 8 * j, 4);
        std::memcpy(&value, bytes.data() + 8 * j + 4, 4);
        wrong += index != expected[j] || std::memcmp(&value, &x[expected[j]], 4) != 0 ? 1 : 0;
      }
      EXPECT_EQ(wrong, 0u) << "case " << c << ", k " << k;
    }
  }
}

// INT8: per block of 256 the scale is the largest magnitude / 127 and each value the nearest
// step; decoding adds q * scale, so every value is within half a step; a zero block has scale 0;
// NaN or Inf anywhere is refused by the encoder; CheckInt8 names a bad size or scale.
TEST(GradientCompressionTest, Int8BlocksQuantiseEachValueToHalfAStepOfItsBlock) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t n : {1u, 255u, 256u, 257u, 1000u}) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = normal(rng) * (i < 256 ? 1.0f : 1e-4f);
    if (n > 600) std::fill(x.begin() + 512, x.begin() + 768, 0.0f);  // block 2: zeros
    std::string bytes;
    ASSERT_TRUE(EncodeInt8(x.data(), n, &bytes));
    ASSERT_EQ(bytes.size(), Int8Bytes(n));
    EXPECT_EQ(Int8Bytes(n), 4 * ((n + 255) / 256) + n);
    ASSERT_TRUE(CheckInt8(bytes, n).ok());
    std::vector<float> out(n, 0.0f);
    AddInt8(bytes, out.data(), n);
    for (size_t b = 0; b * 256 < n; ++b) {
      float largest = 0;
      for (size_t i = b * 256; i < std::min(n, b * 256 + 256); ++i) {
        largest = std::max(largest, std::fabs(x[i]));
      }
      float scale;
      std::memcpy(&scale, bytes.data() + 4 * b, 4);
      EXPECT_EQ(scale, largest / 127.0f) << n << " block " << b;
      for (size_t i = b * 256; i < std::min(n, b * 256 + 256); ++i) {
        EXPECT_LE(std::fabs(out[i] - x[i]), 0.5001f * scale) << n << " " << i;
      }
    }
    x[n / 2] = NAN;
    EXPECT_FALSE(EncodeInt8(x.data(), n, &bytes)) << n;
    x[n / 2] = -INFINITY;
    EXPECT_FALSE(EncodeInt8(x.data(), n, &bytes)) << n;
  }
  // Tiny blocks (a scale below 2^-128, whose inverse would overflow) with zeros in them, one too
  // small for any scale, and one of huge finite values: all encode, each value within a step.
  for (const std::vector<float>& x : std::vector<std::vector<float>>{
           {1e-38f, 0.0f, -3e-39f, 0.0f}, {1e-44f, 0.0f, -1e-45f}, {3e38f, -1e38f, 0.0f}}) {
    std::string bytes;
    ASSERT_TRUE(EncodeInt8(x.data(), x.size(), &bytes)) << x[0];
    ASSERT_TRUE(CheckInt8(bytes, x.size()).ok()) << x[0];
    float scale;
    std::memcpy(&scale, bytes.data(), 4);
    std::vector<float> out(x.size(), 0.0f);
    AddInt8(bytes, out.data(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_TRUE(std::isfinite(out[i])) << x[0] << " " << i;
      EXPECT_LE(std::fabs(out[i] - x[i]), std::max(scale, 1e-44f)) << x[0] << " " << i;
      if (x[i] == 0) {
        EXPECT_EQ(out[i], 0.0f) << x[0] << " " << i;
      }
    }
  }
  std::string bytes;
  const std::vector<float> x = {1, -2, 3};
  ASSERT_TRUE(EncodeInt8(x.data(), 3, &bytes));
  EXPECT_EQ(static_cast<int8_t>(bytes[4 + 1]), -85);  // -2 / (3 / 127), rounded
  EXPECT_EQ(static_cast<int8_t>(bytes[4 + 2]), 127);
  EXPECT_EQ(CheckInt8(bytes.substr(1), 3).message(),
            "expected 7 bytes of ENCODING_INT8 for 3 values but got 6");
  const float nan = NAN;
  std::memcpy(bytes.data(), &nan, 4);
  EXPECT_EQ(CheckInt8(bytes, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(CheckInt8(bytes, 3).message().find("block 0: scale nan"), std::string::npos)
      << CheckInt8(bytes, 3);
}

TEST(GradientCompressionTest, MalformedPayloadsAreRefusedNamingTheProblem) {
  std::string sign(Sign1Bytes(10), '\0');
  EXPECT_TRUE(CheckCompressed(v1::ENCODING_SIGN1, sign, 10).ok());
  EXPECT_NE(CheckCompressed(v1::ENCODING_SIGN1, sign, 20).message().find("expected 7 bytes"),
            std::string::npos);
  sign[5] = 0x04;  // bit 10 of 10 values
  EXPECT_NE(CheckCompressed(v1::ENCODING_SIGN1, sign, 10).message().find("unused bits"),
            std::string::npos);
  sign[5] = 0;
  const float negative = -1.0f;
  std::memcpy(sign.data(), &negative, 4);
  EXPECT_NE(CheckCompressed(v1::ENCODING_SIGN1, sign, 10).message().find("scale must be >= 0"),
            std::string::npos);

  auto pair = [](uint32_t index, float value) {
    std::string p(8, '\0');
    std::memcpy(p.data(), &index, 4);
    std::memcpy(p.data() + 4, &value, 4);
    return p;
  };
  EXPECT_TRUE(CheckCompressed(v1::ENCODING_TOPK, "", 4).ok());
  EXPECT_TRUE(CheckCompressed(v1::ENCODING_TOPK, pair(0, 1) + pair(3, 2), 4).ok());
  EXPECT_NE(CheckCompressed(v1::ENCODING_TOPK, pair(4, 1), 4).message().find("is not below 4"),
            std::string::npos);
  EXPECT_NE(
      CheckCompressed(v1::ENCODING_TOPK, pair(2, 1) + pair(2, 1), 4).message().find("follow 2"),
      std::string::npos);
  EXPECT_NE(CheckCompressed(v1::ENCODING_TOPK, pair(0, 1).substr(0, 7), 4)
                .message()
                .find("multiple of 8"),
            std::string::npos);
  EXPECT_FALSE(
      CheckCompressed(v1::ENCODING_TOPK, pair(0, 1) + pair(1, 1) + pair(2, 1), 2).ok());  // k > n

  bool bad = false;
  ASSERT_TRUE(CheckCompressed(v1::ENCODING_TOPK, pair(1, NAN), 4, &bad).ok());
  EXPECT_TRUE(bad);
  ASSERT_TRUE(CheckCompressed(v1::ENCODING_TOPK, pair(1, 2.0f), 4, &bad).ok());
  EXPECT_FALSE(bad);
  const float inf = INFINITY;
  std::memcpy(sign.data(), &inf, 4);
  ASSERT_TRUE(CheckCompressed(v1::ENCODING_SIGN1, sign, 10, &bad).ok());
  EXPECT_TRUE(bad);
}

// Error feedback loses nothing: after T steps, what was sent plus what is kept equals what was
// given, for both encodings; and the kept part stays bounded instead of growing with T.
TEST(GradientCompressionTest, ErrorFeedbackSendsEverythingEventually) {
  constexpr size_t n = 1000;
  for (const v1::Encoding e : {v1::ENCODING_SIGN1, v1::ENCODING_TOPK}) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.3f, 1.0f);
    ErrorFeedback feedback;
    std::vector<double> given(n, 0.0), sent(n, 0.0);
    std::vector<float> g(n), decoded(n);
    std::string bytes;
    double residual_at_50 = 0;
    for (int step = 0; step < 200; ++step) {
      for (size_t i = 0; i < n; ++i) {
        g[i] = normal(rng);
        given[i] += g[i];
      }
      feedback.Encode(e, g.data(), n, TopKCount(n, 0.05), &bytes);
      DecodeCompressed(e, bytes, decoded.data(), n);
      for (size_t i = 0; i < n; ++i) sent[i] += decoded[i];
      if (step == 49) residual_at_50 = feedback.ResidualL1();
    }
    ASSERT_EQ(feedback.residual().size(), n);
    double worst = 0;
    for (size_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(given[i] - sent[i] - feedback.residual()[i]));
    }
    EXPECT_LT(worst, 1e-2) << v1::Encoding_Name(e);
    // Bounded: the residual after 200 steps is not 4x what it was after 50.
    EXPECT_LT(feedback.ResidualL1(), 2.0 * residual_at_50) << v1::Encoding_Name(e);
    // The mean drift of 0.3 per step arrives: on average the sent sum is near 200 * 0.3 = 60.
    double mean_sent = 0;
    for (double s : sent) mean_sent += s / n;
    EXPECT_NEAR(mean_sent, 60.0, 3.0) << v1::Encoding_Name(e);
  }
}

TEST(GradientCompressionTest, ANonFiniteGradientIsSentAndClearsTheResidual) {
  ErrorFeedback feedback;
  std::vector<float> g = {1.0f, -2.0f, 3.0f, 0.5f};
  std::string bytes;
  feedback.Encode(v1::ENCODING_TOPK, g.data(), g.size(), 1, &bytes);
  EXPECT_GT(feedback.ResidualL1(), 0.0);
  g[1] = NAN;
  feedback.Encode(v1::ENCODING_TOPK, g.data(), g.size(), 1, &bytes);
  bool bad = false;
  ASSERT_TRUE(CheckCompressed(v1::ENCODING_TOPK, bytes, g.size(), &bad).ok());
  EXPECT_TRUE(bad);  // the NaN ranks first, so the shard's policy sees it
  EXPECT_EQ(feedback.ResidualL1(), 0.0);
  feedback.Encode(v1::ENCODING_SIGN1, g.data(), g.size(), 0, &bytes);
  ASSERT_TRUE(CheckCompressed(v1::ENCODING_SIGN1, bytes, g.size(), &bad).ok());
  EXPECT_TRUE(bad);
  EXPECT_EQ(feedback.ResidualL1(), 0.0);
}

}  // namespace
}  // namespace tessera
