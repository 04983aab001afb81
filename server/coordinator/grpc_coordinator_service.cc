#include "server/coordinator/grpc_coordinator_service.h"

#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"

namespace tessera::coordinator {
namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

template <typename T>
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, absl::StatusOr<T> result,
                                T* response) {
  if (result.ok()) *response = std::move(*result);
  return Done(context, result.status());
}

// Runs `call` (returning absl::StatusOr<T>) on `pool`, off gRPC's thread, and finishes the call
// from there with its result in `*response`. The library keeps the request and `response` alive
// until the reactor is finished.
template <typename T, typename Call>
grpc::ServerUnaryReactor* ReplyOnPool(ThreadPool* pool, grpc::CallbackServerContext* context,
                                      T* response, Call call) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool->Schedule([reactor, response, call = std::move(call)]() mutable {
    absl::StatusOr<T> result = call();
    if (result.ok()) *response = std::move(*result);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

// As ReplyOnPool, for a call that returns only an absl::Status.
template <typename Call>
grpc::ServerUnaryReactor* DoneOnPool(ThreadPool* pool, grpc::CallbackServerContext* context,
                                     Call call) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  pool->Schedule(
      [reactor, call = std::move(call)]() mutable { reactor->Finish(ToGrpcStatus(call())); });
  return reactor;
}

// The WatchTasks stream of one worker. It owns itself (self_) until gRPC calls OnDone; the
// coordinator may keep a reference longer, and later Send/Close calls are then no-ops.
class TaskStreamReactor : public grpc::ServerWriteReactor<v1::TaskEvent>,
                          public TaskStream,
                          public std::enable_shared_from_this<TaskStreamReactor> {
 public:
  TaskStreamReactor(Coordinator* coordinator, std::string member_id)
      : coordinator_(coordinator), member_id_(std::move(member_id)) {}

  void Begin(std::shared_ptr<TaskStreamReactor> self) {
    self_ = std::move(self);
    absl::Status opened = coordinator_->OpenTaskStream(member_id_, shared_from_this());
    if (!opened.ok()) Close(opened);
  }

  void Send(const v1::TaskEvent& event) override {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      queue_.push_back(event);
    }
    Pump();
  }
  void Close(const absl::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      close_status_ = status;
    }
    Pump();
  }

  void OnWriteDone(bool ok) override {
    auto keep = shared_from_this();
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        finishing_ = true;
        queue_.clear();
        close_status_ = absl::CancelledError("the worker went away");
      }
    }
    Pump();
  }
  void OnCancel() override {
    auto keep = shared_from_this();
    Close(absl::CancelledError("the worker went away"));
  }
  void OnDone() override {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    self_.reset();
  }
  bool closed() const override {
    absl::MutexLock lock(&mu_);
    return done_ || finishing_;
  }

 private:
  // Starts the next write, or Finish once the queue is empty and a close was asked for.
  void Pump() {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      if (!queue_.empty()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        writing_ = true;
      } else if (finishing_) {
        finished_ = true;
        finish = true;
      } else {
        return;
      }
    }
    // Unlocked: gRPC may run reactions inline.
    if (finish) {
      Finish(ToGrpcStatus(close_status_));
    } else {
      StartWrite(&current_);
    }
  }

  Coordinator* const coordinator_;
  const std::string member_id_;
  std::shared_ptr<TaskStreamReactor> self_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::TaskEvent> queue_ ABSL_GUARDED_BY(mu_);
  v1::TaskEvent current_;  // written by Pump only while !writing_
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status close_status_;  // set once, before finishing_
};

// One WatchJob stream, draining a JobWatch. Owns itself until OnDone. The watch comes later, from
// the pool (Attach): opening it flushes and reads the stored events.
class WatchReactor : public grpc::ServerWriteReactor<v1::WatchJobResponse>,
                     public std::enable_shared_from_this<WatchReactor> {
 public:
  void Begin(std::shared_ptr<WatchReactor> self) { self_ = std::move(self); }

  // The coordinator's answer to WatchJob: the watch to drain, or the error to end the stream with.
  // A watcher that went away meanwhile cancels the watch, so the coordinator forgets it.
  void Attach(absl::StatusOr<std::shared_ptr<JobWatch>> watch) {
    if (!watch.ok()) {
      Stop(watch.status());
      return;
    }
    bool cancelled = false;
    {
      absl::MutexLock lock(&mu_);
      watch_ = *watch;
      cancelled = cancelled_;
    }
    if (cancelled) {
      (*watch)->Cancel();
      return;
    }
    std::weak_ptr<WatchReactor> weak = shared_from_this();
    (*watch)->SetWakeup([weak] {
      if (std::shared_ptr<WatchReactor> reactor = weak.lock()) reactor->Pump();
    });
    Pump();
  }

  void OnWriteDone(bool ok) override {
    auto keep = shared_from_this();
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
    }
    if (!ok) {
      CancelWatch();
      Stop(absl::CancelledError("the watcher went away"));
      return;
    }
    Pump();
  }
  void OnCancel() override {
    auto keep = shared_from_this();
    CancelWatch();
    Stop(absl::CancelledError("the watcher went away"));
  }
  void OnDone() override { self_.reset(); }

 private:
  void Pump() {
    absl::Status end;
    JobWatch::Poll poll;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_ || watch_ == nullptr) return;
      poll = watch_->Next(&current_, &end);
      if (poll == JobWatch::Poll::kEmpty) return;
      if (poll == JobWatch::Poll::kMessage) {
        writing_ = true;
      } else {
        finished_ = true;
      }
    }
    // Unlocked: gRPC may run reactions inline.
    if (poll == JobWatch::Poll::kMessage) {
      StartWrite(&current_);
    } else {
      Finish(ToGrpcStatus(end));
    }
  }
  void CancelWatch() {
    std::shared_ptr<JobWatch> watch;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      watch = watch_;
    }
    if (watch != nullptr) watch->Cancel();
  }
  void Stop(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      finished_ = true;
    }
    Finish(ToGrpcStatus(status));
  }

  std::shared_ptr<WatchReactor> self_;
  absl::Mutex mu_;
  std::shared_ptr<JobWatch> watch_ ABSL_GUARDED_BY(mu_);  // null until Attach
  v1::WatchJobResponse current_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // the watcher went away
};

}  // namespace

