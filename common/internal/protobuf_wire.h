// Protobuf wire format primitives of the PushPull codec (common/push_pull_codec.h): the one set of
// varint and tag helpers, and a bounds-checked read cursor over a message that lies in several
// grpc::Slices. Private to common/.
//
// Reads are as strict as protobuf's parser: a varint has at most 10 bytes and 64 bits, a tag at
// most 5 bytes, a field number is in [1, 2^29 - 1], wire types 3, 4, 6 and 7 (groups and the
// undefined ones) are refused, strings are well-formed UTF-8, and nothing is read past the end of
// the message or of the field that encloses it. Every refusal is INVALID_ARGUMENT and names what is
// malformed and at which byte.
#ifndef TESSERA_COMMON_INTERNAL_PROTOBUF_WIRE_H_
#define TESSERA_COMMON_INTERNAL_PROTOBUF_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/slice.h"

namespace tessera::protobuf_wire {

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kFixed32 = 5,
};

// The tag of field `field` with wire type `type`, as a number.
constexpr uint64_t Tag(int field, WireType type) {
  return (static_cast<uint64_t>(field) << 3) | type;
}

// Appends `v` as a base-128 varint.
void AppendVarint(uint64_t v, std::string* out);
// Bytes of `v` as a varint.
size_t VarintSize(uint64_t v);
// Appends the tag of (field, type).
inline void AppendTag(int field, WireType type, std::string* out) {
  AppendVarint(Tag(field, type), out);
}
// Appends the tag of a length-delimited field and the length `n` (its bytes follow).
inline void AppendLengthPrefix(int field, size_t n, std::string* out) {
  AppendTag(field, kLengthDelimited, out);
  AppendVarint(n, out);
}
// Bytes of a length-delimited field of `n` bytes, tag and length included.
inline size_t LengthDelimitedSize(int field, size_t n) {
  return VarintSize(Tag(field, kLengthDelimited)) + VarintSize(n) + n;
}

// True when `s` is well-formed UTF-8 (as protobuf requires of proto3 strings): no overlong forms,
// no surrogates, nothing above U+10FFFF.
bool IsUtf8(absl::string_view s);

// A position in a message that lies in several slices: the slice and the offset within it.
struct SlicePosition {
  size_t slice = 0;
  size_t offset = 0;
};

// A read cursor over a message that lies in several slices. Positions are absolute offsets into
// the message; every read is checked against `limit`, the end of the enclosing field. `message`
// names the message in errors ("PushPullRequest"). Not thread-safe; `slices` must outlive it.
class Cursor {
 public:
  Cursor(const std::vector<grpc::Slice>& slices, absl::string_view message);

  size_t position() const { return position_; }
  size_t size() const { return size_; }
  // Where the next byte lies.
  SlicePosition at() const { return SlicePosition{slice_, offset_}; }

  // INVALID_ARGUMENT "malformed <message>: <what> at byte <position>".
  absl::Status Malformed(absl::string_view what, size_t position) const;

  bool ReadByte(size_t limit, uint8_t* b);
  // A base-128 varint of at most 10 bytes and 64 bits.
  bool ReadVarint(size_t limit, uint64_t* v);
  // Views the next n bytes, which must end by `limit`: *out when they lie in one slice, else
  // *pieces (when not null; *out is then empty). Returns false when they pass `limit`.
  bool ReadBytes(size_t limit, size_t n, absl::string_view* out,
                 std::vector<absl::string_view>* pieces);
  // Copies the next n bytes into *out (small fields).
  bool ReadString(size_t limit, size_t n, std::string* out);
  bool Skip(size_t limit, size_t n);

  // Field-level reads; each returns Malformed naming `name` (the field) on failure.
  // The next tag: fails on a tag of more than 5 bytes (protobuf refuses those, however small the
  // value), field number 0, a number over 2^29 - 1, or wire types 3, 4, 6, 7.
  absl::Status ReadTag(size_t limit, uint32_t* field, uint32_t* wire_type);
  // Skips a field of an unknown number whose tag has been read.
  absl::Status SkipField(size_t limit, uint32_t wire_type);
  // The varint value of field `name`, whose tag (read at `at`) must have wire type kVarint.
  absl::Status ReadVarintField(size_t limit, uint32_t field, uint32_t wire_type,
                               absl::string_view name, size_t at, uint64_t* v);
  // The length prefix of field `name` (wire type kLengthDelimited, tag read at `at`); *end is
  // the end of the bytes it announces, which must lie within `limit`.
  absl::Status ReadLength(size_t limit, uint32_t field, uint32_t wire_type, absl::string_view name,
                          size_t at, size_t* end);
  // A string field (UTF-8), copied.
  absl::Status ReadUtf8Field(size_t limit, uint32_t field, uint32_t wire_type,
                             absl::string_view name, size_t at, std::string* out);
  // The varint value of a field whose wire type was checked, without a tag (packed elements).
  absl::Status ReadVarintValue(size_t limit, absl::string_view name, uint64_t* v);

 private:
  void Advance(size_t n);
  void Settle();
  // Bytes left before `limit` and the end of the message.
  size_t Left(size_t limit) const;

  const std::vector<grpc::Slice>& slices_;
  const absl::string_view message_;
  size_t size_ = 0;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t position_ = 0;
};

}  // namespace tessera::protobuf_wire

#endif  // TESSERA_COMMON_INTERNAL_PROTOBUF_WIRE_H_
