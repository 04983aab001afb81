#include "server/checkpoint_writer.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/store_limits.h"

namespace tessera::server {
namespace {

// Written captures kept in JobCheckpoints::captures to answer a repeated Checkpoint of the same
// step.
constexpr size_t kKeptWrittenCaptures = 8;
// Checkpoint calls that may wait for steps not reached yet: distinct steps per job, and calls per
// step.
constexpr size_t kMaxPendingCaptures = 16;
constexpr size_t kMaxCheckpointWaiters = 64;
// How far ahead of the job's completed steps a Checkpoint call may name a step. 2^20 steps is
// days of training at any realistic rate (the coordinator asks a few seconds of steps ahead);
// anything further is a mistake or an attempt to hold a registration forever.
constexpr int64_t kMaxCheckpointStepsAhead = int64_t{1} << 20;
// Automatic checkpoint files of a job that no Checkpoint call named (so none can be committed:
// the coordinator commits only steps it asked every shard for) kept on disk; older ones are
// deleted. They pile up while the coordinator is away; 8 covers a restart of it many times over.
constexpr size_t kMaxUnrequestedCheckpointFiles = 8;

bool IsAutoStep(const v1::JobConfig& config, int64_t step) {
  return config.checkpoint_every_steps() > 0 && step > 0 &&
         step % config.checkpoint_every_steps() == 0;
}

absl::Status ShuttingDown() { return absl::CancelledError("the parameter store is shutting down"); }

}  // namespace

struct CheckpointWriter::Registration {
  std::shared_ptr<Capture> capture;  // registered: the call waits for it
  std::shared_ptr<Capture> written;  // the step is written already
  absl::Status refused;
  std::vector<CheckpointWaiter> pruned;  // cancelled calls to answer
};

CheckpointWriter::CheckpointWriter(std::string checkpoint_dir, uint32_t shard_index,
                                   std::shared_ptr<MemoryBudget> budget)
    : checkpoint_dir_(std::move(checkpoint_dir)),
      shard_index_(shard_index),
      budget_(std::move(budget)) {
  if (!checkpoint_dir_.empty()) {
    writer_ = std::thread([this] { WriterLoop(); });
  } else {
    absl::MutexLock lock(&writer_mu_);
    writer_joined_ = true;
  }
}

CheckpointWriter::~CheckpointWriter() { Stop(); }

void CheckpointWriter::Stop() {
  if (writer_.joinable()) {
    {
      absl::MutexLock lock(&writer_mu_);
      writer_stop_ = true;
    }
    writer_.join();
  }
  // Tasks queued after the writer's last look at its queue: answered (cancelled) here, with no
  // lock held.
  std::deque<std::function<void(bool)>> left;
  {
    absl::MutexLock lock(&writer_mu_);
    writer_joined_ = true;
    left.swap(writer_queue_);
  }
  for (std::function<void(bool)>& task : left) task(/*cancelled=*/true);
}

void CheckpointWriter::EnqueueWrite(std::function<void(bool cancelled)> task) {
  {
    absl::MutexLock lock(&writer_mu_);
    if (!writer_joined_) {
      // Also while stopping: the writer runs every queued task before it exits, and Stop() runs
      // (cancelled) what came in after that. A task never runs inline here, so callers may hold
      // store locks.
      writer_queue_.push_back(std::move(task));
      return;
    }
  }
  // Only without a checkpoint_dir (no writer): nothing is ever captured then, and every caller
  // that gets here holds no lock.
  task(/*cancelled=*/true);
}

void CheckpointWriter::WriterLoop() {
  // Runs every queued task, also after the stop request, so every write is answered.
  for (;;) {
    std::function<void(bool)> task;
    {
      absl::MutexLock lock(&writer_mu_);
      writer_mu_.Await(absl::Condition(
          +[](CheckpointWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->writer_mu_) {
            return w->writer_stop_ || !w->writer_queue_.empty();
          },
          this));
      if (writer_queue_.empty()) return;
      task = std::move(writer_queue_.front());
      writer_queue_.pop_front();
    }
    task(/*cancelled=*/false);
  }
}

// --- Captures ---------------------------------------------------------------------------------

int64_t CheckpointWriter::NextCaptureAfter(JobState& job, int64_t boundary) {
  if (checkpoint_dir_.empty()) return kNoCapture;
  int64_t next = kNoCapture;
  const int64_t every = job.config.checkpoint_every_steps();
  if (every > 0 && boundary < kMaxStep) next = (boundary / every + 1) * every;
  absl::MutexLock lock(&job.checkpoints.mu);
  for (auto it = job.checkpoints.captures.upper_bound(boundary);
       it != job.checkpoints.captures.end(); ++it) {
    if (it->second->state == Capture::State::kCapturing && it->second->status.ok()) {
      next = std::min(next, it->first);
      break;
    }
  }
  return next;
}

void CheckpointWriter::MaybeCaptureLocked(JobState& job, Partition& p) {
  while (p.next_capture != kNoCapture) {
    const int64_t step = p.next_capture;
    if (job.gate.StepsCompletedLocked(p, step) < step) return;
    CaptureLocked(job, p, step);
    p.next_capture = NextCaptureAfter(job, step);
  }
}

bool CheckpointWriter::ReserveCopy(JobState& job, Partition& p, int64_t step,
                                   std::shared_ptr<Capture>* capture) {
  const int slots = p.num_slots;
  int64_t bytes = static_cast<int64_t>(p.last_applied.size()) * 32;
  if (!p.sparse) {
    bytes += p.num_elements * 4 * (1 + slots);
  } else {
    const size_t width = static_cast<size_t>(p.dim) * (1 + slots);
    bytes += p.rows->size() * PartitionSnapshot::BytesPerRow(width) +
             p.rows->pending_size() * PartitionSnapshot::BytesPerPendingId();
  }
  std::vector<CheckpointWaiter> failed_waiters;
  absl::Status failed_status;
  {
    JobCheckpoints& ckpt = job.checkpoints;
    absl::MutexLock lock(&ckpt.mu);
    if (ckpt.retired) return false;
    auto it = ckpt.captures.find(step);
    if (it == ckpt.captures.end()) {
      if (!IsAutoStep(job.config, step)) return false;  // a registration that failed meanwhile
      it = ckpt.captures.emplace(step, std::make_shared<Capture>(step, budget_)).first;
    }
    *capture = it->second;
    Capture& c = **capture;
    if (c.state != Capture::State::kCapturing || !c.status.ok() || c.captured.contains(&p)) {
      return false;
    }
    if (budget_->TryReserve(bytes)) {
      c.charged += bytes;
      return true;
    }
    c.status = budget_->Exhausted(
        absl::StrCat("the checkpoint of job '", job.id, "' at step ", step, " (key ", p.name, ")"),
        bytes);
    c.ReleaseMemory();
    // Nothing more is copied. The waiters are answered from the writer thread, after every lock
    // of this thread (p.mu, checkpoints.mu) is released: EnqueueWrite never runs a task inline
    // while captures can happen.
    failed_waiters.swap(c.waiters);
    failed_status = c.status;
  }
  if (!failed_waiters.empty()) {
    EnqueueWrite([waiters = std::move(failed_waiters), failed_status](bool) {
      for (const CheckpointWaiter& w : waiters) w(failed_status);
    });
  }
  return false;
}

PartitionSnapshot CheckpointWriter::SnapshotLocked(const JobState& job, const Partition& p) {
  PartitionSnapshot snap;
  v1::PartitionCheckpoint& meta = snap.meta;
  meta.mutable_key()->set_tensor(p.tensor);
  meta.mutable_key()->set_index(p.index);
  meta.set_sparse(p.sparse);
  meta.set_version(p.version.load(std::memory_order_relaxed));
  for (size_t w = 0; w < p.clocks.size(); ++w) {
    meta.add_clocks(job.gate.BoundaryClockLocked(p, w));
  }
  const std::vector<AppliedSeq>& seqs = job.gate.BoundarySeqsLocked(p);
  for (size_t w = 0; w < seqs.size(); ++w) {
    if (!seqs[w].seen) continue;
    v1::CheckpointSeq* seq = meta.add_last_applied();
    seq->set_worker(static_cast<uint32_t>(w));
    seq->set_incarnation(seqs[w].incarnation);
    seq->set_seq(seqs[w].seq);
  }
  if (!p.sparse) {
    meta.set_num_elements(p.num_elements);
    if (p.average) meta.set_update(v1::DENSE_UPDATE_AVERAGE);
    snap.weights = p.weights;  // a reference (copy-on-write)
    snap.slots = p.slots;
    return snap;
  }
  if (!meta.mutable_table()->ParseFromString(p.table_decl)) {
    meta.mutable_table()->set_name(p.tensor);  // the declaration was serialized by us
  }
  const kernels::SparseRows& rows = *p.rows;
  snap.row_ids.reserve(rows.rows().size());
  for (const auto& [id, row] : rows.rows()) snap.row_ids.push_back(id);
  std::sort(snap.row_ids.begin(), snap.row_ids.end());
  const size_t width = static_cast<size_t>(p.dim) * (1 + p.num_slots);
  snap.row_values.resize(snap.row_ids.size() * width);
  snap.row_updates.reserve(snap.row_ids.size());
  snap.row_last_clocks.reserve(snap.row_ids.size());
  for (size_t i = 0; i < snap.row_ids.size(); ++i) {
    const kernels::SparseRows::Row& row = *rows.Find(snap.row_ids[i]);
    snap.row_updates.push_back(row.updates);
    snap.row_last_clocks.push_back(row.last_clock);
    std::copy_n(row.values.data(), width, snap.row_values.data() + i * width);
  }
  snap.pending_ids.reserve(rows.pending().size());
  for (const auto& [id, pending] : rows.pending()) snap.pending_ids.push_back(id);
  std::sort(snap.pending_ids.begin(), snap.pending_ids.end());
  for (int64_t id : snap.pending_ids) {
    const kernels::SparseRows::Pending& pending = rows.pending().find(id)->second;
    snap.pending_sightings.push_back(pending.sightings);
    snap.pending_last_clocks.push_back(pending.last_clock);
  }
  meta.set_num_pending(snap.pending_ids.size());
  *meta.mutable_row_counts() = rows.counts();
  meta.set_num_rows(snap.row_ids.size());
  return snap;
}

void CheckpointWriter::CaptureLocked(JobState& job, Partition& p, int64_t step) {
  std::shared_ptr<Capture> capture;
  if (!ReserveCopy(job, p, step, &capture)) return;
  // Copy without checkpoints.mu (only p.mu): the partition cannot change meanwhile.
  PartitionSnapshot snap = SnapshotLocked(job, p);
  {
    absl::MutexLock lock(&job.checkpoints.mu);
    if (job.checkpoints.retired || capture->state != Capture::State::kCapturing ||
        !capture->status.ok()) {
      return;
    }
    capture->captured.insert(&p);
    capture->snapshots.push_back(std::move(snap));
    if (capture->captured.size() < job.num_partitions.load(std::memory_order_acquire)) return;
    capture->state = Capture::State::kWriting;
  }
  // The writer holds the job until the file is written (every JobState is owned by a
  // shared_ptr).
  EnqueueCaptureWrite(job.shared_from_this(), std::move(capture));
}

void CheckpointWriter::EnqueueCaptureWrite(std::shared_ptr<JobState> job,
                                           std::shared_ptr<Capture> capture) {
  EnqueueWrite([this, job = std::move(job), capture = std::move(capture)](bool cancelled) {
    if (cancelled) {
      CancelCapture(*job, *capture, ShuttingDown());
      return;
    }
    WriteCapture(job, capture);
  });
}

void CheckpointWriter::ResumeCaptures(JobState& job, int64_t step) {
  {
    absl::MutexLock lock(&job.checkpoints.mu);
    job.checkpoints.retired = false;
  }
  const int64_t next = NextCaptureAfter(job, step);
  for (const std::shared_ptr<Partition>& p : job.AllPartitions()) {
    absl::MutexLock lock(&p->mu);
    p->next_capture = next;
  }
}

void CheckpointWriter::RetireCaptures(JobState& job, const absl::Status& status) {
  std::vector<CheckpointWaiter> waiters;
  {
    absl::MutexLock lock(&job.checkpoints.mu);
    job.checkpoints.retired = true;
    for (auto& [step, capture] : job.checkpoints.captures) {
      if (capture->state != Capture::State::kCapturing) continue;
      for (CheckpointWaiter& w : capture->waiters) waiters.push_back(std::move(w));
      capture->waiters.clear();
      capture->ReleaseMemory();
    }
  }
  for (const CheckpointWaiter& w : waiters) w(status);
}

void CheckpointWriter::MarkDropped(JobState& job) {
  absl::MutexLock lock(&job.checkpoints.mu);
  job.checkpoints.dropped = true;
}

void CheckpointWriter::RemoveJobFiles(absl::string_view job_id) {
  if (checkpoint_dir_.empty() || !ValidateJobId(job_id).ok()) return;
  EnqueueWrite([this, dir = absl::StrCat(checkpoint_dir_, "/", job_id)](bool) {
    std::error_code error;
    if (std::filesystem::remove_all(dir, error) > 0 && !error) {
      SyncDirectory(checkpoint_dir_).IgnoreError();
    }
  });
}

void CheckpointWriter::CancelCapture(JobState& job, Capture& capture, const absl::Status& status) {
  std::vector<CheckpointWaiter> waiters;
  {
    absl::MutexLock lock(&job.checkpoints.mu);
    capture.ReleaseMemory();
    capture.state = Capture::State::kDone;
    capture.status = status;
    waiters.swap(capture.waiters);
  }
  for (const CheckpointWaiter& w : waiters) w(status);
}

// --- Checkpoint calls -------------------------------------------------------------------------

absl::Status CheckpointWriter::CheckRequest(const v1::CheckpointRequest& request) const {
  if (checkpoint_dir_.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints need a data directory: --data_dir not set on this shard");
  }
  absl::Status valid = ValidateJobId(request.job_id());
  if (valid.ok() && (request.step() < 1 || request.step() > kMaxStep)) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("step: must be in [1, ", kMaxStep, "], got ", request.step()));
  }
  if (valid.ok() &&
      (request.retain_from_step() < 0 || request.retain_from_step() > request.step())) {
    valid = absl::InvalidArgumentError(absl::StrCat("retain_from_step: must be in [0, step ",
                                                    request.step(), "], got ",
                                                    request.retain_from_step()));
  }
  return valid;
}

