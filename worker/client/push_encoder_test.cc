#include "worker/client/push_encoder.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/gradient_compression.h"
#include "gtest/gtest.h"

namespace tessera {
namespace client {
namespace {

std::vector<float> Decoded(v1::Encoding encoding, const v1::Slice& slice, size_t n) {
  std::vector<float> out(n);
  EXPECT_TRUE(CheckCompressed(encoding, slice.data(), n).ok());
  DecodeCompressed(encoding, slice.data(), out.data(), n);
  return out;
}

TEST(PushEncoderTest, Fp32IsLentAndSparseRowsKeepTheEncoding) {
  PushEncoder encoder(v1::ENCODING_FP32, 0.01);
  const std::vector<float> g = {1.5f, -2.0f, 3.0f};
  v1::Slice slice;
  const absl::string_view lent = encoder.Encode("w", 0, g.data(), g.size(), &slice);
  EXPECT_EQ(static_cast<const void*>(lent.data()), static_cast<const void*>(g.data()));
  EXPECT_EQ(lent.size(), 12u);
  EXPECT_TRUE(slice.data().empty());
  EXPECT_EQ(encoder.sparse_encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(PushEncoder(v1::ENCODING_BF16, 0.01).sparse_encoding(), v1::ENCODING_BF16);
  EXPECT_EQ(PushEncoder(v1::ENCODING_SIGN1, 0.01).sparse_encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(PushEncoder(v1::ENCODING_TOPK, 0.01).sparse_encoding(), v1::ENCODING_FP32);
}

// Error feedback's invariant, per partition: what was sent over the steps plus the residual is
// exactly what was pushed. Two partitions of one tensor and one of another keep apart residuals.
TEST(PushEncoderTest, EachPartitionSendsItsGradientsOverTheSteps) {
  for (v1::Encoding encoding : {v1::ENCODING_SIGN1, v1::ENCODING_TOPK}) {
    PushEncoder encoder(encoding, 0.25);
    const size_t n = 8;
    struct Part {
      const char* tensor;
      uint32_t index;
      std::vector<double> pushed, sent;
    };
    std::vector<Part> parts = {{"a", 0, {}, {}}, {"a", 1, {}, {}}, {"b", 0, {}, {}}};
    for (Part& p : parts) p.pushed.assign(n, 0), p.sent.assign(n, 0);
    for (int step = 0; step < 20; ++step) {
      for (size_t k = 0; k < parts.size(); ++k) {
        Part& p = parts[k];
        std::vector<float> g(n);
        for (size_t i = 0; i < n; ++i) {
          g[i] = static_cast<float>((k + 1) * (i % 3 == 0 ? -0.5 : 0.25) * (1 + step % 4));
          p.pushed[i] += g[i];
        }
        v1::Slice slice;
        EXPECT_TRUE(encoder.Encode(p.tensor, p.index, g.data(), n, &slice).empty());
        const std::vector<float> d = Decoded(encoding, slice, n);
        for (size_t i = 0; i < n; ++i) p.sent[i] += d[i];
      }
    }
    // Without per-partition residuals the three partitions' sums would mix; the total residual
    // is what separates sent from pushed.
    double gap = 0;
    for (const Part& p : parts) {
      for (size_t i = 0; i < n; ++i) gap += std::abs(p.pushed[i] - p.sent[i]);
    }
    EXPECT_NEAR(gap, encoder.ResidualL1(), 1e-3 * (1 + gap)) << v1::Encoding_Name(encoding);
    EXPECT_GT(encoder.ResidualL1(), 0.0) << v1::Encoding_Name(encoding);
    // The residual stays bounded: far below what was pushed.
    double pushed = 0;
    for (const Part& p : parts) {
      for (double v : p.pushed) pushed += std::abs(v);
    }
    EXPECT_LT(encoder.ResidualL1(), 0.2 * pushed) << v1::Encoding_Name(encoding);
  }
}

TEST(PushEncoderTest, TopKSendsTheFractionOfEachPartition) {
  PushEncoder encoder(v1::ENCODING_TOPK, 0.1);
  std::vector<float> g(100);
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i);
  v1::Slice slice;
  encoder.Encode("w", 3, g.data(), g.size(), &slice);
  ASSERT_EQ(slice.data().size(), 8u * 10);
  uint32_t first;
  std::memcpy(&first, slice.data().data(), 4);
  EXPECT_EQ(first, 90u);  // the ten largest are 90..99
}

}  // namespace
}  // namespace client
}  // namespace tessera
