// The PushPull stream's messages in protobuf wire format, read and written by hand so that the
// shard neither copies a gradient into a protobuf string nor serialises weights into a fresh
// buffer (docs/benchmarks.md, "Push/pull goodput").
//
// Requests: ParsePushPullRequest reads a v1::PushPullRequest from the slices of a received
// grpc::ByteBuffer. The small fields (ids, keys, row ids) are copied; each gradient's bytes are
// viewed in place, as one view when they lie in one slice and otherwise as the list of their pieces
// in consecutive slices (gRPC delivers 8 to 64 KiB slices, so a 4 MiB gradient arrives in about 64
// pieces, and a value may straddle two); the store reads the pieces without first joining them.
// It is as strict as protobuf's parser and stricter where the parser would skip (a known field
// with the wrong wire type, groups), and it never reads past the end of the message or a field.
//
// Responses: SerializePushPullResponse writes a v1::PushPullResponse whose weight data lies in
// strings of a BufferPool or in the store's weights themselves: the header fields are serialised
// (small), and every large weight data becomes its own grpc::Slice, over the string (which goes
// back to the pool when gRPC releases it) or over a dense partition's fp32 weights shared with the
// store (SharedWeights, whose reference gRPC drops when it releases the slice; the store copies the
// weights before it next updates them if that has not happened yet).
//
// Header-only so that server/CMakeLists.txt need not change.
#ifndef TESSERA_SERVER_INTERNAL_PUSH_PULL_WIRE_H_
#define TESSERA_SERVER_INTERNAL_PUSH_PULL_WIRE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "google/protobuf/repeated_field.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/parameter_store.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server::internal {

// Strings whose capacity is kept for reuse, so that 4 MiB buffers are not allocated (and their
// pages faulted in) for every message. Thread-safe. Held through a shared_ptr, because the slices
// that return strings to it may outlive their stream.
class BufferPool {
 public:
  // Keeps at most `max_buffers` strings and `max_bytes` of capacity; beyond that, returned strings
  // are freed.
  BufferPool(size_t max_buffers, size_t max_bytes)
      : max_buffers_(max_buffers), max_bytes_(max_bytes) {}

  // An empty string, with the capacity of an earlier one when the pool holds one (the largest).
  std::string Take() {
    absl::MutexLock lock(&mu_);
    if (free_.empty()) return std::string();
    std::string s = std::move(free_.back());
    free_.pop_back();
    held_bytes_ -= s.capacity();
    s.clear();
    return s;
  }

  // Gives `s` back for reuse.
  void Give(std::string s) {
    if (s.capacity() < kMinPooledBytes) return;
    absl::MutexLock lock(&mu_);
    if (free_.size() >= max_buffers_ || held_bytes_ + s.capacity() > max_bytes_) return;
    held_bytes_ += s.capacity();
    free_.push_back(std::move(s));
  }

  size_t held_bytes() const {
    absl::MutexLock lock(&mu_);
    return held_bytes_;
  }

  // A grpc::Slice over the bytes of `data` that gives `data` back to `pool` once gRPC releases the
  // slice (on any thread, possibly after the stream is gone).
  static grpc::Slice MakeSlice(std::shared_ptr<BufferPool> pool, std::string data) {
    auto* holder = new Holder{std::move(pool), std::move(data)};
    return grpc::Slice(holder->data.data(), holder->data.size(), &Holder::Release, holder);
  }

 private:
  // Strings smaller than this are not worth keeping.
  static constexpr size_t kMinPooledBytes = 64 << 10;

  struct Holder {
    std::shared_ptr<BufferPool> pool;
    std::string data;
    static void Release(void* p) {
      auto* holder = static_cast<Holder*>(p);
      holder->pool->Give(std::move(holder->data));
      delete holder;
    }
  };

