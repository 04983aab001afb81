// The transport to one parameter shard, kept apart from the client's domain logic
// (partitioning, routing, retries) so that ParameterClient can be tested against a fake shard.
#ifndef TESSERA_WORKER_CLIENT_SHARD_CLIENT_H_
#define TESSERA_WORKER_CLIENT_SHARD_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {
namespace client {

// One parameter shard (DESIGN.md §3). Implementations are thread-safe: any thread may call any
// method at any time, and many PushPull requests may be in flight at once.
class ShardClient {
 public:
  // Called exactly once per PushPull request, on an arbitrary thread, with the shard's response or
  // a transport error (UNAVAILABLE when the stream broke, DEADLINE_EXCEEDED when the deadline
  // passed, CANCELLED when the client shut down). A response whose `status` is not OK is still
  // delivered as a value: the per-request outcome is the caller's to interpret.
  using PushPullCallback = std::function<void(absl::StatusOr<v1::PushPullResponse>)>;

  virtual ~ShardClient() = default;

  // "host:port" of the shard, for error messages.
  virtual const std::string& address() const = 0;

  // Where a transport may decode the fp32 weights of one partition straight from its receive
  // buffers into the caller's memory, instead of returning them in the response's bytes.
  struct WeightsTarget {
    std::string tensor;
    uint32_t index = 0;
    float* out = nullptr;  // nullptr: no target
    size_t count = 0;      // values at `out`
    // Set to true by the transport, before `done` runs, when it wrote the weights of
    // (tensor, index) to `out`; that slice of the response then has empty data.
    bool* written = nullptr;
  };

  // One PushPull: the request, and optionally push data lent from the caller's memory and where
  // the answered weights may go.
  struct PushPullCall {
    PushPullCall() = default;
    // A request alone is a call (implicit, so that `{request}` reads as one).
    PushPullCall(std::shared_ptr<const v1::PushPullRequest> request,  // NOLINT(runtime/explicit)
                 std::vector<absl::string_view> lent = {})
        : request(std::move(request)), lent(std::move(lent)) {}
    PushPullCall(std::shared_ptr<const v1::PushPullRequest> request,
                 std::vector<absl::string_view> lent, WeightsTarget target)
        : request(std::move(request)), lent(std::move(lent)), target(std::move(target)) {}

    // Shared, not copied, so that a retry resends the very same request; it must not be modified
    // afterwards. Responses are matched to requests by `seq`.
    std::shared_ptr<const v1::PushPullRequest> request;
    // Empty, or one entry per request->push(i): a non-empty entry is that slice's data, whose own
    // `data` field must then be empty. The caller keeps the lent memory valid and unchanged until
    // `done` runs, and the transport does not read it once `done` has run (GrpcShardClient runs
    // `done` only after gRPC has let go of every slice pointing into it). A retry after `done` may
    // lend the same memory again.
    std::vector<absl::string_view> lent;
    // Optional (target.out == nullptr: none). A transport that does not decode in place ignores it
    // and returns the weights in the response.
    WeightsTarget target;
    // Wanted first: the trainer marks the requests whose weights the next forward pass reads
    // before the large tensors' (ParameterClient's `urgent`). GrpcShardClient sends them on a
    // stream of their own, so they do not queue behind bulk transfers; a transport may ignore it.
    // A partition's next push leaves only after its answer, so moving a request to another
    // stream never reorders one partition's pushes.
    bool urgent = false;
  };

  // Sends `call` on the shard's long-lived PushPull stream and returns without blocking on the
  // network; `done` runs once with the answer (see PushPullCallback), or with INTERNAL when
  // `lent` does not fit the request (an entry for a slice past the last, or for one that has data
  // of its own). Transports resend nothing: a broken stream fails the requests on it with
  // UNAVAILABLE, and the caller decides whether to send them again (ParameterClient's RetryPolicy).
  virtual void PushPull(PushPullCall call, absl::Time deadline, PushPullCallback done) = 0;

  // Fails every PushPull in flight with CANCELLED now, without waiting for its answer or its
  // deadline (a pull parked at a BSP barrier may otherwise wait the whole deadline); their
  // callbacks run before this returns, and no weights are written to their targets afterwards. (A
  // request whose answer or deadline came just before may still have its callback waiting for
  // gRPC to release lent bytes, see PushPullCall::lent; it runs soon after, on another thread.)
  // Later calls work as usual. Used when the caller shuts down. The default does nothing: calls in
  // flight then end with their answer or at their deadline.
  virtual void CancelPending() {}

  // Blocking server-streaming Pull; returns every weight slice the shard sent, in order.
  virtual absl::StatusOr<std::vector<v1::Slice>> Pull(const v1::PullRequest& request,
                                                      absl::Time deadline) = 0;

  // Blocking control calls.
  virtual absl::StatusOr<v1::CreateJobStateResponse> CreateJobState(
      const v1::CreateJobStateRequest& request, absl::Time deadline) = 0;
  virtual absl::Status UpdateMembership(const v1::UpdateMembershipRequest& request,
                                        absl::Time deadline) = 0;
  virtual absl::Status DropJob(const v1::DropJobRequest& request, absl::Time deadline) = 0;

  // Whether the shard's process answers at all, by `deadline` (a grpc.health.v1 check: a
  // stopped process answers nothing, DEADLINE_EXCEEDED). The default, for a transport with no
  // process behind it, answers OK.
  virtual absl::Status CheckHealth(absl::Time /*deadline*/) { return absl::OkStatus(); }
};

// `call` with its lent push data copied into a new request (and `lent` left empty), for a
// transport that does not send lent bytes in place, or a decorator that keeps or sends the request
// after `done` has run (when the lent memory may be gone). The target is kept.
ShardClient::PushPullCall WithLentDataCopied(ShardClient::PushPullCall call);

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_SHARD_CLIENT_H_
