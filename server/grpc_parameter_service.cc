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

// Requests of one stream that are read but not yet answered; reading pauses beyond this.
constexpr int kMaxInFlightPerStream = 64;
// Bytes a PullResponse adds around its slices (tags and lengths), with room to spare.
constexpr size_t kMessageOverhead = 1024;

// One PushPull stream. It deletes itself once gRPC is done with it (OnDone) and no request of it is
// still queued, running or parked in the store.
class PushPullReactor final
    : public grpc::ServerBidiReactor<v1::PushPullRequest, v1::PushPullResponse> {
 public:
  PushPullReactor(ParameterStore* store, internal::ThreadPool* pool, size_t max_message_bytes)
      : store_(store), pool_(pool), max_message_bytes_(max_message_bytes) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
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
        auto request = std::make_unique<v1::PushPullRequest>();
        request->Swap(&request_);
        pending_.push_back(std::move(request));
        ++in_flight_;
        if (!draining_) {
          draining_ = true;
          schedule = true;
        }
        if (in_flight_ < kMaxInFlightPerStream && !finish_called_ && !cancelled_) {
          read_again = true;
          starting_read_ = true;
        } else {
          read_paused_ = true;
        }
      }
    }
    if (schedule) pool_->Schedule([this] { DrainOne(); });
    if (read_again) StartReadAndMaybeFinish();
    if (finish) Finish(finish_with);
  }

  void OnWriteDone(bool ok) override {
    const v1::PushPullResponse* next = nullptr;
    bool finish = false;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      writes_.pop_front();
      if (!ok) {
        cancelled_ = true;
        finish_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke");
        writes_.clear();
      }
      if (!writes_.empty() && !finish_called_) {
        writing_ = true;
        next = writes_.front().get();
      }
      finish = ShouldFinishLocked(&finish_with);
    }
    if (next != nullptr) StartWrite(next);
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
      // Keep the response being written (it is owned until OnWriteDone); drop the rest.
      while (writes_.size() > (writing_ ? 1u : 0u)) writes_.pop_back();
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
  // Runs on the pool: processes the oldest pending request, then hands the stream back to the
  // pool if more are waiting, so streams share the pool fairly.
  void DrainOne() {
    std::unique_ptr<v1::PushPullRequest> request;
    {
      absl::MutexLock lock(&mu_);
      request = std::move(pending_.front());
      pending_.pop_front();
    }
    const uint64_t seq = request->seq();
    if (Cancelled()) {
      Complete(seq, absl::CancelledError("the call was cancelled"));
    } else {
      store_->PushPull(
          *request,
          [this, seq](absl::StatusOr<v1::PushPullResponse> response) {
            Complete(seq, std::move(response));
          },
          cancelled_flag_);
    }
    request.reset();
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

  // Answers one request; runs once per request, on any thread.
  void Complete(uint64_t seq, absl::StatusOr<v1::PushPullResponse> result) {
    auto response = std::make_unique<v1::PushPullResponse>();
    if (result.ok()) {
      response->Swap(&*result);
      const size_t bytes = response->ByteSizeLong();
      if (bytes > max_message_bytes_) {
        response = std::make_unique<v1::PushPullResponse>();
        response->mutable_status()->set_code(
            static_cast<int>(absl::StatusCode::kResourceExhausted));
        response->mutable_status()->set_message(absl::StrCat(
            "the answer to seq ", seq, " is ", bytes, " bytes, over --max_message_bytes ",
            max_message_bytes_, "; pull fewer keys per request"));
      }
    } else {
      response->mutable_status()->set_code(static_cast<int>(result.status().code()));
      response->mutable_status()->set_message(std::string(result.status().message()));
    }
    response->set_seq(seq);

    const v1::PushPullResponse* write = nullptr;
    bool read_again = false;
    {
      absl::MutexLock lock(&mu_);
      if (!finish_called_ && !cancelled_) {
        writes_.push_back(std::move(response));
        if (!writing_) {
          writing_ = true;
          write = writes_.front().get();
        }
        if (read_paused_ && in_flight_ - 1 < kMaxInFlightPerStream && !reads_done_) {
          read_paused_ = false;
          read_again = true;
          starting_read_ = true;
        }
      }
    }
    // in_flight_ still counts this request, so the reactor cannot be destroyed here.
    if (write != nullptr) StartWrite(write);
    if (read_again) StartReadAndMaybeFinish();
    bool finish;
    bool destroy;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      finish = ShouldFinishLocked(&finish_with);
      destroy = CanDestroyLocked();
    }
    if (finish) Finish(finish_with);
    if (destroy) delete this;
  }

  // StartRead with starting_read_ set, so that no other thread calls Finish (after which gRPC may
  // be done with the call) until StartRead has returned; then finishes if that was held back.
  void StartReadAndMaybeFinish() {
    StartRead(&request_);
    bool finish;
    grpc::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      starting_read_ = false;
      finish = ShouldFinishLocked(&finish_with);
    }
    if (finish) Finish(finish_with);
  }

  // Finish once nothing is being written or started and either the client closed its side and
  // every request is answered, or the call is cancelled. Marks Finish as called; the caller calls
  // it unlocked.
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
  internal::ThreadPool* const pool_;
  const size_t max_message_bytes_;
  v1::PushPullRequest request_;  // target of the one outstanding read
  const std::shared_ptr<std::atomic<bool>> cancelled_flag_ = std::make_shared<std::atomic<bool>>();

  absl::Mutex mu_;
  std::deque<std::unique_ptr<v1::PushPullRequest>> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<v1::PushPullResponse>> writes_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // read, not yet answered
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool starting_read_ ABSL_GUARDED_BY(mu_) = false;  // a StartRead is being issued
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  bool on_done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

// Pull: parks on the gate without a thread, then streams the weights in messages that each stay
// under the message limit. At most one write is outstanding, and Finish is never called while a
// StartWrite is being issued or outstanding, so no write reaches a call that gRPC is done with.
class PullReactor final : public grpc::ServerWriteReactor<v1::PullResponse> {
 public:
  PullReactor(ParameterStore* store, internal::ThreadPool* pool, const v1::PullRequest& request,
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

GrpcParameterService::GrpcParameterService(ParameterStore* store, internal::ThreadPool* pool,
                                           size_t max_message_bytes)
    : store_(store), pool_(pool), max_message_bytes_(max_message_bytes) {}

grpc::ServerBidiReactor<v1::PushPullRequest, v1::PushPullResponse>* GrpcParameterService::PushPull(
    grpc::CallbackServerContext* context) {
  return new PushPullReactor(store_, pool_, max_message_bytes_);
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
  pool_->Schedule([this, reactor, request] {
    reactor->Finish(ToGrpcStatus(store_->UpdateMembership(*request)));
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
  // TODO(#6): write ckpt-<step>/shard-<i> to --data_dir.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(absl::UnimplementedError("checkpoints arrive with issue #6")));
  return reactor;
}

grpc::ServerUnaryReactor* GrpcParameterService::Restore(grpc::CallbackServerContext* context,
                                                        const v1::RestoreRequest* request,
                                                        v1::RestoreResponse* response) {
  // TODO(#6): load the newest committed checkpoint of the job.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(absl::UnimplementedError("checkpoints arrive with issue #6")));
  return reactor;
}

}  // namespace tessera::server
