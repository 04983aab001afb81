#include "worker/client/grpc_shard_client.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/health_probe.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_callback.h"
#include "spdlog/spdlog.h"

namespace tessera {
namespace client {

namespace {

// A static string: gRPC keeps a pointer to the method name for the life of the call.
const char* const kPushPullMethod = "/tessera.v1.ParameterService/PushPull";

// Keepalive ping interval and timeout on the channels to the shards. The shards accept pings this
// often (common/grpc_server.cc).
constexpr int kKeepaliveMs = 5000;

}  // namespace

class GrpcShardClient::Loan {
 public:
  explicit Loan(GrpcShardClient* owner) : owner_(owner) {}

  // One more reference into the borrowed memory (a slice, or a send about to make slices).
  void Take() {
    absl::MutexLock lock(&mu_);
    ++live_;
    owner_->borrowed_references_.fetch_add(1, std::memory_order_relaxed);
  }

  // Drops one; the last one hands a deferred callback to the sweeper. The mutex orders gRPC's
  // reads of the memory (before it releases the slice) before the callback.
  void Return() {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      owner_->borrowed_references_.fetch_sub(1, std::memory_order_release);
      if (--live_ == 0) fn.swap(when_returned_);
    }
    if (fn) owner_->PostReady(std::move(fn));
  }

  bool Outstanding() {
    absl::MutexLock lock(&mu_);
    return live_ > 0;
  }

  // Keeps *fn for the last Return and returns true; false (leaving *fn) when nothing is out.
  bool Defer(std::function<void()>* fn) {
    absl::MutexLock lock(&mu_);
    if (live_ == 0) return false;
    when_returned_ = std::move(*fn);
    return true;
  }

  // Blocks until nothing is out. Only for a loan without a deferred callback.
  void AwaitReturned() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int64_t* live) { return *live == 0; }, &live_));
  }

 private:
  GrpcShardClient* const owner_;
  absl::Mutex mu_;
  int64_t live_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> when_returned_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A slice over borrowed memory: the loan counts it until gRPC releases it.
grpc::Slice BorrowedSlice(absl::string_view data,
                          const std::shared_ptr<GrpcShardClient::Loan>& loan) {
  loan->Take();
  auto* keep = new std::shared_ptr<GrpcShardClient::Loan>(loan);
  return grpc::Slice(
      const_cast<char*>(data.data()), data.size(),
      [](void* p) {
        auto* held = static_cast<std::shared_ptr<GrpcShardClient::Loan>*>(p);
        (*held)->Return();
        delete held;
      },
      keep);
}

// The lent push data of one call as external data for the codec: entry i is push(i)'s data (empty:
// not lent), and each slice over it is counted by the loan until gRPC releases it.
class LentPushData final : public ExternalSliceData {
 public:
  LentPushData(const std::vector<absl::string_view>& lent,
               const std::shared_ptr<GrpcShardClient::Loan>& loan)
      : lent_(lent), loan_(loan) {}

  size_t size() const override { return lent_.size(); }
  int index(size_t k) const override { return static_cast<int>(k); }
  absl::string_view bytes(size_t k) const override { return lent_[k]; }
  grpc::Slice SliceOver(size_t k) const override { return BorrowedSlice(lent_[k], loan_); }

 private:
  const std::vector<absl::string_view>& lent_;
  const std::shared_ptr<GrpcShardClient::Loan>& loan_;
};

}  // namespace

