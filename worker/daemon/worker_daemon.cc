#include "worker/daemon/worker_daemon.h"

#include <unistd.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/failpoint.h"
#include "common/grpc_status.h"
#include "common/process.h"
#include "grpcpp/channel.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::worker {

// Sends the progress reports of the task in hand from its own thread, in order, so a slow or
// absent coordinator never holds up a training step. Plain progress reports replace each other
// (only the newest is kept); the ones that must not be lost (evaluations, epoch ends, the
// terminal phase) are all kept, in order. While the coordinator is unreachable (or does not know
// this member: the agent registers again and the reports go out under the new id) the front
// report is retried with capped exponential backoff. At most kMaxQueued reports are kept: past
// that the oldest plain, then the oldest epoch-end reports are dropped (logged once); evaluated
// and terminal reports never are.
class WorkerDaemon::ProgressSender {
 public:
  static constexpr size_t kMaxQueued = 1000;

  ProgressSender(WorkerDaemon* daemon, v1::Task task)
      : daemon_(daemon), task_(std::move(task)), thread_([this] { Run(); }) {}
  // Stop().
  ~ProgressSender() { Stop(); }

  // Queues `report`; never blocks on the coordinator. Ignored after Abandon() or Stop().
  void Offer(const v1::ProgressReport& report) {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    const bool keep = MustKeep(report);
    if (!keep) {
      for (auto it = queue_.begin(); it != queue_.end();) {
        it = it->keep ? std::next(it) : queue_.erase(it);
      }
    }
    queue_.push_back({next_id_++, report, keep});
    if (queue_.size() > kMaxQueued) DropOne();
  }
  // Waits until every queued report has been delivered (or refused as invalid), until
  // `deadline`, or until Abandon()/Stop(). True when nothing is left.
  bool Drain(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(this, &ProgressSender::DrainedOrStopped), deadline);
    return queue_.empty();
  }
  // Drops whatever is queued and ignores later offers, without waiting (the report on the wire,
  // if any, still completes). For a preempted task: nothing more of its incarnation goes out.
  void Abandon() {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();
  }
  // Abandon(), then joins the thread (after the report on the wire, if any).
  void Stop() {
    Abandon();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Entry {
    uint64_t id = 0;
    v1::ProgressReport report;
    bool keep = false;
  };

  // Evaluations, epoch ends and terminal phases must reach the coordinator.
  static bool MustKeep(const v1::ProgressReport& r) {
    return r.phase() != v1::TASK_PHASE_TRAINING || r.evaluated() ||
           (r.steps_per_epoch() > 0 && r.step() > 0 && r.step() % r.steps_per_epoch() == 0) ||
           (r.total_steps() > 0 && r.step() == r.total_steps());
  }
  static bool Droppable(const Entry& e) {
    return !e.report.evaluated() && e.report.phase() == v1::TASK_PHASE_TRAINING;
  }

  void DropOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // The oldest plain report first, then the oldest epoch end.
    auto victim =
        std::find_if(queue_.begin(), queue_.end(), [](const Entry& e) { return !e.keep; });
    if (victim == queue_.end()) victim = std::find_if(queue_.begin(), queue_.end(), &Droppable);
    if (victim == queue_.end()) return;
    if (!dropping_logged_) {
      dropping_logged_ = true;
      spdlog::warn(
          "job {}: {} progress reports buffered while the coordinator is unreachable; "
          "dropping the oldest plain and epoch-end ones",
          task_.job_id(), queue_.size());
    }
    queue_.erase(victim);
  }

  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }
  bool DrainedOrStopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || queue_.empty();
  }

  void Run() {
    absl::Duration backoff = daemon_->options_.initial_backoff;
    bool down = false;
    // Replicated jobs: while the training loop waits on a shard that does not answer, it makes no
    // reports; this thread then tells the coordinator which shards are unreachable (in a copy of
    // the last report) every progress interval, and the acks bring the down shards back.
    const bool replicated = spec::Replicas(task_.spec()) > 1;
    std::optional<v1::ProgressReport> last;
    for (;;) {
      Entry entry;
      bool probe = false;
      {
        absl::MutexLock lock(&mu_);
        if (replicated) {
          mu_.AwaitWithTimeout(absl::Condition(this, &ProgressSender::Ready),
                               daemon_->options_.progress_interval);
        } else {
          mu_.Await(absl::Condition(this, &ProgressSender::Ready));
        }
        if (stop_) return;
        if (queue_.empty()) {
          if (!last.has_value()) continue;
          entry.report = *last;  // sent without the lock below
          probe = true;
        } else {
          entry = queue_.front();
        }
      }
      if (probe) {
        // Also while a shard is being filled: a loop that waits on it must hear at once when the
        // fill is given up (its ack then stops the writes to that shard).
        const std::vector<int> unreachable = daemon_->TakeUnreachableShards(task_);
        if (unreachable.empty() && daemon_->FillReportFor(task_).from_step == 0) continue;
        for (int shard : unreachable) entry.report.add_unreachable_shards(shard);
        const absl::StatusOr<v1::ProgressAck> ack = daemon_->Report(task_, entry.report);
        if (!ack.ok()) {
          spdlog::warn("job {}: report of unreachable shards not delivered: {}", task_.job_id(),
                       ack.status().ToString());
        }
        continue;
      }
      if (entry.report.phase() == v1::TASK_PHASE_TRAINING) last = entry.report;
      // Without the lock: an RPC.
      absl::StatusOr<v1::ProgressAck> ack = daemon_->Report(task_, entry.report);
      const bool refused = !ack.ok() && ack.status().code() == absl::StatusCode::kInvalidArgument;
      if (ack.ok() || refused) {
        if (refused) {
          spdlog::error("job {}: progress report refused: {}", task_.job_id(),
                        ack.status().ToString());
        }
        size_t left = 0;
        {
          absl::MutexLock lock(&mu_);
          // A plain report may have been replaced meanwhile: erase it only if still queued.
          for (auto it = queue_.begin(); it != queue_.end(); ++it) {
            if (it->id == entry.id) {
              queue_.erase(it);
              break;
            }
          }
          left = queue_.size();
        }
        if (down) {
          spdlog::info("job {}: coordinator {} answers again; sending {} buffered report(s)",
                       task_.job_id(), daemon_->options_.coordinator, left);
          down = false;
        }
        backoff = daemon_->options_.initial_backoff;
        if (ack.ok() && ack->cancel()) {
          spdlog::info("job {}: the coordinator asked incarnation {} to stop", task_.job_id(),
                       task_.incarnation());
          daemon_->CancelTask(task_.job_id(), "cancelled", task_.incarnation());
        }
        continue;
      }
      if (!down) {
        spdlog::warn("job {}: progress report not delivered ({}); buffering and retrying",
                     task_.job_id(), ack.status().ToString());
        down = true;
      }
      absl::MutexLock lock(&mu_);
      // Returns early on Abandon()/Stop().
      mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff);
      backoff = std::min(backoff * 2, daemon_->options_.max_backoff);
    }
  }

  WorkerDaemon* const daemon_;
  const v1::Task task_;
  absl::Mutex mu_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool dropping_logged_ ABSL_GUARDED_BY(mu_) = false;
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
  if (options.data_plane_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane_attempts: must be >= 1, got ", options.data_plane_attempts));
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

WorkerDaemon::Stats WorkerDaemon::stats() const {
  absl::MutexLock lock(&mu_);
  Stats out = stats_;
  out.busy = task_running_ && !terminal_reported_;
  out.job_id = out.busy ? task_.job_id() : "";
  out.rank = out.busy ? task_.rank() : 0;
  if (!out.busy) {
    out.step = 0;
    out.samples_per_second = 0;
    out.loss = 0;
  }
  return out;
}

void WorkerDaemon::RecordProgress(const v1::ProgressReport& report) {
  absl::MutexLock lock(&mu_);
  if (!task_running_ || report.incarnation() != task_.incarnation()) return;
  if (report.step() > stats_.step) {
    stats_.steps_total += report.step() - stats_.step;
    stats_.step = report.step();
  }
  stats_.samples_per_second = report.samples_per_second();
  stats_.loss = report.loss();
}

absl::Status WorkerDaemon::CheckLive() const {
  return MutexResponds(&mu_, absl::Seconds(5), "the worker daemon's lock");
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
  // acts on the report at once): wait for that task's thread, then take the new one. A higher
  // incarnation of the job in hand (a rewind to a checkpoint, or the rank handed over again)
  // preempts it: the trainer is cancelled and joined, and nothing more of its incarnation is
  // reported, the terminal phase included.
  std::thread finishing;
  {
    absl::MutexLock lock(&mu_);
    const bool same_assignment = task_running_ && task_.job_id() == task.job_id() &&
                                 task_.rank() == task.rank() &&
                                 task_.incarnation() == task.incarnation();
    if (task_running_ && task_.job_id() == task.job_id() &&
        task.incarnation() > task_.incarnation()) {
      spdlog::info(
          "job {}: incarnation {} (rank {}, start_step {}) preempts incarnation {} "
          "(rank {})",
          task.job_id(), task.incarnation(), task.rank(), task.start_step(), task_.incarnation(),
          task_.rank());
      preempted_ = true;
      cancel_requested_ = true;
      cancel_reason_ = "preempted";
      if (trainer_ != nullptr) trainer_->Cancel();
      if (sender_ != nullptr) sender_->Abandon();
      finishing = std::move(task_thread_);
    } else if (task_running_ && terminal_reported_ && !same_assignment) {
      finishing = std::move(task_thread_);
    }
  }
  if (finishing.joinable()) finishing.join();
  std::string busy_with;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    if (task_running_) {
      if (task_.job_id() == task.job_id()) {
        if (task_.rank() != task.rank() || task_.incarnation() != task.incarnation()) {
          spdlog::warn(
              "job {}: ignoring the assignment of rank {} incarnation {}: incarnation {} "
              "(rank {}) is newer or the same",
              task.job_id(), task.rank(), task.incarnation(), task_.incarnation(), task_.rank());
        }
        return;  // the same assignment again (a reopened stream), or an older one
      }
      busy_with = task_.job_id();
    } else {
      if (finished_.has_value() && finished_->job_id() == task.job_id() &&
          finished_->rank() == task.rank() && finished_->incarnation() == task.incarnation()) {
        // The coordinator sends the assignment again on a new task stream; this one has ended
        // here already, and a new incarnation is what would run it again.
        spdlog::info("job {}: ignoring rank {} incarnation {} again: it has ended here",
                     task.job_id(), task.rank(), task.incarnation());
        return;
      }
      // The previous task thread has finished its work; reap it before starting the next.
      if (task_thread_.joinable()) task_thread_.join();
      task_running_ = true;
      terminal_reported_ = false;
      preempted_ = false;
      task_ = task;
      stats_.step = task.start_step();
      stats_.samples_per_second = 0;
      stats_.loss = 0;
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

void WorkerDaemon::CancelTask(const std::string& job_id, const std::string& why,
                              std::optional<uint64_t> incarnation) {
  absl::MutexLock lock(&mu_);
  if (!task_running_ || (!job_id.empty() && task_.job_id() != job_id)) return;
  if (incarnation.has_value() && task_.incarnation() != *incarnation) return;
  if (!cancel_requested_) {
    cancel_requested_ = true;
    cancel_reason_ = why;
  }
  if (trainer_ != nullptr) trainer_->Cancel();
}

absl::StatusOr<v1::ProgressAck> WorkerDaemon::Report(const v1::Task& task,
                                                     v1::ProgressReport report) {
  report.set_member_id(agent_->member_id());
  if (report.member_id().empty()) {
    return absl::UnavailableError(
        absl::StrCat("coordinator ", options_.coordinator, ": not registered (yet)"));
  }
  report.set_job_id(task.job_id());
  report.set_rank(task.rank());
  report.set_incarnation(task.incarnation());
  const bool replicated = spec::Replicas(task.spec()) > 1;
  if (replicated) {
    for (int shard : TakeUnreachableShards(task)) report.add_unreachable_shards(shard);
    const client::ParameterClient::FillReport fill = FillReportFor(task);
    report.set_fill_from_step(fill.from_step);
    report.set_fill_missed(fill.missed);
  }
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  v1::ProgressAck ack;
  const grpc::Status status = stub_->ReportProgress(&context, report, &ack);
  if (!status.ok()) {
    const absl::Status s = FromGrpcStatus(status);
    return absl::Status(s.code(),
                        absl::StrCat("coordinator ", options_.coordinator, ": ", s.message()));
  }
  if (replicated) ApplyDownShards(task, ack, report.step());
  return ack;
}

std::vector<int> WorkerDaemon::TakeUnreachableShards(const v1::Task& task) {
  absl::MutexLock lock(&mu_);
  if (trainer_ == nullptr || !task_running_ || task_.incarnation() != task.incarnation()) return {};
  return trainer_->TakeUnreachableShards();
}

client::ParameterClient::FillReport WorkerDaemon::FillReportFor(const v1::Task& task) {
  absl::MutexLock lock(&mu_);
  if (trainer_ == nullptr || !task_running_ || task_.incarnation() != task.incarnation()) return {};
  return trainer_->FillReport();
}

void WorkerDaemon::ApplyDownShards(const v1::Task& task, const v1::ProgressAck& ack,
                                   int64_t reported_step) {
  absl::MutexLock lock(&mu_);
  if (trainer_ == nullptr || !task_running_ || task_.incarnation() != task.incarnation()) return;
  trainer_->SetDownShards(std::vector<int>(ack.down_shards().begin(), ack.down_shards().end()));
  const v1::ShardFill* fill = ack.has_fill() ? &ack.fill() : nullptr;
  if (fill != nullptr) {
    if (fills_incarnation_ != task.incarnation()) {
      fills_incarnation_ = task.incarnation();
      fills_heard_ = 0;
      last_fill_step_ = 0;
    }
    if (fill->from_step() != last_fill_step_) {
      last_fill_step_ = fill->from_step();
      ++fills_heard_;
    }
    // A rank that hears of this fill late: it trains on without it until past its step.
    if (reported_step <= fill->from_step() &&
        failpoint::Hit(absl::StrCat("worker.rank", task.rank(), ".fill"), fills_heard_)) {
      fill = nullptr;
    }
  }
  // After the down shards: a fill's shard is one of them.
  trainer_->SetFill(fill);
}

void WorkerDaemon::RunTask(v1::Task task) {
  spdlog::info("job {}: rank {} of {} on {} shard(s), incarnation {}, start_step {}", task.job_id(),
               task.rank(), task.world_size(), task.shard_addresses_size(), task.incarnation(),
               task.start_step());
  ProgressSender sender(this, task);
  {
    absl::MutexLock lock(&mu_);
    sender_ = &sender;
  }
  trainer::DistributedOptions o;
  o.task = task;
  o.device = options_.device;
  o.cpu_devices = options_.cpu_devices;
  o.cuda_devices = options_.cuda_devices;
  o.num_threads = options_.num_threads;
  o.progress_interval = options_.progress_interval;
  o.max_attempts = options_.data_plane_attempts;
  o.dataset_roots = options_.dataset_roots;
  o.credentials = options_.credentials;
  o.on_note = [&task](const std::string& note) {
    spdlog::info("job {}: rank {} {}", task.job_id(), task.rank(), note);
  };
  o.on_progress = [this, &sender](const v1::ProgressReport& p) {
    RecordProgress(p);
    sender.Offer(p);
  };
  // Rank 0's TRAINING_DONE polls go out after every buffered report, so the coordinator sees
  // the reports in order.
  o.report = [this, &task,
              &sender](const v1::ProgressReport& p) -> absl::StatusOr<v1::ProgressAck> {
    if (!sender.Drain(absl::Now() + options_.rpc_timeout)) {
      return absl::UnavailableError("earlier progress reports are not delivered yet");
    }
    return Report(task, p);
  };

  absl::StatusOr<v1::ProgressReport> result;
  int64_t steps_per_epoch = 0;
  absl::StatusOr<std::unique_ptr<trainer::DistributedTrainer>> created =
      trainer::DistributedTrainer::Create(std::move(o));
  std::unique_ptr<trainer::DistributedTrainer> trainer;
  if (!created.ok()) {
    result = created.status();
  } else {
    trainer = *std::move(created);
    steps_per_epoch = trainer->steps_per_epoch();
    if (trainer->local_devices() > 1) {
      spdlog::info("job {}: rank {} {}", task.job_id(), task.rank(),
                   trainer->devices_description());
    }
    {
      absl::MutexLock lock(&mu_);
      if (cancel_requested_) trainer->Cancel();
      trainer_ = trainer.get();
    }
    spdlog::info("job {}: {} training examples on {}, steps {}..{}", task.job_id(),
                 trainer->train_data().size(), trainer->backend().Description(),
                 trainer->start_step(), trainer->total_steps());
    result = trainer->Run();
    absl::MutexLock lock(&mu_);
    trainer_ = nullptr;
  }

  v1::ProgressReport terminal;
  bool stopping = false;
  bool preempted = false;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    preempted = preempted_;
    if (result.ok()) {
      terminal = *result;
    } else {
      terminal.set_phase(v1::TASK_PHASE_FAILED);
      terminal.set_error(cancel_requested_ && result.status().code() == absl::StatusCode::kCancelled
                             ? cancel_reason_
                             : std::string(result.status().message()));
      terminal.set_shard_error(trainer::IsShardError(result.status()));
      terminal.set_steps_per_epoch(steps_per_epoch);
    }
    terminal_reported_ = true;
  }
  if (preempted) {
    // A newer incarnation of this job replaces this one: it reports nothing more.
    spdlog::info("job {}: incarnation {} preempted", task.job_id(), task.incarnation());
    sender.Stop();
  } else {
    if (terminal.phase() == v1::TASK_PHASE_FAILED) {
      spdlog::warn("job {}: rank {} failed{}: {}", task.job_id(), task.rank(),
                   terminal.shard_error() ? " (data plane)" : "", terminal.error());
    } else {
      spdlog::info("job {}: rank {} done after {} steps{}", task.job_id(), task.rank(),
                   terminal.step(),
                   terminal.evaluated() ? absl::StrCat(", test accuracy ", terminal.test_accuracy())
                                        : std::string());
    }
    // The terminal report matters (the job waits for it): it goes out after every buffered
    // report, retried for terminal_report_timeout (for one call's time when stopping).
    sender.Offer(terminal);
    const absl::Time give_up =
        absl::Now() + (stopping ? options_.rpc_timeout : options_.terminal_report_timeout);
    if (!sender.Drain(give_up)) {
      spdlog::error(
          "job {}: terminal report not delivered within {}", task.job_id(),
          absl::FormatDuration(stopping ? options_.rpc_timeout : options_.terminal_report_timeout));
    }
    sender.Stop();
  }
  {
    absl::MutexLock lock(&mu_);
    sender_ = nullptr;
  }
  // May block until the data-plane calls still in flight end (the coordinator drops the job on
  // the shards once it has the report, which ends them).
  trainer.reset();
  absl::MutexLock lock(&mu_);
  task_running_ = false;
  finished_ = task_;
  trainer_ = nullptr;
}

}  // namespace tessera::worker
