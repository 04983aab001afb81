#include "common/push_pull_codec.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/internal/protobuf_wire.h"
#include "common/status_macros.h"
#include "google/protobuf/message_lite.h"
#include "google/protobuf/repeated_field.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace tessera {
namespace {

using protobuf_wire::AppendLengthPrefix;
using protobuf_wire::AppendTag;
using protobuf_wire::AppendVarint;
using protobuf_wire::Cursor;
using protobuf_wire::kLengthDelimited;
using protobuf_wire::kVarint;
using protobuf_wire::LengthDelimitedSize;
using protobuf_wire::Tag;
using protobuf_wire::VarintSize;

using Key = v1::PartitionKey;
using Request = v1::PushPullRequest;
using Response = v1::PushPullResponse;
using SliceMessage = v1::Slice;
using Slices = google::protobuf::RepeatedPtrField<v1::Slice>;

// ---- Writing -----------------------------------------------------------------------------------

// int32 and enum values travel sign-extended to 64 bits.
uint64_t Int32Wire(int32_t v) { return static_cast<uint64_t>(static_cast<int64_t>(v)); }

// A varint field, left out when zero (proto3).
void AppendVarintField(int field, uint64_t v, std::string* out) {
  if (v == 0) return;
  AppendTag(field, kVarint, out);
  AppendVarint(v, out);
}
size_t VarintFieldSize(int field, uint64_t v) {
  return v == 0 ? 0 : VarintSize(Tag(field, kVarint)) + VarintSize(v);
}

void AppendStringField(int field, absl::string_view s, std::string* out) {
  if (s.empty()) return;
  AppendLengthPrefix(field, s.size(), out);
  out->append(s.data(), s.size());
}

// A small nested message (a key, a status, a pull slice), serialised by protobuf.
void AppendMessageField(int field, const google::protobuf::MessageLite& m, std::string* out) {
  AppendLengthPrefix(field, m.ByteSizeLong(), out);
  m.AppendToString(out);
}

size_t PackedRowIdsSize(const SliceMessage& s) {
  size_t n = 0;
  for (int64_t r : s.row_ids()) n += VarintSize(static_cast<uint64_t>(r));
  return n;
}

// Bytes of the fields of `s` but its data; *packed is the size of its packed row ids.
size_t SliceMetaSize(const SliceMessage& s, size_t* packed) {
  size_t n = 0;
  if (s.has_key()) n += LengthDelimitedSize(SliceMessage::kKeyFieldNumber, s.key().ByteSizeLong());
  n += VarintFieldSize(SliceMessage::kEncodingFieldNumber, Int32Wire(s.encoding()));
  *packed = PackedRowIdsSize(s);
  if (s.row_ids_size() > 0) n += LengthDelimitedSize(SliceMessage::kRowIdsFieldNumber, *packed);
  n += VarintFieldSize(SliceMessage::kWantWeightsFieldNumber, s.want_weights() ? 1 : 0);
  n += VarintFieldSize(SliceMessage::kVersionFieldNumber, static_cast<uint64_t>(s.version()));
  n += VarintFieldSize(SliceMessage::kWeightsIdFieldNumber, s.weights_id());
  return n;
}

// Appends one Slice of message field `field` whose data has `n` bytes, up to the data: its tag and
// length, its other fields, and the data's tag and length (the caller sends the n bytes next).
void AppendSliceHead(int field, const SliceMessage& s, size_t n, std::string* out) {
  size_t packed;
  const size_t meta = SliceMetaSize(s, &packed);
  const size_t body = meta + (n > 0 ? LengthDelimitedSize(SliceMessage::kDataFieldNumber, n) : 0);
  AppendLengthPrefix(field, body, out);
  if (s.has_key()) AppendMessageField(SliceMessage::kKeyFieldNumber, s.key(), out);
  AppendVarintField(SliceMessage::kEncodingFieldNumber, Int32Wire(s.encoding()), out);
  if (s.row_ids_size() > 0) {
    AppendLengthPrefix(SliceMessage::kRowIdsFieldNumber, packed, out);
    for (int64_t r : s.row_ids()) AppendVarint(static_cast<uint64_t>(r), out);
  }
  AppendVarintField(SliceMessage::kWantWeightsFieldNumber, s.want_weights() ? 1 : 0, out);
  AppendVarintField(SliceMessage::kVersionFieldNumber, static_cast<uint64_t>(s.version()), out);
  AppendVarintField(SliceMessage::kWeightsIdFieldNumber, s.weights_id(), out);
  if (n > 0) AppendLengthPrefix(SliceMessage::kDataFieldNumber, n, out);
}

// The bytes that `n` bytes of data add to a Slice of `meta` bytes inside a message: the data field
// and the growth of the Slice's length prefix.
size_t DataFieldGrowth(size_t meta, size_t n) {
  if (n == 0) return 0;
  const size_t body = meta + LengthDelimitedSize(SliceMessage::kDataFieldNumber, n);
  return (body - meta) + (VarintSize(body) - VarintSize(meta));
}

// A message made of small serialised bytes (copied into slices of their own) and large data
// slices, in order.
class MessageWriter {
 public:
  // Where the next small bytes go.
  std::string* pending() { return &pending_; }
  // Ends the pending bytes and appends `s`.
  void Append(grpc::Slice s) {
    Flush();
    size_ += s.size();
    slices_.push_back(std::move(s));
  }
  // Puts the message in *out (by swapping, which copies nothing); *bytes is its size.
  void Finish(grpc::ByteBuffer* out, size_t* bytes) {
    Flush();
    *bytes = size_;
    grpc::ByteBuffer message(slices_.data(), slices_.size());
    out->Swap(&message);
  }

