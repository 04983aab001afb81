// CheckpointWriter: the checkpoints of every job on this shard (DESIGN.md §7, docs/checkpoints.md):
// capture bookkeeping, the writer thread, retention.
//
// A capture of step S is due at every k * checkpoint_every_steps and at every step a Checkpoint
// call registers. Each partition is copied under its own lock (its dense weights by reference,
// see SharedWeights) at the moment it reaches boundary S (the consistency gate says when:
// ConsistencyGate::StepsCompletedLocked), so pushes never wait for other partitions. Once every
// partition and table of the job is copied, the writer thread writes
// <checkpoint_dir>/<job_id>/ckpt-<S>/shard-<shard_index> (server/checkpoint_file.h): the push path
// never does file I/O. The copy counts against max_memory_bytes until it is written. Every
// Checkpoint answer runs with no store lock held (from the writer thread, or inline for errors
// found at once).
//
// Life cycle: kRunning from construction (when checkpoint_dir is set: the thread runs), kStopped
// after Stop() (the thread joined; tasks queued after that are answered as cancelled).
// Lock order: Partition::mu > JobCheckpoints::mu > the writer's queue lock; the store's lock may
// be held over EnqueueWrite (RemoveJobFiles), never over file I/O.
#ifndef TESSERA_SERVER_CHECKPOINT_WRITER_H_
#define TESSERA_SERVER_CHECKPOINT_WRITER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoint_capture.h"
#include "server/checkpoint_file.h"
#include "server/job_state.h"
#include "server/memory_budget.h"
#include "server/partition.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// Owned by the store. Thread-safe.
class CheckpointWriter {
 public:
  // Starts the writer thread when `checkpoint_dir` is not empty; without one nothing is ever
  // captured. `budget` is charged for the copies until they are written.
  CheckpointWriter(std::string checkpoint_dir, uint32_t shard_index,
                   std::shared_ptr<MemoryBudget> budget);
  // Stop().
  ~CheckpointWriter();

  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  const std::string& checkpoint_dir() const { return checkpoint_dir_; }
  uint32_t shard_index() const { return shard_index_; }

  // The checks of a Checkpoint call before its job is looked up: FAILED_PRECONDITION without a
  // checkpoint_dir; INVALID_ARGUMENT for a bad job_id, step (< 1 or huge) or retain_from_step
  // (< 0 or > step).
  absl::Status CheckRequest(const v1::CheckpointRequest& request) const;
  // ParameterStore::Checkpoint for `job` once CheckRequest passed (the same contract): makes sure
  // the job's snapshot at request.step is written, then applies retention. `done` runs exactly
  // once, never under a lock. Never blocks on file I/O.
  void Checkpoint(std::shared_ptr<JobState> job, const v1::CheckpointRequest& request,
                  CheckpointDone done, std::shared_ptr<const std::atomic<bool>> cancelled);

  // The next step after `boundary` that a partition of `job` must be captured at (kNoCapture:
  // none, always without a checkpoint_dir). Takes job.checkpoints.mu.
  int64_t NextCaptureAfter(JobState& job, int64_t boundary);
  // Captures p at its next capture step when it has reached it; hands a complete capture to the
  // writer thread. Call after p's step boundary may have moved.
  void MaybeCaptureLocked(JobState& job, Partition& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);

  // For a job built from the file of `step` (retired until now, nobody else holds it yet): lets
  // its captures start, from the first one due after `step`.
  void ResumeCaptures(JobState& job, int64_t step);
  // Fails the job's unwritten captures with `status` and refuses later ones (drop, restore,
  // shutdown; a file being written is still finished and answered).
  void RetireCaptures(JobState& job, const absl::Status& status);
  // DropJob: the job's captures still queued for the writer are not written (ABORTED).
  void MarkDropped(JobState& job);
  // Queues the deletion of <checkpoint_dir>/<job_id> after every write queued so far, also for a
  // job not in memory. Nothing without a checkpoint_dir or for a job_id that is no safe file name.
  // Never blocks on I/O (the caller may hold the store's lock, so that the deletion is ordered
  // before any write of a job created later under the same id).
  void RemoveJobFiles(absl::string_view job_id);