// One PushPull stream. It owns itself from Start() until OnDone(), so that gRPC may finish it
// after the owner has dropped it. Writes are queued: the callback API allows one at a time.
// StartWrite is always called without holding mu_, because gRPC may run OnWriteDone inline in
// the calling thread.
class GrpcShardClient::Stream final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Stream(GrpcShardClient* owner, int slot, uint64_t generation)
      : owner_(owner), slot_(slot), generation_(generation) {}
  // The owner waits for every stream to be destroyed, so that the ClientContext (which holds a
  // reference to the channel) never drops the channel's last reference on a gRPC callback
  // thread: gRPC 1.51 cannot shut a channel down from its own callback threads
  // (grpc/grpc#32584; it aborts with `prior > 0` in ref_counted.h).
  ~Stream() override {
    // Unwritten messages go first: their borrowed slices are returned while the owner still waits.
    std::deque<std::unique_ptr<grpc::ByteBuffer>> unwritten;
    {
      absl::MutexLock lock(&mu_);
      unwritten.swap(queue_);
    }
    unwritten.clear();
    owner_->OnStreamDestroyed();
  }

  int slot() const { return slot_; }
  uint64_t generation() const { return generation_; }

  // Binds the call and queues the first read. Does not start it (no callback can run yet).
  void Bind(std::shared_ptr<Stream> self) {
    self_ = std::move(self);
    owner_->generic_stub_->PrepareBidiStreamingCall(&context_, kPushPullMethod, grpc::StubOptions(),
                                                    this);
    StartRead(&response_);
  }

  // REQUIRES: Bind(). Call without holding the owner's lock: OnDone may run inline.
  void Start() { StartCall(); }

  // Queues `message` for writing. False when the stream has already ended (the message is then
  // dropped); the owner's OnStreamDone then takes care of every request pending on it. A message
  // with lent slices: the caller holds a reference of their loan across the call.
  bool Send(std::unique_ptr<grpc::ByteBuffer> message) {
    const grpc::ByteBuffer* first = nullptr;
    {
      absl::MutexLock lock(&mu_);
      // `message` outlives the lock, so a lent slice is released without it held.
      if (finished_) return false;
      queue_.push_back(std::move(message));
      if (!writing_) {
        writing_ = true;
        first = queue_.front().get();
      }
    }
    if (first != nullptr) StartWrite(first);
    return true;
  }

  void Cancel() { context_.TryCancel(); }

  void OnWriteDone(bool ok) override {
    const grpc::ByteBuffer* next = nullptr;
    // Messages are destroyed after the lock is released: releasing a borrowed slice may hand a
    // deferred callback to the sweeper.
    std::deque<std::unique_ptr<grpc::ByteBuffer>> written;
    {
      absl::MutexLock lock(&mu_);
      written.push_back(std::move(queue_.front()));
      queue_.pop_front();
      if (!ok) finished_ = true;
      if (finished_) {
        while (!queue_.empty()) {
          written.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        writing_ = false;
      } else if (!queue_.empty()) {
        next = queue_.front().get();
      } else {
        writing_ = false;
      }
    }
    if (next != nullptr) StartWrite(next);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      return;
    }
    {
      DecodedPushPullResponse response;
      const absl::Status decoded = response_.Dump(&response.received).ok()
                                       ? DecodePushPullResponse(&response)
                                       : absl::DataLossError("the received message has no bytes");
      if (decoded.ok()) {
        owner_->Deliver(&response);
      } else {
        // An undecodable answer cannot be matched to its request; the request then runs into its
        // deadline and is retried.
        spdlog::warn("{}: undecodable PushPull response: {}", owner_->options_.address,
                     decoded.ToString());
      }
    }
    response_.Clear();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::Status s = status.ok() ? absl::UnavailableError("PushPull stream ended by the shard")
                                 : FromGrpcStatus(status);
    owner_->OnStreamDone(slot_, generation_, std::move(s));
    // Last touch of *this: the self reference may be the final one.
    std::shared_ptr<Stream> keep = std::move(self_);
  }

 private:
  GrpcShardClient* const owner_;
  const int slot_;
  const uint64_t generation_;
  std::shared_ptr<Stream> self_;
  grpc::ClientContext context_;
  grpc::ByteBuffer response_;

  absl::Mutex mu_;
  std::deque<std::unique_ptr<grpc::ByteBuffer>> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {

// gRPC 1.51 (with the epoll poller) runs the callback-API calls of a process on one shared
// "callback alternative" completion queue, reference-counted by the channels that made callback
// calls. When the last such channel goes, the queue and its threads are torn down, and the next
// channel makes a new one; that cycle races with the queue's threads and aborts the process
// (`assertion failed: prior > 0` in ref_counted.h) when clients come and go, as in tests. One
// channel that has made a callback call and is never destroyed keeps the queue for the life of
// the process. Its one call goes to port 1, fails at once, and nobody waits for it.
void PinCallbackCompletionQueue() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto* channel = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
    auto* service = v1::ParameterService::NewStub(*channel).release();
    auto* context = new grpc::ClientContext();
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(1)));
    auto* request = new v1::DropJobRequest();
    auto* response = new v1::DropJobResponse();
    service->async()->DropJob(context, request, response, [](grpc::Status) {});
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcShardClient>> GrpcShardClient::Create(const Options& options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("GrpcShardClient: address is empty");
  }
  if (options.streams < 1 || options.streams > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("GrpcShardClient: streams must be in [1, 64], got ", options.streams));
  }
  PinCallbackCompletionQueue();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  args.SetMaxSendMessageSize(-1);
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A connection whose peer went silent (a partition, a shard host gone) is noticed by keepalive
  // pings within 2 * kKeepaliveMs instead of TCP's retransmission backoff (measured: training
  // resumed 24 s after a 30 s partition healed), and a new one is made at once (CreateChannel
  // caps the reconnect backoff at 2 s).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  auto channel = options.credentials.CreateChannel(options.address, args);
  return std::unique_ptr<GrpcShardClient>(new GrpcShardClient(options, std::move(channel)));
}

