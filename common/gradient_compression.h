// Compressed dense gradients on the wire: 1-bit sign and top-k (issue #17), and the error
// feedback that keeps them converging (the worker adds what an encoding dropped to its next
// gradient, as BytePS's compressors do).
//
// Formats (v1::Encoding, parameter.proto), for a partition of n values:
//   SIGN1  4 + ceil(n / 8) bytes: an fp32 scale (the mean |x| of the values encoded), then bit i
//          (byte i / 8, least significant first) set when value i is -scale, clear for +scale;
//          the unused bits of the last byte are zero.
//   TOPK   8 * k bytes, 0 <= k <= n: k pairs (uint32 index, fp32 value), little-endian, indices
//          strictly increasing and below n; every other value is zero.
//   INT8   4 * ceil(n / 256) + n bytes (weight deltas in pulls only): an fp32 scale per block of
//          256 values, then one int8 q per value (the encoder writes -127 to 127); value i is q_i *
//          scale_(i / 256).
// The shard validates a payload whole (CheckCompressed) and decodes it to n floats; a sparse
// table's rows are never compressed (they are sparse already).
#ifndef TESSERA_COMMON_GRADIENT_COMPRESSION_H_
#define TESSERA_COMMON_GRADIENT_COMPRESSION_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {

// SIGN1 or TOPK.
bool IsCompressed(v1::Encoding encoding);

// Pull encodings that answer a dense partition with a change of the weights the puller holds
// (server/published_weights.h): TOPK and INT8.
bool IsWeightDelta(v1::Encoding encoding);

// Bytes of a SIGN1 payload of n values.
size_t Sign1Bytes(size_t n);

// The number of values a TOPK push keeps of n: ceil(fraction * n), at least 1 when n > 0.
// REQUIRES: 0 < fraction <= 1.
size_t TopKCount(size_t n, double fraction);

// INVALID_ARGUMENT (naming the sizes, or the first bad index) unless `bytes` is a well-formed
// payload of n values in `encoding`. `non_finite`, when given, is set when the scale or a value is
// NaN or Inf. REQUIRES: IsCompressed(encoding).
absl::Status CheckCompressed(v1::Encoding encoding, absl::string_view bytes, size_t n,
                             bool* non_finite = nullptr);

// Decodes a payload that CheckCompressed accepted into out[0, n).
void DecodeCompressed(v1::Encoding encoding, absl::string_view bytes, float* out, size_t n);

// Adds a TOPK payload that CheckCompressed accepted to out[0, n): out[index] += value per pair
// (weight deltas, server/published_weights.h; both ends add the same floats the same way).
void AddTopK(absl::string_view bytes, float* out);

// Replaces *out with the payload of x[0, n): SIGN1 (top_k ignored), or TOPK keeping the top_k
// values of largest magnitude (ties: the lower index). REQUIRES: IsCompressed(encoding),
// top_k <= n.
//
// TOPK selects among candidates kept in a buffer (about 1.5 bytes per value at a fraction of
// 0.1, 4 when its sample misled it); a caller that encodes often keeps a TopKScratch for it, so
// that each call does not allocate (and fault in) it anew. Null: a local buffer.
struct TopKScratch {
  std::vector<uint32_t> candidates;
};
void EncodeCompressed(v1::Encoding encoding, const float* x, size_t n, size_t top_k,
                      std::string* out, TopKScratch* scratch = nullptr);

// INT8 weight deltas. Int8Bytes: the payload's size for n values. EncodeInt8 replaces *out with
// the payload of x[0, n), each block scaled by its largest magnitude, each value rounded to the
// nearest step; false, leaving *out unspecified, when x holds NaN or Inf. CheckInt8:
// INVALID_ARGUMENT (naming the size or the block) unless `bytes` is a payload of n values with
// finite scales >= 0. AddInt8 adds a checked payload to out[0, n) (both ends add the same floats
// the same way, so a copy built from the deltas is the shard's bit for bit).
size_t Int8Bytes(size_t n);
bool EncodeInt8(const float* x, size_t n, std::string* out);
absl::Status CheckInt8(absl::string_view bytes, size_t n);
void AddInt8(absl::string_view bytes, float* out, size_t n);

// One partition's error feedback: the part of past gradients the encoding has not sent yet.
class ErrorFeedback {
 public:
  // Encodes g[0, n) plus the residual into *out and keeps, as the new residual, what the payload
  // does not carry: (g + residual) - decode(*out). A gradient holding NaN or Inf is encoded as it
  // is (the shard's non_finite_policy decides) and clears the residual, so that one bad step does
  // not poison every later one. REQUIRES: n is the same on every call.
  void Encode(v1::Encoding encoding, const float* g, size_t n, size_t top_k, std::string* out);

  // The residual (empty before the first Encode).
  const std::vector<float>& residual() const { return residual_; }
  // Sum of |residual|, for the logs and the tests.
  double ResidualL1() const;

 private:
  std::vector<float> residual_;
  std::vector<float> sum_;  // g + residual, reused
  TopKScratch scratch_;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_GRADIENT_COMPRESSION_H_