  // Joins the writer thread, which first runs every task queued (a file being written is
  // finished), then answers what was queued after that as cancelled. Idempotent.
  void Stop();

 private:
  // What a Checkpoint call found under the job's lock (see Register).
  struct Registration;

  // Copies p into the capture of `step` (created for an automatic step); hands a complete capture
  // to the writer.
  void CaptureLocked(JobState& job, Partition& p, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Reserves the copy of p for `capture` (false when it is not to be copied, or does not fit:
  // the capture then fails and its waiters are answered from the writer thread).
  bool ReserveCopy(JobState& job, Partition& p, int64_t step, std::shared_ptr<Capture>* capture)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // p's state at its step boundary.
  PartitionSnapshot SnapshotLocked(const JobState& job, const Partition& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Queues the write of a complete capture (or its cancellation at shutdown).
  void EnqueueCaptureWrite(std::shared_ptr<JobState> job, std::shared_ptr<Capture> capture);

  // Checkpoint's steps: registers the call's waiter for its step, or finds the step written or
  // refused; then captures the partitions at the step and fails the capture when one is past it.
  Registration Register(JobState& job, const v1::CheckpointRequest& request, CheckpointDone* done,
                        std::shared_ptr<const std::atomic<bool>>* cancelled);
  void CaptureAtRegistration(const std::shared_ptr<JobState>& job,
                             const std::shared_ptr<Capture>& capture,
                             const std::vector<std::shared_ptr<Partition>>& partitions,
                             int64_t step);
  // The largest number of steps any partition of the job completed (BSP: versions; SSP/ASP:
  // worker clocks). Takes each partition's lock; hold no other lock.
  int64_t CompletedSteps(JobState& job, const std::vector<std::shared_ptr<Partition>>& partitions);
  // Moves the cancelled waiters of the job's pending captures into *cancelled, forgets registered
  // captures left without waiters, and returns how many captures still count against
  // kMaxPendingCaptures (registered ones, and automatic ones someone waits for).
  size_t PruneCancelledWaitersLocked(JobState& job, std::vector<CheckpointWaiter>* cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.checkpoints.mu);

  // Writer thread: writes the capture's file, applies retention, answers its waiters.
  void WriteCapture(const std::shared_ptr<JobState>& job, const std::shared_ptr<Capture>& capture);
  // The header and the data pieces of the capture's file. REQUIRES: the capture is kWriting.
  v1::CheckpointHeader LayOut(const JobState& job, Capture& capture,
                              std::vector<absl::string_view>* pieces) const;
  // Marks the capture written (or failed), forgets older captures that can no longer complete
  // and the written ones beyond the newest few, and moves every waiter to answer to *waiters.
  void FinishWrite(JobState& job, Capture& capture,
                   const absl::StatusOr<WrittenCheckpoint>& written, const std::string& path,
                   std::vector<CheckpointWaiter>* waiters);
  void ApplyRetention(const JobState& job, int64_t retain_from_step);
  // Writer thread, after `written_step` is written: keeps at most kMaxUnrequestedCheckpointFiles
  // automatic files above the largest step any Checkpoint call named, deleting the oldest.
  void LimitUnrequestedFiles(JobState& job, int64_t written_step);
  // Answers a capture the writer will not write (shutdown: CANCELLED; dropped job: ABORTED).
  void CancelCapture(JobState& job, Capture& capture, const absl::Status& status);

  // Queues `task` for the writer thread; never runs it inline while the writer exists, so callers
  // may hold store locks. The task gets true when the writer is stopped before it ran.
  void EnqueueWrite(std::function<void(bool cancelled)> task);
  void WriterLoop();

  const std::string checkpoint_dir_;
  const uint32_t shard_index_;
  const std::shared_ptr<MemoryBudget> budget_;

  // One thread running file writes in order.
  absl::Mutex writer_mu_;
  std::deque<std::function<void(bool)>> writer_queue_ ABSL_GUARDED_BY(writer_mu_);
  bool writer_stop_ ABSL_GUARDED_BY(writer_mu_) = false;
  // Set once no writer thread will run queued tasks any more (none started, or joined).
  bool writer_joined_ ABSL_GUARDED_BY(writer_mu_) = false;
  std::thread writer_;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_CHECKPOINT_WRITER_H_