GrpcShardClient::GrpcShardClient(const Options& options, std::shared_ptr<grpc::Channel> channel)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::ParameterService::NewStub(channel_)),
      generic_stub_(std::make_unique<grpc::GenericStub>(channel_)),
      streams_(static_cast<size_t>(options.streams) + 1) {
  sweeper_ = std::thread([this] { SweepDeadlines(); });
}

GrpcShardClient::~GrpcShardClient() {
  std::vector<std::shared_ptr<Stream>> streams;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    streams.swap(streams_);
  }
  // Without the lock: dropping the last reference runs ~Stream, which takes mu_.
  for (auto& stream : streams) {
    if (stream != nullptr) stream->Cancel();
  }
  streams.clear();
  std::multimap<uint64_t, Pending> left;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* live) { return *live == 0; }, &live_streams_));
    left.swap(pending_);
  }
  for (auto& [seq, p] : left) {
    if (p.loan != nullptr) p.loan->AwaitReturned();
    p.done(absl::CancelledError(
        absl::StrCat(options_.address, ": PushPull seq ", seq, " cancelled: client shut down")));
  }
  // Deferred callbacks run on the sweeper; it stops once none is left.
  {
    absl::MutexLock lock(&ready_mu_);
    ready_mu_.Await(absl::Condition(
        +[](int64_t* deferred) { return *deferred == 0; }, &deferred_));
    sweeper_stop_ = true;
  }
  sweeper_.join();
}

std::shared_ptr<GrpcShardClient::Stream> GrpcShardClient::CurrentStreamLocked(int slot,
                                                                              bool* created) {
  std::shared_ptr<Stream>& stream = streams_[slot];
  *created = stream == nullptr;
  if (stream == nullptr) {
    stream = std::make_shared<Stream>(this, slot, next_generation_++);
    stream->Bind(stream);
    ++live_streams_;
  }
  return stream;
}

void GrpcShardClient::PushPull(PushPullCall call, absl::Time deadline, PushPullCallback done) {
  const uint64_t seq = call.request->seq();
  bool lends = false;
  for (absl::string_view b : call.lent) lends = lends || !b.empty();
  std::shared_ptr<Loan> loan;
  if (lends) {
    loan = std::make_shared<Loan>(this);
    // Held until the message is queued: the request cannot finish (and its caller free the
    // memory) while Send still reads it.
    loan->Take();
  }
  auto message = std::make_unique<grpc::ByteBuffer>();
  absl::Status encoded;
  {
    const LentPushData lent(call.lent, loan);
    encoded = EncodePushPullRequest(call.request, lends ? &lent : nullptr, options_.zero_copy_push,
                                    message.get());
  }
  if (!encoded.ok()) {
    // Nothing points into the lent memory: the codec refused before it made any slice.
    if (loan != nullptr) loan->Return();
    done(absl::Status(encoded.code(), absl::StrCat(options_.address, ": PushPull seq ", seq, ": ",
                                                   encoded.message())));
    return;
  }
  std::shared_ptr<Stream> stream;
  bool start = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      // A retry has the same seq, so it takes the same stream as its first attempt.
      const int slot = SlotOf(seq, call.urgent);
      stream = CurrentStreamLocked(slot, &start);
      Pending p;
      p.stream_slot = slot;
      p.loan = loan;
      p.deadline = deadline;
      p.done = std::move(done);
      if (call.target.out != nullptr && call.target.written != nullptr) {
        p.target = std::move(call.target);
      }
      p.stream_generation = stream->generation();
      pending_.emplace(seq, std::move(p));
    }
  }
  if (stream == nullptr) {
    message.reset();  // gives its lent slices back
    if (loan != nullptr) loan->Return();
    done(absl::CancelledError(
        absl::StrCat(options_.address, ": PushPull seq ", seq, " refused: client shutting down")));
    return;
  }
  if (start) stream->Start();
  // A false return means the stream ended under us; OnStreamDone fails what was pending on it.
  stream->Send(std::move(message));
  if (loan != nullptr) loan->Return();
}

