#include "worker/daemon/worker_daemon.h"

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "grpcpp/channel.h"
#include "spdlog/spdlog.h"

namespace tessera::worker {

// Sends the newest progress report of the task in hand from its own thread, so a slow
// coordinator never holds up a training step. Reports that arrive while one is on the wire
// replace each other; only the newest is sent next.
class WorkerDaemon::ProgressSender {
 public:
  ProgressSender(WorkerDaemon* daemon, v1::Task task)
      : daemon_(daemon), task_(std::move(task)), thread_([this] { Run(); }) {}
  // Stop().
  ~ProgressSender() { Stop(); }

  void Offer(const v1::ProgressReport& report) {
    absl::MutexLock lock(&mu_);
    pending_ = report;
  }
  // Drops whatever is pending and joins the thread (after the report on the wire, if any).
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      pending_.reset();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || pending_.has_value(); }

  void Run() {
    for (;;) {
      v1::ProgressReport report;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &ProgressSender::Ready));
        if (stop_) return;
        report = *std::move(pending_);
        pending_.reset();
      }
      // Without the lock: an RPC.
      absl::StatusOr<v1::ProgressAck> ack = daemon_->Report(task_, report);
      if (!ack.ok()) {
        spdlog::warn("job {}: progress report not delivered: {}", task_.job_id(),
                     ack.status().ToString());
      } else if (ack->cancel()) {
        spdlog::info("job {}: the coordinator asked to stop", task_.job_id());
        daemon_->CancelTask(task_.job_id(), "cancelled");
      }
    }
  }

  WorkerDaemon* const daemon_;
  const v1::Task task_;
  absl::Mutex mu_;
  std::optional<v1::ProgressReport> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Create(Options options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("coordinator: must be host:port, got an empty address");
  }
  if (!options.device.empty() && options.device != "auto" && options.device != "cpu" &&
      options.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device: must be auto, cpu or cuda, got \"", options.device, "\""));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: must be >= 0, got ", options.num_threads));
  }
  if (options.hostname.empty()) {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) options.hostname = name;
  }
  return std::unique_ptr<WorkerDaemon>(new WorkerDaemon(std::move(options)));
}

WorkerDaemon::WorkerDaemon(Options options) : options_(std::move(options)) {
  MemberAgent::Options a;
  a.coordinator = options_.coordinator;
  a.registration.set_role(v1::MEMBER_ROLE_WORKER);
  a.registration.set_hostname(options_.hostname);
  a.registration.set_pid(static_cast<int64_t>(getpid()));
  a.registration.set_device(options_.device_name);
  a.initial_backoff = options_.initial_backoff;
  a.max_backoff = options_.max_backoff;
  a.rpc_timeout = options_.rpc_timeout;
  a.credentials = options_.credentials;
  a.on_registered = [this](const std::string& id) { OnRegistered(id); };
  agent_ = std::make_unique<MemberAgent>(std::move(a));
  stub_ = v1::ClusterService::NewStub(agent_->channel());
}

WorkerDaemon::~WorkerDaemon() { Stop(); }

void WorkerDaemon::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (started_ || stopping_) return;
    started_ = true;
  }
  spdlog::info("tessera-worker: coordinator {}, device {}, host {}", options_.coordinator,
               options_.device_name, options_.hostname);
  watch_thread_ = std::thread([this] { WatchLoop(); });
  agent_->Start();
}

void WorkerDaemon::Stop() {
  std::thread task;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    if (task_running_) {
      cancel_requested_ = true;
      cancel_reason_ = "worker stopped";
      if (trainer_ != nullptr) trainer_->Cancel();
    }
    if (watch_context_ != nullptr) watch_context_->TryCancel();
    task.swap(task_thread_);
  }
  // The task reports FAILED "worker stopped" before it ends; then the member leaves.
  if (task.joinable()) task.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  agent_->Stop(/*deregister=*/true);
}

std::string WorkerDaemon::current_job() const {
  absl::MutexLock lock(&mu_);
  return task_running_ ? task_.job_id() : std::string();
}