 private:
  void Flush() {
    if (pending_.empty()) return;
    size_ += pending_.size();
    slices_.emplace_back(pending_.data(), pending_.size());  // copies the small bytes
    pending_.clear();
  }

  std::string pending_;
  std::vector<grpc::Slice> slices_;
  size_t size_ = 0;
};

// For each of a message's slices, the entry of `external` that holds its data, or -1.
using EntryOfSlice = absl::InlinedVector<int, 16>;

// INTERNAL when an entry's index is out of range or repeated, or names a slice that has data.
absl::Status MapExternal(const ExternalSliceData* external, const Slices& slices,
                         absl::string_view what, EntryOfSlice* out) {
  out->assign(static_cast<size_t>(slices.size()), -1);
  if (external == nullptr) return absl::OkStatus();
  for (size_t k = 0; k < external->size(); ++k) {
    if (external->bytes(k).empty()) continue;
    const int i = external->index(k);
    if (i < 0 || i >= slices.size() || (*out)[static_cast<size_t>(i)] != -1 ||
        !slices.Get(i).data().empty()) {
      return absl::InternalError(absl::StrCat("external data for ", what, " slice ", i, " of ",
                                              slices.size(), " does not fit the message"));
    }
    (*out)[static_cast<size_t>(i)] = static_cast<int>(k);
  }
  return absl::OkStatus();
}

// A slice over `data`, which lies in *request: it holds the request until gRPC releases it.
grpc::Slice SliceHoldingRequest(const std::shared_ptr<const Request>& request,
                                absl::string_view data) {
  auto* keep = new std::shared_ptr<const Request>(request);
  return grpc::Slice(
      const_cast<char*>(data.data()), data.size(),
      [](void* p) { delete static_cast<std::shared_ptr<const Request>*>(p); }, keep);
}

void SerializeCopy(const Request& request, grpc::ByteBuffer* out) {
  grpc::ByteBuffer message;  // the writer wants an empty buffer
  bool own_buffer = false;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, Request>(request, &message, &own_buffer)
      .IgnoreError();  // serialising a valid message cannot fail
  out->Swap(&message);
}

// ---- Reading -----------------------------------------------------------------------------------

absl::Status DecodeKey(Cursor* in, size_t limit, DecodedSlice* out) {
  while (in->position() < limit) {
    const size_t at = in->position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    TESSERA_RETURN_IF_ERROR(in->ReadTag(limit, &field, &wire_type));
    uint64_t v;
    switch (field) {
      case Key::kTensorFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in->ReadUtf8Field(limit, field, wire_type, "key.tensor", at, &out->tensor));
        break;
      case Key::kIndexFieldNumber:
        TESSERA_RETURN_IF_ERROR(in->ReadVarintField(limit, field, wire_type, "key.index", at, &v));
        out->index = static_cast<uint32_t>(v);
        break;
      default:
        TESSERA_RETURN_IF_ERROR(in->SkipField(limit, wire_type));
    }
  }
  return absl::OkStatus();
}

