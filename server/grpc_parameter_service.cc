#include "server/grpc_parameter_service.h"

#include <atomic>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"

namespace tessera::server {
namespace {

// Bytes a PullResponse adds around its slices (tags and lengths), with room to spare.
constexpr size_t kMessageOverhead = 1024;
// Reused buffers kept by each stream for answered weights that are copied: bf16 and fp16
// encodings and sparse rows (dense fp32 answers share the store's weights instead). Freed with the
// stream. 16 covers a 64 MiB tensor's 4 MiB partitions in flight on one stream; 4 buffers and
// 16 MiB cost about 15% of goodput in the 64 MiB, 1 shard benchmark when fp32 answers were still
// copied (docs/benchmarks.md).
constexpr size_t kPooledBuffersPerStream = 16;
constexpr size_t kPooledBytesPerStream = size_t{64} << 20;

void RaiseTo(std::atomic<int64_t>* peak, int64_t value) {
  int64_t seen = peak->load(std::memory_order_relaxed);
  while (value > seen && !peak->compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// One PushPull stream, raw: requests are decoded by the codec on the pool and answered with weights
// shared with the store or in reused buffers (common/push_pull_codec.h). It deletes itself
// once gRPC is done with it (OnDone) and no request of it is still queued, running or parked in the
// store.
class PushPullReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PushPullReactor(ParameterStore* store, ThreadPool* pool, size_t max_message_bytes,
                  size_t max_queued_bytes,
                  std::shared_ptr<GrpcParameterService::StatsCounters> stats)
      : store_(store),
        pool_(pool),
        max_message_bytes_(max_message_bytes),
        max_queued_bytes_(max_queued_bytes),
        stats_(std::move(stats)) {
    StartRead(&read_buffer_);
  }

  void OnReadDone(bool ok) override {
    std::unique_ptr<Pending> request;
    size_t bytes = 0;
    if (ok) {
      request = std::make_unique<Pending>();
      bytes = read_buffer_.Length();
      request->bytes = bytes;
      if (!read_buffer_.Dump(&request->slices).ok()) request->slices.clear();
      read_buffer_.Clear();
      stats_->requests_read.fetch_add(1, std::memory_order_relaxed);
    }
    bool read_again = false;
    bool schedule = false;
    bool finish = false;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {
        reads_done_ = true;
        finish = ShouldFinishLocked(&finish_with);
      } else {
        request_bytes_ += request->bytes;
        pending_.push_back(std::move(request));
        ++in_flight_;
        RecordPeakLocked();
        if (!draining_) {
          draining_ = true;
          schedule = true;
        }
        if (!finish_called_ && !cancelled_ && CanReadLocked()) {
          read_again = true;
          starting_read_ = true;
        } else {
          read_paused_ = true;
        }
      }
    }
    if (schedule && !RunsInline(bytes)) {
      pool_->Schedule([this] { DrainOne(); });
      schedule = false;
    }
    if (read_again) StartReadAndMaybeFinish();
    if (finish) Finish(finish_with);
    // Last: DrainOne may delete this reactor.
    if (schedule) {
      stats_->requests_inline.fetch_add(1, std::memory_order_relaxed);
      DrainOne();
    }
  }

  void OnWriteDone(bool ok) override {
    std::unique_ptr<Write> written;  // released unlocked: its slices go back to the pool
    const grpc::ByteBuffer* next = nullptr;
    bool read_again = false;
    bool finish = false;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      write_bytes_ -= writes_.front()->bytes;
      written = std::move(writes_.front());
      writes_.pop_front();
      if (!ok) {
        cancelled_ = true;
        finish_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke");
        DropQueuedWritesLocked();
      }
      if (!writes_.empty() && !finish_called_) {
        writing_ = true;
        next = &writes_.front()->buffer;
      }
      read_again = ResumeReadLocked();
      finish = ShouldFinishLocked(&finish_with);
    }
    written.reset();
    if (next != nullptr) StartWrite(next);
    if (read_again) StartReadAndMaybeFinish();
    if (finish) Finish(finish_with);
  }

  void OnCancel() override {
    // Lets the gates drop this stream's parked pulls (they complete with CANCELLED).
    cancelled_flag_->store(true, std::memory_order_release);
    bool finish = false;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      finish_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled");
      DropQueuedWritesLocked();
      finish = ShouldFinishLocked(&finish_with);
    }
    if (finish) Finish(finish_with);
  }