  const size_t max_buffers_;
  const size_t max_bytes_;
  mutable absl::Mutex mu_;
  std::vector<std::string> free_ ABSL_GUARDED_BY(mu_);
  size_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// One slice of a parsed request. Its data points into the request's received slices: `data` when
// it lies in one of them, else `pieces` (then `data` is empty). Pull slices keep no data.
struct ParsedSlice {
  std::string tensor;
  uint32_t index = 0;
  int32_t encoding = 0;
  absl::string_view data;
  std::vector<absl::string_view> pieces;
  std::vector<int64_t> row_ids;
  bool want_weights = false;
  int64_t version = 0;
};

// A v1::PushPullRequest read from the wire. It holds references to the received slices that its
// views point into. Not copyable (views point into it).
struct ParsedPushPullRequest {
  ParsedPushPullRequest() = default;
  ParsedPushPullRequest(const ParsedPushPullRequest&) = delete;
  ParsedPushPullRequest& operator=(const ParsedPushPullRequest&) = delete;

  // The request as the store takes it; valid while this object lives and is not changed.
  PushPullView View() const {
    PushPullView view;
    view.job_id = job_id;
    view.worker_id = worker_id;
    view.incarnation = incarnation;
    view.step = step;
    view.seq = seq;
    view.pull_encoding = static_cast<v1::Encoding>(pull_encoding);
    auto slice_view = [](const ParsedSlice& s) {
      SliceView v;
      v.tensor = s.tensor;
      v.index = s.index;
      v.encoding = static_cast<v1::Encoding>(s.encoding);
      v.data = s.data;
      v.pieces = absl::MakeConstSpan(s.pieces);
      v.row_ids = absl::MakeConstSpan(s.row_ids);
      v.want_weights = s.want_weights;
      return v;
    };
    view.push.reserve(push.size());
    for (const ParsedSlice& s : push) view.push.push_back(slice_view(s));
    view.pull.reserve(pull.size());
    for (const ParsedSlice& s : pull) view.pull.push_back(slice_view(s));
    return view;
  }

  std::string job_id;
  uint32_t worker_id = 0;
  uint64_t incarnation = 0;
  int64_t step = 0;
  uint64_t seq = 0;
  bool has_seq = false;  // a seq field was read (also when the parse failed later)
  std::vector<ParsedSlice> push;
  std::vector<ParsedSlice> pull;
  int32_t pull_encoding = 0;

  std::vector<grpc::Slice> received;
  size_t pieced_bytes = 0;  // gradient bytes that span received slices (read in pieces)
};

namespace wire_detail {

constexpr uint32_t kVarint = 0;
constexpr uint32_t kFixed64 = 1;
constexpr uint32_t kLengthDelimited = 2;
constexpr uint32_t kFixed32 = 5;

// A read cursor over a message that lies in several slices. Positions are absolute offsets into
// the message; every read is checked against `limit`, the end of the enclosing field.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) size_ += s.size();
    Settle();
  }

  size_t position() const { return position_; }
  size_t size() const { return size_; }

  bool ReadByte(size_t limit, uint8_t* b) {
    if (position_ >= limit || position_ >= size_) return false;
    *b = slices_[slice_].begin()[offset_];
    Advance(1);
    return true;
  }

