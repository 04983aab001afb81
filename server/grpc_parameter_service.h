// GrpcParameterService: the ParameterService of proto/tessera/v1/parameter.proto over gRPC's
// callback API, adapting a ParameterStore (DESIGN.md §3).
//
// Reactors move requests onto a bounded thread pool, where the store's work (parsing, decoding,
// the optimizer, encoding the answer) runs; a PushPull request of at most kInlineRequestBytes that
// finds its stream idle is processed on the gRPC thread that read it instead (one thread hand-off
// less per round trip). PushPull keeps one stream per worker-shard pair: requests of a stream are
// applied in the order they arrive (so a worker's sequence numbers reach each partition in order),
// one at a time; a pull that waits on the consistency gate
// parks without holding the stream, and later requests go on. Responses carry the request's seq
// and can leave out of order; a failed request is answered in PushPullResponse.status and the
// stream stays open. Writes are queued so that at most one is outstanding.
//
// PushPull is a raw method (grpc::ByteBuffer both ways), so that no gradient or weight is copied
// into or out of a protobuf string (the PushPull codec, common/push_pull_codec.h): a request's
// gradient is read in place from gRPC's receive slices (the store takes their pieces, see
// SliceView), and the answered weights are not copied either: a dense fp32 answer is sent straight
// from the partition's weights, which the answer holds by reference until gRPC has sent it (the
// store copies them before an update only if an answer still holds them: SharedWeights,
// PushPullAnswerSink); bf16/fp16 and sparse answers are encoded into reused buffers that gRPC
// sends as they are. A malformed
// request gets INVALID_ARGUMENT in its response when its seq can be read, and otherwise ends the
// stream with INVALID_ARGUMENT.
//
// Flow control: a stream stops reading while its read-but-unanswered requests plus its queued
// responses number kMaxQueuedPerStream or more, or hold max_queued_bytes or more, and resumes as
// responses are written; so a client that does not read its responses cannot make the shard queue
// them without bound.
#ifndef TESSERA_SERVER_GRPC_PARAMETER_SERVICE_H_
#define TESSERA_SERVER_GRPC_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/push_pull_codec.h"
#include "common/thread_pool.h"
#include "server/parameter_store.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::server {

// Every method typed except PushPull, which is raw (see above).
using ParameterCallbackServiceBase = v1::ParameterService::WithRawCallbackMethod_PushPull<
    v1::ParameterService::WithCallbackMethod_Pull<v1::ParameterService::WithCallbackMethod_Push<
        v1::ParameterService::WithCallbackMethod_CreateJobState<
            v1::ParameterService::WithCallbackMethod_UpdateMembership<
                v1::ParameterService::WithCallbackMethod_DropJob<
                    v1::ParameterService::WithCallbackMethod_Checkpoint<
                        v1::ParameterService::WithCallbackMethod_Restore<
                            v1::ParameterService::WithCallbackMethod_ReadCheckpoint<
                                v1::ParameterService::WithCallbackMethod_Fill<
                                    v1::ParameterService::Service>>>>>>>>>>;

// Counters of the PushPull streams, over all streams since the service was made. Thread-safe.
struct PushPullStreamStats {
  int64_t requests_read = 0;
  // Of those, the requests processed on the gRPC thread that read them
  // (GrpcParameterService::kInlineRequestBytes); the rest went to the pool.
  int64_t requests_inline = 0;
  // Largest number of one stream's requests read but not answered plus responses not yet written.
  int64_t peak_queued = 0;
  // Largest number of bytes those held (requests until applied, responses until written).
  int64_t peak_queued_bytes = 0;
  // Gradient bytes that spanned receive slices (read in place, piece by piece).
  int64_t pieced_request_bytes = 0;
  // Requests refused as malformed (answered with INVALID_ARGUMENT or ending their stream).
  int64_t malformed_requests = 0;
};

// The weights of a PushPull answer that the store shares by reference (PushPullAnswerSink::shared)
// as external data for the codec: each slice the codec makes over them holds its own reference
// until gRPC releases it, so the store copies the weights before it next updates them if that has
// not happened yet. Refers to `shared`, which must outlive it; thread-compatible.
class SharedAnswerWeights final : public ExternalSliceData {
 public:
  explicit SharedAnswerWeights(const std::vector<std::pair<int, SharedWeights>>& shared)
      : shared_(shared) {}