// --- JobService ----------------------------------------------------------------------------------

grpc::ServerUnaryReactor* GrpcJobService::CreateJob(grpc::CallbackServerContext* context,
                                                    const v1::CreateJobRequest* request,
                                                    v1::Job* response) {
  return ReplyOnPool(store_pool_, context, response,
                     [this, request] { return coordinator_->CreateJob(request->spec()); });
}

grpc::ServerUnaryReactor* GrpcJobService::GetJob(grpc::CallbackServerContext* context,
                                                 const v1::GetJobRequest* request,
                                                 v1::Job* response) {
  return Reply(context, coordinator_->GetJob(request->job_id()), response);
}

grpc::ServerUnaryReactor* GrpcJobService::ListJobs(grpc::CallbackServerContext* context,
                                                   const v1::ListJobsRequest* request,
                                                   v1::ListJobsResponse* response) {
  absl::StatusOr<std::vector<v1::Job>> jobs = coordinator_->ListJobs(*request);
  if (jobs.ok()) {
    for (v1::Job& job : *jobs) *response->add_jobs() = std::move(job);
  }
  return Done(context, jobs.status());
}

grpc::ServerUnaryReactor* GrpcJobService::CancelJob(grpc::CallbackServerContext* context,
                                                    const v1::CancelJobRequest* request,
                                                    v1::Job* response) {
  return ReplyOnPool(store_pool_, context, response,
                     [this, request] { return coordinator_->CancelJob(request->job_id()); });
}

grpc::ServerWriteReactor<v1::WatchJobResponse>* GrpcJobService::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  auto reactor = std::make_shared<WatchReactor>();
  reactor->Begin(reactor);
  // A copy: a watcher that goes away ends the call (OnCancel finishes it at once), and gRPC frees
  // `request` with it, maybe before the pool gets here.
  store_pool_->Schedule(
      [this, reactor, request = *request] { reactor->Attach(coordinator_->WatchJob(request)); });
  return reactor.get();
}

grpc::ServerUnaryReactor* GrpcJobService::CheckpointJob(grpc::CallbackServerContext* context,
                                                        const v1::CheckpointJobRequest* request,
                                                        v1::CheckpointRecord* response) {
  // The call waits for the shards to reach the step and write it: on its own pool, so that a
  // flood of checkpoints queues there and holds up neither gRPC's threads nor the store pool.
  return ReplyOnPool(checkpoint_pool_, context, response,
                     [this, request] { return coordinator_->CheckpointJob(request->job_id()); });
}

// --- ClusterService ------------------------------------------------------------------------------

grpc::ServerUnaryReactor* GrpcClusterService::Register(grpc::CallbackServerContext* context,
                                                       const v1::RegisterRequest* request,
                                                       v1::RegisterResponse* response) {
  return ReplyOnPool(store_pool_, context, response,
                     [this, request] { return coordinator_->Register(*request); });
}

grpc::ServerUnaryReactor* GrpcClusterService::Heartbeat(grpc::CallbackServerContext* context,
                                                        const v1::HeartbeatRequest* request,
                                                        v1::HeartbeatResponse* response) {
  return Done(context, coordinator_->Heartbeat(*request));
}

grpc::ServerUnaryReactor* GrpcClusterService::Deregister(grpc::CallbackServerContext* context,
                                                         const v1::DeregisterRequest* request,
                                                         v1::DeregisterResponse* response) {
  return DoneOnPool(store_pool_, context,
                    [this, request] { return coordinator_->Deregister(*request); });
}

grpc::ServerUnaryReactor* GrpcClusterService::ListMembers(grpc::CallbackServerContext* context,
                                                          const v1::ListMembersRequest* request,
                                                          v1::ListMembersResponse* response) {
  for (v1::Member& member : coordinator_->ListMembers()) {
    *response->add_members() = std::move(member);
  }
  return Done(context, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::TaskEvent>* GrpcClusterService::WatchTasks(
    grpc::CallbackServerContext* context, const v1::WatchTasksRequest* request) {
  auto reactor = std::make_shared<TaskStreamReactor>(coordinator_, request->member_id());
  reactor->Begin(reactor);
  return reactor.get();
}

grpc::ServerUnaryReactor* GrpcClusterService::ReportProgress(grpc::CallbackServerContext* context,
                                                             const v1::ProgressReport* request,
                                                             v1::ProgressAck* response) {
  return ReplyOnPool(store_pool_, context, response,
                     [this, request] { return coordinator_->ReportProgress(*request); });
}

}  // namespace tessera::coordinator
