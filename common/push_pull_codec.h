// The PushPull codec: v1::PushPullRequest and v1::PushPullResponse in protobuf wire format, read
// and written by hand so that neither end copies a gradient or a weight into or out of a protobuf
// string (docs/data-plane.md, docs/benchmarks.md "Push/pull goodput"). The worker's transport
// (worker/client/grpc_shard_client.cc) and the shard's (server/grpc_parameter_service.cc) both use
// it; it knows neither. Field numbers come from the generated code.
//
// Requests, client to shard. EncodePushPullRequest writes the small fields and sends the data of
// every large push slice as its own grpc::Slice: over the request itself (held by reference) or
// over bytes the caller lends (ExternalSliceData). DecodePushPullRequest reads a request from the
// slices of a received grpc::ByteBuffer: the small fields (ids, keys, row ids) are copied; each
// gradient's bytes are viewed in place, as one view when they lie in one slice and otherwise as
// the list of their pieces in consecutive slices (gRPC delivers 8 to 64 KiB slices, so a 4 MiB
// gradient arrives in about 64 pieces, and a value may straddle two); the store reads the pieces
// without first joining them (PushPullView, common/push_pull_view.h).
//
// Responses, shard to client. EncodePushPullResponse writes a response whose large weight data
// lies in strings of a BufferPool or outside the message (ExternalSliceData: a shard's weights
// shared with its store): every large data becomes its own grpc::Slice, over the string (which goes
// back to the pool when gRPC releases it) or over the external bytes (held until gRPC releases
// them). DecodePushPullResponse reads a response from the received slices, leaving the weight data
// in place, and TakePushPullResponse then decodes fp32 weights straight into the caller's buffer
// (or copies them into the response).
//
// Strictness. Both decoders refuse what protobuf's parser refuses, and more: a known field with
// the wrong wire type and groups are refused where protobuf would skip them; tags have at most 5
// bytes; nothing is read past the end of the message or of a field. Refusals are INVALID_ARGUMENT,
// naming what is malformed and at which byte. Unknown fields are skipped on reading; the encoders
// write only known fields, in an order of their own (which every parser accepts).
//
// Thread-safety: the functions are thread-safe on distinct arguments. Slices that the encoders
// make may be released by gRPC on any thread, after the call and its arguments are gone.
#ifndef TESSERA_COMMON_PUSH_PULL_CODEC_H_
#define TESSERA_COMMON_PUSH_PULL_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/buffer_pool.h"
#include "common/push_pull_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {

// Slice data of at least this many bytes travels as its own grpc::Slice, and is left in the
// received slices by the decoders; smaller data is copied into the serialised message.
inline constexpr size_t kOwnSliceMinBytes = 16 << 10;

// Slice data that an encoder sends from where it lies, without copying it into the message. Entry
// k is the data of the message's slice index(k): push(index) of a request, weights(index) of a
// response, whose own data field must then be empty. Entries with empty bytes are ignored. The
// implementation keeps the bytes valid and unchanged for as long as the slices it makes are held.
class ExternalSliceData {
 public:
  virtual ~ExternalSliceData() = default;

  virtual size_t size() const = 0;
  virtual int index(size_t k) const = 0;
  virtual absl::string_view bytes(size_t k) const = 0;
  // A grpc::Slice over bytes(k) that keeps them valid and unchanged until gRPC releases it (on any
  // thread, possibly after the message and this object are gone). Called at most once per entry
  // and encode, for entries of at least kOwnSliceMinBytes that travel as their own slice.
  virtual grpc::Slice SliceOver(size_t k) const = 0;
};

// ---- Requests (client to shard) ----------------------------------------------------------------

// Serialises *request into *out. The data of push(i) is the bytes of the entry of `lent` for i
// when there is one (null: none), else its own data field. With `zero_copy`, large data
// (kOwnSliceMinBytes or more) travels as its own slice: lent bytes through lent->SliceOver, the
// request's own data as a slice that holds `request` until gRPC releases it. Without, every byte
// is copied into the message. INTERNAL (*out unchanged) when `lent` does not fit the request (an
// index out of range or repeated, or naming a slice whose data is not empty).
absl::Status EncodePushPullRequest(const std::shared_ptr<const v1::PushPullRequest>& request,
                                   const ExternalSliceData* lent, bool zero_copy,
                                   grpc::ByteBuffer* out);

// One slice of a decoded request. Its data points into the request's received slices: `data` when
// it lies in one of them, else `pieces` (then `data` is empty). Pull slices keep no data.
struct DecodedSlice {
  std::string tensor;
  uint32_t index = 0;
  int32_t encoding = 0;
  absl::string_view data;
  std::vector<absl::string_view> pieces;
  std::vector<int64_t> row_ids;
  bool want_weights = false;
  int64_t version = 0;
  uint64_t weights_id = 0;
};