int64_t CheckpointWriter::CompletedSteps(
    JobState& job, const std::vector<std::shared_ptr<Partition>>& partitions) {
  int64_t completed = 0;
  for (const std::shared_ptr<Partition>& p : partitions) {
    absl::MutexLock lock(&p->mu);
    completed = std::max(completed, job.gate.FurthestStepLocked(*p, /*live=*/nullptr));
  }
  return completed;
}

size_t CheckpointWriter::PruneCancelledWaitersLocked(JobState& job,
                                                     std::vector<CheckpointWaiter>* cancelled) {
  size_t pending = 0;
  const absl::Status gone = absl::CancelledError("the Checkpoint call was cancelled");
  std::map<int64_t, std::shared_ptr<Capture>>& captures = job.checkpoints.captures;
  for (auto it = captures.begin(); it != captures.end();) {
    Capture& c = *it->second;
    if (c.state != Capture::State::kCapturing) {
      ++it;
      continue;
    }
    auto keep = std::stable_partition(c.waiters.begin(), c.waiters.end(),
                                      [](const CheckpointWaiter& w) { return !w.is_cancelled(); });
    const bool had_cancelled = keep != c.waiters.end();
    for (auto w = keep; w != c.waiters.end(); ++w) cancelled->push_back(std::move(*w));
    c.waiters.erase(keep, c.waiters.end());
    if (c.registered && c.waiters.empty() && had_cancelled) {
      // Nobody wants this step any more: forget it (a CaptureLocked that holds it sees the status).
      c.status = gone;
      c.ReleaseMemory();
      it = captures.erase(it);
      continue;
    }
    if (c.registered || !c.waiters.empty()) ++pending;
    ++it;
  }
  return pending;
}

