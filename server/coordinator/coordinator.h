// Coordinator: the control plane's domain logic (DESIGN.md §6, docs/coordinator.md), without any
// transport. The gRPC adapter (grpc_coordinator_service.h) calls it; tests call it directly with a
// fake clock and a fake ShardControl.
//
// State: jobs (PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED) and members (shards and
// workers with leases), all in memory under one mutex and mirrored to the JobStore. A mutation
// queues its rows under the mutex; the calling thread then writes them in one SQLite transaction
// after releasing it (FlushWrites: writers take turns on a second mutex, so rows land in the order
// they were queued). A call that changed state returns only once its rows are durable.
//
// Tick() does the periodic work: the owed DropJob calls (ended jobs, retained weights that go;
// kept in SQLite and retried with a backoff per shard address until settled), one scheduling
// pass (strict FIFO gang scheduling of the oldest PENDING job), lease expiry, the restart grace
// for RUNNING jobs, throttled progress writes, and the fault-tolerance actions (DESIGN.md §7,
// docs/coordinator.md "Fault tolerance"): committing the automatic checkpoints, recovering a job
// whose shard was lost (Restore on every shard, UpdateMembership, new Tasks), removing a lost
// worker's rank from the shards' membership, and handing a lost rank to an idle worker. Start()
// runs Tick on a thread that wakes on every change and at least every 500 ms; tests call it by
// hand.
//
// Shard calls never run under mu_. The fault-tolerance actions may block for an RPC deadline, so
// Tick runs each on a thread of its own (CoordinatorOptions::inline_actions: on the calling
// thread, for tests); a job has at most one action (recovery, membership change, hand-over) and
// one automatic checkpoint call in flight, so a change of membership never waits for a checkpoint
// call that long-polls a step ahead of the job; every action re-checks the job's state under the
// lock before it changes anything (a checkpoint planned before a recovery is never committed).
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
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
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
    int64_t checkpoint_step = 0;  // the newest committed checkpoint; 0: none
    int64_t recoveries = 0;       // rewinds to a checkpoint so far
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
  struct MemberEntry {
    int64_t n = 0;  // the number in "s-<n>"/"w-<n>"
    v1::Member member;
    std::shared_ptr<TaskStream> stream;
    // The worker's current assignment (until it is released), and whether the records that make
    // it durable are written (SendAssigns): from then on a task stream that replaces another gets
    // it again, since the old one may have taken it to a worker that was no longer reading, or
    // there was no stream when it was due (the worker ignores an assignment it already runs).
    std::optional<v1::TaskEvent> assign;
    bool assign_durable = false;
  };
  struct JobEntry {
    int64_t n = 0;
    v1::Job job;
    int64_t last_seq = 0;
    bool starting = false;           // the scheduler is creating its state on the shards
    bool weights_on_shards = false;  // SUCCEEDED and not yet dropped by --retain_models
    int64_t last_progress_event_ms = 0;
    int64_t last_write_ms = 0;
    bool dirty = false;  // the record changed since it was last queued for writing
    // After a coordinator restart: RUNNING jobs' ranks must report by then (0: not restarting).
    int64_t restart_deadline_ms = 0;
    std::vector<bool> rank_seen;
    std::vector<std::shared_ptr<JobWatch>> watchers;
    // Committed checkpoints, newest first (RUNNING and SUCCEEDED jobs).
    std::vector<v1::CheckpointRecord> checkpoints;
    bool action_running = false;      // a fault-tolerance action of the job is in flight
    bool checkpoint_running = false;  // an automatic checkpoint call is in flight
    // The last automatic checkpoint that failed (not interrupted); later plans skip past it.
    int64_t checkpoint_failed_step = 0;
    int64_t recovery_since_ms = 0;  // when the current recovery began
    bool membership_dirty = false;  // the shards must hear the live ranks again
    // Ranks handed over at a step the job has not reached yet: rank -> the step it joined at (the
    // shards have it live from there, not before). Kept until the job's step reaches it, so that
    // a later membership update never makes such a rank live before its join (its new worker
    // starts there). Cleared by a recovery (every rank restarts at the checkpoint); re-derived
    // after a restart (Load).
    std::map<int, int64_t> joins;
    int handover_attempts = 0;   // hand-overs that came too late, since the last success
    int64_t handover_floor = 0;  // the most steps a shard said it had done in such an answer
    // Workers of the job whose trainer ended (they reported FAILED while the job recovered): they
    // stay BUSY for the recovery's new Task, and are released, not cancelled, if the job ends.
    std::set<std::string> stopped_members;
  };
  // A membership as the shards must hear it: (effective_step, live ranks) in ascending steps, to
  // be sent in this order (each replaces the shards' history from its step on).
  using MembershipLayers = std::vector<std::pair<int64_t, std::vector<uint32_t>>>;
  // What a checkpoint asks of the shards, planned under the lock.
  struct CheckpointPlan {
    std::string job_id;
    int64_t step = 0;
    int64_t retain_from_step = 0;
    std::vector<std::string> addresses;
    int recoveries = 0;  // the job's count when planned: a recovery in between voids it
    bool manual = false;
  };
  struct RecoveryPlan {
    std::string job_id;
    std::vector<int64_t> steps;  // committed checkpoints, newest first
    std::vector<std::string> addresses;
    std::vector<uint32_t> live_ranks;
    uint64_t incarnation_base = 0;
  };
  struct HandoverPlan {
    std::string job_id;
    int rank = 0;
    std::string member_id;
    int64_t start_step = 0;
    std::vector<std::string> addresses;
    std::vector<uint32_t> live_ranks;  // without `rank`
    MembershipLayers resend;           // sent before the join (empty: none)
  };
  // When an owed DropJob is tried next (ShardDrop is the store's), and how often it was queued:
  // a drop queued again while its call ran (a Restore recreated the job) is not settled by it.
  struct DropRetry {
    int64_t next_try_ms = 0;
    int64_t backoff_ms = 0;  // 0: never failed
    uint64_t generation = 0;
  };

  Coordinator(const CoordinatorOptions& options, JobStore* store, ShardControl* shards);
  absl::Status Load();
  int64_t NowMs() const;
  void Wake();
  void Run();

  // Writes the queued rows; returns the store's (sticky) error.
  absl::Status FlushWrites() ABSL_LOCKS_EXCLUDED(mu_);
  // Calls DropJob for the owed drops that are due and whose shard address is a live shard; an
  // answer OK or NOT_FOUND settles a drop (deleted from the database), another error retries it
  // with a backoff from 1 s doubling to kMaxDropBackoff, and at once when a shard registers at
  // that address.
  void RunShardDrops() ABSL_LOCKS_EXCLUDED(mu_);
  // Owes DropJob(job_id) to the shard at `address`, in memory and (with the next FlushWrites) in
  // the database, so that a coordinator restart does not forget it.
  void QueueDrop(const std::string& address, const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One scheduling pass over the oldest PENDING job; true when it started.
  bool Schedule() ABSL_LOCKS_EXCLUDED(mu_);

  JobEntry* FindJob(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  MemberEntry* FindMember(const std::string& member_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueJob(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueMember(const MemberEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends an event built from the record (and `message`), queues both, tells the watchers.
  void AddEvent(JobEntry& entry, const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a RUNNING or PENDING job: FAILED or CANCELLED with `reason`, cancels its workers' tasks
  // (except `except_member`), queues DropJob on its shards.
  void EndJob(JobEntry& entry, v1::JobState state, const std::string& reason,
              const std::string& except_member) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the member's recorded assignment is still its rank's current one in a RUNNING job
  // that is not recovering, and the member has not finished it.
  bool StillAssigned(const MemberEntry& member) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records `event` as the member's assignment, to be sent by SendAssigns once durable.
  void RecordAssign(MemberEntry& member, const v1::TaskEvent& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks each (member id, assign) durable and sends it on the member's current task stream (if
  // any), unless it is no longer StillAssigned (released, reassigned, the job ended meanwhile).
  void SendAssigns(const std::vector<std::pair<std::string, v1::TaskEvent>>& assigns)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A worker back to READY (when it is BUSY with `job_id`).
  void ReleaseWorker(MemberEntry& member, const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A member LOST or LEFT: fails the RUNNING jobs that depend on it.
  void MemberGone(MemberEntry& member, v1::MemberState state, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyRetention() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- Fault tolerance (docs/coordinator.md "Fault tolerance").
  // Runs `action` on a thread of its own (or inline, see CoordinatorOptions::inline_actions).
  void RunAction(std::function<void()> action) ABSL_LOCKS_EXCLUDED(mu_);
  // Joins the action threads that have finished (all of them when `all`).
  void ReapActions(bool all) ABSL_LOCKS_EXCLUDED(mu_);
  // Plans this tick's actions (checkpoint, recovery, membership, hand-over), at most one per job.
  std::vector<std::function<void()>> PlanActions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A RUNNING job lost a shard (or a rank hit a data-plane error): recovers it from its newest
  // checkpoint, or fails it with `cause` when it has none or has recovered too often.
  void StartRecovery(JobEntry& entry, const std::string& cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank `rank` of a RUNNING job has no worker any more: it is marked lost and leaves the shards'
  // membership; the job fails when no rank is left.
  void LoseRank(JobEntry& entry, int rank, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<CheckpointPlan> PlanCheckpoint(JobEntry& entry, int64_t step, bool manual)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checkpoint on every shard of the plan; the first error, naming the shard.
  absl::StatusOr<std::vector<v1::CheckpointResponse>> CallCheckpoint(const CheckpointPlan& plan)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Commits a checkpoint every shard confirmed (record, retention, event); then flushes.
  absl::StatusOr<v1::CheckpointRecord> CommitCheckpoint(
      const CheckpointPlan& plan, const std::vector<v1::CheckpointResponse>& responses)
      ABSL_LOCKS_EXCLUDED(mu_);
  void AutoCheckpoint(const CheckpointPlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  void Recover(const RecoveryPlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  // The job's live ranks `live_ranks` from `effective_step` on, as layers: the ranks of
  // entry.joins whose join step lies beyond `effective_step` join again at their own step.
  MembershipLayers LayeredMembership(const JobEntry& entry, const std::vector<uint32_t>& live_ranks,
                                     int64_t effective_step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UpdateMembership of every layer, in order, on every shard; a failure sets membership_dirty.
  void SendMembership(const std::string& job_id, const std::vector<std::string>& addresses,
                      const MembershipLayers& layers) ABSL_LOCKS_EXCLUDED(mu_);
  void Handover(const HandoverPlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  // Steps a rank can be expected to do within a second (at least 10), doubled per earlier
  // `attempt`.
  int64_t StepMargin(const JobEntry& entry, int attempt) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The largest step reported by a rank that is not lost.
  int64_t MaxRankStep(const v1::Job& job) const;
  // An incarnation above every one the job has handed out (>= now_ms * 1024).
  uint64_t NextIncarnation(const v1::Job& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::DataPosition PositionAt(const v1::Job& job, int64_t step) const;
  // Drops the job's checkpoint records (its weights left the shards).
  void ForgetCheckpoints(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckLeases() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the oldest departed members beyond options_.max_departed_members per role. The newest
  // member of each role stays, so ids are not handed out again after a restart.
  void ForgetDepartedMembers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets task streams that have ended; a worker still holding a task of an ended job goes
  // back to READY.
  void ReapStreams() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetPendingReason(JobEntry& entry, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string WorkerName(const v1::JobWorker& worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  JobStore* const store_;
  ShardControl* const shards_;

  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one FlushWrites at a time
  absl::Mutex tick_mu_ ABSL_ACQUIRED_BEFORE(mu_);   // one Tick at a time

  mutable absl::Mutex mu_;
  std::map<int64_t, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);  // by n: oldest first
  std::map<std::string, int64_t> job_n_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, MemberEntry> members_ ABSL_GUARDED_BY(mu_);
  int64_t next_shard_n_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_worker_n_ ABSL_GUARDED_BY(mu_) = 1;
  StoreWrite pending_ ABSL_GUARDED_BY(mu_);
  std::map<ShardDrop, DropRetry> drops_ ABSL_GUARDED_BY(mu_);
  absl::Status store_error_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
  // When the tick loop last finished a tick (or started), in absl::GetCurrentTimeNanos(); 0
  // before Start().
  std::atomic<int64_t> last_tick_ns_{0};
  std::atomic<bool> ticks_stopped_{false};  // Stop() ran: CheckLive no longer asks for ticks

  struct ActionThread {
    std::thread thread;
    std::shared_ptr<bool> done;  // guarded by actions_mu_
  };
  absl::Mutex actions_mu_;
  std::vector<ActionThread> actions_ ABSL_GUARDED_BY(actions_mu_);
  bool actions_stopped_ ABSL_GUARDED_BY(actions_mu_) = false;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_COORDINATOR_H_