  size_t size() const override { return shared_.size(); }
  int index(size_t k) const override { return shared_[k].first; }
  absl::string_view bytes(size_t k) const override { return shared_[k].second.bytes(); }
  grpc::Slice SliceOver(size_t k) const override;

 private:
  const std::vector<std::pair<int, SharedWeights>>& shared_;
};

class GrpcParameterService final : public ParameterCallbackServiceBase {
 public:
  // Read-but-unanswered requests plus unwritten responses of one stream beyond which it stops
  // reading.
  static constexpr int kMaxQueuedPerStream = 64;
  static constexpr size_t kDefaultMaxQueuedBytes = size_t{64} << 20;
  // A PushPull request of at most this many bytes that reaches an idle stream is processed on the
  // gRPC thread that read it, not handed to the pool: without the hand-off (a futex wake and a
  // switch to another thread) the push/pull goodput rose 2-44% at 64 KiB to 16 MiB on 2 cores
  // (docs/benchmarks.md, "One thread hand-off less per round trip"). The store's work never waits
  // for another request to arrive (a gated pull parks instead), so the thread is held for the
  // decode, the check and the optimizer of one request: at most 2 default partitions. Larger
  // requests, and every request that queues behind another on its stream, go to the pool.
  static constexpr size_t kInlineRequestBytes = size_t{8} << 20;

  // `store` and `pool` must outlive the service and every call it serves. Answers larger than
  // max_message_bytes are split (Pull) or refused with RESOURCE_EXHAUSTED (PushPull). A PushPull
  // stream stops reading while its queued requests and responses hold max_queued_bytes or more
  // (it always reads when nothing is queued).
  GrpcParameterService(ParameterStore* store, ThreadPool* pool, size_t max_message_bytes,
                       size_t max_queued_bytes = kDefaultMaxQueuedBytes);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PushPull(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<v1::PullResponse>* Pull(grpc::CallbackServerContext* context,
                                                   const v1::PullRequest* request) override;
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context,
                                 const v1::PushPullRequest* request,
                                 v1::PushResponse* response) override;
  grpc::ServerUnaryReactor* CreateJobState(grpc::CallbackServerContext* context,
                                           const v1::CreateJobStateRequest* request,
                                           v1::CreateJobStateResponse* response) override;
  grpc::ServerUnaryReactor* UpdateMembership(grpc::CallbackServerContext* context,
                                             const v1::UpdateMembershipRequest* request,
                                             v1::UpdateMembershipResponse* response) override;
  grpc::ServerUnaryReactor* DropJob(grpc::CallbackServerContext* context,
                                    const v1::DropJobRequest* request,
                                    v1::DropJobResponse* response) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const v1::CheckpointRequest* request,
                                       v1::CheckpointResponse* response) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* context,
                                    const v1::RestoreRequest* request,
                                    v1::RestoreResponse* response) override;
  grpc::ServerUnaryReactor* ReadCheckpoint(grpc::CallbackServerContext* context,
                                           const v1::ReadCheckpointRequest* request,
                                           v1::ReadCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* Fill(grpc::CallbackServerContext* context,
                                 const v1::FillRequest* request,
                                 v1::FillResponse* response) override;

  // Counters of the PushPull streams. Thread-safe.
  PushPullStreamStats stream_stats() const;

  // Shared with the streams, which may outlive a call to the service's methods.
  struct StatsCounters {
    std::atomic<int64_t> requests_read{0};
    std::atomic<int64_t> requests_inline{0};
    std::atomic<int64_t> peak_queued{0};
    std::atomic<int64_t> peak_queued_bytes{0};
    std::atomic<int64_t> pieced_request_bytes{0};
    std::atomic<int64_t> malformed_requests{0};
  };

 private:
  ParameterStore* const store_;
  ThreadPool* const pool_;
  const size_t max_message_bytes_;
  const size_t max_queued_bytes_;
  const std::shared_ptr<StatsCounters> stats_ = std::make_shared<StatsCounters>();
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_GRPC_PARAMETER_SERVICE_H_