CheckpointWriter::Registration CheckpointWriter::Register(
    JobState& job, const v1::CheckpointRequest& request, CheckpointDone* done,
    std::shared_ptr<const std::atomic<bool>>* cancelled) {
  const int64_t step = request.step();
  Registration r;
  absl::MutexLock lock(&job.checkpoints.mu);
  auto it = job.checkpoints.captures.find(step);
  if (job.checkpoints.retired) {
    r.refused = absl::AbortedError(absl::StrCat("job '", job.id, "' was dropped or restored"));
  } else if (it != job.checkpoints.captures.end() && it->second->state == Capture::State::kDone) {
    r.written = it->second;
  } else if (it != job.checkpoints.captures.end() && !it->second->status.ok()) {
    r.refused = it->second->status;
  } else {
    // Each waiting call holds an open RPC until its step comes: bound them, so that requests
    // for far-away steps cannot pile up. Cancelled calls no longer count.
    const size_t pending = PruneCancelledWaitersLocked(job, &r.pruned);
    it = job.checkpoints.captures.find(step);
    const bool is_new = it == job.checkpoints.captures.end();
    const bool counts = is_new || (!it->second->registered && it->second->waiters.empty());
    if ((counts && pending >= kMaxPendingCaptures) ||
        (!is_new && it->second->waiters.size() >= kMaxCheckpointWaiters)) {
      r.refused = absl::ResourceExhaustedError(
          absl::StrCat("step: job '", job.id, "' already has ", pending,
                       " checkpoints waiting for their step (at most ", kMaxPendingCaptures,
                       ", each with at most ", kMaxCheckpointWaiters, " calls waiting)"));
    } else {
      if (is_new) {
        it = job.checkpoints.captures.emplace(step, std::make_shared<Capture>(step, budget_)).first;
        it->second->registered = !IsAutoStep(job.config, step);
      }
      r.capture = it->second;
      r.capture->retain_from_step =
          std::max(r.capture->retain_from_step, request.retain_from_step());
      r.capture->waiters.push_back({std::move(*done), std::move(*cancelled)});
    }
  }
  if (r.refused.ok())
    job.checkpoints.max_requested_step = std::max(job.checkpoints.max_requested_step, step);
  return r;
}