void GrpcShardClient::Finish(const std::shared_ptr<Loan>& loan, PushPullCallback done,
                             absl::StatusOr<v1::PushPullResponse> result) {
  if (loan == nullptr) {
    done(std::move(result));
    return;
  }
  std::function<void()> run = [done = std::move(done), result = std::move(result)]() mutable {
    done(std::move(result));
  };
  {
    absl::MutexLock lock(&ready_mu_);
    ++deferred_;
  }
  if (loan->Defer(&run)) return;
  {
    absl::MutexLock lock(&ready_mu_);
    --deferred_;
  }
  run();
}

void GrpcShardClient::PostReady(std::function<void()> fn) {
  absl::MutexLock lock(&ready_mu_);
  ready_.push_back(std::move(fn));
}

void GrpcShardClient::CancelStream(int slot, uint64_t generation) {
  std::shared_ptr<Stream> stream;
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<size_t>(slot) < streams_.size() && streams_[slot] != nullptr &&
        streams_[slot]->generation() == generation) {
      stream = streams_[slot];
    }
  }
  if (stream != nullptr) stream->Cancel();
}

void GrpcShardClient::Deliver(DecodedPushPullResponse* response) {
  const uint64_t seq = response->header.seq();
  PushPullCallback done;
  WeightsTarget target;
  std::shared_ptr<Loan> loan;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.lower_bound(seq);
    if (it == pending_.end() || it->first != seq) return;  // late answer: dropped
    done = std::move(it->second.done);
    target = std::move(it->second.target);
    loan = std::move(it->second.loan);
    pending_.erase(it);
  }
  // The request is out of pending_, so nobody else runs `done`: the caller's buffer is still
  // waiting for these weights.
  Fp32WeightsTarget in_place;
  if (target.out != nullptr) {
    in_place.tensor = target.tensor;
    in_place.index = target.index;
    in_place.out = target.out;
    in_place.count = target.count;
  }
  bool written = false;
  v1::PushPullResponse answer = TakePushPullResponse(response, in_place, &written);
  if (written) *target.written = true;
  // The shard has read the whole request, so its bytes were written; gRPC releases their slices
  // once the write completes, usually before now.
  Finish(loan, std::move(done), std::move(answer));
}

void GrpcShardClient::OnStreamDone(int slot, uint64_t generation, absl::Status status) {
  struct Failed {
    uint64_t seq;
    PushPullCallback done;
    std::shared_ptr<Loan> loan;
  };
  std::vector<Failed> failed;
  bool stopping;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    if (!streams_.empty() && streams_[slot] != nullptr &&
        streams_[slot]->generation() == generation) {
      streams_[slot].reset();
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.stream_generation != generation) {
        ++it;
        continue;
      }
      failed.push_back(Failed{it->first, std::move(it->second.done), std::move(it->second.loan)});
      it = pending_.erase(it);
    }
  }
  // CANCELLED only when this client is shutting down: a stream that CancelStream ended for a
  // stalled request, or that the shard cancelled, is a transport failure the caller may retry.
  const absl::StatusCode code = stopping && status.code() == absl::StatusCode::kCancelled
                                    ? absl::StatusCode::kCancelled
                                    : absl::StatusCode::kUnavailable;
  for (Failed& f : failed) {
    // The stream has ended, so gRPC lets go of its slices without being told.
    Finish(f.loan, std::move(f.done),
           absl::Status(code, absl::StrCat(options_.address, ": PushPull seq ", f.seq,
                                           " lost with its stream: ", status.ToString())));
  }
}

