// ParameterStore: the state of one parameter shard, without any transport (DESIGN.md §2-4). A
// façade over the rooms that hold and run that state:
//
//   server/job_state.h           a job: config, gate, partitions and tables, counters, membership
//   server/partition.h           a dense partition or sparse table: storage and its apply
//   server/consistency_gate.h    the consistency policy: admission, BSP staging and completion,
//                                SSP scaling, the waits of pulls
//   server/request_validation.h  the checks a request passes before it touches state
//   server/pull_answer.h         answering pulls once their gate opens
//   server/memory_budget.h       the bytes of state held, against max_memory_bytes
//   server/checkpoint_writer.h   captures, the writer thread, retention (docs/checkpoints.md)
//   server/checkpoint_restore.h  building a job from its checkpoint file
//   server/shard_fill.h          a fill's pages, and cutting this shard's state from its sources
//   server/fill_journal.h        the pushes a shard being filled keeps until its fill is installed
//
// Request path of a push (PushPull, Push):
//   1. Resolve the job and every key, and check every slice without locks (ResolvePush):
//      worker_id, step, encoding, byte counts, row ids, non-finite values. Any error fails the
//      whole request.
//   2. Lock the touched partitions in address order (PartitionLocks; independent partitions never
//      share a lock), then per slice: a seen (worker, incarnation, seq) is a duplicate and is
//      acknowledged only; a stale incarnation is FAILED_PRECONDITION; the gate admits the step (a
//      step from the future is INVALID_ARGUMENT); then the state the push grows (BSP staging
//      buffers, new sparse rows) must fit max_memory_bytes (else RESOURCE_EXHAUSTED). Any error
//      still fails the whole request.
//   3. Apply through the gate (ConsistencyGate::ApplyPushLocked): BSP stages the worker's gradient
//      for the step and, once every live worker of the step has pushed, applies sum /
//      contributors once; SSP applies grad / num_live at once; ASP applies grad at once. Every
//      pushed partition's clock for the worker becomes max(clock, step + 1). A partition whose
//      step boundary moved is captured if a checkpoint is due (CheckpointWriter).
//   4. Unlock and release the pulls this opens.
// Before all of it, a push of a job being filled here goes to its journal (FillJournal::Keep):
// kept and acknowledged until the fill is installed and its journal has caught up (the Fill call
// that installed it applies the kept pushes, and those that come in meanwhile, until none is
// left); then the job's pushes go this way again.
// The pull half waits on the gate (see consistency_gate.h) and never blocks a thread.
//
// Lock order: the store's mu_ > JobState::mu; JobState::membership_mu > ConsistencyGate's lock;
// Partition::mu > ConsistencyGate's lock; Partition::mu > JobCheckpoints::mu > JobState::log_mu
// and the writer's lock. Nothing takes a partition's lock while holding JobCheckpoints::mu, and
// no lock is held over file I/O.
#ifndef TESSERA_SERVER_PARAMETER_STORE_H_
#define TESSERA_SERVER_PARAMETER_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/push_pull_view.h"
#include "server/checkpoint_file.h"
#include "server/fill_journal.h"
#include "server/push_pull_answer_sink.h"
#include "server/shard_fill.h"
#include "server/shared_weights.h"
#include "server/store_histogram.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

class CheckpointWriter;
class JobState;
class MemoryBudget;
class PullAnswerer;
struct PushSlice;
struct ShardCounters;

// What a push did besides applying: slices acknowledged as already applied, and slices skipped
// for NaN/Inf under NON_FINITE_POLICY_SKIP.
struct PushAck {
  uint32_t duplicates = 0;
  uint32_t skipped_non_finite = 0;
};

// Counters of one job on this shard.
struct JobStats {
  int64_t duplicates = 0;
  int64_t skipped_non_finite = 0;
  int64_t updates_applied = 0;  // optimizer applications, over all partitions and tables
  int64_t max_staleness_served = 0;
  size_t parked_pulls = 0;
};

// Counters of the whole shard since it started (jobs dropped included), for metrics. Read by
// One sparse table's rows on this shard and what its lifecycle did (kernels/sparse_rows.h).
struct TableStats {
  std::string job_id;
  std::string table;
  int64_t rows = 0;     // held now
  int64_t pending = 0;  // ids counted, not admitted yet
  int64_t admitted = 0, evicted = 0, pending_evicted = 0, dropped_gradients = 0;
};

