#include "server/gradient_payload.h"

#include "common/gradient_compression.h"

namespace tessera::server {
namespace {

// The fp32 check runs over blocks of this many values (1 KiB), and asks for the bytes
// kNonFinitePrefetchBytes ahead of each block to be fetched meanwhile: the check is the first
// pass over a gradient that the kernel has just copied into gRPC's receive buffers, in pieces of 8
// to 64 KiB that the hardware prefetcher does not follow across pages, and it waited on those
// loads (measured: 4 shards, 1 client, 64 MiB, ratio 0.463 without and 0.486 with, means of 5
// interleaved runs; docs/benchmarks.md).
constexpr size_t kNonFiniteBlockValues = 256;
constexpr size_t kNonFinitePrefetchBytes = 2048;

}  // namespace

bool HasNonFinite(v1::Encoding encoding, absl::string_view bytes) {
  const char* p = bytes.data();
  if (BytesPerValue(encoding) == 4) {
    const size_t n = bytes.size() / 4;
    uint32_t bad = 0;
    for (size_t begin = 0; begin < n; begin += kNonFiniteBlockValues) {
      const size_t end = std::min(n, begin + kNonFiniteBlockValues);
      const size_t ahead = 4 * begin + kNonFinitePrefetchBytes;
      for (size_t line = 0; line < 4 * kNonFiniteBlockValues && ahead + line < bytes.size();
           line += 64) {
        __builtin_prefetch(p + ahead + line);
      }
#pragma omp simd reduction(| : bad)
      for (size_t i = begin; i < end; ++i) {
        uint32_t u;
        std::memcpy(&u, p + 4 * i, 4);
        bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
      }
    }
    return bad != 0;
  }
  const uint16_t mask = encoding == v1::ENCODING_BF16 ? 0x7f80u : 0x7c00u;
  const size_t n = bytes.size() / 2;
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    bad |= static_cast<uint32_t>((h & mask) == mask);
  }
  return bad != 0;
}

absl::string_view Contiguous(const SliceView& slice, std::string* buffer) {
  if (slice.pieces.empty()) return slice.data;
  buffer->clear();
  buffer->reserve(DataSize(slice));
  for (absl::string_view piece : slice.pieces) buffer->append(piece.data(), piece.size());
  return *buffer;
}

bool HasNonFinite(const SliceView& slice) {
  const size_t width = BytesPerValue(slice.encoding);
  bool bad = false;
  ForEachRun(slice, width, [&](const char* p, size_t n) {
    if (!bad) bad = HasNonFinite(slice.encoding, absl::string_view(p, n));
  });
  return bad;
}

size_t DataSize(const SliceView& slice) {
  if (slice.pieces.empty()) return slice.data.size();
  size_t n = 0;
  for (absl::string_view piece : slice.pieces) n += piece.size();
  return n;
}

void DecodeSlice(const SliceView& slice, float* out, size_t n) {
  if (IsCompressed(slice.encoding)) {
    std::string buffer;
    DecodeCompressed(slice.encoding, Contiguous(slice, &buffer), out, n);
    return;
  }
  const size_t width = BytesPerValue(slice.encoding);
  size_t at = 0;
  ForEachRun(slice, width, [&](const char* p, size_t bytes) {
    const size_t k = std::min(bytes / width, n - at);
    DecodeValues(slice.encoding, absl::string_view(p, k * width), out + at, k).IgnoreError();
    at += k;
  });
}

SparseGrad MergeRows(const SliceView& slice, uint32_t dim) {
  const size_t k = slice.row_ids.size();
  std::vector<float> raw(k * dim);
  DecodeSlice(slice, raw.data(), raw.size());
  std::vector<size_t> order(k);
  for (size_t i = 0; i < k; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return slice.row_ids[a] < slice.row_ids[b]; });
  SparseGrad out;
  out.ids.reserve(k);
  out.values.reserve(k * dim);
  for (size_t i : order) {
    const float* src = raw.data() + i * dim;
    if (!out.ids.empty() && out.ids.back() == slice.row_ids[i]) {
      float* dst = out.values.data() + (out.ids.size() - 1) * dim;
      for (uint32_t j = 0; j < dim; ++j) dst[j] += src[j];
    } else {
      out.ids.push_back(slice.row_ids[i]);
      out.values.insert(out.values.end(), src, src + dim);
    }
  }
  return out;
}

}  // namespace tessera::server