// Decodes one Slice that ends at `limit`. `keep_pieces`: keep the pieces of data that spans
// received slices (push slices and answered weights; pull slices carry no data that is read).
absl::Status DecodeSlice(Cursor* in, size_t limit, bool keep_pieces, DecodedSlice* out) {
  while (in->position() < limit) {
    const size_t at = in->position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    TESSERA_RETURN_IF_ERROR(in->ReadTag(limit, &field, &wire_type));
    uint64_t v;
    size_t end;
    switch (field) {
      case SliceMessage::kKeyFieldNumber:
        TESSERA_RETURN_IF_ERROR(in->ReadLength(limit, field, wire_type, "key", at, &end));
        TESSERA_RETURN_IF_ERROR(DecodeKey(in, end, out));
        break;
      case SliceMessage::kEncodingFieldNumber:
        TESSERA_RETURN_IF_ERROR(in->ReadVarintField(limit, field, wire_type, "encoding", at, &v));
        out->encoding = static_cast<int32_t>(v);
        break;
      case SliceMessage::kDataFieldNumber:
        TESSERA_RETURN_IF_ERROR(in->ReadLength(limit, field, wire_type, "data", at, &end));
        // A repeated data field: the last one wins.
        if (!in->ReadBytes(end, end - in->position(), &out->data,
                           keep_pieces ? &out->pieces : nullptr)) {
          return in->Malformed("data past the end", at);
        }
        break;
      case SliceMessage::kRowIdsFieldNumber:  // packed or not
        if (wire_type == kVarint) {
          TESSERA_RETURN_IF_ERROR(in->ReadVarintValue(limit, "row_ids", &v));
          out->row_ids.push_back(static_cast<int64_t>(v));
          break;
        }
        TESSERA_RETURN_IF_ERROR(in->ReadLength(limit, field, wire_type, "row_ids", at, &end));
        while (in->position() < end) {
          TESSERA_RETURN_IF_ERROR(in->ReadVarintValue(end, "row_ids", &v));
          out->row_ids.push_back(static_cast<int64_t>(v));
        }
        break;
      case SliceMessage::kWantWeightsFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in->ReadVarintField(limit, field, wire_type, "want_weights", at, &v));
        out->want_weights = v != 0;
        break;
      case SliceMessage::kVersionFieldNumber:
        TESSERA_RETURN_IF_ERROR(in->ReadVarintField(limit, field, wire_type, "version", at, &v));
        out->version = static_cast<int64_t>(v);
        break;
      case SliceMessage::kWeightsIdFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in->ReadVarintField(limit, field, wire_type, "weights_id", at, &out->weights_id));
        break;
      default:
        TESSERA_RETURN_IF_ERROR(in->SkipField(limit, wire_type));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeRpcStatus(Cursor* in, size_t limit, v1::RpcStatus* out) {
  while (in->position() < limit) {
    const size_t at = in->position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    TESSERA_RETURN_IF_ERROR(in->ReadTag(limit, &field, &wire_type));
    uint64_t v;
    switch (field) {
      case v1::RpcStatus::kCodeFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in->ReadVarintField(limit, field, wire_type, "status.code", at, &v));
        out->set_code(static_cast<int32_t>(v));
        break;
      case v1::RpcStatus::kMessageFieldNumber:
        TESSERA_RETURN_IF_ERROR(in->ReadUtf8Field(limit, field, wire_type, "status.message", at,
                                                  out->mutable_message()));
        break;
      default:
        TESSERA_RETURN_IF_ERROR(in->SkipField(limit, wire_type));
    }
  }
  return absl::OkStatus();
}

// Bytes of a decoded slice's data.
size_t DataSize(const DecodedSlice& s) {
  if (s.pieces.empty()) return s.data.size();
  size_t n = 0;
  for (absl::string_view piece : s.pieces) n += piece.size();
  return n;
}

// Copies a decoded slice's data to `out`, which has room for DataSize(s) bytes.
void CopyData(const DecodedSlice& s, char* out) {
  if (s.pieces.empty()) {
    if (!s.data.empty()) std::memcpy(out, s.data.data(), s.data.size());
    return;
  }
  for (absl::string_view piece : s.pieces) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
}

