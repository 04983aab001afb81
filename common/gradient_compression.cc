#include "common/gradient_compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace {

float ReadFloat(const char* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

uint32_t ReadU32(const char* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

// The magnitude top-k ranks by: NaN ranks above everything, so that a bad gradient reaches the
// shard's non_finite_policy instead of being dropped silently.
float Rank(float v) { return std::isnan(v) ? INFINITY : std::fabs(v); }

}  // namespace

bool IsCompressed(v1::Encoding encoding) {
  return encoding == v1::ENCODING_SIGN1 || encoding == v1::ENCODING_TOPK;
}

size_t Sign1Bytes(size_t n) { return 4 + (n + 7) / 8; }

size_t TopKCount(size_t n, double fraction) {
  if (n == 0) return 0;
  const double k = std::ceil(fraction * static_cast<double>(n));
  return std::clamp<size_t>(static_cast<size_t>(k), 1, n);
}

absl::Status CheckCompressed(v1::Encoding encoding, absl::string_view bytes, size_t n,
                             bool* non_finite) {
  bool bad = false;
  if (encoding == v1::ENCODING_SIGN1) {
    if (bytes.size() != Sign1Bytes(n)) {
      return absl::InvalidArgumentError(absl::StrCat("expected ", Sign1Bytes(n),
                                                     " bytes of ENCODING_SIGN1 for ", n,
                                                     " values but got ", bytes.size()));
    }
    const float scale = ReadFloat(bytes.data());
    if (std::isfinite(scale) && scale < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ENCODING_SIGN1 scale must be >= 0, got ", scale));
    }
    bad = !std::isfinite(scale);
    if (n % 8 != 0) {
      const auto last = static_cast<unsigned char>(bytes.back());
      if ((last >> (n % 8)) != 0) {
        return absl::InvalidArgumentError(
            "ENCODING_SIGN1: the unused bits of the last byte must be zero");
      }
    }
  } else {
    if (bytes.size() % 8 != 0 || bytes.size() / 8 > n) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected a multiple of 8 bytes of ENCODING_TOPK, at most ", 8 * n, " for ",
                       n, " values, but got ", bytes.size()));
    }
    const size_t k = bytes.size() / 8;
    int64_t previous = -1;
    for (size_t i = 0; i < k; ++i) {
      const uint32_t index = ReadU32(bytes.data() + 8 * i);
      if (index >= n || static_cast<int64_t>(index) <= previous) {
        return absl::InvalidArgumentError(
            absl::StrCat("ENCODING_TOPK pair ", i, ": index ", index,
                         index >= n ? absl::StrCat(" is not below ", n)
                                    : absl::StrCat(" does not follow ", previous)));
      }
      previous = index;
      bad = bad || !std::isfinite(ReadFloat(bytes.data() + 8 * i + 4));
    }
  }
  if (non_finite != nullptr) *non_finite = bad;
  return absl::OkStatus();
}

void DecodeCompressed(v1::Encoding encoding, absl::string_view bytes, float* out, size_t n) {
  if (encoding == v1::ENCODING_SIGN1) {
    // Each value is the scale with bit i as its sign bit; a byte's eight at a time (vectorised).
    const uint32_t scale = ReadU32(bytes.data());
    const auto* bits = reinterpret_cast<const unsigned char*>(bytes.data() + 4);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const uint32_t b = bits[i / 8];
      uint32_t v[8];
      for (uint32_t j = 0; j < 8; ++j) v[j] = scale | (((b >> j) & 1u) << 31);
      std::memcpy(out + i, v, sizeof(v));
    }
    for (; i < n; ++i) {
      const uint32_t v = scale | (((bits[i / 8] >> (i % 8)) & 1u) << 31);
      std::memcpy(out + i, &v, 4);
    }
    return;
  }
  std::fill(out, out + n, 0.0f);
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    out[ReadU32(bytes.data() + i)] = ReadFloat(bytes.data() + i + 4);
  }
}

