#include "common/encoding.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

size_t BytesPerValue(v1::Encoding encoding) {
  switch (encoding) {
    case v1::ENCODING_UNSPECIFIED:
    case v1::ENCODING_FP32:
      return 4;
    case v1::ENCODING_BF16:
    case v1::ENCODING_FP16:
      return 2;
    default:
      return 0;
  }
}

uint16_t FloatToBf16(float f) {
  uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t FloatToFp16(float f) {
  const uint32_t u = Bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> Inf
  if (abs < 0x38800000u) {
    // Subnormal or zero in fp16: shift the implicit-one mantissa and round to nearest even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return FromBits(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return FromBits(sign);
    // Subnormal: value = mant * 2^-24.
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

namespace {

// BF16 eight values at a time: -O2 vectorises a loop of fixed length, not one of n (a pull of
// the MLP's weights is 250k conversions on each side). Same results as the scalar functions.
void EncodeBf16(const float* in, size_t n, char* p) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint32_t u[8];
    uint16_t h[8];
    std::memcpy(u, in + i, sizeof(u));
    for (size_t j = 0; j < 8; ++j) {
      const uint32_t nan = (u[j] >> 16) | 0x40u;
      const uint32_t rounded = (u[j] + 0x7fffu + ((u[j] >> 16) & 1u)) >> 16;
      h[j] = static_cast<uint16_t>((u[j] & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
    }
    std::memcpy(p + 2 * i, h, sizeof(h));
  }
  for (; i < n; ++i) {
    const uint16_t h = FloatToBf16(in[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

void DecodeBf16(const char* p, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint16_t h[8];
    uint32_t u[8];
    std::memcpy(h, p + 2 * i, sizeof(h));
    for (size_t j = 0; j < 8; ++j) u[j] = static_cast<uint32_t>(h[j]) << 16;
    std::memcpy(out + i, u, sizeof(u));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = Bf16ToFloat(h);
  }
}

}  // namespace

absl::Status DecodeValues(v1::Encoding encoding, absl::string_view bytes, float* out, size_t n) {
  const size_t width = BytesPerValue(encoding);
  if (width == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown encoding ", static_cast<int>(encoding)));
  }
  if (bytes.size() != n * width) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", n, " values (", n * width,
                                                   " bytes) but got ", bytes.size(), " bytes"));
  }
  const char* p = bytes.data();
  if (n == 0) return absl::OkStatus();  // memcpy must not see the null pointers of empty data
  if (width == 4) {
    std::memcpy(out, p, n * 4);
    return absl::OkStatus();
  }
  if (encoding == v1::ENCODING_BF16) {
    DecodeBf16(p, n, out);
    return absl::OkStatus();
  }
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = Fp16ToFloat(h);
  }
  return absl::OkStatus();
}

void EncodeValues(v1::Encoding encoding, const float* in, size_t n, std::string* out) {
  const size_t width = BytesPerValue(encoding);
  out->resize(n * width);
  char* p = out->data();
  if (n == 0) return;
  if (width == 4) {
    std::memcpy(p, in, n * 4);
    return;
  }
  if (encoding == v1::ENCODING_BF16) {
    EncodeBf16(in, n, p);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = FloatToFp16(in[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

}  // namespace tessera