// A v1::PushPullRequest read from the wire. It holds the received slices that its views point
// into. Not copyable (views point into it).
struct DecodedPushPullRequest {
  DecodedPushPullRequest() = default;
  DecodedPushPullRequest(const DecodedPushPullRequest&) = delete;
  DecodedPushPullRequest& operator=(const DecodedPushPullRequest&) = delete;

  // The request as a store takes it; valid while this object lives and is not changed.
  PushPullView View() const;

  std::string job_id;
  uint32_t worker_id = 0;
  uint64_t incarnation = 0;
  int64_t step = 0;
  uint64_t seq = 0;
  bool has_seq = false;  // a seq field was read (also when the decode failed later)
  std::vector<DecodedSlice> push;
  std::vector<DecodedSlice> pull;
  int32_t pull_encoding = 0;

  std::vector<grpc::Slice> received;
  size_t pieced_bytes = 0;  // gradient bytes that span received slices (read in pieces)
};

// Decodes `out->received` (the slices of one message) as a v1::PushPullRequest into *out, which
// must be freshly constructed. Gradient data is viewed in place (see DecodedSlice), never copied.
// INVALID_ARGUMENT (see "Strictness"); out->has_seq then says whether the seq was read, so that
// the caller can answer that request alone.
absl::Status DecodePushPullRequest(DecodedPushPullRequest* out);

// Looks for the seq of a message that DecodePushPullRequest refused, reading only the top-level
// framing up to the first malformed field. False when no seq can be read.
bool FindPushPullSeq(const std::vector<grpc::Slice>& received, uint64_t* seq);

// ---- Responses (shard to client) ---------------------------------------------------------------

// The serialised size of `response` with the data of `external` (null: none) filled in, which is
// what EncodePushPullResponse sends, without copying anything. INTERNAL when `external` does not
// fit the response (as for EncodePushPullRequest).
absl::StatusOr<size_t> PushPullResponseSize(const v1::PushPullResponse& response,
                                            const ExternalSliceData* external);

// Serialises *response into *out without copying large weight data: each large data string is
// taken out of `response` (which is left without it) and sent as its own slice that gives the
// string to `pool` once gRPC is done with it; the data of weights(i) for an entry of `external` is
// sent as external->SliceOver (small external data is copied). *bytes is the message's size.
// INTERNAL (nothing serialised, `response` and *out unchanged) when `external` does not fit the
// response.
absl::Status EncodePushPullResponse(v1::PushPullResponse* response,
                                    const ExternalSliceData* external,
                                    const std::shared_ptr<BufferPool>& pool, grpc::ByteBuffer* out,
                                    size_t* bytes);
// The same for a response that holds all of its data (cannot fail).
void EncodePushPullResponse(v1::PushPullResponse* response, const std::shared_ptr<BufferPool>& pool,
                            grpc::ByteBuffer* out, size_t* bytes);

// A v1::PushPullResponse read from the wire, its weight data still in the received slices (which
// it holds). `header` has every field but the weights; weights[i] is weights(i), its data viewed
// in place as in DecodedSlice. Not copyable (views point into it).
struct DecodedPushPullResponse {
  DecodedPushPullResponse() = default;
  DecodedPushPullResponse(const DecodedPushPullResponse&) = delete;
  DecodedPushPullResponse& operator=(const DecodedPushPullResponse&) = delete;

  v1::PushPullResponse header;
  std::vector<DecodedSlice> weights;
  std::vector<grpc::Slice> received;
};

// Decodes `out->received` as a v1::PushPullResponse into *out, which must be freshly constructed.
// Nothing of the weight data is copied yet. INVALID_ARGUMENT (see "Strictness").
absl::Status DecodePushPullResponse(DecodedPushPullResponse* out);

// Where the fp32 weights of one partition may be decoded straight from the received slices.
struct Fp32WeightsTarget {
  absl::string_view tensor;
  uint32_t index = 0;
  float* out = nullptr;  // nullptr: no target
  size_t count = 0;      // values at `out`
};

// The response of `decoded`, whose weight data is copied into the response's slices, except that
// large data (kOwnSliceMinBytes or more) of an fp32 (or unspecified) slice whose key is (tensor,
// index) of `target` and that holds exactly target.count values is copied straight into
// target.out; that slice's data is then left empty and *written set to true (else left alone).
// Leaves `decoded` without its weights.
v1::PushPullResponse TakePushPullResponse(DecodedPushPullResponse* decoded,
                                          const Fp32WeightsTarget& target, bool* written);

}  // namespace tessera

#endif  // TESSERA_COMMON_PUSH_PULL_CODEC_H_