void AddTopK(absl::string_view bytes, float* out) {
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    out[ReadU32(bytes.data() + i)] += ReadFloat(bytes.data() + i + 4);
  }
}

void EncodeCompressed(v1::Encoding encoding, const float* x, size_t n, size_t top_k,
                      std::string* out) {
  if (encoding == v1::ENCODING_SIGN1) {
    out->assign(Sign1Bytes(n), '\0');
    // Eight partial sums, so that the loop vectorises without reordering one sum.
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (size_t j = 0; j < 8; ++j) lanes[j] += std::fabs(x[i + j]);
    }
    double l1 = 0;
    for (; i < n; ++i) l1 += std::fabs(x[i]);
    for (double lane : lanes) l1 += lane;
    const float scale = n == 0 ? 0.0f : static_cast<float>(l1 / static_cast<double>(n));
    std::memcpy(out->data(), &scale, 4);
    auto* bits = reinterpret_cast<unsigned char*>(out->data() + 4);
    for (i = 0; i + 8 <= n; i += 8) {
      uint32_t u[8];
      std::memcpy(u, x + i, sizeof(u));
      uint32_t b = 0;
      for (uint32_t j = 0; j < 8; ++j) b |= (u[j] >> 31) << j;
      bits[i / 8] = static_cast<unsigned char>(b);
    }
    for (; i < n; ++i) {
      if (std::signbit(x[i])) bits[i / 8] |= static_cast<unsigned char>(1u << (i % 8));
    }
    return;
  }
  // The k-th largest rank is the threshold: every value above it goes, and of those equal to it
  // the lowest indices, so one pass in index order writes the pairs already sorted.
  out->resize(8 * top_k);
  if (top_k == 0) return;
  std::vector<float> rank(x, x + n);
  for (float& r : rank) r = Rank(r);
  std::nth_element(rank.begin(), rank.begin() + (top_k - 1), rank.end(), std::greater<float>());
  const float threshold = rank[top_k - 1];
  size_t above = 0;
  for (size_t i = 0; i < n; ++i) above += Rank(x[i]) > threshold ? 1 : 0;
  size_t ties = top_k - above;
  char* p = out->data();
  for (size_t i = 0; i < n; ++i) {
    const float r = Rank(x[i]);
    if (r > threshold || (r == threshold && ties > 0)) {
      if (r == threshold) --ties;
      const auto index = static_cast<uint32_t>(i);
      std::memcpy(p, &index, 4);
      std::memcpy(p + 4, x + i, 4);
      p += 8;
    }
  }
}

void ErrorFeedback::Encode(v1::Encoding encoding, const float* g, size_t n, size_t top_k,
                           std::string* out) {
  if (residual_.size() != n) residual_.assign(n, 0.0f);
  sum_.resize(n);
  // NaN and Inf have every exponent bit set; or-ing a flag keeps the loop vectorised.
  uint32_t non_finite = 0;
  for (size_t i = 0; i < n; ++i) {
    const float v = g[i] + residual_[i];
    sum_[i] = v;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    non_finite |= (u & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
  }
  EncodeCompressed(encoding, sum_.data(), n, top_k, out);
  if (non_finite != 0) {
    std::fill(residual_.begin(), residual_.end(), 0.0f);
    return;
  }
  // residual = sum - decode(out), without a second buffer: the decoded values are either
  // +-scale everywhere (SIGN1) or the sum itself at the pairs (TOPK).
  if (encoding == v1::ENCODING_SIGN1) {
    const float scale = ReadFloat(out->data());
    for (size_t i = 0; i < n; ++i) residual_[i] = sum_[i] - std::copysign(scale, sum_[i]);
    return;
  }
  std::copy(sum_.begin(), sum_.end(), residual_.begin());
  for (size_t i = 0; i + 8 <= out->size(); i += 8) residual_[ReadU32(out->data() + i)] = 0.0f;
}

double ErrorFeedback::ResidualL1() const {
  double l1 = 0;
  for (float r : residual_) l1 += std::fabs(r);
  return l1;
}

}  // namespace tessera