void WorkerDaemon::OnRegistered(const std::string& member_id) {
  spdlog::info("tessera-worker: registered with {} as {}", options_.coordinator, member_id);
  absl::MutexLock lock(&mu_);
  member_id_ = member_id;
  ++registrations_;
  // The open stream belongs to the old id: end it, and WatchLoop opens one for the new id.
  if (watch_context_ != nullptr) watch_context_->TryCancel();
}

void WorkerDaemon::WatchLoop() {
  absl::Duration backoff = options_.initial_backoff;
  for (;;) {
    std::string member_id;
    uint64_t registration = 0;
    grpc::ClientContext context;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerDaemon* d)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return d->stopping_ || !d->member_id_.empty(); },
          this));
      if (stopping_) return;
      member_id = member_id_;
      registration = registrations_;
      context.set_deadline(absl::ToChronoTime(absl::Now() + options_.watch_deadline));
      watch_context_ = &context;
    }
    v1::WatchTasksRequest request;
    request.set_member_id(member_id);
    std::unique_ptr<grpc::ClientReader<v1::TaskEvent>> reader =
        stub_->WatchTasks(&context, request);
    v1::TaskEvent event;
    bool received = false;
    while (reader->Read(&event)) {
      received = true;
      HandleEvent(event);
    }
    const absl::Status status = FromGrpcStatus(reader->Finish());
    bool renewed = false;
    {
      absl::MutexLock lock(&mu_);
      watch_context_ = nullptr;
      if (stopping_) return;
      renewed = registrations_ != registration;
    }
    if (renewed) continue;  // a new member id: reopen at once
    if (received) backoff = options_.initial_backoff;
    if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      spdlog::debug("task stream from {} reached its deadline; reopening", options_.coordinator);
      continue;
    }
    spdlog::warn("task stream from coordinator {} ended: {}; reopening in {}", options_.coordinator,
                 status.ToString(), absl::FormatDuration(backoff));
    {
      absl::MutexLock lock(&mu_);
      // Returns early when Stop() is called.
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff);
      if (stopping_) return;
    }
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

void WorkerDaemon::HandleEvent(const v1::TaskEvent& event) {
  if (event.has_cancel()) {
    spdlog::info("job {}: cancel from the coordinator{}{}", event.cancel().job_id(),
                 event.cancel().reason().empty() ? "" : ": ", event.cancel().reason());
    CancelTask(event.cancel().job_id(), "cancelled");
    return;
  }
  if (!event.has_assign()) return;
  const v1::Task& task = event.assign();
  // A new task while the previous one only winds down after its terminal report (the coordinator
  // acts on the report at once): wait for that task's thread, then take the new one.
  std::thread finishing;
  {
    absl::MutexLock lock(&mu_);
    if (task_running_ && terminal_reported_ &&
        !(task_.job_id() == task.job_id() && task_.rank() == task.rank() &&
          task_.incarnation() == task.incarnation())) {
      finishing = std::move(task_thread_);
    }
  }
  if (finishing.joinable()) finishing.join();
  std::string busy_with;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    if (task_running_) {
      if (task_.job_id() == task.job_id() && task_.rank() == task.rank() &&
          task_.incarnation() == task.incarnation()) {
        return;  // the same assignment again, on a reopened stream
      }
      busy_with = task_.job_id();
    } else {
      // The previous task thread has finished its work; reap it before starting the next.
      if (task_thread_.joinable()) task_thread_.join();
      task_running_ = true;
      terminal_reported_ = false;
      task_ = task;
      cancel_requested_ = false;
      cancel_reason_.clear();
      task_thread_ = std::thread([this, task] { RunTask(task); });
      return;
    }
  }
  // Without the lock: an RPC. The coordinator should never do this; fail the new task rather
  // than leave its job waiting.
  spdlog::error("job {}: assigned while job {} is still running here; refusing it", task.job_id(),
                busy_with);
  v1::ProgressReport failed;
  failed.set_rank(task.rank());
  failed.set_phase(v1::TASK_PHASE_FAILED);
  failed.set_error(absl::StrCat("worker busy with job ", busy_with));
  absl::StatusOr<v1::ProgressAck> ack = Report(task, failed);
  if (!ack.ok())
    spdlog::warn("job {}: report not delivered: {}", task.job_id(), ack.status().ToString());
}