// ParameterStore::GetShardStats().
struct ShardStats {
  int64_t jobs = 0;          // held now
  int64_t parked_pulls = 0;  // waiting on a gate now
  // Jobs being filled here (server/fill_journal.h), and the bytes of the pushes their journals
  // keep until the fill is installed and caught up.
  int64_t fill_journals = 0;
  int64_t fill_journal_bytes = 0;
  int64_t bytes_pushed = 0;     // gradient bytes of pushes applied or staged (not duplicates)
  int64_t bytes_pulled = 0;     // weight bytes answered (pulls and PushPull weights)
  int64_t updates_applied = 0;  // optimizer applications
  int64_t duplicates = 0;       // push slices acknowledged as already applied (exactly-once)
  int64_t skipped_non_finite = 0;
  // Dense partitions' weights copied before an update because an answer or a checkpoint still
  // held them (SharedWeights); 0 when every answer was sent before the next update.
  int64_t weight_copies_on_write = 0;
  // Nanoseconds a gated pull waited at its job's gate, from parking to release (0 when it was
  // open at once), by consistency mode.
  StoreHistogram::Snapshot bsp_wait_ns;
  StoreHistogram::Snapshot ssp_wait_ns;
  // SSP: per applied push slice, step - the slowest live worker's clock on that partition when
  // the push was admitted (clocks only grow, so at apply it is at most this).
  StoreHistogram::Snapshot ssp_staleness;
  // Every sparse table of every job, by job and table name.
  std::vector<TableStats> tables;
};

struct ParameterStoreOptions {
  // Runs the continuation of a parked pull once its gate opens. Empty: it runs inline on the thread
  // that opened the gate (a pushing thread).
  std::function<void(std::function<void()>)> executor;
  // Cap on the bytes the shard's state may hold (weights, optimizer slots, sparse rows, BSP
  // staging, per-worker bookkeeping) over all jobs; beyond it CreateJobState and pushes that would
  // grow the state fail with RESOURCE_EXHAUSTED. 0: three quarters of the physical memory.
  int64_t max_memory_bytes = 0;
  // Largest answer: each pulled slice, and the whole answer of a PushPull, must fit, or the
  // request fails with RESOURCE_EXHAUSTED before anything is read. 0: no limit.
  size_t max_message_bytes = 0;
  // Where checkpoint files go: <checkpoint_dir>/<job_id>/ckpt-<step>/shard-<shard_index>. Empty:
  // nothing is captured and Checkpoint and Restore answer FAILED_PRECONDITION.
  std::string checkpoint_dir;
  uint32_t shard_index = 0;
};

// Thread-safe. Never blocks on a gate: waiting pulls park and finish through their callback.
class ParameterStore {
 public:
  using PushPullDone = std::function<void(absl::StatusOr<v1::PushPullResponse>)>;
  using PullDone = std::function<void(absl::StatusOr<std::vector<v1::Slice>>)>;
  using CheckpointDone = std::function<void(absl::StatusOr<v1::CheckpointResponse>)>;

  // Starts the checkpoint writer thread when options.checkpoint_dir is set.
  explicit ParameterStore(ParameterStoreOptions options = {});
  // Fails every parked pull and every unanswered Checkpoint with CANCELLED; joins the writer
  // (a file being written is finished first).
  ~ParameterStore();

  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;

  // Creates the job or adds partitions and tables to it; additive and idempotent. INVALID_ARGUMENT
  // for a bad config or declaration (the message names the field), or a job_id that is not a safe
  // file name (see ValidateJobId); FAILED_PRECONDITION when the
  // job exists with another config, or a partition or table exists with another size or
  // declaration; RESOURCE_EXHAUSTED when the new state would exceed max_memory_bytes. All or
  // nothing.
  absl::StatusOr<v1::CreateJobStateResponse> CreateJobState(
      const v1::CreateJobStateRequest& request);

  // Changes the live workers from request.effective_step on; completes a BSP step that no longer
  // waits for anyone. Answers completed_steps (see the proto). NOT_FOUND for an unknown job,
  // INVALID_ARGUMENT for bad ids or steps.
  absl::StatusOr<v1::UpdateMembershipResponse> UpdateMembership(
      const v1::UpdateMembershipRequest& request);

