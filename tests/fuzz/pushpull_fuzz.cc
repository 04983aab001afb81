// tessera_fuzz_pushpull: every request of the data plane and the shard's control calls, from bytes,
// against a ParameterStore holding declared jobs (scripts/fuzz.sh; docs/reliability.md).
//
// The first input byte picks the request, the rest is its wire form:
//   0  PushPullRequest read by the PushPull codec (common/push_pull_codec.h) from 1-3 receive
//      slices (byte 1 picks the cuts), checked against protobuf's parser of the same bytes: the
//      codec may refuse more (it is stricter) but never accepts what protobuf refuses, and what it
//      accepts reads the same fields. The request then goes to store A by reference
//      (PushPullView) and, parsed by protobuf, to an identical store B: both answer the same code.
//      The same bytes are also read as a PushPullResponse by the codec's response decoder (the
//      client's), held to the same rule against protobuf.
//   1  PushPullRequest -> Push, then PushPull with pulls;
//   2  PullRequest -> Pull;
//   3  CreateJobStateRequest -> CreateJobState (then DropJob of a job it created);
//   4  UpdateMembershipRequest -> UpdateMembership, then a push and a pull.
// Invariants beyond "no crash and no sanitizer report": an OK push to a REJECT job carries no
// NaN or Inf in any fp32 slice, and every answer is OK or one of the documented codes.
//
// Each input gets fresh stores (jobs declared anew), so a crash reproduces from its input alone.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/push_pull_codec.h"
#include "grpcpp/support/slice.h"
#include "server/parameter_store.h"
#include "tessera/v1/parameter.pb.h"

namespace {

using tessera::server::ParameterStore;
using tessera::server::ParameterStoreOptions;
namespace v1 = tessera::v1;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "tessera_fuzz_pushpull: invariant broken: %s\n", what);
  std::abort();
}

// The codes a shard may answer a request with (grpc_parameter_service.h, parameter_store.h).
void CheckCode(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
    // A BSP push one step ahead or a pull two ahead: the answer of a copy that lags the shard the
    // worker last heard from (consistency_gate.cc CheckPullStep), retried by the client.
    case absl::StatusCode::kUnavailable:
      return;
    default:
      std::fprintf(stderr, "unexpected status: %s\n", status.ToString().c_str());
      Fail("a code outside the documented set");
  }
}

// Job "asp": ASP, 2 workers, SGD, REJECT; dense w/0 (16), w/1 (5), b/0 (3); sparse table emb
// (dim 4). Job "bsp": BSP, 2 workers, Adam, SKIP; dense w/0 (16).
std::unique_ptr<ParameterStore> MakeStore() {
  ParameterStoreOptions options;
  options.max_memory_bytes = 64 << 20;  // pushes that grow state beyond it: RESOURCE_EXHAUSTED
  options.max_message_bytes = 1 << 20;
  auto store = std::make_unique<ParameterStore>(options);
  for (const bool asp : {true, false}) {
    v1::CreateJobStateRequest request;
    request.set_job_id(asp ? "asp" : "bsp");
    v1::JobConfig* c = request.mutable_config();
    c->set_consistency(asp ? v1::CONSISTENCY_ASP : v1::CONSISTENCY_BSP);
    c->set_num_workers(2);
    c->mutable_optimizer()->set_kind(asp ? v1::OPTIMIZER_KIND_SGD : v1::OPTIMIZER_KIND_ADAM);
    c->mutable_optimizer()->set_learning_rate(0.1f);
    c->set_non_finite_policy(asp ? v1::NON_FINITE_POLICY_REJECT : v1::NON_FINITE_POLICY_SKIP);
    auto add = [&](const char* tensor, uint32_t index, int64_t n) {
      v1::DensePartitionDecl* p = request.add_partitions();
      p->mutable_key()->set_tensor(tensor);
      p->mutable_key()->set_index(index);
      p->set_num_elements(n);
    };
    add("w", 0, 16);
    if (asp) {
      add("w", 1, 5);
      add("b", 0, 3);
      v1::SparseTableDecl* t = request.add_tables();
      t->set_name("emb");
      t->set_dim(4);
    }
    if (!store->CreateJobState(request).ok()) Fail("declaring the base jobs");
  }
  return store;
}

// Runs PushPull and returns the status `done` got (CANCELLED when a pull is still parked: the
// store's destructor answers it later, into a flag that outlives the store).
absl::Status PushPullStatus(ParameterStore* store, const v1::PushPullRequest& request) {
  auto result = std::make_shared<absl::Status>(absl::CancelledError("parked"));
  store->PushPull(request,
                  [result](absl::StatusOr<v1::PushPullResponse> r) { *result = r.status(); });
  return *result;
}

