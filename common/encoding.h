// Wire encodings of tensor values: fp32, bf16 and fp16, little-endian (DESIGN.md §3).
#ifndef TESSERA_COMMON_ENCODING_H_
#define TESSERA_COMMON_ENCODING_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {

// Bytes per value of `encoding`, or 0 for a value that is not a known encoding.
size_t BytesPerValue(v1::Encoding encoding);

// Decodes `bytes` into n floats at `out`. INVALID_ARGUMENT when the encoding is unknown or the
// byte count is not n * BytesPerValue(encoding); the message names both sizes.
absl::Status DecodeValues(v1::Encoding encoding, absl::string_view bytes, float* out, size_t n);

// Replaces *out with the n values at `in` in `encoding`. REQUIRES: a known encoding.
void EncodeValues(v1::Encoding encoding, const float* in, size_t n, std::string* out);

// Round-to-nearest-even conversions; NaN stays NaN, overflow becomes Inf.
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);
float Fp16ToFloat(uint16_t h);

}  // namespace tessera

#endif  // TESSERA_COMMON_ENCODING_H_