void CheckpointWriter::Checkpoint(std::shared_ptr<JobState> job,
                                  const v1::CheckpointRequest& request, CheckpointDone done,
                                  std::shared_ptr<const std::atomic<bool>> cancelled) {
  const int64_t step = request.step();
  const std::vector<std::shared_ptr<Partition>> partitions = job->AllPartitions();
  // A registration for a step the job will not reach for a very long time would hold its slot
  // (and its RPC) for that long.
  const int64_t completed_now = CompletedSteps(*job, partitions);
  if (step - completed_now > kMaxCheckpointStepsAhead) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "step: ", step, " is more than ", kMaxCheckpointStepsAhead, " steps ahead of job '",
        job->id, "', which has completed ", completed_now, " steps on this shard")));
    return;
  }
  Registration r = Register(*job, request, &done, &cancelled);
  // Every answer below runs without store locks.
  const absl::Status gone = absl::CancelledError("the Checkpoint call was cancelled");
  for (const CheckpointWaiter& w : r.pruned) w(gone);
  if (!r.refused.ok()) {
    done(r.refused);
    return;
  }
  if (r.written != nullptr) {
    // Written already: answer from the writer (retention is file I/O).
    const int64_t retain = request.retain_from_step();
    EnqueueWrite([this, job, written = r.written, retain, done = std::move(done)](bool stopping) {
      if (stopping) {
        done(ShuttingDown());
        return;
      }
      if (!written->status.ok()) {
        done(written->status);
        return;
      }
      if (retain > 0) ApplyRetention(*job, retain);
      done(written->response);
    });
    return;
  }
  CaptureAtRegistration(job, r.capture, partitions, step);
}

