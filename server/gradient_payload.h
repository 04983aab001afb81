// Reading the payload of a pushed slice where it lies: its size, the NaN/Inf check, decoding, and
// runs of whole values over a transport's receive buffers at any alignment (see SliceView).
//
// A pushed fp32 gradient is read twice and copied never: once by HasNonFinite, once by the
// optimizer through ForEachGradientRun (docs/data-plane.md, "The PushPull stream on the wire").
#ifndef TESSERA_SERVER_GRADIENT_PAYLOAD_H_
#define TESSERA_SERVER_GRADIENT_PAYLOAD_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/encoding.h"
#include "common/push_pull_view.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// A sparse gradient with unique row ids (duplicates in a push are summed in order).
struct SparseGrad {
  std::vector<int64_t> ids;
  std::vector<float> values;  // ids.size() * dim
};

// True when any value in `bytes` (values of `encoding`, a known one) is NaN or Inf, checked on
// the raw bits.
bool HasNonFinite(v1::Encoding encoding, absl::string_view bytes);
// The same over the slice's data, piece by piece. REQUIRES: a known, uncompressed encoding.
bool HasNonFinite(const SliceView& slice);

// Bytes of the slice's data (see SliceView).
size_t DataSize(const SliceView& slice);

// The slice's data in one piece: slice.data, or its pieces copied into *buffer.
absl::string_view Contiguous(const SliceView& slice, std::string* buffer);

// Decodes the slice's n values into out[0, n), compressed ones too. REQUIRES: the size and
// encoding were validated (CheckCompressed for a compressed one).
void DecodeSlice(const SliceView& slice, float* out, size_t n);

// The slice's rows (slice.row_ids, dim values each) decoded, sorted by row id, with the values of
// repeated ids summed in request order. REQUIRES: the size and encoding were validated.
SparseGrad MergeRows(const SliceView& slice, uint32_t dim);

// Calls run(const char* bytes, size_t size) over the slice's data in order, in runs of whole
// values of `width` bytes at any alignment; a value that straddles two pieces is passed alone from
// a small buffer. REQUIRES: DataSize(slice) is a multiple of width, and width <= 8.
template <typename Run>
void ForEachRun(const SliceView& slice, size_t width, const Run& run) {
  if (slice.pieces.empty()) {
    if (!slice.data.empty()) run(slice.data.data(), slice.data.size());
    return;
  }
  char carry[8];
  size_t carried = 0;
  for (absl::string_view piece : slice.pieces) {
    const char* p = piece.data();
    size_t n = piece.size();
    if (carried > 0) {
      const size_t k = std::min(width - carried, n);
      std::memcpy(carry + carried, p, k);
      carried += k;
      p += k;
      n -= k;
      if (carried < width) continue;
      run(static_cast<const char*>(carry), width);
      carried = 0;
    }
    const size_t whole = n / width * width;
    if (whole > 0) run(p, whole);
    if (n > whole) std::memcpy(carry, p + whole, n - whole);
    carried = n - whole;
  }
}

// Calls apply(const float* g, size_t begin, size_t count) or apply_bytes(const char* g, size_t
// begin, size_t count) over the slice's n values, in order: once with the payload itself when it
// is aligned fp32 in one piece; for other fp32 data, apply_bytes over each run of whole values as
// it lies in the pieces, at any alignment (the optimizer reads such bytes directly, so the
// gradient is read once, in place; a value split between two pieces comes alone from a small
// buffer); for bf16, fp16 and the compressed encodings, once with the whole gradient decoded
// into `scratch`.
// REQUIRES: the size and encoding were validated.
template <typename Apply, typename ApplyBytes>
void ForEachGradientRun(const SliceView& slice, size_t n, std::vector<float>* scratch,
                        const Apply& apply, const ApplyBytes& apply_bytes) {
  if (BytesPerValue(slice.encoding) != 4) {
    scratch->resize(n);
    DecodeSlice(slice, scratch->data(), n);
    apply(static_cast<const float*>(scratch->data()), size_t{0}, n);
    return;
  }
  if (slice.pieces.empty() &&
      reinterpret_cast<uintptr_t>(slice.data.data()) % alignof(float) == 0) {
    apply(reinterpret_cast<const float*>(slice.data.data()), size_t{0}, n);
    return;
  }
  size_t done = 0;
  ForEachRun(slice, 4, [&](const char* p, size_t bytes) {
    const size_t k = std::min(bytes / 4, n - done);
    apply_bytes(p, done, k);
    done += k;
  });
}

}  // namespace tessera::server

#endif  // TESSERA_SERVER_GRADIENT_PAYLOAD_H_