  void OnDone() override {
    bool destroy;
    {
      absl::MutexLock lock(&mu_);
      on_done_ = true;
      destroy = CanDestroyLocked();
    }
    if (destroy) delete this;
  }

 private:
  // A request as received: its slices, not yet parsed.
  struct Pending {
    std::vector<grpc::Slice> slices;
    size_t bytes = 0;
  };
  // A serialised response and its size.
  struct Write {
    grpc::ByteBuffer buffer;
    size_t bytes = 0;
  };

  // Whether a request of `bytes` that finds its stream idle is run on the gRPC thread that read
  // it (see kInlineRequestBytes) rather than handed to the pool.
  static bool RunsInline(size_t bytes) {
    return bytes <= GrpcParameterService::kInlineRequestBytes;
  }

  // Parses and processes the oldest pending request, then hands the stream to the pool if more
  // are waiting, so streams share the pool fairly. Runs on the pool, or on the gRPC thread that
  // read a request of at most kInlineRequestBytes into an idle stream.
  void DrainOne() {
    std::unique_ptr<Pending> pending;
    {
      absl::MutexLock lock(&mu_);
      pending = std::move(pending_.front());
      pending_.pop_front();
    }
    const size_t bytes = pending->bytes;
    {
      // Views into `request` are valid until the store returns (it applies the push before).
      DecodedPushPullRequest request;
      request.received = std::move(pending->slices);
      pending.reset();
      const absl::Status parsed = DecodePushPullRequest(&request);
      stats_->pieced_request_bytes.fetch_add(static_cast<int64_t>(request.pieced_bytes),
                                             std::memory_order_relaxed);
      uint64_t seq = request.seq;
      if (!parsed.ok()) {
        stats_->malformed_requests.fetch_add(1, std::memory_order_relaxed);
        if (FindPushPullSeq(request.received, &seq) || request.has_seq) {
          Complete(seq, parsed);
        } else {
          FailStream(parsed);
        }
      } else if (Cancelled()) {
        Complete(seq, absl::CancelledError("the call was cancelled"));
      } else {
        // Dense fp32 answers come back by reference in the sink (not copied); the rest are
        // written into the stream's reused buffers.
        auto sink = std::make_shared<PushPullAnswerSink>();
        sink->take_buffer = [buffers = response_buffers_] { return buffers->Take(); };
        store_->PushPull(
            request.View(),
            [this, seq, sink](absl::StatusOr<v1::PushPullResponse> response) {
              Complete(seq, std::move(response), std::move(sink->shared));
            },
            cancelled_flag_, sink);
      }
    }
    bool read_again;
    {
      absl::MutexLock lock(&mu_);
      request_bytes_ -= bytes;
      read_again = ResumeReadLocked();
    }
    // draining_ is still set, so the reactor outlives this.
    if (read_again) StartReadAndMaybeFinish();
    bool again;
    bool destroy = false;
    {
      absl::MutexLock lock(&mu_);
      again = !pending_.empty();
      if (!again) {
        draining_ = false;
        destroy = CanDestroyLocked();
      }
    }
    if (again) pool_->Schedule([this] { DrainOne(); });
    if (destroy) delete this;
  }

