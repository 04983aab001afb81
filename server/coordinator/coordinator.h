// Coordinator: the control plane's domain logic (DESIGN.md §6, docs/coordinator.md), without any
// transport. The gRPC adapter (grpc_coordinator_service.h) calls it; tests call it directly with a
// fake clock and a fake ShardControl.
//
// State: jobs (PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED) and members (shards and
// workers with leases), all in memory under one mutex and mirrored to the JobStore. A mutation
// queues its rows under the mutex; the calling thread then writes them in one SQLite transaction
// after releasing it (writers take turns on a second mutex, so rows land in the order they were
// queued). A call that changed state returns only once its rows are durable.
//
// The class is a façade over rooms of their own in internal/, which share one state type
// (internal/cluster_state.h: the jobs, the members, the queued rows, the owed drops, and the
// mutex), each function annotated with the lock it needs:
//   member_registry     registration, heartbeats, leases, task streams
//   gang_scheduler      the oldest PENDING job onto idle workers and the shards
//   checkpoint_planner  automatic and manual checkpoints: plans, calls, commits, retention
//   recovery            shard loss and rewinds, lost ranks, hand-overs, the restart grace
//   progress_reports, job_events
//                       ReportProgress into the record, events and watches
//   job_lifecycle       creation, cancellation, the end of a job, --retain_models
//   shard_drops         the durable owed DropJob calls and their retries
//   task_assignments, job_steps, action_threads
//                       the Tasks sent to workers; step arithmetic; the action threads
// None of them includes this header.
//
// Tick() does the periodic work: the owed DropJob calls, lease expiry, the restart grace for
// RUNNING jobs, throttled progress writes, the fault-tolerance actions (DESIGN.md §7,
// docs/coordinator.md "Fault tolerance"; at most one action and one automatic checkpoint call
// per job, each on a thread of its own, see internal/action_threads.h and
// CoordinatorOptions::inline_actions), and the scheduling passes (strict FIFO gang scheduling
// of the oldest PENDING job). Start() runs Tick on a thread that wakes on every change and at
// least every 500 ms; tests call it by hand. Shard calls never run under the mutex; every action
// re-checks the job's state under it before it changes anything (a checkpoint planned before a
// recovery is never committed).
//
// Life cycle: Create() -> kNew; Start() -> kRunning (the tick thread); Stop() -> kStopped (cancels
// the shard calls in flight with ShardControl::CancelAll, then joins the tick thread and every
// action thread). Every other method works in every state (tests never
// Start()).
// Thread-safety: every method may be called from any thread.
#ifndef TESSERA_SERVER_COORDINATOR_COORDINATOR_H_
#define TESSERA_SERVER_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/coordinator/coordinator_options.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/job_watch.h"
#include "server/coordinator/shard_control.h"
#include "server/coordinator/task_stream.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::coordinator {

namespace internal {
struct ClusterState;
class ActionThreads;
}  // namespace internal

// What the coordinator's metrics read at scrape time (Coordinator::MetricsSnapshot).
struct CoordinatorMetricsSnapshot {
  // Jobs by state, every state from PENDING to CANCELLED present (zeros included).
  std::map<v1::JobState, int64_t> jobs;
  // Members by (role, state), every server and worker role and READY..LEFT state present.
  std::map<std::pair<v1::MemberRole, v1::MemberState>, int64_t> members;
  struct JobProgress {
    std::string job_id;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    int64_t step = 0;
    int64_t total_steps = 0;
    // Steps per second of the job (every worker's steps at once): its samples per second over
    // batch_size * workers while RUNNING, 0 once it ended.
    double step_rate = 0;
    double loss = 0;
    double train_accuracy = 0;
    bool evaluated = false;
    double test_accuracy = 0;
    std::optional<double> test_auc;  // binary tasks, once evaluated
    int64_t checkpoint_step = 0;     // the newest committed checkpoint; 0: none
    int64_t recoveries = 0;          // rewinds to a checkpoint so far
    // RUNNING jobs, by rank: how long the job's step has waited for the rank (the stall
    // inspector; 0: it waits for nothing of it).
    std::vector<double> rank_stalled_seconds;
  };
  // The RUNNING jobs and the kMetricsRecentJobs newest (by creation) ended ones, oldest first.
  std::vector<JobProgress> progress;
};

class Coordinator {
 public:
  // Ended jobs MetricsSnapshot() still reports (the newest), so that label sets stay bounded.
  static constexpr size_t kMetricsRecentJobs = 20;