void CheckpointWriter::CaptureAtRegistration(
    const std::shared_ptr<JobState>& job, const std::shared_ptr<Capture>& capture,
    const std::vector<std::shared_ptr<Partition>>& partitions, int64_t step) {
  // Per partition: capture now when it sits at the boundary, remember the step when it is before
  // it, and fail the capture when it is past it.
  int64_t completed = 0;
  std::string past;
  for (const std::shared_ptr<Partition>& p : partitions) {
    absl::MutexLock lock(&p->mu);
    const int64_t reached = job->gate.StepsCompletedLocked(*p, step);
    completed = std::max(completed, reached);
    if (reached > step) {
      bool captured;
      {
        absl::MutexLock ckpt_lock(&job->checkpoints.mu);
        captured = capture->captured.contains(p.get());
      }
      if (!captured && past.empty()) past = p->name;
      continue;
    }
    if (reached == step) {
      CaptureLocked(*job, *p, step);
    } else {
      p->next_capture = std::min(p->next_capture, step);
    }
  }
  std::vector<CheckpointWaiter> failed;
  absl::Status status;
  bool write_empty = false;
  {
    JobCheckpoints& ckpt = job->checkpoints;
    absl::MutexLock lock(&ckpt.mu);
    if (!past.empty() && capture->state == Capture::State::kCapturing) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "step: job '", job->id, "' has already passed step ", step, " on this shard (key ", past,
          " has completed ", completed, " steps); checkpoint a later step"));
      capture->status = status;
      capture->ReleaseMemory();
      failed.swap(capture->waiters);
      auto it = ckpt.captures.find(step);
      if (it != ckpt.captures.end() && it->second == capture) ckpt.captures.erase(it);
    } else if (partitions.empty() && capture->state == Capture::State::kCapturing) {
      capture->state = Capture::State::kWriting;
      write_empty = true;
    }
  }
  for (const CheckpointWaiter& w : failed) w(status);
  if (write_empty) EnqueueCaptureWrite(job, capture);
}