  bool Cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  // Answers one request; runs once per request (or FailStream does), on any thread. `shared`:
  // the weight data of `result` held by reference (PushPullAnswerSink::shared), sent from where
  // it lies and released when gRPC has sent it.
  void Complete(uint64_t seq, absl::StatusOr<v1::PushPullResponse> result,
                std::vector<std::pair<int, SharedWeights>> shared = {}) {
    v1::PushPullResponse response;
    // Refers to `shared`: whatever is left in it when the answer is encoded is sent from there.
    const SharedAnswerWeights external(shared);
    if (result.ok()) {
      response.Swap(&*result);
      // The shared data is not in `response` yet: count it too.
      const absl::StatusOr<size_t> bytes = PushPullResponseSize(response, &external);
      absl::Status refused;
      if (!bytes.ok()) {
        refused = bytes.status();
      } else if (*bytes > max_message_bytes_) {
        refused = absl::ResourceExhaustedError(absl::StrCat(
            "the answer to seq ", seq, " is ", *bytes, " bytes, over --max_message_bytes ",
            max_message_bytes_, "; pull fewer keys per request"));
      }
      if (!refused.ok()) {
        for (v1::Slice& w : *response.mutable_weights()) {
          response_buffers_->Give(std::move(*w.mutable_data()));
        }
        shared.clear();
        response.Clear();
        response.mutable_status()->set_code(static_cast<int>(refused.code()));
        response.mutable_status()->set_message(std::string(refused.message()));
      }
    } else {
      shared.clear();  // none (the store fills the sink only for an answer)
      response.mutable_status()->set_code(static_cast<int>(result.status().code()));
      response.mutable_status()->set_message(std::string(result.status().message()));
    }
    response.set_seq(seq);
    auto write = std::make_unique<Write>();
    // Cannot fail: PushPullResponseSize checked `shared` against `response` above.
    const absl::Status encoded = EncodePushPullResponse(&response, &external, response_buffers_,
                                                        &write->buffer, &write->bytes);
    shared.clear();  // the slices hold their own references
    if (!encoded.ok()) {
      v1::PushPullResponse failed;
      failed.set_seq(seq);
      failed.mutable_status()->set_code(static_cast<int>(encoded.code()));
      failed.mutable_status()->set_message(std::string(encoded.message()));
      EncodePushPullResponse(&failed, response_buffers_, &write->buffer, &write->bytes);
    }

    const grpc::ByteBuffer* start = nullptr;
    bool read_again = false;
    bool answered = false;
    {
      absl::MutexLock lock(&mu_);
      if (!finish_called_ && !cancelled_) {
        write_bytes_ += write->bytes;
        writes_.push_back(std::move(write));
        // Until Release, in_flight_ still counts this request: answered_ keeps every thread from
        // counting it twice (as a request and as its response).
        ++answered_;
        answered = true;
        RecordPeakLocked();
        if (!writing_) {
          writing_ = true;
          start = &writes_.front()->buffer;
        }
        read_again = ResumeReadLocked();
      }
    }
    write.reset();
    // in_flight_ still counts this request, so the reactor cannot be destroyed here.
    if (start != nullptr) StartWrite(start);
    if (read_again) StartReadAndMaybeFinish();
    Release(answered);
  }

  // Ends the stream with `status` (a request whose seq cannot be read); counts as the answer to
  // that request.
  void FailStream(const absl::Status& status) {
    cancelled_flag_->store(true, std::memory_order_release);
    {
      absl::MutexLock lock(&mu_);
      if (!finish_called_ && !cancelled_) {
        cancelled_ = true;
        finish_status_ = ToGrpcStatus(status);
        DropQueuedWritesLocked();
      }
    }
    Release();
  }

