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

// A write reactor that ends at once with an error.
template <typename Message>
class FailedStream : public grpc::ServerWriteReactor<Message> {
 public:
  explicit FailedStream(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

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

// One WatchJob stream, draining a JobWatch. Owns itself until OnDone.
class WatchReactor : public grpc::ServerWriteReactor<v1::WatchJobResponse>,
                     public std::enable_shared_from_this<WatchReactor> {
 public:
  explicit WatchReactor(std::shared_ptr<JobWatch> watch) : watch_(std::move(watch)) {}

  void Begin(std::shared_ptr<WatchReactor> self) {
    self_ = std::move(self);
    std::weak_ptr<WatchReactor> weak = self_;
    watch_->SetWakeup([weak] {
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
      watch_->Cancel();
      Stop(absl::CancelledError("the watcher went away"));
      return;
    }
    Pump();
  }
  void OnCancel() override {
    auto keep = shared_from_this();
    watch_->Cancel();
    Stop(absl::CancelledError("the watcher went away"));
  }
  void OnDone() override { self_.reset(); }

 private:
  void Pump() {
    absl::Status end;
    JobWatch::Poll poll;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
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
  void Stop(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      finished_ = true;
    }
    Finish(ToGrpcStatus(status));
  }

  const std::shared_ptr<JobWatch> watch_;
  std::shared_ptr<WatchReactor> self_;
  absl::Mutex mu_;
  v1::WatchJobResponse current_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

// --- JobService ----------------------------------------------------------------------------------

grpc::ServerUnaryReactor* GrpcJobService::CreateJob(grpc::CallbackServerContext* context,
                                                    const v1::CreateJobRequest* request,
                                                    v1::Job* response) {
  return Reply(context, coordinator_->CreateJob(request->spec()), response);
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
  return Reply(context, coordinator_->CancelJob(request->job_id()), response);
}

grpc::ServerWriteReactor<v1::WatchJobResponse>* GrpcJobService::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  absl::StatusOr<std::shared_ptr<JobWatch>> watch = coordinator_->WatchJob(*request);
  if (!watch.ok()) return new FailedStream<v1::WatchJobResponse>(watch.status());
  auto reactor = std::make_shared<WatchReactor>(std::move(*watch));
  reactor->Begin(reactor);
  return reactor.get();
}

GrpcJobService::~GrpcJobService() {
  std::vector<Blocking> blocking;
  {
    absl::MutexLock lock(&mu_);
    blocking.swap(blocking_);
  }
  for (Blocking& b : blocking) b.thread.join();
}

grpc::ServerUnaryReactor* GrpcJobService::CheckpointJob(grpc::CallbackServerContext* context,
                                                        const v1::CheckpointJobRequest* request,
                                                        v1::CheckpointRecord* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::vector<Blocking> finished;
  {
    absl::MutexLock lock(&mu_);
    std::vector<Blocking> running;
    for (Blocking& b : blocking_) (*b.done ? finished : running).push_back(std::move(b));
    blocking_.swap(running);
    auto done = std::make_shared<bool>(false);
    // Off the reactor thread: the call waits for the shards to reach the step and write it.
    std::thread thread([this, reactor, response, done, job_id = request->job_id()] {
      absl::StatusOr<v1::CheckpointRecord> record = coordinator_->CheckpointJob(job_id);
      if (record.ok()) *response = std::move(*record);
      reactor->Finish(ToGrpcStatus(record.status()));
      absl::MutexLock lock(&mu_);
      *done = true;
    });
    blocking_.push_back({std::move(thread), std::move(done)});
  }
  // Unlocked: the threads of earlier calls that are done (they set `done` as their last step).
  for (Blocking& b : finished) b.thread.join();
  return reactor;
}

// --- ClusterService ------------------------------------------------------------------------------

grpc::ServerUnaryReactor* GrpcClusterService::Register(grpc::CallbackServerContext* context,
                                                       const v1::RegisterRequest* request,
                                                       v1::RegisterResponse* response) {
  return Reply(context, coordinator_->Register(*request), response);
}

grpc::ServerUnaryReactor* GrpcClusterService::Heartbeat(grpc::CallbackServerContext* context,
                                                        const v1::HeartbeatRequest* request,
                                                        v1::HeartbeatResponse* response) {
  return Done(context, coordinator_->Heartbeat(*request));
}

grpc::ServerUnaryReactor* GrpcClusterService::Deregister(grpc::CallbackServerContext* context,
                                                         const v1::DeregisterRequest* request,
                                                         v1::DeregisterResponse* response) {
  return Done(context, coordinator_->Deregister(*request));
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
  return Reply(context, coordinator_->ReportProgress(*request), response);
}

}  // namespace tessera::coordinator