// --- The writer thread's work -----------------------------------------------------------------

v1::CheckpointHeader CheckpointWriter::LayOut(const JobState& job, Capture& capture,
                                              std::vector<absl::string_view>* pieces) const {
  v1::CheckpointHeader header;
  header.set_format_version(1);
  header.set_job_id(job.id);
  header.set_step(capture.step);
  header.set_shard_index(shard_index_);
  header.set_time_unix_ms(absl::ToUnixMillis(absl::Now()));
  *header.mutable_config() = job.config;
  header.set_min_incarnation(job.min_incarnation.load(std::memory_order_acquire));
  for (v1::CheckpointMembership& m : job.MembershipLog()) *header.add_membership() = std::move(m);
  std::vector<PartitionSnapshot>& snaps = capture.snapshots;
  std::sort(snaps.begin(), snaps.end(), [](const PartitionSnapshot& a, const PartitionSnapshot& b) {
    return std::make_pair(a.meta.key().tensor(), a.meta.key().index()) <
           std::make_pair(b.meta.key().tensor(), b.meta.key().index());
  });
  uint64_t offset = 0;
  auto add = [&](const void* data, size_t bytes, v1::CheckpointRange* range) {
    range->set_offset(offset);
    range->set_length(bytes);
    offset += bytes;
    if (bytes > 0) pieces->emplace_back(static_cast<const char*>(data), bytes);
  };
  for (PartitionSnapshot& snap : snaps) {
    v1::PartitionCheckpoint* meta = header.add_partitions();
    *meta = snap.meta;
    if (!snap.meta.sparse()) {
      add(snap.weights.data(), snap.weights.size() * 4, meta->mutable_weights());
      for (const std::vector<float>& slot : snap.slots) {
        add(slot.data(), slot.size() * 4, meta->add_slots());
      }
    } else {
      add(snap.row_ids.data(), snap.row_ids.size() * 8, meta->mutable_row_ids());
      add(snap.row_updates.data(), snap.row_updates.size() * 8, meta->mutable_row_updates());
      add(snap.row_values.data(), snap.row_values.size() * 4, meta->mutable_row_values());
      add(snap.row_last_clocks.data(), snap.row_last_clocks.size() * 8,
          meta->mutable_row_last_clocks());
      add(snap.pending_ids.data(), snap.pending_ids.size() * 8, meta->mutable_pending_ids());
      add(snap.pending_sightings.data(), snap.pending_sightings.size() * 4,
          meta->mutable_pending_sightings());
      add(snap.pending_last_clocks.data(), snap.pending_last_clocks.size() * 8,
          meta->mutable_pending_last_clocks());
    }
  }
  return header;
}