  // The request that Complete or FailStream answered is no longer in flight; `answered`: its
  // response was queued (and counted in answered_).
  void Release(bool answered = false) {
    bool finish;
    bool destroy;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      if (answered) --answered_;
      finish = ShouldFinishLocked(&finish_with);
      destroy = CanDestroyLocked();
    }
    if (finish) Finish(finish_with);
    if (destroy) delete this;
  }

  // StartRead with starting_read_ set, so that no other thread calls Finish (after which gRPC may
  // be done with the call) until StartRead has returned; then finishes if that was held back.
  void StartReadAndMaybeFinish() {
    StartRead(&read_buffer_);
    bool finish;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      starting_read_ = false;
      finish = ShouldFinishLocked(&finish_with);
    }
    if (finish) Finish(finish_with);
  }

  // Whether another request may be read: the stream's requests read but not answered and its
  // responses not yet written stay under kMaxQueuedPerStream and max_queued_bytes_ (one is always
  // read when nothing is queued). A request whose response is queued counts once.
  int64_t QueuedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return in_flight_ - answered_ + static_cast<int64_t>(writes_.size());
  }
  bool CanReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t queued = QueuedLocked();
    if (queued == 0) return true;
    return queued < GrpcParameterService::kMaxQueuedPerStream &&
           request_bytes_ + write_bytes_ < max_queued_bytes_;
  }

  // Resumes reading paused by CanReadLocked once it allows; true when the caller must call
  // StartReadAndMaybeFinish (unlocked).
  bool ResumeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!read_paused_ || reads_done_ || finish_called_ || cancelled_) return false;
    if (!CanReadLocked()) return false;
    read_paused_ = false;
    starting_read_ = true;
    return true;
  }

  void RecordPeakLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RaiseTo(&stats_->peak_queued, QueuedLocked());
    RaiseTo(&stats_->peak_queued_bytes, static_cast<int64_t>(request_bytes_ + write_bytes_));
  }

  // Keeps the response being written (it is owned until OnWriteDone); drops the rest.
  void DropQueuedWritesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (writes_.size() > (writing_ ? 1u : 0u)) {
      write_bytes_ -= writes_.back()->bytes;
      writes_.pop_back();
    }
  }

  // Finish once nothing is being written or started and either the client closed its side and
  // every request is answered, or the call is cancelled (or broken). Marks Finish as called; the
  // caller calls it unlocked.
  bool ShouldFinishLocked(grpc::Status* status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finish_called_ || writing_ || starting_read_ || !writes_.empty()) return false;
    if (cancelled_ || (reads_done_ && in_flight_ == 0)) {
      finish_called_ = true;
      *status = finish_status_;
      return true;
    }
    return false;
  }

  bool CanDestroyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return on_done_ && in_flight_ == 0 && !draining_;
  }

  ParameterStore* const store_;
  ThreadPool* const pool_;
  const size_t max_message_bytes_;
  const size_t max_queued_bytes_;
  const std::shared_ptr<GrpcParameterService::StatsCounters> stats_;
  grpc::ByteBuffer read_buffer_;  // target of the one outstanding read
  const std::shared_ptr<std::atomic<bool>> cancelled_flag_ = std::make_shared<std::atomic<bool>>();
  // Reused strings for the answered weights. Shared with the slices gRPC still holds, which give
  // them back.
  const std::shared_ptr<BufferPool> response_buffers_ =
      std::make_shared<BufferPool>(kPooledBuffersPerStream, kPooledBytesPerStream);

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Write>> writes_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;     // read, not yet answered
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;      // of in_flight_, those whose response is queued
  size_t request_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of requests read and not yet processed
  size_t write_bytes_ ABSL_GUARDED_BY(mu_) = 0;    // of the responses in writes_
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool starting_read_ ABSL_GUARDED_BY(mu_) = false;  // a StartRead is being issued
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // or broken by a malformed request
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  bool on_done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

// Checkpoint: answered by the store, possibly much later (when its step is written). A cancelled
// call (client gone, deadline passed) is finished at once with CANCELLED and sets the flag the
// store reads, so that it stops counting against the job's bounds; the store's late answer then
// finds the call finished and does nothing.
class CheckpointReactor final : public grpc::ServerUnaryReactor {
 public:
  // What the store's callback holds: outlives the reactor.
  struct Call {
    absl::Mutex mu;
    CheckpointReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // null once finished
    v1::CheckpointResponse* response ABSL_GUARDED_BY(mu) = nullptr;
  };

  explicit CheckpointReactor(v1::CheckpointResponse* response) {
    absl::MutexLock lock(&call_->mu);
    call_->reactor = this;
    call_->response = response;
  }

  std::shared_ptr<Call> call() const { return call_; }
  std::shared_ptr<const std::atomic<bool>> cancelled_flag() const { return cancelled_; }

  // Finishes the call with `result` unless it was finished (cancelled) already.
  static void Answer(const std::shared_ptr<Call>& call,
                     absl::StatusOr<v1::CheckpointResponse> result) {
    CheckpointReactor* reactor;
    {
      absl::MutexLock lock(&call->mu);
      reactor = call->reactor;
      if (reactor == nullptr) return;
      if (result.ok()) call->response->Swap(&*result);
      call->reactor = nullptr;
      call->response = nullptr;
    }
    // OnDone (which deletes the reactor) runs only after this Finish.
    reactor->Finish(ToGrpcStatus(result.status()));
  }

  void OnCancel() override {
    cancelled_->store(true, std::memory_order_release);
    {
      absl::MutexLock lock(&call_->mu);
      if (call_->reactor == nullptr) return;  // answered already
      call_->reactor = nullptr;
      call_->response = nullptr;
    }
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
  }

  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<Call> call_ = std::make_shared<Call>();
  const std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
};