  // Validates `options`, loads every job and member from `store` (members become LOST; RUNNING
  // jobs get one lease period plus 5 s, the daemons' longest registration backoff, for their ranks
  // to report). `store` and `shards` must outlive the
  // coordinator. INVALID_ARGUMENT naming the option; the store's errors.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const CoordinatorOptions& options,
                                                             JobStore* store, ShardControl* shards);
  ~Coordinator();  // Stop()

  // Starts the tick thread. Stop() cancels the shard calls in flight (ShardControl::CancelAll),
  // joins the tick and action threads, and ends every watch and task stream with UNAVAILABLE; a
  // CheckpointJob in progress returns (CANCELLED or UNAVAILABLE) without trying again.
  // Idempotent.
  void Start();
  void Stop();

  // --- JobService. Each returns the record; errors: INVALID_ARGUMENT naming the field,
  // NOT_FOUND, FAILED_PRECONDITION (see job.proto), or the store's sticky error.
  absl::StatusOr<v1::Job> CreateJob(const v1::JobSpec& spec);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  absl::StatusOr<std::vector<v1::Job>> ListJobs(const v1::ListJobsRequest& request);
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id);
  // The watch starts with the current record, then the stored events after `after_seq`, then
  // live ones; it ends OK after the terminal event. Blocks on one SQLite read.
  absl::StatusOr<std::shared_ptr<JobWatch>> WatchJob(const v1::WatchJobRequest& request);
  // Takes a checkpoint of a RUNNING job at a step a little ahead of its progress (enough for 2 s
  // of steps, at least 10, at most total_steps) and returns the committed record. A shard that
  // answers FAILED_PRECONDITION (the step passed before it was registered) makes it try again
  // further ahead, up to 5 times. Blocks on shard calls (each up to checkpoint_timeout) and SQLite.
  // FAILED_PRECONDITION for a job that is not RUNNING, is recovering or has no step left;
  // ABORTED when the job recovered meanwhile; a shard's error with its index and address.
  absl::StatusOr<v1::CheckpointRecord> CheckpointJob(const std::string& job_id);

  // --- ClusterService.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  absl::Status Heartbeat(const v1::HeartbeatRequest& request);
  absl::Status Deregister(const v1::DeregisterRequest& request);
  std::vector<v1::Member> ListMembers();
  // Makes `stream` the worker's task stream (an older one is closed with ABORTED). NOT_FOUND for
  // an unknown, lost or departed member; INVALID_ARGUMENT for an empty id or a shard.
  absl::Status OpenTaskStream(const std::string& member_id, std::shared_ptr<TaskStream> stream);
  absl::StatusOr<v1::ProgressAck> ReportProgress(const v1::ProgressReport& report);

  // One round of the periodic work (see the file comment). Blocks on shard calls and SQLite.
  void Tick();

  // Counts and per-job progress for the metrics endpoint. Takes the coordinator's lock briefly
  // (one pass over jobs and members, no I/O). Thread-safe.
  CoordinatorMetricsSnapshot MetricsSnapshot() const;

  // The systemd watchdog's liveness probe: OK when the coordinator's lock can be taken within 5 s
  // and, once Start() has run, the tick loop has finished a tick within `max_tick_age` (a tick
  // waits on shard calls, each bounded by its deadline); DEADLINE_EXCEEDED otherwise.
  absl::Status CheckLive(absl::Duration max_tick_age) const;

 private:
  Coordinator(const CoordinatorOptions& options, JobStore* store, ShardControl* shards);
  // Loads every job, member and owed drop from the store (see Create).
  absl::Status Load();
  // The tick loop of Start().
  void Run();

  // The shared state of the rooms, with the one mutex; the action threads.
  const std::unique_ptr<internal::ClusterState> state_;
  const std::unique_ptr<internal::ActionThreads> actions_;
  absl::Mutex tick_mu_;  // one Tick at a time; taken before the state's mutex
  std::thread thread_;   // the tick loop: started by Start(), joined by Stop()
  // When the tick loop last finished a tick (or started), in absl::GetCurrentTimeNanos(); 0
  // before Start().
  std::atomic<int64_t> last_tick_ns_{0};
  std::atomic<bool> ticks_stopped_{false};  // Stop() ran: CheckLive no longer asks for ticks
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_COORDINATOR_H_