void CheckpointWriter::WriteCapture(const std::shared_ptr<JobState>& job,
                                    const std::shared_ptr<Capture>& capture) {
  bool dropped;
  {
    absl::MutexLock lock(&job->checkpoints.mu);
    dropped = job->checkpoints.dropped;
  }
  if (dropped) {
    CancelCapture(*job, *capture,
                  absl::AbortedError(absl::StrCat("job '", job->id, "' was dropped")));
    return;
  }
  // The capture is kWriting: nothing else touches its snapshots.
  std::vector<absl::string_view> pieces;
  const v1::CheckpointHeader header = LayOut(*job, *capture, &pieces);
  const std::string path = CheckpointPath(checkpoint_dir_, job->id, capture->step, shard_index_);
  absl::StatusOr<WrittenCheckpoint> written = absl::UnknownError("unset");
  absl::Status dirs = MakeDurableDirs(path.substr(0, path.rfind('/')));
  if (dirs.ok()) {
    written = WriteCheckpointFile(path, header, pieces);
  } else {
    written = dirs;
  }
  std::vector<CheckpointWaiter> waiters;
  FinishWrite(*job, *capture, written, path, &waiters);
  // Read without the lock: the capture is kDone, and nothing changes a written capture.
  const absl::Status status = capture->status;
  if (status.ok() && capture->retain_from_step > 0) {
    ApplyRetention(*job, capture->retain_from_step);
  }
  if (status.ok()) LimitUnrequestedFiles(*job, capture->step);
  for (const CheckpointWaiter& w : waiters) {
    if (status.ok()) {
      w(capture->response);
    } else {
      w(status);
    }
  }
}

