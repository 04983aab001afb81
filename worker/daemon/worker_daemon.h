// WorkerDaemon: `tessera-worker --coordinator ADDR` (DESIGN.md §1, §6; issue #4).
//
// A MemberAgent (common/membership.h) registers the worker (role WORKER, hostname, pid, device)
// and keeps its lease alive, retrying with backoff while the coordinator is unreachable. After
// every registration the daemon (re)opens ClusterService.WatchTasks for the new member id and
// keeps it open, reopening it with capped exponential backoff when it breaks (the reason is
// logged). A Task.assign starts a DistributedTrainer on the task thread; one task at a time.
// Progress is forwarded with ReportProgress from a sender thread, in order, so training never
// waits for the coordinator: plain progress reports replace each other, while evaluated ones,
// epoch ends and the terminal phase are all kept (at most 1000 reports; past that the oldest
// plain and epoch-end ones are dropped, logged once) and retried with backoff while the
// coordinator is unreachable or does not know this member (after its restart the agent registers
// again and they go out under the new member id). An ack with cancel stops the task (only the
// incarnation the report was about), and so does a CancelTask for its job. When the task ends
// the daemon reports the terminal phase (SUCCEEDED on rank 0, TRAINING_DONE on the others,
// FAILED with the error, shard_error set when it came from the data plane) and waits for the next
// task. Every report carries the task's incarnation.
//
// Assignments for the job in hand: a higher incarnation (a rewind to a checkpoint, a hand-over)
// preempts the running task: its trainer is cancelled and joined, nothing more of the old
// incarnation is reported (no terminal report), and the new task starts. The same or a lower
// incarnation is ignored (logged). An assignment for another job while busy is refused with a
// FAILED report.
//
// Life cycle: Create() (kNew) -> Start() (kRunning) -> Stop() (kStopped): Stop() cancels a
// running task, which reports FAILED "worker stopped", then deregisters and joins every thread.
// Thread-safety: every method may be called from any thread.
#ifndef TESSERA_WORKER_DAEMON_WORKER_DAEMON_H_
#define TESSERA_WORKER_DAEMON_WORKER_DAEMON_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/membership.h"
#include "common/security.h"
#include "grpcpp/client_context.h"
#include "tessera/v1/job.grpc.pb.h"
#include "worker/trainer/distributed_trainer.h"

namespace tessera::worker {

class WorkerDaemon {
 public:
  struct Options {
    std::string coordinator;  // host:port
    // Overrides each task's spec.device when not empty: "auto", "cpu" or "cuda".
    std::string device;
    // What the worker registers as its device ("cpu", "cuda:0", "cpu:2" with 2 CPU devices,
    // "cuda:0,cuda:1" with two GPUs).
    std::string device_name;
    // --devices cpu:N: N CPU devices per task (DistributedOptions.cpu_devices): model replicas,
    // or the stages of a pipelined model.
    int cpu_devices = 1;
    // --devices cuda:0,cuda:1: the GPUs per task (DistributedOptions.cuda_devices).
    std::vector<int> cuda_devices;
    std::string hostname;
    // CPU threads for the backend; 0 keeps the OpenMP default.
    int num_threads = 0;
    // Backoff between attempts to reopen the task stream.
    absl::Duration initial_backoff = absl::Milliseconds(200);
    absl::Duration max_backoff = absl::Seconds(5);
    // Deadline of each unary call to the coordinator.
    absl::Duration rpc_timeout = absl::Seconds(5);
    // The task stream is reopened (without backoff) when this deadline passes.
    absl::Duration watch_deadline = absl::Hours(1);
    // Progress reports at most this often (and at every epoch end).
    absl::Duration progress_interval = absl::Milliseconds(500);
    // A terminal report is retried for this long before the daemon gives up on it.
    absl::Duration terminal_report_timeout = absl::Seconds(60);
    // Attempts per data-plane request (DistributedOptions::max_attempts): the default rides out
    // about 70 s of a partition before the task fails.
    int data_plane_attempts = 40;
    // The folders a task's dataset files must lie in (DistributedOptions::dataset_roots); empty:
    // anywhere. tessera-worker's --dataset_root (default /usr/share/datasets).
    std::vector<std::string> dataset_roots;
    // How the channels to the coordinator and the shards are made (default: plaintext, no
    // token).
    ClientCredentials credentials;
  };

  // INVALID_ARGUMENT naming the field for an empty coordinator, a device other than
  // auto|cpu|cuda, or negative threads. Makes no RPC.
  static absl::StatusOr<std::unique_ptr<WorkerDaemon>> Create(Options options);
  // Stop().
  ~WorkerDaemon();