absl::Status PushPullViewStatus(ParameterStore* store, const tessera::PushPullView& view) {
  auto result = std::make_shared<absl::Status>(absl::CancelledError("parked"));
  store->PushPull(view, [result](absl::StatusOr<v1::PushPullResponse> r) { *result = r.status(); });
  return *result;
}

bool HasNonFinite(const v1::PushPullRequest& request) {
  for (const v1::Slice& s : request.push()) {
    if (s.encoding() != v1::ENCODING_FP32 && s.encoding() != v1::ENCODING_UNSPECIFIED) continue;
    for (size_t i = 0; i + 4 <= s.data().size(); i += 4) {
      float f;
      std::memcpy(&f, s.data().data() + i, 4);
      if (!std::isfinite(f)) return true;
    }
  }
  return false;
}

void CheckRejectPolicy(const v1::PushPullRequest& request, const absl::Status& status) {
  if (status.ok() && request.job_id() == "asp" && HasNonFinite(request)) {
    Fail("a push with NaN/Inf was accepted by a NON_FINITE_POLICY_REJECT job");
  }
}

// The codec's response decoder against protobuf's parser on the same slices.
void FuzzResponseDecoder(const std::vector<grpc::Slice>& slices, const char* bytes, size_t n) {
  tessera::DecodedPushPullResponse decoded;
  decoded.received = slices;
  const absl::Status hand = tessera::DecodePushPullResponse(&decoded);
  v1::PushPullResponse proto;
  const bool proto_ok = proto.ParseFromArray(bytes, static_cast<int>(n));
  if (!hand.ok()) {
    if (hand.code() != absl::StatusCode::kInvalidArgument) {
      Fail("the response decoder refused with another code than INVALID_ARGUMENT");
    }
    return;
  }
  if (!proto_ok) Fail("the response decoder accepted bytes that protobuf refuses");
  bool written = false;
  const v1::PushPullResponse got = tessera::TakePushPullResponse(&decoded, {}, &written);
  if (got.seq() != proto.seq() || got.status().code() != proto.status().code() ||
      got.status().message() != proto.status().message() ||
      got.duplicates() != proto.duplicates() ||
      got.skipped_non_finite() != proto.skipped_non_finite() ||
      got.weights_size() != proto.weights_size() || written) {
    Fail("the response decoder read other top-level fields than protobuf");
  }
  for (int i = 0; i < proto.weights_size(); ++i) {
    const v1::Slice& h = got.weights(i);
    const v1::Slice& p = proto.weights(i);
    if (h.key().tensor() != p.key().tensor() || h.key().index() != p.key().index() ||
        h.encoding() != p.encoding() || h.data() != p.data() ||
        h.row_ids_size() != p.row_ids_size() || h.want_weights() != p.want_weights() ||
        h.version() != p.version()) {
      Fail("the response decoder read another weight slice than protobuf");
    }
    for (int k = 0; k < p.row_ids_size(); ++k) {
      if (h.row_ids(k) != p.row_ids(k)) Fail("the response decoder read other row ids");
    }
  }
}