void CheckpointWriter::FinishWrite(JobState& job, Capture& capture,
                                   const absl::StatusOr<WrittenCheckpoint>& written,
                                   const std::string& path,
                                   std::vector<CheckpointWaiter>* waiters) {
  JobCheckpoints& ckpt = job.checkpoints;
  absl::MutexLock lock(&ckpt.mu);
  capture.ReleaseMemory();
  capture.state = Capture::State::kDone;
  if (written.ok()) {
    v1::CheckpointResponse response;
    response.set_path(path);
    response.set_bytes(written->bytes);
    response.set_crc32c(written->crc32c);
    response.set_step(capture.step);
    capture.response = response;
  } else {
    capture.status = absl::Status(written.status().code(),
                                  absl::StrCat("checkpoint of job '", job.id, "' at step ",
                                               capture.step, ": ", written.status().message()));
  }
  waiters->swap(capture.waiters);
  // Captures older than this one that are still incomplete can no longer complete; forget
  // them, and keep only the newest written ones.
  std::vector<CheckpointWaiter> superseded;
  absl::Status gone = absl::FailedPreconditionError(
      absl::StrCat("checkpoint of job '", job.id, "': the partitions passed this step without ",
                   "all of them being captured (step ", capture.step, " was written since)"));
  size_t done = 0;
  for (auto it = ckpt.captures.end(); it != ckpt.captures.begin();) {
    --it;
    Capture& c = *it->second;
    const bool stale = it->first < capture.step && c.state == Capture::State::kCapturing;
    if (c.state == Capture::State::kDone) ++done;
    if (stale || (c.state == Capture::State::kDone && done > kKeptWrittenCaptures)) {
      for (CheckpointWaiter& w : c.waiters) superseded.push_back(std::move(w));
      c.waiters.clear();
      it = ckpt.captures.erase(it);
    }
  }
  for (CheckpointWaiter& w : superseded) {
    waiters->push_back(
        {[w = std::move(w), gone](absl::StatusOr<v1::CheckpointResponse>) { w(gone); }, nullptr});
  }
}

void CheckpointWriter::ApplyRetention(const JobState& job, int64_t retain_from_step) {
  const std::string job_dir = absl::StrCat(checkpoint_dir_, "/", job.id);
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpointSteps(job_dir, shard_index_);
  if (!steps.ok()) return;
  bool removed = false;
  for (int64_t step : *steps) {
    if (step >= retain_from_step) break;
    const std::string path = CheckpointPath(checkpoint_dir_, job.id, step, shard_index_);
    if (::unlink(path.c_str()) == 0) removed = true;
    const std::string dir = path.substr(0, path.rfind('/'));
    ::unlink((path + ".tmp").c_str());
    ::rmdir(dir.c_str());  // only when no other shard's file is left in it
  }
  if (removed) SyncDirectory(job_dir).IgnoreError();
}

void CheckpointWriter::LimitUnrequestedFiles(JobState& job, int64_t written_step) {
  std::vector<int64_t> remove;
  {
    JobCheckpoints& ckpt = job.checkpoints;
    absl::MutexLock lock(&ckpt.mu);
    std::set<int64_t>& files = ckpt.unrequested_files;
    if (written_step > ckpt.max_requested_step) files.insert(written_step);
    files.erase(files.begin(), files.upper_bound(ckpt.max_requested_step));
    while (files.size() > kMaxUnrequestedCheckpointFiles) {
      const int64_t step = *files.begin();
      files.erase(files.begin());
      remove.push_back(step);
      // A later Checkpoint of this step must not be answered with the deleted file.
      auto it = ckpt.captures.find(step);
      if (it != ckpt.captures.end() && it->second->state == Capture::State::kDone) {
        ckpt.captures.erase(it);
      }
    }
  }
  if (remove.empty()) return;
  for (int64_t step : remove) {
    const std::string path = CheckpointPath(checkpoint_dir_, job.id, step, shard_index_);
    ::unlink(path.c_str());
    ::rmdir(path.substr(0, path.rfind('/')).c_str());  // only when no other shard's file is left
  }
  SyncDirectory(absl::StrCat(checkpoint_dir_, "/", job.id)).IgnoreError();
}

}  // namespace tessera::server