  WorkerDaemon(const WorkerDaemon&) = delete;
  WorkerDaemon& operator=(const WorkerDaemon&) = delete;

  // Starts registering and watching for tasks; returns at once. Call once.
  void Start();
  // Cancels a running task (reported FAILED "worker stopped"), deregisters, joins the threads.
  // Blocks until the task has ended; idempotent.
  void Stop();

  // The current member id (empty until registered).
  std::string member_id() const { return agent_->member_id(); }
  // The job of the task in hand, empty when idle.
  std::string current_job() const;
  // The systemd watchdog's liveness probe: OK when the daemon's lock can be taken within 5 s.
  absl::Status CheckLive() const;

  // What the metrics endpoint shows (worker/daemon/worker_metrics.h), as of the trainer's last
  // progress report (at most every Options::progress_interval and at each epoch end).
  struct Stats {
    int64_t steps_total = 0;  // training steps completed by this process, every task together
    bool busy = false;        // a task is in hand
    std::string job_id;       // the task in hand ("" when idle)
    int rank = 0;
    int64_t step = 0;  // the task's step at its last report (its start_step before one)
    double samples_per_second = 0;
    double loss = 0;
  };
  // Thread-safe.
  Stats stats() const;

 private:
  class ProgressSender;

  explicit WorkerDaemon(Options options);
  void OnRegistered(const std::string& member_id);
  void WatchLoop();
  void HandleEvent(const v1::TaskEvent& event);
  void RunTask(v1::Task task);
  // Folds a progress report of the task in hand into stats_.
  void RecordProgress(const v1::ProgressReport& report) ABSL_LOCKS_EXCLUDED(mu_);
  // One ReportProgress with member_id, job_id, rank and incarnation filled in. UNAVAILABLE while
  // not registered. Replicated jobs: the report names the shards the trainer found unreachable,
  // and the ack's down shards go to the trainer.
  absl::StatusOr<v1::ProgressAck> Report(const v1::Task& task, v1::ProgressReport report);
  // The task's trainer, when it is the one running: its unreachable shards; SetDownShards.
  std::vector<int> TakeUnreachableShards(const v1::Task& task) ABSL_LOCKS_EXCLUDED(mu_);
  // `reported_step`: the step of the report the ack answers (failpoint worker.rank<R>.fill).
  void ApplyDownShards(const v1::Task& task, const v1::ProgressAck& ack, int64_t reported_step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What the running task's data plane says of the coordinator's fill, for the next report.
  client::ParameterClient::FillReport FillReportFor(const v1::Task& task) ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels the task in hand when it belongs to `job_id` (any job when empty) and, when given,
  // is of `incarnation`.
  void CancelTask(const std::string& job_id, const std::string& why,
                  std::optional<uint64_t> incarnation = std::nullopt);

  const Options options_;
  std::unique_ptr<MemberAgent> agent_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
  std::thread watch_thread_;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string member_id_ ABSL_GUARDED_BY(mu_);
  uint64_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  // The open task stream's context, to cancel it on Stop() or a new registration.
  grpc::ClientContext* watch_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  // The task in hand.
  std::thread task_thread_ ABSL_GUARDED_BY(mu_);
  bool task_running_ ABSL_GUARDED_BY(mu_) = false;
  // The task in hand is sending (or has sent) its terminal report: the coordinator may already
  // have freed this worker and assign the next task while the trainer still winds down.
  bool terminal_reported_ ABSL_GUARDED_BY(mu_) = false;
  v1::Task task_ ABSL_GUARDED_BY(mu_);
  // The last task that ended here: an assignment of it again is ignored.
  std::optional<v1::Task> finished_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::string cancel_reason_ ABSL_GUARDED_BY(mu_);
  trainer::DistributedTrainer* trainer_ ABSL_GUARDED_BY(mu_) = nullptr;  // owned by RunTask
  // The fills the task of this incarnation heard of (how many, the last one's step), for the
  // failpoint worker.rank<R>.fill (common/failpoint.h).
  uint64_t fills_incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  int fills_heard_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_fill_step_ ABSL_GUARDED_BY(mu_) = 0;
  ProgressSender* sender_ ABSL_GUARDED_BY(mu_) = nullptr;  // owned by RunTask
  // A newer incarnation of the job in hand took over: the task reports nothing more.
  bool preempted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera::worker

#endif  // TESSERA_WORKER_DAEMON_WORKER_DAEMON_H_
