#include "common/internal/protobuf_wire.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tessera::protobuf_wire {

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

bool IsUtf8(absl::string_view s) {
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

Cursor::Cursor(const std::vector<grpc::Slice>& slices, absl::string_view message)
    : slices_(slices), message_(message) {
  for (const grpc::Slice& s : slices_) size_ += s.size();
  Settle();
}

absl::Status Cursor::Malformed(absl::string_view what, size_t position) const {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed ", message_, ": ", what, " at byte ", position));
}

size_t Cursor::Left(size_t limit) const {
  return std::min(limit - std::min(limit, position_), size_ - position_);
}

bool Cursor::ReadByte(size_t limit, uint8_t* b) {
  if (position_ >= limit || position_ >= size_) return false;
  *b = slices_[slice_].begin()[offset_];
  Advance(1);
  return true;
}

bool Cursor::ReadVarint(size_t limit, uint64_t* v) {
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

bool Cursor::ReadBytes(size_t limit, size_t n, absl::string_view* out,
                       std::vector<absl::string_view>* pieces) {
  if (n > Left(limit)) return false;
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

bool Cursor::ReadString(size_t limit, size_t n, std::string* out) {
  if (n > Left(limit)) return false;
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

bool Cursor::Skip(size_t limit, size_t n) {
  if (n > Left(limit)) return false;
  Advance(n);
  return true;
}

void Cursor::Advance(size_t n) {
  position_ += n;
  while (n > 0) {
    const size_t k = std::min(n, slices_[slice_].size() - offset_);
    offset_ += k;
    n -= k;
    Settle();
  }
}

void Cursor::Settle() {
  while (slice_ < slices_.size() && offset_ >= slices_[slice_].size()) {
    ++slice_;
    offset_ = 0;
  }
}

absl::Status Cursor::ReadTag(size_t limit, uint32_t* field, uint32_t* wire_type) {
  const size_t at = position_;
  uint64_t tag;
  if (!ReadVarint(limit, &tag) || position_ - at > 5) {
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

absl::Status Cursor::SkipField(size_t limit, uint32_t wire_type) {
  const size_t at = position_;
  uint64_t v;
  switch (wire_type) {
    case kVarint:
      if (!ReadVarint(limit, &v)) return Malformed("truncated varint", at);
      return absl::OkStatus();
    case kFixed64:
      if (!Skip(limit, 8)) return Malformed("truncated fixed64", at);
      return absl::OkStatus();
    case kFixed32:
      if (!Skip(limit, 4)) return Malformed("truncated fixed32", at);
      return absl::OkStatus();
    default:
      if (!ReadVarint(limit, &v)) return Malformed("truncated length", at);
      if (!Skip(limit, v)) return Malformed("length past the end", at);
      return absl::OkStatus();
  }
}

namespace {

absl::Status ExpectWireType(const Cursor& in, uint32_t field, uint32_t wire_type, uint32_t want,
                            absl::string_view name, size_t at) {
  if (wire_type == want) return absl::OkStatus();
  return in.Malformed(
      absl::StrCat("field ", name, " (", field, ") has wire type ", wire_type, ", expected ", want),
      at);
}

}  // namespace

absl::Status Cursor::ReadVarintValue(size_t limit, absl::string_view name, uint64_t* v) {
  const size_t at = position_;
  if (!ReadVarint(limit, v)) return Malformed(absl::StrCat("truncated varint in ", name), at);
  return absl::OkStatus();
}

absl::Status Cursor::ReadVarintField(size_t limit, uint32_t field, uint32_t wire_type,
                                     absl::string_view name, size_t at, uint64_t* v) {
  absl::Status s = ExpectWireType(*this, field, wire_type, kVarint, name, at);
  if (!s.ok()) return s;
  return ReadVarintValue(limit, name, v);
}

absl::Status Cursor::ReadLength(size_t limit, uint32_t field, uint32_t wire_type,
                                absl::string_view name, size_t at, size_t* end) {
  absl::Status s = ExpectWireType(*this, field, wire_type, kLengthDelimited, name, at);
  if (!s.ok()) return s;
  const size_t length_at = position_;
  uint64_t n;
  if (!ReadVarint(limit, &n)) {
    return Malformed(absl::StrCat("truncated length of ", name), length_at);
  }
  if (n > Left(limit)) {
    return Malformed(absl::StrCat("length ", n, " of ", name, " past the end"), length_at);
  }
  *end = position_ + static_cast<size_t>(n);
  return absl::OkStatus();
}

absl::Status Cursor::ReadUtf8Field(size_t limit, uint32_t field, uint32_t wire_type,
                                   absl::string_view name, size_t at, std::string* out) {
  size_t end;
  absl::Status s = ReadLength(limit, field, wire_type, name, at, &end);
  if (!s.ok()) return s;
  ReadString(end, end - position_, out);
  if (!IsUtf8(*out)) return Malformed(absl::StrCat(name, " is not valid UTF-8"), at);
  return absl::OkStatus();
}

}  // namespace tessera::protobuf_wire