// Appends a decoded slice's n bytes of data to *out, without first zero-filling it (resize would:
// a whole extra pass over a 4 MiB partition).
void AppendData(const DecodedSlice& s, size_t n, std::string* out) {
  out->reserve(out->size() + n);
  if (s.pieces.empty()) {
    out->append(s.data.data(), s.data.size());
    return;
  }
  for (absl::string_view piece : s.pieces) out->append(piece.data(), piece.size());
}

}  // namespace

// ---- Requests ----------------------------------------------------------------------------------

absl::Status EncodePushPullRequest(const std::shared_ptr<const v1::PushPullRequest>& request,
                                   const ExternalSliceData* lent, bool zero_copy,
                                   grpc::ByteBuffer* out) {
  const Request& r = *request;
  EntryOfSlice entry_of;
  TESSERA_RETURN_IF_ERROR(MapExternal(lent, r.push(), "push", &entry_of));
  const bool lends =
      std::any_of(entry_of.begin(), entry_of.end(), [](int entry) { return entry >= 0; });
  if (!zero_copy && !lends) {
    SerializeCopy(r, out);
    return absl::OkStatus();
  }
  MessageWriter message;
  std::string* head = message.pending();
  AppendStringField(Request::kJobIdFieldNumber, r.job_id(), head);
  AppendVarintField(Request::kWorkerIdFieldNumber, r.worker_id(), head);
  AppendVarintField(Request::kIncarnationFieldNumber, r.incarnation(), head);
  AppendVarintField(Request::kStepFieldNumber, static_cast<uint64_t>(r.step()), head);
  AppendVarintField(Request::kSeqFieldNumber, r.seq(), head);
  for (const SliceMessage& s : r.pull()) AppendMessageField(Request::kPullFieldNumber, s, head);
  AppendVarintField(Request::kPullEncodingFieldNumber, Int32Wire(r.pull_encoding()), head);
  for (int i = 0; i < r.push_size(); ++i) {
    const SliceMessage& s = r.push(i);
    const int entry = entry_of[static_cast<size_t>(i)];
    const absl::string_view data =
        entry >= 0 ? lent->bytes(static_cast<size_t>(entry)) : absl::string_view(s.data());
    AppendSliceHead(Request::kPushFieldNumber, s, data.size(), head);
    if (data.size() < kOwnSliceMinBytes || !zero_copy) {
      head->append(data.data(), data.size());
    } else if (entry >= 0) {
      message.Append(lent->SliceOver(static_cast<size_t>(entry)));
    } else {
      message.Append(SliceHoldingRequest(request, data));
    }
  }
  size_t bytes;
  message.Finish(out, &bytes);
  return absl::OkStatus();
}

PushPullView DecodedPushPullRequest::View() const {
  PushPullView view;
  view.job_id = job_id;
  view.worker_id = worker_id;
  view.incarnation = incarnation;
  view.step = step;
  view.seq = seq;
  view.pull_encoding = static_cast<v1::Encoding>(pull_encoding);
  auto slice_view = [](const DecodedSlice& s) {
    SliceView v;
    v.tensor = s.tensor;
    v.index = s.index;
    v.encoding = static_cast<v1::Encoding>(s.encoding);
    v.data = s.data;
    v.pieces = absl::MakeConstSpan(s.pieces);
    v.row_ids = absl::MakeConstSpan(s.row_ids);
    v.want_weights = s.want_weights;
    v.weights_id = s.weights_id;
    return v;
  };
  view.push.reserve(push.size());
  for (const DecodedSlice& s : push) view.push.push_back(slice_view(s));
  view.pull.reserve(pull.size());
  for (const DecodedSlice& s : pull) view.pull.push_back(slice_view(s));
  return view;
}