  // Makes sure the job's snapshot at request.step is written (registering the capture when the
  // step is not captured anyway), then applies retention (retain_from_step). `done` runs exactly
  // once, never under a store lock: on the writer thread once the file is durable, or inline on
  // an error found at once: INVALID_ARGUMENT for a bad job_id, step (< 1, huge, or more than
  // 2^20 steps ahead of the steps the job completed on this shard) or retain_from_step (< 0 or
  // > step); FAILED_PRECONDITION without checkpoint_dir or when a partition is already past the
  // step (the message says the completed steps); NOT_FOUND for an unknown job;
  // RESOURCE_EXHAUSTED when the copy does not fit max_memory_bytes, or when 16 registered steps
  // (or 64 calls for this step) already wait; INTERNAL for I/O errors; ABORTED when the job is
  // dropped or restored first. Once `cancelled` (optional) is set, the call stops counting
  // against those bounds: it is answered CANCELLED at the next Checkpoint call of the job (or
  // when its step is written), and a registered step nobody waits for any more is forgotten.
  // Never blocks on file I/O. Thread-safe.
  void Checkpoint(const v1::CheckpointRequest& request, CheckpointDone done,
                  std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // Replaces the job's state (creating the job when absent) with the file of request.step, all or
  // nothing; parked pulls of the replaced state fail with ABORTED, and pushes of an incarnation
  // below request.min_incarnation fail with FAILED_PRECONDITION from now on. NOT_FOUND when the
  // file does not exist, DATA_LOSS when it does not verify or holds another job, step or shard
  // (the job is left as it was), FAILED_PRECONDITION without checkpoint_dir, INVALID_ARGUMENT for
  // bad fields, RESOURCE_EXHAUSTED when the restored state does not fit next to the old one.
  // Blocks on file I/O: call it off latency-sensitive threads. Thread-safe.
  absl::StatusOr<v1::RestoreResponse> Restore(const v1::RestoreRequest& request);

  // The part of Restore after the file is read: builds a fresh job from `contents` (every field
  // and range checked first: DATA_LOSS naming what is wrong) and swaps it in under the header's
  // job_id. Needs no checkpoint_dir or file (the fuzz target calls it). Automatic files of steps
  // up to max(protect_through, the header's step) are never deleted as unrequested by the new
  // job (Restore passes the newest file of the job on disk). Thread-safe.
  absl::StatusOr<v1::RestoreResponse> RestoreJobFromCheckpoint(const CheckpointContents& contents,
                                                               uint64_t min_incarnation,
                                                               int64_t protect_through = 0);

  // Filling a new copy (server/shard_fill.h): a page of this shard's checkpoint file of
  // (job_id, step). FAILED_PRECONDITION without checkpoint_dir; otherwise as ReadFilePage.
  // Blocks on file I/O.
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCheckpoint(
      const v1::ReadCheckpointRequest& request) const;
  // A page of a fill (FillRequest, parameter.proto): once every source file is whole, the state
  // this shard's index holds is cut from them (CutFill) and installed as the job, as Restore
  // does, and the pushes its journal kept are applied until it has caught up (journaled); a
  // replay that fails, or kJournalStall without one applied, drops the job (this copy would lack
  // a push that the acting copy holds) and is returned. With page.open, opens the job's journal
  // instead (FillJournal::Open). Blocks on the cut and the catch-up. Thread-safe.
  absl::StatusOr<v1::FillResponse> Fill(const v1::FillRequest& page);
  static constexpr absl::Duration kJournalStall = absl::Seconds(10);

  // Removes the job; its parked pulls and waiting Checkpoint calls fail with ABORTED. With a
  // checkpoint_dir, the writer thread then skips the job's queued writes and deletes
  // <checkpoint_dir>/<job_id> (asynchronously, after any write in progress). NOT_FOUND for an
  // unknown job.
  absl::Status DropJob(absl::string_view job_id);

  // The systemd watchdog's liveness probe: OK when the store's lock can be taken within 5 s.
  absl::Status CheckLive() const;

  // Applies the push slices of `request` (all or nothing) and advances the worker's clock on each
  // pushed partition; ignores its pull slices. Never waits. RESOURCE_EXHAUSTED when the new
  // sparse rows or BSP staging it needs would exceed max_memory_bytes.
  absl::StatusOr<PushAck> Push(const v1::PushPullRequest& request);

  // Push, then answers request.pull (gated for request.step) and the push slices with
  // want_weights (gated for request.step + 1) in one response, with duplicates and
  // skipped_non_finite filled in. `done` runs exactly once: inline when nothing waits, later
  // (see ParameterStoreOptions::executor) otherwise. Validation errors fail before anything is
  // applied; a key pulled twice is INVALID_ARGUMENT and an answer over max_message_bytes is
  // RESOURCE_EXHAUSTED, both before anything is applied. A BSP pull two steps past a partition's
  // version is UNAVAILABLE (a copy that lags the shard the worker last read: try again), one
  // further ahead INVALID_ARGUMENT. Once `cancelled` (optional) is set, a pull that still waits
  // may finish with CANCELLED instead (the push stays applied).
  void PushPull(const v1::PushPullRequest& request, PushPullDone done,
                std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // The same as PushPull above (one implementation, the same validation and errors), for a
  // request by reference: `request` and what it points to need to stay valid only until this call
  // returns (the push is applied before it returns; a parked pull keeps nothing of it). With a
  // `sink`, a dense slice answered in fp32 does not copy the weights: its `data` in the response
  // stays empty and the sink gets a reference to the partition's values instead (see
  // PushPullAnswerSink; the response alone is then incomplete), and the data of the other slices
  // is written into strings from sink->take_buffer. max_message_bytes counts the shared bytes.
  void PushPull(const PushPullView& request, PushPullDone done,
                std::shared_ptr<const std::atomic<bool>> cancelled = nullptr,
                std::shared_ptr<PushPullAnswerSink> sink = nullptr);

  // Answers request.keys once the gate opens for request.step (negative: no gating); keys must be
  // distinct, and each slice of the answer must fit max_message_bytes. `cancelled` as for
  // PushPull.
  void Pull(const v1::PullRequest& request, PullDone done,
            std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  absl::StatusOr<JobStats> GetJobStats(absl::string_view job_id) const;

  // The shard-wide counters. Takes the store's lock and each job's gate lock briefly (reader);
  // the counters themselves are relaxed atomics. Thread-safe.
  ShardStats GetShardStats() const;

  // The stall inspector: every job whose step has waited at least `min_wait` for some rank
  // (ConsistencyGate::FindStall over all its partitions), with its id; at most
  // kMaxStallsReported jobs, the longest waits first. What the shard's heartbeat carries.
  static constexpr size_t kMaxStallsReported = 1024;
  // The wait the shard's heartbeat reports a stall from (server/main.cc).
  static constexpr absl::Duration kStallReportAfter = absl::Seconds(1);
  std::vector<v1::ShardStall> FindStalls(absl::Duration min_wait) const;

  // Fails every parked pull with `status` (server shutdown). Later pulls that must wait fail too.
  // Checkpoint calls still waiting for their step fail with `status` too (a file being written
  // is still finished and answered by the writer).
  void CloseAll(const absl::Status& status);

 private:
  absl::StatusOr<std::shared_ptr<JobState>> FindJob(absl::string_view job_id) const;
  // FindJob, then the checks every pull makes: a known `encoding` (INVALID_ARGUMENT naming
  // `encoding_field`) and a worker_id below the job's num_workers.
  absl::StatusOr<std::shared_ptr<JobState>> FindJobForCaller(
      absl::string_view job_id, uint32_t worker_id, v1::Encoding encoding,
      absl::string_view encoding_field) const;

  // PushPull without the journal.
  void PushPullToStore(const PushPullView& request, PushPullDone done,
                       std::shared_ptr<const std::atomic<bool>> cancelled,
                       std::shared_ptr<PushPullAnswerSink> sink);
  // The push path (see the top of this file). `held` (optional; a fill's catch-up): the
  // partitions, by name, that already hold this push (server/shard_fill.h FillOverlap): their
  // slices count as applied (the seq is recorded) and are not applied again.
  absl::StatusOr<PushAck> PushToJob(JobState& job, const PushPullView& request,
                                    const absl::flat_hash_set<std::string>* held = nullptr);
  // Step 2, with every item's partition locked: exactly-once and the gate's admission, then the
  // budget for the state the push grows.
  absl::Status AdmitPushLocked(JobState& job, const PushPullView& request,
                               const absl::flat_hash_set<std::string>* held,
                               std::vector<PushSlice>* items);
  absl::Status ReserveGrowthLocked(JobState& job, const PushPullView& request,
                                   std::vector<PushSlice>* items);
  // Step 3: applies every item through the gate and captures what is due; true when a version
  // changed.
  bool ApplyPushLocked(JobState& job, const PushPullView& request,
                       const std::vector<PushSlice>& items, PushAck* ack, int64_t* bytes_pushed);

  const ParameterStoreOptions options_;
  // Shared with every job and partition, which give their bytes back when destroyed.
  const std::shared_ptr<MemoryBudget> budget_;
  // Shard-wide counters; shared with jobs and parked pulls, which may outlive a call.
  const std::shared_ptr<ShardCounters> counters_;
  const std::unique_ptr<CheckpointWriter> writer_;
  const std::unique_ptr<PullAnswerer> pulls_;
  FillAssembler fills_;
  FillJournal journal_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<JobState>> jobs_ ABSL_GUARDED_BY(mu_);
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_PARAMETER_STORE_H_
