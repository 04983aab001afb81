// ClusterState: what the coordinator knows, shared by its rooms (the member registry, the gang
// scheduler, the checkpoint planner, recovery, progress and events, the shard drops) under ONE
// mutex, `mu`. Each room is a set of functions over it, annotated with the lock it needs; the
// façade (coordinator.h) owns the state and is the only one that takes `mu` on a caller's behalf.
//
// Writes: a change is made in memory under `mu`, which queues its rows in `pending`; the thread
// that made it then calls FlushWrites(), which writes every queued row in one SQLite transaction
// after releasing `mu` (writers take turns on `write_mu`, so rows land in the order they were
// queued). A failed write is sticky (`store_error`): every later change is refused with it.
//
// Private to server/coordinator/.
#ifndef TESSERA_SERVER_COORDINATOR_INTERNAL_CLUSTER_STATE_H_
#define TESSERA_SERVER_COORDINATOR_INTERNAL_CLUSTER_STATE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/coordinator/coordinator_options.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/job_watch.h"
#include "server/coordinator/shard_control.h"
#include "server/coordinator/task_stream.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::internal {

// A shard or a worker, as registered.
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
  // A shard a replicated job's rank could not reach (shard_failover.h): from then on, its lease
  // is SuspectLeaseMs(); a heartbeat clears it. 0: not suspected.
  int64_t suspected_ms = 0;
};

// A job: its record and what the rooms keep about it in memory.
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
  // after a restart (DerivedJoins, recovery.h).
  std::map<int, int64_t> joins;
  int handover_attempts = 0;   // hand-overs that came too late, since the last success
  int64_t handover_floor = 0;  // the most steps a shard said it had done in such an answer
  // Workers of the job whose trainer ended (they reported FAILED while the job recovered): they
  // stay BUSY for the recovery's new Task, and are released, not cancelled, if the job ends.
  std::set<std::string> stopped_members;
  // The stall inspector (stall_inspector.h): each shard's latest report for the job, by shard
  // index, with when it came.
  struct ReportedStall {
    v1::ShardStall stall;
    int64_t received_ms = 0;
  };
  std::map<int, ReportedStall> shard_stalls;
  // The stall the last STALL event named: its step (-1: none) and ranks, and the longest it had
  // waited as last seen.
  int64_t named_stall_step = -1;
  std::set<int> named_stall_ranks;
  int64_t named_stall_waited_ms = 0;
  // The progress lease counts from no earlier than this: the last time one of the job's shards
  // was silent or the job recovering (which stall every rank), or a rank left the job (the others
  // may have waited for it).
  int64_t progress_lease_floor_ms = 0;
  // Ranks the progress lease warned about, until their step moves.
  std::set<int> stall_warned;
  // Replicated jobs: the fill of a down shard in flight (shard_refill.h); shard < 0: none. Not
  // stored: after a coordinator restart the ranks hear no fill and a later tick starts again.
  struct Fill {
    int shard = -1;
    std::string address;  // where the shard serves now
    int64_t step = 0;     // the ranks write it every push of this step and later
    uint64_t generation = 0;
    int64_t started_ms = 0;
    bool action_done = false;  // the Checkpoint and CopyFill calls are over
    bool installed = false;    // the shard holds the job at `step`
    bool given_up = false;     // what it installed is to be dropped; tried again later
    std::set<int>
        adopted;  // ranks that write it from `step` on (since the install, once installed)
    v1::FillResponse copied;
    int64_t copy_ms = 0;  // CopyFill: the files copied to the shard and installed there
  };
  Fill fill;
  uint64_t fill_generation = 0;
  int fill_attempts = 0;      // fills given up since the last one that finished
  int64_t fill_retry_ms = 0;  // no new fill before this
  std::string fill_refused;   // why the job cannot be filled, as last logged
};

// When an owed DropJob (ShardDrop is the store's) is tried next, and how often it was queued: a
// drop queued again while its call ran (a Restore recreated the job) is not settled by it.
struct DropRetry {
  int64_t next_try_ms = 0;
  int64_t backoff_ms = 0;  // 0: never failed
  uint64_t generation = 0;
};

// The state. `store` and `shards` are not owned and outlive it. Thread-safe through `mu`.
struct ClusterState {
  ClusterState(const CoordinatorOptions& options, JobStore* store, ShardControl* shards)
      : options(options), store(store), shards(shards) {}

  ClusterState(const ClusterState&) = delete;
  ClusterState& operator=(const ClusterState&) = delete;

  // Unix milliseconds: options.now_ms, or the wall clock. Takes no lock.
  int64_t NowMs() const;

  JobEntry* FindJob(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  MemberEntry* FindMember(const std::string& member_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Queues the job's record (clears `dirty`, stamps `last_write_ms`), or the member's.
  void QueueJob(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void QueueMember(const MemberEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Asks the tick loop for a tick now.
  void Wake() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { wake = true; }

  // Writes the queued rows in one transaction; returns the store's (sticky) error. Blocks on
  // SQLite, without `mu` (write_mu, held meanwhile, keeps the batches in the order queued).
  absl::Status FlushWrites() ABSL_LOCKS_EXCLUDED(mu, write_mu);

  const CoordinatorOptions options;
  JobStore* const store;
  ShardControl* const shards;

  absl::Mutex write_mu ABSL_ACQUIRED_BEFORE(mu);  // one FlushWrites at a time
  mutable absl::Mutex mu;
  std::map<int64_t, JobEntry> jobs ABSL_GUARDED_BY(mu);  // by n: oldest first
  std::map<std::string, int64_t> job_n ABSL_GUARDED_BY(mu);
  std::map<std::string, MemberEntry> members ABSL_GUARDED_BY(mu);
  int64_t next_shard_n ABSL_GUARDED_BY(mu) = 1;
  int64_t next_worker_n ABSL_GUARDED_BY(mu) = 1;
  StoreWrite pending ABSL_GUARDED_BY(mu);
  std::map<ShardDrop, DropRetry> drops ABSL_GUARDED_BY(mu);  // the owed DropJob calls
  absl::Status store_error ABSL_GUARDED_BY(mu);
  bool wake ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool started ABSL_GUARDED_BY(mu) = false;
};

bool IsTerminal(v1::JobState state);
// READY or BUSY.
bool IsLive(const v1::Member& member);
// "w-3 on host" ("?" for a missing hostname).
std::string WorkerName(const v1::JobWorker& worker);
// "2.5 s".
std::string SecondsText(absl::Duration d);

}  // namespace tessera::coordinator::internal

#endif  // TESSERA_SERVER_COORDINATOR_INTERNAL_CLUSTER_STATE_H_