void FuzzHandParser(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const uint8_t cuts = data[0];
  const char* bytes = reinterpret_cast<const char*>(data + 1);
  const size_t n = size - 1;
  tessera::DecodedPushPullRequest parsed;
  // Up to three slices, cut where byte 0 says.
  const size_t a = n == 0 ? 0 : (cuts & 0x0f) * n / 16;
  const size_t b = n == 0 ? 0 : a + ((cuts >> 4) * (n - a)) / 16;
  for (const auto& [from, to] : {std::pair<size_t, size_t>{0, a}, {a, b}, {b, n}}) {
    if (to > from) parsed.received.emplace_back(bytes + from, to - from);
  }
  FuzzResponseDecoder(parsed.received, bytes, n);
  const absl::Status hand = tessera::DecodePushPullRequest(&parsed);
  v1::PushPullRequest proto;
  const bool proto_ok = proto.ParseFromArray(bytes, static_cast<int>(n));
  if (!hand.ok()) {
    if (hand.code() != absl::StatusCode::kInvalidArgument) {
      Fail("the hand parser refused with another code than INVALID_ARGUMENT");
    }
    return;
  }
  if (!proto_ok) Fail("the hand parser accepted bytes that protobuf refuses");
  // Same fields.
  if (parsed.job_id != proto.job_id() || parsed.worker_id != proto.worker_id() ||
      parsed.incarnation != proto.incarnation() || parsed.step != proto.step() ||
      parsed.seq != proto.seq() ||
      parsed.pull_encoding != static_cast<int32_t>(proto.pull_encoding()) ||
      parsed.push.size() != static_cast<size_t>(proto.push_size()) ||
      parsed.pull.size() != static_cast<size_t>(proto.pull_size())) {
    Fail("the hand parser read other top-level fields than protobuf");
  }
  for (int i = 0; i < proto.push_size(); ++i) {
    const tessera::DecodedSlice& h = parsed.push[static_cast<size_t>(i)];
    const v1::Slice& p = proto.push(i);
    std::string joined(h.data);
    for (absl::string_view piece : h.pieces) joined.append(piece.data(), piece.size());
    if (h.tensor != p.key().tensor() || h.index != p.key().index() ||
        h.encoding != static_cast<int32_t>(p.encoding()) || joined != p.data() ||
        h.row_ids != std::vector<int64_t>(p.row_ids().begin(), p.row_ids().end()) ||
        h.want_weights != p.want_weights() || h.weights_id != p.weights_id()) {
      Fail("the hand parser read another push slice than protobuf");
    }
  }
  // The same request by reference and by protobuf: the same answer.
  std::unique_ptr<ParameterStore> by_view = MakeStore();
  std::unique_ptr<ParameterStore> by_proto = MakeStore();
  const absl::Status s1 = PushPullViewStatus(by_view.get(), parsed.View());
  const absl::Status s2 = PushPullStatus(by_proto.get(), proto);
  CheckCode(s1);
  CheckCode(s2);
  CheckRejectPolicy(proto, s1);
  if (s1.code() != s2.code()) {
    std::fprintf(stderr, "view: %s\nproto: %s\n", s1.ToString().c_str(), s2.ToString().c_str());
    Fail("PushPull by view and by protobuf answered differently");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t kind = data[0] % 5;
  const uint8_t* body = data + 1;
  const size_t n = size - 1;
  if (kind == 0) {
    FuzzHandParser(body, n);
    return 0;
  }
  std::unique_ptr<ParameterStore> store = MakeStore();
  switch (kind) {
    case 1: {
      v1::PushPullRequest request;
      if (!request.ParseFromArray(body, static_cast<int>(n))) return 0;
      absl::StatusOr<tessera::server::PushAck> ack = store->Push(request);
      CheckCode(ack.status());
      CheckRejectPolicy(request, ack.status());
      request.set_seq(request.seq() + 1);
      const absl::Status s = PushPullStatus(store.get(), request);
      CheckCode(s);
      CheckRejectPolicy(request, s);
      break;
    }
    case 2: {
      v1::PullRequest request;
      if (!request.ParseFromArray(body, static_cast<int>(n))) return 0;
      auto result = std::make_shared<absl::Status>(absl::CancelledError("parked"));
      store->Pull(request,
                  [result](absl::StatusOr<std::vector<v1::Slice>> r) { *result = r.status(); });
      CheckCode(*result);
      break;
    }
    case 3: {
      v1::CreateJobStateRequest request;
      if (!request.ParseFromArray(body, static_cast<int>(n))) return 0;
      absl::StatusOr<v1::CreateJobStateResponse> r = store->CreateJobState(request);
      CheckCode(r.status());
      if (r.ok() && request.job_id().empty()) Fail("a job state without a job_id was created");
      if (r.ok() && request.job_id() != "asp" && request.job_id() != "bsp" &&
          !store->DropJob(request.job_id()).ok()) {
        Fail("a job state just created could not be dropped");
      }
      break;
    }
    default: {
      v1::UpdateMembershipRequest request;
      if (!request.ParseFromArray(body, static_cast<int>(n))) return 0;
      CheckCode(store->UpdateMembership(request).status());
      // The gate after the change: a push and a gated pull of each worker.
      for (uint32_t worker = 0; worker < 2; ++worker) {
        v1::PushPullRequest push;
        push.set_job_id(request.job_id());
        push.set_worker_id(worker);
        push.set_incarnation(1);
        push.set_seq(1);
        push.set_step(request.effective_step() > 0 && request.effective_step() < (1 << 20)
                          ? request.effective_step()
                          : 0);
        v1::Slice* s = push.add_push();
        s->mutable_key()->set_tensor("w");
        s->set_data(std::string(16 * 4, '\0'));
        s->set_want_weights(true);
        CheckCode(PushPullStatus(store.get(), push));
      }
      break;
    }
  }
  return 0;
}