// Pull: parks on the gate without a thread, then streams the weights in messages that each stay
// under the message limit. At most one write is outstanding, and Finish is never called while a
// StartWrite is being issued or outstanding, so no write reaches a call that gRPC is done with.
class PullReactor final : public grpc::ServerWriteReactor<v1::PullResponse> {
 public:
  PullReactor(ParameterStore* store, ThreadPool* pool, const v1::PullRequest& request,
              size_t max_message_bytes)
      : max_message_bytes_(max_message_bytes), request_(request) {
    pool->Schedule([this, store] {
      store->Pull(
          request_,
          [this](absl::StatusOr<std::vector<v1::Slice>> weights) { OnWeights(std::move(weights)); },
          cancelled_flag_);
    });
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) cancelled_ = true;
    }
    WriteNext();
  }

  void OnCancel() override {
    // Lets the gate drop the parked pull; OnWeights then runs with CANCELLED.
    cancelled_flag_->store(true, std::memory_order_release);
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      // A write in flight finishes the call from OnWriteDone.
      if (writing_ || finish_called_) return;
      finish_called_ = true;
    }
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
  }

  void OnDone() override {
    bool destroy;
    {
      absl::MutexLock lock(&mu_);
      on_done_ = true;
      destroy = answered_;
    }
    if (destroy) delete this;
  }

 private:
  void OnWeights(absl::StatusOr<std::vector<v1::Slice>> weights) {
    absl::Status status = weights.status();
    if (status.ok()) {
      messages_.emplace_back();
      size_t bytes = 0;
      for (v1::Slice& slice : *weights) {
        const size_t size = slice.ByteSizeLong() + 16;
        if (size + kMessageOverhead > max_message_bytes_) {
          status = absl::ResourceExhaustedError(absl::StrCat(
              "key ", slice.key().tensor(), "/", slice.key().index(), ": its weights take ", size,
              " bytes, over --max_message_bytes ", max_message_bytes_, "; pull fewer rows"));
          break;
        }
        if (bytes + size + kMessageOverhead > max_message_bytes_) {
          messages_.emplace_back();
          bytes = 0;
        }
        messages_.back().add_weights()->Swap(&slice);
        bytes += size;
      }
    }
    if (!status.ok()) {
      bool finish;
      {
        absl::MutexLock lock(&mu_);
        finish = !finish_called_;
        finish_called_ = true;
      }
      if (finish) Finish(ToGrpcStatus(status));
    } else {
      WriteNext();
    }
    // Until answered_ is set, OnDone leaves the reactor alive for this function.
    bool destroy;
    {
      absl::MutexLock lock(&mu_);
      answered_ = true;
      destroy = on_done_;
    }
    if (destroy) delete this;
  }

  // Starts the next write, or finishes (OK when everything is written, CANCELLED when the call
  // broke). REQUIRES: no write outstanding.
  void WriteNext() {
    const v1::PullResponse* next = nullptr;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      if (finish_called_) return;
      if (cancelled_) {
        finish_with = grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled");
      } else if (next_ < messages_.size()) {
        writing_ = true;
        next = &messages_[next_++];
      }
      if (next == nullptr) finish_called_ = true;
    }
    if (next != nullptr) {
      StartWrite(next);
    } else {
      Finish(std::move(finish_with));
    }
  }

  const size_t max_message_bytes_;
  const v1::PullRequest request_;
  const std::shared_ptr<std::atomic<bool>> cancelled_flag_ = std::make_shared<std::atomic<bool>>();
  // Filled by OnWeights before the first write; read by the writes.
  std::vector<v1::PullResponse> messages_;

  absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
  bool on_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::Slice SharedAnswerWeights::SliceOver(size_t k) const {
  // gRPC only reads a slice it sends; the holder keeps the values alive and unchanged until gRPC
  // drops the slice (on any thread).
  auto* holder = new SharedWeights(shared_[k].second);
  return grpc::Slice(
      const_cast<char*>(holder->bytes().data()), holder->bytes().size(),
      [](void* h) { delete static_cast<SharedWeights*>(h); }, holder);
}

GrpcParameterService::GrpcParameterService(ParameterStore* store, ThreadPool* pool,
                                           size_t max_message_bytes, size_t max_queued_bytes)
    : store_(store),
      pool_(pool),
      max_message_bytes_(max_message_bytes),
      max_queued_bytes_(max_queued_bytes) {}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GrpcParameterService::PushPull(
    grpc::CallbackServerContext* context) {
  return new PushPullReactor(store_, pool_, max_message_bytes_, max_queued_bytes_, stats_);
}

