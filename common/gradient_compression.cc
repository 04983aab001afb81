#include "common/gradient_compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

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
// shard's non_finite_policy instead of being dropped silently. As a key: the bits of |v|, which
// order non-negative floats as their values do, with NaN's (above Inf's) lowered to Inf's, so
// that NaN and Inf tie as one rank and the lower index goes first.
uint32_t RankKey(uint32_t bits) { return std::min(bits & 0x7fffffffu, 0x7f800000u); }

constexpr size_t kInt8Block = 256;
size_t Int8Blocks(size_t n) { return (n + kInt8Block - 1) / kInt8Block; }

uint32_t KeyAt(const float* x, size_t i) {
  return RankKey(ReadU32(reinterpret_cast<const char*>(x + i)));
}

// The k-th largest rank key of x[0, n), and in *above how many keys exceed it.
// REQUIRES: 0 < k <= n.
//
// Selecting among all n values costs a copy of them and several passes (std::nth_element); on a
// large partition a strided sample of the keys first gives a bound t that, by the sample, about
// 1.2 k values plus a margin reach. The values at or above t are the candidates, and when at least
// k of them exist the k-th largest of all is the k-th largest of the candidates (every key above
// it is at least t too). A sample that set t too high (fewer than k candidates) or far too low
// (more candidates than `candidates` has room for, about 0.3 n + k) falls back to all values, so
// the answer is exact either way; only the time and the memory depend on the sample.
uint32_t KthLargestKey(const float* x, size_t n, size_t k, size_t* above,
                       std::vector<uint32_t>* candidates) {
  constexpr size_t kSample = 4096;
  std::vector<uint32_t>& c = *candidates;
  size_t count = 0;
  bool sampled = false;
  if (n >= 4 * kSample && k <= n / 2) {
    std::vector<uint32_t> sample(kSample);
    for (size_t j = 0; j < kSample; ++j) sample[j] = KeyAt(x, j * n / kSample);
    const double expected = static_cast<double>(k) * kSample / static_cast<double>(n);
    const auto position = static_cast<size_t>(1.2 * expected + 4.0 * std::sqrt(expected) + 8.0);
    if (position < kSample) {
      std::nth_element(sample.begin(), sample.begin() + static_cast<ptrdiff_t>(position),
                       sample.end(), std::greater<uint32_t>());
      const uint32_t bound = sample[position];
      // Room for twice the candidates the sample predicts.
      const size_t room = std::min(n, 2 * (position + 1) * (n / kSample) + k);
      if (c.size() < room) c.resize(room);
      // Branch-free (a branch taken for about one value in eight at random mispredicts often):
      // every key is written, and the end moves past it only when it is a candidate.
      size_t i = 0;
      for (; i < n && count < room; ++i) {
        const uint32_t key = KeyAt(x, i);
        c[count] = key;
        count += key >= bound ? 1 : 0;
      }
      sampled = count >= k && (count < room || i == n);
    }
  }
  if (!sampled) {
    if (c.size() < n) c.resize(n);
    for (size_t i = 0; i < n; ++i) c[i] = KeyAt(x, i);
    count = n;
  }
  std::nth_element(c.begin(), c.begin() + static_cast<ptrdiff_t>(k - 1),
                   c.begin() + static_cast<ptrdiff_t>(count), std::greater<uint32_t>());
  const uint32_t threshold = c[k - 1];
  // nth_element leaves every key before position k-1 at least the threshold.
  size_t larger = 0;
  for (size_t i = 0; i + 1 < k; ++i) larger += c[i] > threshold ? 1 : 0;
  *above = larger;
  return threshold;
}

}  // namespace

bool IsCompressed(v1::Encoding encoding) {
  return encoding == v1::ENCODING_SIGN1 || encoding == v1::ENCODING_TOPK;
}

