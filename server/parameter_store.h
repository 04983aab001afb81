// ParameterStore: the state of one parameter shard, without any transport (DESIGN.md §2-4).
//
// Per job it holds dense partitions and sparse embedding tables, each with its weights, optimizer
// slots, version (number of updates applied) and, for each worker, the last applied
// (incarnation, seq). A ConsistencyGate per job decides when pulls are answered.
//
// Request path of a push (PushPull, Push):
//   1. Resolve the job and every key, and check every slice without locks: worker_id, step,
//      encoding, byte counts, row ids, non-finite values. Any error fails the whole request.
//   2. Lock the touched partitions in address order (independent partitions never share a lock),
//      then per slice: a seen (worker, incarnation, seq) is a duplicate and is acknowledged only;
//      a stale incarnation is FAILED_PRECONDITION; the step is checked against the gate (a step
//      from the future is INVALID_ARGUMENT); then the state the push grows (BSP staging buffers,
//      new sparse rows) must fit max_memory_bytes (else RESOURCE_EXHAUSTED). Any error still fails
//      the whole request.
//   3. Apply: BSP stages the worker's gradient for the step and, once every live worker of the
//      step has pushed, applies sum / contributors once (the sum runs in ascending worker order, so
//      the result does not depend on arrival order); SSP applies grad / num_live at once; ASP
//      applies grad at once. The learning rate is ScheduledLearningRate(schedule, lr, step).
//      Every pushed partition's clock for the worker becomes max(clock, step + 1).
//   4. Unlock and release the pulls this opens.
// The pull half waits on the gate (see consistency_gate.h) and never blocks a thread.
//
// Checkpoints (docs/checkpoints.md). A capture of step S is due at every k * checkpoint_every_steps
// and at every step a Checkpoint call registers. Each partition is copied under its own lock (its
// dense weights by reference, see SharedWeights) at the moment it reaches boundary S (BSP: its
// version becomes S, before any update of step S; SSP and ASP: the slowest live worker's clock on
// it reaches S), so pushes never wait for other partitions. Once every partition and table of the
// job is copied, the store's writer thread writes
// <checkpoint_dir>/<job_id>/ckpt-<S>/shard-<shard_index> (server/checkpoint_file.h): the push path
// never does file I/O. The copy counts against max_memory_bytes until it is written. Restore reads
// and verifies a whole file, builds a fresh job from it, and only then swaps it in.
//
// Lock order: Job::membership_mu > ConsistencyGate's lock; Partition::mu > ConsistencyGate's lock;
// Partition::mu > Job::ckpt_mu > Job::log_mu and the writer's lock. Nothing takes a partition's
// lock while holding ckpt_mu.
#ifndef TESSERA_SERVER_PARAMETER_STORE_H_
#define TESSERA_SERVER_PARAMETER_STORE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/optimizer.h"
#include "server/checkpoint_file.h"
#include "server/consistency_gate.h"
#include "server/push_pull_answer_sink.h"
#include "server/push_pull_view.h"
#include "server/shared_weights.h"
#include "server/store_histogram.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

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
// ParameterStore::GetShardStats().
struct ShardStats {
  int64_t jobs = 0;             // held now
  int64_t parked_pulls = 0;     // waiting on a gate now
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
  // RESOURCE_EXHAUSTED, both before anything is applied. Once `cancelled` (optional) is set, a
  // pull that still waits may finish with CANCELLED instead (the push stays applied).
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

  // Fails every parked pull with `status` (server shutdown). Later pulls that must wait fail too.
  // Checkpoint calls still waiting for their step fail with `status` too (a file being written
  // is still finished and answered by the writer).
  void CloseAll(const absl::Status& status);

 private:
  struct Job;
  struct Partition;
  struct PullItem;
  struct Counters;
  class MemoryBudget;
  struct PartitionSnapshot;
  struct Capture;
  struct CheckpointWaiter;