PushPullStreamStats GrpcParameterService::stream_stats() const {
  PushPullStreamStats out;
  out.requests_read = stats_->requests_read.load(std::memory_order_relaxed);
  out.requests_inline = stats_->requests_inline.load(std::memory_order_relaxed);
  out.peak_queued = stats_->peak_queued.load(std::memory_order_relaxed);
  out.peak_queued_bytes = stats_->peak_queued_bytes.load(std::memory_order_relaxed);
  out.pieced_request_bytes = stats_->pieced_request_bytes.load(std::memory_order_relaxed);
  out.malformed_requests = stats_->malformed_requests.load(std::memory_order_relaxed);
  return out;
}

grpc::ServerWriteReactor<v1::PullResponse>* GrpcParameterService::Pull(
    grpc::CallbackServerContext* context, const v1::PullRequest* request) {
  return new PullReactor(store_, pool_, *request, max_message_bytes_);
}

grpc::ServerUnaryReactor* GrpcParameterService::Push(grpc::CallbackServerContext* context,
                                                     const v1::PushPullRequest* request,
                                                     v1::PushResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool_->Schedule([this, reactor, request, response] {
    absl::StatusOr<PushAck> ack = store_->Push(*request);
    if (ack.ok()) {
      response->set_duplicates(ack->duplicates);
      response->set_skipped_non_finite(ack->skipped_non_finite);
    }
    reactor->Finish(ToGrpcStatus(ack.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::CreateJobState(
    grpc::CallbackServerContext* context, const v1::CreateJobStateRequest* request,
    v1::CreateJobStateResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool_->Schedule([this, reactor, request, response] {
    absl::StatusOr<v1::CreateJobStateResponse> result = store_->CreateJobState(*request);
    if (result.ok()) response->Swap(&*result);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::UpdateMembership(
    grpc::CallbackServerContext* context, const v1::UpdateMembershipRequest* request,
    v1::UpdateMembershipResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool_->Schedule([this, reactor, request, response] {
    absl::StatusOr<v1::UpdateMembershipResponse> result = store_->UpdateMembership(*request);
    if (result.ok()) response->Swap(&*result);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::DropJob(grpc::CallbackServerContext* context,
                                                        const v1::DropJobRequest* request,
                                                        v1::DropJobResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool_->Schedule([this, reactor, request] {
    reactor->Finish(ToGrpcStatus(store_->DropJob(request->job_id())));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::Checkpoint(grpc::CallbackServerContext* context,
                                                           const v1::CheckpointRequest* request,
                                                           v1::CheckpointResponse* response) {
  (void)context;
  // The store answers from its writer thread once the file is durable: no thread waits for it.
  auto* reactor = new CheckpointReactor(response);
  store_->Checkpoint(
      *request,
      [call = reactor->call()](absl::StatusOr<v1::CheckpointResponse> result) {
        CheckpointReactor::Answer(call, std::move(result));
      },
      reactor->cancelled_flag());
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::Restore(grpc::CallbackServerContext* context,
                                                        const v1::RestoreRequest* request,
                                                        v1::RestoreResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Reading and verifying the file is file I/O: on the pool, never on a gRPC thread.
  pool_->Schedule([this, reactor, request, response] {
    absl::StatusOr<v1::RestoreResponse> result = store_->Restore(*request);
    if (result.ok()) response->Swap(&*result);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::ReadCheckpoint(
    grpc::CallbackServerContext* context, const v1::ReadCheckpointRequest* request,
    v1::ReadCheckpointResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool_->Schedule([this, reactor, request, response] {
    absl::StatusOr<v1::ReadCheckpointResponse> result = store_->ReadCheckpoint(*request);
    if (result.ok()) response->Swap(&*result);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::Fill(grpc::CallbackServerContext* context,
                                                     const v1::FillRequest* request,
                                                     v1::FillResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The last page cuts and installs the state: on the pool.
  pool_->Schedule([this, reactor, request, response] {
    absl::StatusOr<v1::FillResponse> result = store_->Fill(*request);
    if (result.ok()) response->Swap(&*result);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

}  // namespace tessera::server