void WorkerDaemon::CancelTask(const std::string& job_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (!task_running_ || (!job_id.empty() && task_.job_id() != job_id)) return;
  if (!cancel_requested_) {
    cancel_requested_ = true;
    cancel_reason_ = why;
  }
  if (trainer_ != nullptr) trainer_->Cancel();
}

absl::StatusOr<v1::ProgressAck> WorkerDaemon::Report(const v1::Task& task,
                                                     v1::ProgressReport report) {
  report.set_member_id(agent_->member_id());
  report.set_job_id(task.job_id());
  report.set_rank(task.rank());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  v1::ProgressAck ack;
  const grpc::Status status = stub_->ReportProgress(&context, report, &ack);
  if (!status.ok()) {
    const absl::Status s = FromGrpcStatus(status);
    return absl::Status(s.code(),
                        absl::StrCat("coordinator ", options_.coordinator, ": ", s.message()));
  }
  return ack;
}

void WorkerDaemon::RunTask(v1::Task task) {
  spdlog::info("job {}: rank {} of {} on {} shard(s), incarnation {}", task.job_id(), task.rank(),
               task.world_size(), task.shard_addresses_size(), task.incarnation());
  ProgressSender sender(this, task);
  trainer::DistributedOptions o;
  o.task = task;
  o.device = options_.device;
  o.num_threads = options_.num_threads;
  o.progress_interval = options_.progress_interval;
  o.credentials = options_.credentials;
  o.on_progress = [&sender](const v1::ProgressReport& p) { sender.Offer(p); };
  o.report = [this, &task](const v1::ProgressReport& p) { return Report(task, p); };

  absl::StatusOr<v1::ProgressReport> result;
  absl::StatusOr<std::unique_ptr<trainer::DistributedTrainer>> created =
      trainer::DistributedTrainer::Create(std::move(o));
  std::unique_ptr<trainer::DistributedTrainer> trainer;
  if (!created.ok()) {
    result = created.status();
  } else {
    trainer = *std::move(created);
    {
      absl::MutexLock lock(&mu_);
      if (cancel_requested_) trainer->Cancel();
      trainer_ = trainer.get();
    }
    spdlog::info("job {}: {} training examples on {}, {} steps", task.job_id(),
                 trainer->train_data().size(), trainer->backend().Description(),
                 trainer->total_steps());
    result = trainer->Run();
    absl::MutexLock lock(&mu_);
    trainer_ = nullptr;
  }
  sender.Stop();

  v1::ProgressReport terminal;
  bool stopping = false;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    if (result.ok()) {
      terminal = *result;
    } else {
      terminal.set_phase(v1::TASK_PHASE_FAILED);
      terminal.set_error(cancel_requested_ && result.status().code() == absl::StatusCode::kCancelled
                             ? cancel_reason_
                             : std::string(result.status().message()));
    }
  }
  if (terminal.phase() == v1::TASK_PHASE_FAILED) {
    spdlog::warn("job {}: rank {} failed: {}", task.job_id(), task.rank(), terminal.error());
  } else {
    spdlog::info("job {}: rank {} done after {} steps{}", task.job_id(), task.rank(),
                 terminal.step(),
                 terminal.evaluated() ? absl::StrCat(", test accuracy ", terminal.test_accuracy())
                                      : std::string());
  }
  {
    absl::MutexLock lock(&mu_);
    terminal_reported_ = true;
  }
  // The terminal report matters (the job waits for it): retry it, but only once when stopping.
  const absl::Time give_up = absl::Now() + options_.terminal_report_timeout;
  absl::Duration backoff = options_.initial_backoff;
  for (;;) {
    absl::StatusOr<v1::ProgressAck> ack = Report(task, terminal);
    if (ack.ok()) break;
    if (stopping || absl::Now() + backoff > give_up ||
        ack.status().code() == absl::StatusCode::kNotFound ||
        ack.status().code() == absl::StatusCode::kInvalidArgument) {
      spdlog::error("job {}: terminal report not delivered: {}", task.job_id(),
                    ack.status().ToString());
      break;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  // May block until the data-plane calls still in flight end (the coordinator drops the job on
  // the shards once it has the report, which ends them).
  trainer.reset();
  absl::MutexLock lock(&mu_);
  task_running_ = false;
  trainer_ = nullptr;
}

}  // namespace tessera::worker