  absl::StatusOr<std::shared_ptr<Job>> FindJob(absl::string_view job_id) const;
  // FindJob, then the checks every pull makes: a known `encoding` (INVALID_ARGUMENT naming
  // `encoding_field`) and a worker_id below the job's num_workers.
  absl::StatusOr<std::shared_ptr<Job>> FindJobForCaller(absl::string_view job_id,
                                                        uint32_t worker_id, v1::Encoding encoding,
                                                        absl::string_view encoding_field) const;
  // The part of CreateJobState after validation: adds what `request` declares to `job`.
  absl::StatusOr<v1::CreateJobStateResponse> AddToJob(
      Job& job, const v1::CreateJobStateRequest& request,
      const std::vector<kernels::OptimizerParams>& table_params);
  // `one_message`: the whole answer must fit in one message (PushPull).
  absl::Status ResolvePulls(const Job& job, const PushPullView& request, bool one_message,
                            std::vector<PullItem>* items) const;
  absl::StatusOr<PushAck> PushToJob(Job& job, const PushPullView& request);
  // `sink` (optional): takes dense fp32 answers by reference, slice i of `done`'s answer being
  // item i (see PushPull).
  void AnswerWhenOpen(std::shared_ptr<Job> job, std::vector<PullItem> items, v1::Encoding encoding,
                      std::shared_ptr<const std::atomic<bool>> cancelled,
                      std::function<void(absl::StatusOr<std::vector<v1::Slice>>)> done,
                      std::shared_ptr<PushPullAnswerSink> sink = nullptr);

  // Checkpoints. Captures p at its next capture step when it has reached it. REQUIRES: p.mu held
  // (not annotated: clang cannot name a member of the incomplete Partition here).
  void MaybeCaptureLocked(Job& job, Partition& p);
  // Copies p into the capture of `step` (created for an automatic step); hands a complete capture
  // to the writer. REQUIRES: p.mu held.
  void CaptureLocked(Job& job, Partition& p, int64_t step);
  // The next step after `boundary` that p must be captured at (INT64_MAX: none).
  int64_t NextCaptureAfter(Job& job, int64_t boundary);
  // Writer thread: writes the capture's file, applies retention, answers its waiters.
  void WriteCapture(const std::shared_ptr<Job>& job, const std::shared_ptr<Capture>& capture);
  void ApplyRetention(const Job& job, int64_t retain_from_step);
  // Queues `task` for the writer thread; never runs it inline while the writer exists, so callers
  // may hold store locks. The task gets true when the store is being destroyed.
  void EnqueueWrite(std::function<void(bool cancelled)> task);
  // The largest number of steps any partition of the job completed (BSP: versions; SSP/ASP:
  // worker clocks). Takes each partition's lock; hold no other store lock.
  int64_t CompletedSteps(Job& job, const std::vector<std::shared_ptr<Partition>>& partitions);
  // Moves the cancelled waiters of the job's pending captures into *cancelled, forgets registered
  // captures left without waiters, and returns how many captures still count against
  // kMaxPendingCaptures (registered ones, and automatic ones someone waits for).
  // REQUIRES: job.ckpt_mu held.
  size_t PruneCancelledWaitersLocked(Job& job, std::vector<CheckpointWaiter>* cancelled);
  // Answers a capture the writer will not write (shutdown: CANCELLED; dropped job: ABORTED).
  void CancelCapture(Job& job, Capture& capture, const absl::Status& status);
  // Writer thread, after `written_step` is written: keeps at most kMaxUnrequestedCheckpointFiles
  // automatic files above the largest step any Checkpoint call named, deleting the oldest.
  void LimitUnrequestedFiles(Job& job, int64_t written_step);
  // Fails the job's unwritten captures with `status` and refuses later ones (drop, restore).
  void RetireCaptures(Job& job, const absl::Status& status);
  void WriterLoop();

  const ParameterStoreOptions options_;
  // Shared with every job and partition, which give their bytes back when destroyed.
  const std::shared_ptr<MemoryBudget> budget_;
  // Shard-wide counters; shared with jobs and parked pulls, which may outlive a call.
  const std::shared_ptr<Counters> counters_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  absl::Status closed_ ABSL_GUARDED_BY(mu_);

  // The checkpoint writer: one thread running file writes in order. Its tasks get true when the
  // store is being destroyed before they ran.
  absl::Mutex writer_mu_;
  std::deque<std::function<void(bool)>> writer_queue_ ABSL_GUARDED_BY(writer_mu_);
  bool writer_stop_ ABSL_GUARDED_BY(writer_mu_) = false;
  // Set once no writer thread will run queued tasks any more (none started, or joined).
  bool writer_joined_ ABSL_GUARDED_BY(writer_mu_) = false;
  std::thread writer_;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_PARAMETER_STORE_H_