void GrpcShardClient::CancelPending() {
  std::multimap<uint64_t, Pending> cancelled;
  {
    absl::MutexLock lock(&mu_);
    cancelled.swap(pending_);
  }
  // A request whose bytes are still queued on its stream can only be given back by ending that
  // stream (its other requests, if any, are written again on a new one).
  for (auto& [seq, p] : cancelled) {
    if (p.loan != nullptr && p.loan->Outstanding()) {
      CancelStream(p.stream_slot, p.stream_generation);
    }
  }
  // Out of pending_, so a late answer is dropped (Deliver) and never written to a target.
  for (auto& [seq, p] : cancelled) {
    if (p.loan != nullptr) p.loan->AwaitReturned();
    p.done(absl::CancelledError(absl::StrCat(options_.address, ": PushPull seq ", seq,
                                             " cancelled: client shutting down")));
  }
}

void GrpcShardClient::OnStreamDestroyed() {
  // Last touch of *this by a stream: the destructor waits for live_streams_ to reach 0.
  absl::MutexLock lock(&mu_);
  --live_streams_;
}

void GrpcShardClient::SweepDeadlines() {
  absl::Time next_sweep = absl::Now() + absl::Milliseconds(25);
  for (;;) {
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&ready_mu_);
      ready_mu_.AwaitWithDeadline(absl::Condition(this, &GrpcShardClient::SweeperWoken),
                                  next_sweep);
      if (ready_.empty() && sweeper_stop_) return;
      ready.swap(ready_);
    }
    for (std::function<void()>& fn : ready) fn();
    if (!ready.empty()) {
      absl::MutexLock lock(&ready_mu_);
      deferred_ -= static_cast<int64_t>(ready.size());
    }
    if (absl::Now() >= next_sweep) {
      ExpireDeadlines();
      next_sweep = absl::Now() + absl::Milliseconds(25);
    }
  }
}

void GrpcShardClient::ExpireDeadlines() {
  struct Expired {
    uint64_t seq;
    PushPullCallback done;
    std::shared_ptr<Loan> loan;
    uint64_t generation;
    int slot;
  };
  std::vector<Expired> expired;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    const absl::Time now = absl::Now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(Expired{it->first, std::move(it->second.done), std::move(it->second.loan),
                                  it->second.stream_generation, it->second.stream_slot});
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Expired& e : expired) {
    // Bytes still queued on a stalled stream are given back only when the stream ends.
    if (e.loan != nullptr && e.loan->Outstanding()) {
      CancelStream(e.slot, e.generation);
    }
    Finish(e.loan, std::move(e.done),
           absl::DeadlineExceededError(
               absl::StrCat(options_.address, ": PushPull seq ", e.seq, " deadline exceeded")));
  }
}

namespace {

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
}

}  // namespace

absl::StatusOr<std::vector<v1::Slice>> GrpcShardClient::Pull(const v1::PullRequest& request,
                                                             absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  std::unique_ptr<grpc::ClientReader<v1::PullResponse>> reader = stub_->Pull(&context, request);
  std::vector<v1::Slice> slices;
  v1::PullResponse response;
  while (reader->Read(&response)) {
    for (v1::Slice& s : *response.mutable_weights()) slices.push_back(std::move(s));
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status, options_.address);
  return slices;
}

absl::StatusOr<v1::CreateJobStateResponse> GrpcShardClient::CreateJobState(
    const v1::CreateJobStateRequest& request, absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::CreateJobStateResponse response;
  grpc::Status status = stub_->CreateJobState(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, options_.address);
  return response;
}

absl::Status GrpcShardClient::UpdateMembership(const v1::UpdateMembershipRequest& request,
                                               absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::UpdateMembershipResponse response;
  return FromGrpcStatus(stub_->UpdateMembership(&context, request, &response), options_.address);
}

absl::Status GrpcShardClient::DropJob(const v1::DropJobRequest& request, absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::DropJobResponse response;
  return FromGrpcStatus(stub_->DropJob(&context, request, &response), options_.address);
}

absl::Status GrpcShardClient::CheckHealth(absl::Time deadline) {
  const absl::Status status = tessera::CheckHealth(channel_.get(), deadline);
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(options_.address, " ", status.message()));
}

}  // namespace client
}  // namespace tessera