bool IsWeightDelta(v1::Encoding encoding) {
  return encoding == v1::ENCODING_TOPK || encoding == v1::ENCODING_INT8;
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
                      std::string* out, TopKScratch* scratch) {
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
  if (top_k == 0) {
    out->clear();
    return;
  }
  TopKScratch local;
  if (scratch == nullptr) scratch = &local;
  size_t above = 0;
  const uint32_t threshold = KthLargestKey(x, n, top_k, &above, &scratch->candidates);
  // Branch-free as in KthLargestKey: each pair is written, and kept when its value is taken;
  // the spare pair at the end takes the writes after the last kept one.
  size_t ties = top_k - above;
  out->resize(8 * top_k + 8);
  char* p = out->data();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = KeyAt(x, i);
    const bool tie = key == threshold && ties > 0;
    const auto index = static_cast<uint32_t>(i);
    std::memcpy(p, &index, 4);
    std::memcpy(p + 4, x + i, 4);
    ties -= tie ? 1 : 0;
    p += key > threshold || tie ? 8 : 0;
  }
  out->resize(8 * top_k);
}

size_t Int8Bytes(size_t n) { return 4 * Int8Blocks(n) + n; }

bool EncodeInt8(const float* x, size_t n, std::string* out) {
  const size_t blocks = Int8Blocks(n);
  out->resize(Int8Bytes(n));
  char* scales = out->data();
  auto* q = reinterpret_cast<int8_t*>(out->data() + 4 * blocks);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * kInt8Block, end = std::min(n, begin + kInt8Block);
    float largest = 0;
    uint32_t non_finite = 0;  // NaN and Inf have every exponent bit set
    for (size_t i = begin; i < end; ++i) {
      largest = std::max(largest, std::fabs(x[i]));
      const uint32_t bits = ReadU32(reinterpret_cast<const char*>(x + i));
      non_finite |= (bits & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
    }
    if (non_finite != 0) return false;
    const float scale = largest / 127.0f;
    std::memcpy(scales + 4 * b, &scale, 4);
    // Divided, not multiplied by 1 / scale: that overflows to Inf for a scale below 2^-128. A
    // block too small for a nonzero scale sends zeros; its change stays in the next difference.
    // Rounded to the nearest step, ties to even, as std::nearbyint does, but by adding and
    // taking away 1.5 * 2^23 (exact for |v| <= 127), which vectorises where a libm call does not.
    constexpr float kRound = 12582912.0f;
    for (size_t i = begin; i < end; ++i) {
      const float steps = scale > 0 ? std::clamp(x[i] / scale, -127.0f, 127.0f) : 0.0f;
      q[i] = static_cast<int8_t>((steps + kRound) - kRound);
    }
  }
  return true;
}

absl::Status CheckInt8(absl::string_view bytes, size_t n) {
  if (bytes.size() != Int8Bytes(n)) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", Int8Bytes(n),
                                                   " bytes of ENCODING_INT8 for ", n,
                                                   " values but got ", bytes.size()));
  }
  for (size_t b = 0; b < Int8Blocks(n); ++b) {
    const float scale = ReadFloat(bytes.data() + 4 * b);
    if (!(std::isfinite(scale) && scale >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ENCODING_INT8 block ", b, ": scale ", scale, " is not finite and >= 0"));
    }
  }
  return absl::OkStatus();
}

void AddInt8(absl::string_view bytes, float* out, size_t n) {
  const size_t blocks = Int8Blocks(n);
  const auto* q = reinterpret_cast<const int8_t*>(bytes.data() + 4 * blocks);
  for (size_t b = 0; b < blocks; ++b) {
    const float scale = ReadFloat(bytes.data() + 4 * b);
    const size_t begin = b * kInt8Block, end = std::min(n, begin + kInt8Block);
    for (size_t i = begin; i < end; ++i) out[i] += static_cast<float>(q[i]) * scale;
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
  EncodeCompressed(encoding, sum_.data(), n, top_k, out, &scratch_);
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
  residual_.swap(sum_);  // sum_ is scratch until the next call
  for (size_t i = 0; i + 8 <= out->size(); i += 8) residual_[ReadU32(out->data() + i)] = 0.0f;
}

double ErrorFeedback::ResidualL1() const {
  double l1 = 0;
  for (float r : residual_) l1 += std::fabs(r);
  return l1;
}

}  // namespace tessera