  // A base-128 varint of at most 10 bytes.
  bool ReadVarint(size_t limit, uint64_t* v) {
    *v = 0;
    for (int i = 0; i < 10; ++i) {
      uint8_t b;
      if (!ReadByte(limit, &b)) return false;
      if (i == 9 && b > 1) return false;  // more than 64 bits
      *v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // Views the next n bytes, which must end by `limit`: *out when they lie in one slice, else
  // *pieces (when not null; *out is then empty). Returns false when they pass `limit`.
  bool ReadBytes(size_t limit, size_t n, absl::string_view* out,
                 std::vector<absl::string_view>* pieces) {
    if (n > limit - std::min(limit, position_) || n > size_ - position_) return false;
    *out = absl::string_view();
    if (pieces != nullptr) pieces->clear();
    if (n == 0) return true;
    if (n <= slices_[slice_].size() - offset_) {
      *out = absl::string_view(reinterpret_cast<const char*>(slices_[slice_].begin()) + offset_, n);
      Advance(n);
      return true;
    }
    size_t left = n;
    while (left > 0) {
      const size_t k = std::min(left, slices_[slice_].size() - offset_);
      if (pieces != nullptr) {
        pieces->emplace_back(reinterpret_cast<const char*>(slices_[slice_].begin()) + offset_, k);
      }
      Advance(k);
      left -= k;
    }
    return true;
  }

  // Copies the next n bytes into *out (small fields).
  bool ReadString(size_t limit, size_t n, std::string* out) {
    if (n > limit - std::min(limit, position_) || n > size_ - position_) return false;
    out->clear();
    out->reserve(n);
    size_t left = n;
    while (left > 0) {
      const size_t k = std::min(left, slices_[slice_].size() - offset_);
      out->append(reinterpret_cast<const char*>(slices_[slice_].begin()) + offset_, k);
      Advance(k);
      left -= k;
    }
    return true;
  }

  bool Skip(size_t limit, size_t n) {
    if (n > limit - std::min(limit, position_) || n > size_ - position_) return false;
    Advance(n);
    return true;
  }

 private:
  void Advance(size_t n) {
    position_ += n;
    while (n > 0) {
      const size_t k = std::min(n, slices_[slice_].size() - offset_);
      offset_ += k;
      n -= k;
      Settle();
    }
  }
  void Settle() {
    while (slice_ < slices_.size() && offset_ >= slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t size_ = 0;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t position_ = 0;
};

// True when `s` is well-formed UTF-8 (as protobuf requires of proto3 strings): no overlong forms,
// no surrogates, nothing above U+10FFFF.
inline bool IsUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t n;
    uint32_t cp;
    if ((c & 0xe0) == 0xc0) {
      n = 1;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i - 1 < n) return false;
    for (size_t k = 1; k <= n; ++k) {
      const uint8_t d = static_cast<uint8_t>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    static constexpr uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

inline absl::Status Malformed(absl::string_view what, size_t position) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed PushPullRequest: ", what, " at byte ", position));
}

// Reads a field's tag; fails on a tag of more than 5 bytes (protobuf refuses those, however small
// the value), field number 0, a number over 2^29 - 1, or wire types 3, 4, 6, 7.
inline absl::Status ReadTag(Cursor* in, size_t limit, uint32_t* field, uint32_t* wire_type) {
  const size_t at = in->position();
  uint64_t tag;
  if (!in->ReadVarint(limit, &tag) || in->position() - at > 5) {
    return Malformed("truncated or overlong field tag", at);
  }
  *field = static_cast<uint32_t>(tag >> 3);
  *wire_type = static_cast<uint32_t>(tag & 7);
  if (tag > 0xffffffffu || *field == 0) return Malformed("bad field number", at);
  if (*wire_type != kVarint && *wire_type != kFixed64 && *wire_type != kLengthDelimited &&
      *wire_type != kFixed32) {
    return Malformed(absl::StrCat("unsupported wire type ", *wire_type), at);
  }
  return absl::OkStatus();
}

// Skips a field of an unknown number.
inline absl::Status SkipField(Cursor* in, size_t limit, uint32_t wire_type) {
  const size_t at = in->position();
  uint64_t v;
  switch (wire_type) {
    case kVarint:
      if (!in->ReadVarint(limit, &v)) return Malformed("truncated varint", at);
      return absl::OkStatus();
    case kFixed64:
      if (!in->Skip(limit, 8)) return Malformed("truncated fixed64", at);
      return absl::OkStatus();
    case kFixed32:
      if (!in->Skip(limit, 4)) return Malformed("truncated fixed32", at);
      return absl::OkStatus();
    default:
      if (!in->ReadVarint(limit, &v)) return Malformed("truncated length", at);
      if (!in->Skip(limit, v)) return Malformed("length past the end", at);
      return absl::OkStatus();
  }
}

inline absl::Status ExpectWireType(uint32_t field, uint32_t wire_type, uint32_t want,
                                   absl::string_view name, size_t at) {
  if (wire_type == want) return absl::OkStatus();
  return Malformed(
      absl::StrCat("field ", name, " (", field, ") has wire type ", wire_type, ", expected ", want),
      at);
}

inline absl::Status ReadVarintField(Cursor* in, size_t limit, absl::string_view name, uint64_t* v) {
  const size_t at = in->position();
  if (!in->ReadVarint(limit, v)) return Malformed(absl::StrCat("truncated varint in ", name), at);
  return absl::OkStatus();
}

// Reads a length prefix and returns the end of the field it announces.
inline absl::Status ReadLength(Cursor* in, size_t limit, absl::string_view name, size_t* end) {
  const size_t at = in->position();
  uint64_t n;
  if (!in->ReadVarint(limit, &n)) return Malformed(absl::StrCat("truncated length of ", name), at);
  if (n > limit - std::min(limit, in->position()) || n > in->size() - in->position()) {
    return Malformed(absl::StrCat("length ", n, " of ", name, " past the end"), at);
  }
  *end = in->position() + static_cast<size_t>(n);
  return absl::OkStatus();
}

inline absl::Status ReadUtf8(Cursor* in, size_t limit, absl::string_view name, std::string* out) {
  size_t end;
  const size_t at = in->position();
  absl::Status s = ReadLength(in, limit, name, &end);
  if (!s.ok()) return s;
  in->ReadString(end, end - in->position(), out);
  if (!IsUtf8(*out)) return Malformed(absl::StrCat(name, " is not valid UTF-8"), at);
  return absl::OkStatus();
}

inline absl::Status ParsePartitionKey(Cursor* in, size_t limit, ParsedSlice* out) {
  while (in->position() < limit) {
    const size_t at = in->position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    absl::Status s = ReadTag(in, limit, &field, &wire_type);
    if (!s.ok()) return s;
    uint64_t v;
    switch (field) {
      case 1:
        if (!(s = ExpectWireType(field, wire_type, kLengthDelimited, "key.tensor", at)).ok())
          return s;
        if (!(s = ReadUtf8(in, limit, "key.tensor", &out->tensor)).ok()) return s;
        break;
      case 2:
        if (!(s = ExpectWireType(field, wire_type, kVarint, "key.index", at)).ok()) return s;
        if (!(s = ReadVarintField(in, limit, "key.index", &v)).ok()) return s;
        out->index = static_cast<uint32_t>(v);
        break;
      default:
        if (!(s = SkipField(in, limit, wire_type)).ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Parses one Slice that ends at `limit`. `keep_data`: view its data (push slices only).
inline absl::Status ParseSlice(Cursor* in, size_t limit, bool keep_data, ParsedSlice* out) {
  while (in->position() < limit) {
    const size_t at = in->position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    absl::Status s = ReadTag(in, limit, &field, &wire_type);
    if (!s.ok()) return s;
    uint64_t v;
    size_t end;
    switch (field) {
      case 1:  // key
        if (!(s = ExpectWireType(field, wire_type, kLengthDelimited, "key", at)).ok()) return s;
        if (!(s = ReadLength(in, limit, "key", &end)).ok()) return s;
        if (!(s = ParsePartitionKey(in, end, out)).ok()) return s;
        break;
      case 2:  // encoding
        if (!(s = ExpectWireType(field, wire_type, kVarint, "encoding", at)).ok()) return s;
        if (!(s = ReadVarintField(in, limit, "encoding", &v)).ok()) return s;
        out->encoding = static_cast<int32_t>(v);
        break;
      case 3: {  // data
        if (!(s = ExpectWireType(field, wire_type, kLengthDelimited, "data", at)).ok()) return s;
        if (!(s = ReadLength(in, limit, "data", &end)).ok()) return s;
        // A repeated data field: the last one wins.
        if (!in->ReadBytes(end, end - in->position(), &out->data,
                           keep_data ? &out->pieces : nullptr)) {
          return Malformed("data past the end", at);
        }
        break;
      }
      case 4:  // row_ids, packed or not
        if (wire_type == kVarint) {
          if (!(s = ReadVarintField(in, limit, "row_ids", &v)).ok()) return s;
          out->row_ids.push_back(static_cast<int64_t>(v));
        } else {
          if (!(s = ExpectWireType(field, wire_type, kLengthDelimited, "row_ids", at)).ok())
            return s;
          if (!(s = ReadLength(in, limit, "row_ids", &end)).ok()) return s;
          while (in->position() < end) {
            if (!(s = ReadVarintField(in, end, "row_ids", &v)).ok()) return s;
            out->row_ids.push_back(static_cast<int64_t>(v));
          }
        }
        break;
      case 5:  // want_weights
        if (!(s = ExpectWireType(field, wire_type, kVarint, "want_weights", at)).ok()) return s;
        if (!(s = ReadVarintField(in, limit, "want_weights", &v)).ok()) return s;
        out->want_weights = v != 0;
        break;
      case 6:  // version
        if (!(s = ExpectWireType(field, wire_type, kVarint, "version", at)).ok()) return s;
        if (!(s = ReadVarintField(in, limit, "version", &v)).ok()) return s;
        out->version = static_cast<int64_t>(v);
        break;
      default:
        if (!(s = SkipField(in, limit, wire_type)).ok()) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace wire_detail

// Parses `out->received` (the slices of one message) as a v1::PushPullRequest into *out, which
// must be freshly constructed. Gradient data is viewed in place (see ParsedSlice), never copied.
// INVALID_ARGUMENT, naming what is malformed and where, for anything protobuf would
// not parse and for known fields with the wrong wire type; out->has_seq then says whether the seq
// was read, so that the caller can answer that request alone. Never reads past the message.
inline absl::Status ParsePushPullRequest(ParsedPushPullRequest* out) {
  using namespace wire_detail;  // NOLINT: the wire helpers above
  Cursor in(out->received);
  const size_t limit = in.size();
  while (in.position() < limit) {
    const size_t at = in.position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    absl::Status s = ReadTag(&in, limit, &field, &wire_type);
    if (!s.ok()) return s;
    uint64_t v;
    size_t end;
    switch (field) {
      case 1:
        if (!(s = ExpectWireType(field, wire_type, kLengthDelimited, "job_id", at)).ok()) return s;
        if (!(s = ReadUtf8(&in, limit, "job_id", &out->job_id)).ok()) return s;
        break;
      case 2:
        if (!(s = ExpectWireType(field, wire_type, kVarint, "worker_id", at)).ok()) return s;
        if (!(s = ReadVarintField(&in, limit, "worker_id", &v)).ok()) return s;
        out->worker_id = static_cast<uint32_t>(v);
        break;
      case 3:
        if (!(s = ExpectWireType(field, wire_type, kVarint, "incarnation", at)).ok()) return s;
        if (!(s = ReadVarintField(&in, limit, "incarnation", &v)).ok()) return s;
        out->incarnation = v;
        break;
      case 4:
        if (!(s = ExpectWireType(field, wire_type, kVarint, "step", at)).ok()) return s;
        if (!(s = ReadVarintField(&in, limit, "step", &v)).ok()) return s;
        out->step = static_cast<int64_t>(v);
        break;
      case 5:
        if (!(s = ExpectWireType(field, wire_type, kVarint, "seq", at)).ok()) return s;
        if (!(s = ReadVarintField(&in, limit, "seq", &v)).ok()) return s;
        out->seq = v;
        out->has_seq = true;
        break;
      case 6:
      case 7: {
        const char* name = field == 6 ? "push" : "pull";
        if (!(s = ExpectWireType(field, wire_type, kLengthDelimited, name, at)).ok()) return s;
        if (!(s = ReadLength(&in, limit, name, &end)).ok()) return s;
        std::vector<ParsedSlice>& list = field == 6 ? out->push : out->pull;
        list.emplace_back();
        if (!(s = ParseSlice(&in, end, field == 6, &list.back())).ok()) return s;
        for (absl::string_view piece : list.back().pieces) out->pieced_bytes += piece.size();
        break;
      }
      case 8:
        if (!(s = ExpectWireType(field, wire_type, kVarint, "pull_encoding", at)).ok()) return s;
        if (!(s = ReadVarintField(&in, limit, "pull_encoding", &v)).ok()) return s;
        out->pull_encoding = static_cast<int32_t>(v);
        break;
      default:
        if (!(s = SkipField(&in, limit, wire_type)).ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Looks for the seq of a message that ParsePushPullRequest refused, reading only the top-level
// framing up to the first malformed field. Returns false when no seq can be read.
inline bool FindSeq(const std::vector<grpc::Slice>& received, uint64_t* seq) {
  using namespace wire_detail;  // NOLINT: the wire helpers above
  Cursor in(received);
  const size_t limit = in.size();
  bool found = false;
  while (in.position() < limit) {
    uint32_t field = 0;
    uint32_t wire_type = 0;
    if (!ReadTag(&in, limit, &field, &wire_type).ok()) break;
    if (field == 5 && wire_type == kVarint) {
      uint64_t v;
      if (!in.ReadVarint(limit, &v)) break;
      *seq = v;
      found = true;
      continue;
    }
    if (!SkipField(&in, limit, wire_type).ok()) break;
  }
  return found;
}

namespace wire_detail {

inline void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

inline size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace wire_detail

// Weight data of at least this many bytes travels as its own slice; smaller data is copied into
// the header slice.
constexpr size_t kOwnSliceMinBytes = 16 << 10;

// Weight data of one answered slice held by reference: the index of the slice in the response's
// `weights` and its data (see PushPullAnswerSink::shared).
using SharedSliceData = std::pair<int, SharedWeights>;

namespace wire_detail {

// For each of `response`'s weights, its data held by reference in `shared`, or null. INTERNAL when
// an index is out of range, repeated, or names a slice whose data is not empty.
inline absl::Status SharedByIndex(const v1::PushPullResponse& response,
                                  absl::Span<const SharedSliceData> shared,
                                  std::vector<const SharedWeights*>* out) {
  out->assign(static_cast<size_t>(response.weights_size()), nullptr);
  for (const SharedSliceData& s : shared) {
    if (s.first < 0 || s.first >= response.weights_size() || (*out)[s.first] != nullptr ||
        !response.weights(s.first).data().empty()) {
      return absl::InternalError(absl::StrCat("shared weight data for slice ", s.first, " of ",
                                              response.weights_size(), " does not fit the answer"));
    }
    (*out)[s.first] = &s.second;
  }
  return absl::OkStatus();
}

// The bytes that `n` bytes of data add to a Slice of `meta` bytes inside a PushPullResponse: the
// data field and the growth of the Slice's length prefix.
inline size_t DataFieldGrowth(size_t meta, size_t n) {
  if (n == 0) return 0;
  const size_t body = meta + 1 + VarintSize(n) + n;
  return (body - meta) + (VarintSize(body) - VarintSize(meta));
}

}  // namespace wire_detail

// The serialised size of `response` once the data in `shared` is filled in (what
// SerializePushPullResponse sends), without copying anything. INTERNAL as SharedByIndex.
inline absl::StatusOr<size_t> PushPullResponseSize(const v1::PushPullResponse& response,
                                                   absl::Span<const SharedSliceData> shared) {
  std::vector<const SharedWeights*> by_index;
  absl::Status s = wire_detail::SharedByIndex(response, shared, &by_index);
  if (!s.ok()) return s;
  size_t total = response.ByteSizeLong();
  for (const SharedSliceData& d : shared) {
    total += wire_detail::DataFieldGrowth(response.weights(d.first).ByteSizeLong(),
                                          d.second.bytes().size());
  }
  return total;
}

// Serialises `response` in protobuf wire format without copying large weight data: each data
// string is taken out of `response` (swapped, so `response` is left without it) and sent as its
// own slice, which gives the string to `pool` once gRPC is done with it; the data of weights(i)
// for an (i, values) in `shared` is `values` (whose data in `response` must be empty), sent as a
// slice that holds a reference to them until gRPC is done with it. *bytes is the message's size.
// INTERNAL (nothing serialised, `response` unchanged) when `shared` does not fit the response
// (see SharedByIndex).
inline absl::StatusOr<grpc::ByteBuffer> SerializePushPullResponse(
    v1::PushPullResponse* response, absl::Span<const SharedSliceData> shared,
    const std::shared_ptr<BufferPool>& pool, size_t* bytes) {
  using wire_detail::AppendVarint;
  using wire_detail::VarintSize;
  std::vector<const SharedWeights*> by_index;
  absl::Status fits = wire_detail::SharedByIndex(*response, shared, &by_index);
  if (!fits.ok()) return fits;
  google::protobuf::RepeatedPtrField<v1::Slice> weights;
  weights.Swap(response->mutable_weights());
  std::string pending = response->SerializeAsString();
  size_t total = pending.size();
  std::vector<grpc::Slice> slices;
  for (int i = 0; i < weights.size(); ++i) {
    v1::Slice& w = weights[i];
    const SharedWeights* values = by_index[static_cast<size_t>(i)];
    std::string data;
    data.swap(*w.mutable_data());
    const std::string meta = w.SerializeAsString();
    const size_t n = values != nullptr ? values->bytes().size() : data.size();
    const size_t body = meta.size() + (n > 0 ? 1 + VarintSize(n) + n : 0);
    pending.push_back(static_cast<char>((3 << 3) | 2));  // PushPullResponse.weights
    AppendVarint(body, &pending);
    pending += meta;
    total += 1 + VarintSize(body) + body;
    if (n == 0) continue;
    pending.push_back(static_cast<char>((3 << 3) | 2));  // Slice.data
    AppendVarint(n, &pending);
    if (n < kOwnSliceMinBytes) {
      if (values != nullptr) {
        pending.append(values->bytes().data(), n);
      } else {
        pending += data;
        pool->Give(std::move(data));
      }
      continue;
    }
    slices.emplace_back(pending.data(), pending.size());  // copies the small header bytes
    pending.clear();
    if (values != nullptr) {
      // gRPC only reads a slice it sends; the holder keeps the values alive and unchanged until
      // gRPC drops the slice (on any thread).
      auto* holder = new SharedWeights(*values);
      slices.emplace_back(
          const_cast<char*>(holder->bytes().data()), n,
          [](void* h) { delete static_cast<SharedWeights*>(h); }, holder);
    } else {
      slices.push_back(BufferPool::MakeSlice(pool, std::move(data)));
    }
  }
  if (!pending.empty()) slices.emplace_back(pending.data(), pending.size());
  *bytes = total;
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// SerializePushPullResponse above for a response that holds all of its data.
inline grpc::ByteBuffer SerializePushPullResponse(v1::PushPullResponse* response,
                                                  const std::shared_ptr<BufferPool>& pool,
                                                  size_t* bytes) {
  // Cannot fail: nothing is shared.
  return *SerializePushPullResponse(response, {}, pool, bytes);
}

}  // namespace tessera::server::internal

#endif  // TESSERA_SERVER_INTERNAL_PUSH_PULL_WIRE_H_
