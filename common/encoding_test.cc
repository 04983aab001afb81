#include "common/encoding.h"

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(EncodingTest, Fp32RoundTripIsExact) {
  const std::vector<float> in = {0.0f, -1.5f, 3.25e-20f, 1e30f, -0.0f};
  std::string bytes;
  EncodeValues(v1::ENCODING_FP32, in.data(), in.size(), &bytes);
  ASSERT_EQ(bytes.size(), in.size() * 4);
  std::vector<float> out(in.size());
  ASSERT_TRUE(DecodeValues(v1::ENCODING_FP32, bytes, out.data(), out.size()).ok());
  EXPECT_EQ(out, in);
}

TEST(EncodingTest, HalfPrecisionKnownValues) {
  struct Case {
    float value;
    uint16_t fp16;
    uint16_t bf16;
  };
  const Case cases[] = {
      {1.0f, 0x3c00, 0x3f80}, {-2.0f, 0xc000, 0xc000}, {65504.0f, 0x7bff, 0x4780},
      {0.5f, 0x3800, 0x3f00}, {0.0f, 0x0000, 0x0000},  {5.9604645e-8f, 0x0001, 0x3380},
      {1e6f, 0x7c00, 0x4974},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToFp16(c.value), c.fp16) << c.value;
    EXPECT_EQ(FloatToBf16(c.value), c.bf16) << c.value;
  }
  EXPECT_EQ(Fp16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Fp16ToFloat(0x0001), 5.9604645e-8f);
  EXPECT_TRUE(std::isinf(Fp16ToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(EncodingTest, HalfPrecisionRelativeErrorIsBounded) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1000.0f, 1000.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = dist(rng);
    if (std::fabs(x) < 1e-3f) continue;
    EXPECT_LE(std::fabs(Fp16ToFloat(FloatToFp16(x)) - x), std::fabs(x) * (1.0f / 2048.0f)) << x;
    EXPECT_LE(std::fabs(Bf16ToFloat(FloatToBf16(x)) - x), std::fabs(x) * (1.0f / 256.0f)) << x;
  }
}

TEST(EncodingTest, WrongByteCountIsInvalidArgumentWithSizes) {
  std::vector<float> out(4);
  const absl::Status s = DecodeValues(v1::ENCODING_BF16, std::string(7, '\0'), out.data(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("8 bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("got 7"), std::string::npos) << s;
  EXPECT_EQ(DecodeValues(static_cast<v1::Encoding>(42), "", out.data(), 0).code(),
            absl::StatusCode::kInvalidArgument);
}

// EncodeValues and DecodeValues convert BF16 eight values at a time; every size on and off a
// multiple of 8 gives, value for value, what FloatToBf16 and Bf16ToFloat give: rounding ties to
// even both ways, NaN, infinities, signed zeros, subnormals and the largest finite values.
TEST(EncodingTest, Bf16BlocksMatchTheScalarConversionAtEverySize) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  const float special[] = {0.0f,    -0.0f,         INFINITY,    -INFINITY,  NAN, 1e-40f,
                           -1e-45f, 3.4028235e38f, 1.00390625f, 1.01171875f};  // the last two: ties
  for (size_t n : {0u, 1u, 7u, 8u, 9u, 16u, 31u, 1000u, 1027u}) {
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = bits(rng);
      std::memcpy(&in[i], &u, 4);
      if (i % 3 == 0) in[i] = special[(i / 3) % std::size(special)];
    }
    std::string bytes;
    EncodeValues(v1::ENCODING_BF16, in.data(), n, &bytes);
    ASSERT_EQ(bytes.size(), 2 * n);
    std::vector<float> out(n);
    ASSERT_TRUE(DecodeValues(v1::ENCODING_BF16, bytes, out.data(), n).ok());
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      const float back = Bf16ToFloat(h);
      wrong += h != FloatToBf16(in[i]) || std::memcmp(&out[i], &back, 4) != 0 ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0u) << n;
  }
}

}  // namespace
}  // namespace tessera
