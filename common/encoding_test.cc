#include "common/encoding.h"

#include <cmath>
#include <limits>
#include <random>
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
      {1.0f, 0x3c00, 0x3f80},      {-2.0f, 0xc000, 0xc000}, {65504.0f, 0x7bff, 0x4780},
      {0.5f, 0x3800, 0x3f00},      {0.0f, 0x0000, 0x0000},  {5.9604645e-8f, 0x0001, 0x3380},
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

}  // namespace
}  // namespace tessera