absl::Status DecodePushPullRequest(DecodedPushPullRequest* out) {
  Cursor in(out->received, "PushPullRequest");
  const size_t limit = in.size();
  while (in.position() < limit) {
    const size_t at = in.position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    TESSERA_RETURN_IF_ERROR(in.ReadTag(limit, &field, &wire_type));
    uint64_t v;
    size_t end;
    switch (field) {
      case Request::kJobIdFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in.ReadUtf8Field(limit, field, wire_type, "job_id", at, &out->job_id));
        break;
      case Request::kWorkerIdFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadVarintField(limit, field, wire_type, "worker_id", at, &v));
        out->worker_id = static_cast<uint32_t>(v);
        break;
      case Request::kIncarnationFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadVarintField(limit, field, wire_type, "incarnation", at, &v));
        out->incarnation = v;
        break;
      case Request::kStepFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadVarintField(limit, field, wire_type, "step", at, &v));
        out->step = static_cast<int64_t>(v);
        break;
      case Request::kSeqFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadVarintField(limit, field, wire_type, "seq", at, &v));
        out->seq = v;
        out->has_seq = true;
        break;
      case Request::kPushFieldNumber:
      case Request::kPullFieldNumber: {
        const bool push = field == Request::kPushFieldNumber;
        const char* name = push ? "push" : "pull";
        TESSERA_RETURN_IF_ERROR(in.ReadLength(limit, field, wire_type, name, at, &end));
        std::vector<DecodedSlice>& list = push ? out->push : out->pull;
        list.emplace_back();
        TESSERA_RETURN_IF_ERROR(DecodeSlice(&in, end, push, &list.back()));
        for (absl::string_view piece : list.back().pieces) out->pieced_bytes += piece.size();
        break;
      }
      case Request::kPullEncodingFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in.ReadVarintField(limit, field, wire_type, "pull_encoding", at, &v));
        out->pull_encoding = static_cast<int32_t>(v);
        break;
      default:
        TESSERA_RETURN_IF_ERROR(in.SkipField(limit, wire_type));
    }
  }
  return absl::OkStatus();
}

bool FindPushPullSeq(const std::vector<grpc::Slice>& received, uint64_t* seq) {
  Cursor in(received, "PushPullRequest");
  const size_t limit = in.size();
  bool found = false;
  while (in.position() < limit) {
    uint32_t field = 0;
    uint32_t wire_type = 0;
    if (!in.ReadTag(limit, &field, &wire_type).ok()) break;
    if (field == Request::kSeqFieldNumber && wire_type == kVarint) {
      uint64_t v;
      if (!in.ReadVarint(limit, &v)) break;
      *seq = v;
      found = true;
      continue;
    }
    if (!in.SkipField(limit, wire_type).ok()) break;
  }
  return found;
}

// ---- Responses ---------------------------------------------------------------------------------

absl::StatusOr<size_t> PushPullResponseSize(const v1::PushPullResponse& response,
                                            const ExternalSliceData* external) {
  EntryOfSlice entry_of;
  TESSERA_RETURN_IF_ERROR(MapExternal(external, response.weights(), "weights", &entry_of));
  size_t total = response.ByteSizeLong();
  for (int i = 0; i < response.weights_size(); ++i) {
    const int entry = entry_of[static_cast<size_t>(i)];
    if (entry < 0) continue;
    total += DataFieldGrowth(response.weights(i).ByteSizeLong(),
                             external->bytes(static_cast<size_t>(entry)).size());
  }
  return total;
}

absl::Status EncodePushPullResponse(v1::PushPullResponse* response,
                                    const ExternalSliceData* external,
                                    const std::shared_ptr<BufferPool>& pool, grpc::ByteBuffer* out,
                                    size_t* bytes) {
  EntryOfSlice entry_of;
  TESSERA_RETURN_IF_ERROR(MapExternal(external, response->weights(), "weights", &entry_of));
  MessageWriter message;
  std::string* head = message.pending();
  AppendVarintField(Response::kSeqFieldNumber, response->seq(), head);
  if (response->has_status()) {
    AppendMessageField(Response::kStatusFieldNumber, response->status(), head);
  }
  AppendVarintField(Response::kDuplicatesFieldNumber, response->duplicates(), head);
  AppendVarintField(Response::kSkippedNonFiniteFieldNumber, response->skipped_non_finite(), head);
  AppendVarintField(Response::kGateWaitUsFieldNumber, response->gate_wait_us(), head);
  for (int i = 0; i < response->weights_size(); ++i) {
    SliceMessage& w = *response->mutable_weights(i);
    const int entry = entry_of[static_cast<size_t>(i)];
    if (entry >= 0) {
      const absl::string_view data = external->bytes(static_cast<size_t>(entry));
      AppendSliceHead(Response::kWeightsFieldNumber, w, data.size(), head);
      if (data.size() < kOwnSliceMinBytes) {
        head->append(data.data(), data.size());
      } else {
        message.Append(external->SliceOver(static_cast<size_t>(entry)));
      }
      continue;
    }
    std::string data;
    data.swap(*w.mutable_data());
    AppendSliceHead(Response::kWeightsFieldNumber, w, data.size(), head);
    if (data.size() < kOwnSliceMinBytes) {
      head->append(data);
      pool->Give(std::move(data));
    } else {
      message.Append(BufferPool::MakeSlice(pool, std::move(data)));
    }
  }
  message.Finish(out, bytes);
  return absl::OkStatus();
}

void EncodePushPullResponse(v1::PushPullResponse* response, const std::shared_ptr<BufferPool>& pool,
                            grpc::ByteBuffer* out, size_t* bytes) {
  // Cannot fail: nothing is external.
  EncodePushPullResponse(response, nullptr, pool, out, bytes).IgnoreError();
}

absl::Status DecodePushPullResponse(DecodedPushPullResponse* out) {
  Cursor in(out->received, "PushPullResponse");
  const size_t limit = in.size();
  v1::PushPullResponse& header = out->header;
  while (in.position() < limit) {
    const size_t at = in.position();
    uint32_t field = 0;
    uint32_t wire_type = 0;
    TESSERA_RETURN_IF_ERROR(in.ReadTag(limit, &field, &wire_type));
    uint64_t v;
    size_t end;
    switch (field) {
      case Response::kSeqFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadVarintField(limit, field, wire_type, "seq", at, &v));
        header.set_seq(v);
        break;
      case Response::kStatusFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadLength(limit, field, wire_type, "status", at, &end));
        TESSERA_RETURN_IF_ERROR(DecodeRpcStatus(&in, end, header.mutable_status()));
        break;
      case Response::kWeightsFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadLength(limit, field, wire_type, "weights", at, &end));
        out->weights.emplace_back();
        TESSERA_RETURN_IF_ERROR(DecodeSlice(&in, end, /*keep_pieces=*/true, &out->weights.back()));
        break;
      case Response::kDuplicatesFieldNumber:
        TESSERA_RETURN_IF_ERROR(in.ReadVarintField(limit, field, wire_type, "duplicates", at, &v));
        header.set_duplicates(static_cast<uint32_t>(v));
        break;
      case Response::kSkippedNonFiniteFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in.ReadVarintField(limit, field, wire_type, "skipped_non_finite", at, &v));
        header.set_skipped_non_finite(static_cast<uint32_t>(v));
        break;
      case Response::kGateWaitUsFieldNumber:
        TESSERA_RETURN_IF_ERROR(
            in.ReadVarintField(limit, field, wire_type, "gate_wait_us", at, &v));
        header.set_gate_wait_us(v);
        break;
      default:
        TESSERA_RETURN_IF_ERROR(in.SkipField(limit, wire_type));
    }
  }
  return absl::OkStatus();
}

v1::PushPullResponse TakePushPullResponse(DecodedPushPullResponse* decoded,
                                          const Fp32WeightsTarget& target, bool* written) {
  v1::PushPullResponse response;
  response.Swap(&decoded->header);
  response.mutable_weights()->Reserve(static_cast<int>(decoded->weights.size()));
  for (DecodedSlice& s : decoded->weights) {
    const size_t n = DataSize(s);
    SliceMessage* w = response.add_weights();
    const bool fp32 = s.encoding == v1::ENCODING_FP32 || s.encoding == v1::ENCODING_UNSPECIFIED;
    if (target.out != nullptr && n >= kOwnSliceMinBytes && fp32 &&
        n == target.count * sizeof(float) && s.index == target.index && s.tensor == target.tensor) {
      CopyData(s, reinterpret_cast<char*>(target.out));
      *written = true;
    } else if (n > 0) {
      AppendData(s, n, w->mutable_data());
    }
    w->mutable_key()->set_tensor(std::move(s.tensor));
    w->mutable_key()->set_index(s.index);
    w->set_encoding(static_cast<v1::Encoding>(s.encoding));
    w->mutable_row_ids()->Add(s.row_ids.begin(), s.row_ids.end());
    w->set_want_weights(s.want_weights);
    w->set_version(s.version);
    w->set_weights_id(s.weights_id);
  }
  decoded->weights.clear();
  return response;
}

}  // namespace tessera
