#include "server/parameter_store.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/checkpoint_restore.h"
#include "server/checkpoint_writer.h"
#include "server/consistency_gate.h"
#include "server/job_state.h"
#include "server/memory_budget.h"
#include "server/partition.h"
#include "server/pull_answer.h"
#include "server/request_validation.h"
#include "server/shard_counters.h"
#include "server/store_limits.h"
#include "spdlog/spdlog.h"

namespace tessera::server {
namespace {

void CountUpdate(JobState& job) {
  job.updates_applied.fetch_add(1, std::memory_order_relaxed);
  job.counters->updates_applied.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

ParameterStore::ParameterStore(ParameterStoreOptions options)
    : options_(std::move(options)),
      budget_(std::make_shared<MemoryBudget>(
          options_.max_memory_bytes > 0 ? options_.max_memory_bytes : DefaultMemoryLimit())),
      counters_(std::make_shared<ShardCounters>()),
      writer_(std::make_unique<CheckpointWriter>(options_.checkpoint_dir, options_.shard_index,
                                                 budget_)),
      pulls_(std::make_unique<PullAnswerer>(options_.executor, counters_)),
      fills_(budget_),
      journal_(budget_) {}

ParameterStore::~ParameterStore() {
  CloseAll(absl::CancelledError("the parameter store is shutting down"));
  writer_->Stop();
}

absl::StatusOr<std::shared_ptr<JobState>> ParameterStore::FindJob(absl::string_view job_id) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job_id: unknown job '", job_id, "' on this shard"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<JobState>> ParameterStore::FindJobForCaller(
    absl::string_view job_id, uint32_t worker_id, v1::Encoding encoding,
    absl::string_view encoding_field) const {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<JobState> job, FindJob(job_id));
  TESSERA_RETURN_IF_ERROR(CheckPullCaller(*job, worker_id, encoding, encoding_field));
  return job;
}

absl::StatusOr<v1::CreateJobStateResponse> ParameterStore::CreateJobState(
    const v1::CreateJobStateRequest& request) {
  const v1::JobConfig& config = request.config();
  absl::StatusOr<kernels::OptimizerParams> dense_params = absl::UnknownError("unset");
  std::vector<kernels::OptimizerParams> table_params;
  TESSERA_RETURN_IF_ERROR(ValidateJobRequest(request, &dense_params, &table_params));

  std::shared_ptr<JobState> job;
  bool created = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it == jobs_.end()) {
      const int64_t bytes = JobState::FixedBytes(config.num_workers(), request.job_id().size());
      if (!budget_->TryReserve(bytes)) {
        return budget_->Exhausted(absl::StrCat("job '", request.job_id(), "'"), bytes);
      }
      job = std::make_shared<JobState>(request.job_id(), config, dense_params, budget_, bytes,
                                       counters_);
      if (!closed_.ok()) job->gate.Close(closed_);
      jobs_.emplace(request.job_id(), job);
      created = true;
    } else {
      job = it->second;
      if (!google::protobuf::util::MessageDifferencer::Equals(job->config, config)) {
        return absl::FailedPreconditionError(
            absl::StrCat("config: job '", request.job_id(),
                         "' already exists on this shard with a different config"));
      }
    }
  }

  absl::StatusOr<v1::CreateJobStateResponse> added =
      job->AddDeclared(request, table_params, writer_->NextCaptureAfter(*job, 0));
  if (!added.ok() && created) {
    // All or nothing: forget the job this call created, unless another call added to it since.
    std::shared_ptr<JobState> forget;
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it != jobs_.end() && it->second == job && job->AllPartitions().empty()) {
      forget = std::move(it->second);
      jobs_.erase(it);
    }
  }
  return added;
}

absl::StatusOr<v1::UpdateMembershipResponse> ParameterStore::UpdateMembership(
    const v1::UpdateMembershipRequest& request) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<JobState> job, FindJob(request.job_id()));
  if (request.effective_step() > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("effective_step: must be <= ", kMaxStep, ", got ", request.effective_step()));
  }
  std::vector<uint32_t> live(request.live_workers().begin(), request.live_workers().end());
  TESSERA_RETURN_IF_ERROR(job->UpdateMembership(live, request.effective_step()));
  // A BSP step that waited only for removed workers is complete now; an SSP/ASP partition whose
  // slowest live worker was removed may have reached a capture step.
  bool applied = false;
  int64_t completed = 0;
  const std::vector<bool> live_now = job->gate.LiveSet(kMaxStep);
  for (const std::shared_ptr<Partition>& p : job->AllPartitions()) {
    absl::MutexLock lock(&p->mu);
    const ConsistencyGate::Applied step = job->gate.CompleteStepLocked(*p);
    applied |= step.version_changed;
    if (step.updated) CountUpdate(*job);
    if (step.boundary_moved) writer_->MaybeCaptureLocked(*job, *p);
    completed = std::max(completed, job->gate.FurthestStepLocked(*p, &live_now));
  }
  if (applied) job->gate.Notify();
  v1::UpdateMembershipResponse response;
  response.set_completed_steps(completed);
  return response;
}

absl::Status ParameterStore::CheckLive() const {
  return MutexResponds(&mu_, absl::Seconds(5), "the parameter store's lock");
}

absl::Status ParameterStore::DropJob(absl::string_view job_id) {
  fills_.Forget(std::string(job_id));
  journal_.Forget(job_id);
  std::shared_ptr<JobState> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) {
      job = std::move(it->second);
      jobs_.erase(it);
      writer_->MarkDropped(*job);  // its writes still queued are skipped
    }
    // Its checkpoint files go too, also for a job not in memory (this process started after the
    // job was created, and nobody restored it). Queued under mu_, so it runs after every write of
    // this job and before any write of a job created later under the same id.
    writer_->RemoveJobFiles(job_id);
  }
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrCat("job_id: unknown job '", job_id, "' on this shard"));
  }
  job->gate.Close(absl::AbortedError(absl::StrCat("job '", job_id, "' was dropped")));
  writer_->RetireCaptures(*job, absl::AbortedError(absl::StrCat("job '", job_id, "' was dropped")));
  return absl::OkStatus();
}

namespace {

absl::Status JournalFull(absl::string_view job_id) {
  return absl::NotFoundError(absl::StrCat(
      "job_id: job '", job_id,
      "' is being filled on this shard and its journal of pushes is full; send again"));
}

}  // namespace

absl::StatusOr<PushAck> ParameterStore::Push(const v1::PushPullRequest& request) {
  const PushPullView view = ViewOf(request);
  switch (journal_.Keep(view)) {
    case FillJournal::Kept::kKept:
      return PushAck{};
    case FillJournal::Kept::kFull:
      return JournalFull(request.job_id());
    case FillJournal::Kept::kNotOpen:
      break;
  }
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<JobState> job, FindJob(request.job_id()));
  return PushToJob(*job, view);
}

absl::StatusOr<PushAck> ParameterStore::PushToJob(JobState& job, const PushPullView& request,
                                                  const absl::flat_hash_set<std::string>* held) {
  // 1. Resolve and check every slice without locks.
  std::vector<PushSlice> items;
  TESSERA_RETURN_IF_ERROR(ResolvePush(job, request, &items));
  PushAck ack;
  if (items.empty()) return ack;
  int64_t bytes_pushed = 0;
  bool version_changed = false;
  {
    // 2. Lock in address order, then check sequence numbers and steps, and reserve growth.
    absl::InlinedVector<Partition*, 8> partitions;
    for (const PushSlice& item : items) partitions.push_back(item.partition.get());
    PartitionLocks locks(std::move(partitions));
    TESSERA_RETURN_IF_ERROR(AdmitPushLocked(job, request, held, &items));
    TESSERA_RETURN_IF_ERROR(ReserveGrowthLocked(job, request, &items));
    // 3. Apply.
    version_changed = ApplyPushLocked(job, request, items, &ack, &bytes_pushed);
  }
  // 4. Release the pulls that the new versions (BSP) or clocks (SSP) open.
  job.duplicates.fetch_add(ack.duplicates, std::memory_order_relaxed);
  job.skipped_non_finite.fetch_add(ack.skipped_non_finite, std::memory_order_relaxed);
  ShardCounters& counters = *counters_;
  if (bytes_pushed > 0) counters.bytes_pushed.fetch_add(bytes_pushed, std::memory_order_relaxed);
  if (ack.duplicates > 0) {
    counters.duplicates.fetch_add(ack.duplicates, std::memory_order_relaxed);
  }
  if (ack.skipped_non_finite > 0) {
    counters.skipped_non_finite.fetch_add(ack.skipped_non_finite, std::memory_order_relaxed);
  }
  job.gate.NotifyAfterPush(version_changed);
  return ack;
}

absl::Status ParameterStore::AdmitPushLocked(JobState& job, const PushPullView& request,
                                             const absl::flat_hash_set<std::string>* held,
                                             std::vector<PushSlice>* items) {
  for (PushSlice& item : *items) {
    Partition& p = *item.partition;
    p.mu.AssertHeld();
    TESSERA_ASSIGN_OR_RETURN(
        item.duplicate, p.IsAppliedLocked(request.worker_id, request.incarnation, request.seq));
    if (item.duplicate) continue;
    if (held != nullptr && held->contains(p.name)) {
      item.duplicate = true;
      item.record_seq = true;
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(const bool staged,
                             job.gate.AdmitLocked(p, request.worker_id, request.step));
    if (staged) {
      item.duplicate = true;
      item.record_seq = true;
    }
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::ReserveGrowthLocked(JobState& job, const PushPullView& request,
                                                 std::vector<PushSlice>* items) {
  // The state this push grows: BSP staging (a dense partition's buffer is kept for later steps,
  // sparse rows are given back when the step completes) is reserved here; new sparse rows (at
  // most one per row id) are checked to fit here and charged as they are created.
  int64_t staging = 0;
  int64_t rows = 0;
  const Partition* growing = nullptr;
  for (PushSlice& item : *items) {
    const Partition& p = *item.partition;
    p.mu.AssertHeld();
    if (item.duplicate || item.skip) continue;
    item.staging_bytes = job.gate.StagingBytesLocked(p, request.worker_id, *item.slice);
    const int64_t new_rows = p.NewRowsBound(*item.slice);
    staging += item.staging_bytes;
    rows += new_rows;
    if (growing == nullptr && item.staging_bytes + new_rows > 0) growing = &p;
  }
  if (staging + rows == 0) return absl::OkStatus();
  if (!budget_->TryReserve(staging + rows)) {
    return budget_->Exhausted(absl::StrCat("a push of worker ", request.worker_id, " to key ",
                                           growing->name, " (job '", job.id, "')"),
                              staging + rows);
  }
  budget_->Release(rows);
  for (PushSlice& item : *items) {
    item.partition->charged.fetch_add(item.staging_bytes, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

bool ParameterStore::ApplyPushLocked(JobState& job, const PushPullView& request,
                                     const std::vector<PushSlice>& items, PushAck* ack,
                                     int64_t* bytes_pushed) {
  bool version_changed = false;
  std::vector<float> scratch;
  for (const PushSlice& item : items) {
    item.partition->mu.AssertHeld();
    // Only bytes applied or staged: a slice skipped for NaN/Inf counts in skipped_non_finite.
    if (item.duplicate) {
      ++ack->duplicates;
    } else if (item.skip) {
      ++ack->skipped_non_finite;
    } else {
      *bytes_pushed += static_cast<int64_t>(item.data_size);
    }
    const ConsistencyGate::Applied applied = job.gate.ApplyPushLocked(
        request, job.gate.PushScale(*item.partition, request.step), item, &scratch);
    version_changed |= applied.version_changed;
    if (applied.updated) {
      CountUpdate(job);
      if (item.staleness.has_value()) {
        counters_->ssp_staleness.Observe(std::max<int64_t>(0, *item.staleness));
      }
    }
    // A partition that reached a capture step is captured now, with this push applied.
    if (applied.boundary_moved) writer_->MaybeCaptureLocked(job, *item.partition);
  }
  return version_changed;
}

void ParameterStore::PushPull(const v1::PushPullRequest& request, PushPullDone done,
                              std::shared_ptr<const std::atomic<bool>> cancelled) {
  PushPull(ViewOf(request), std::move(done), std::move(cancelled));
}

void ParameterStore::PushPull(const PushPullView& request, PushPullDone done,
                              std::shared_ptr<const std::atomic<bool>> cancelled,
                              std::shared_ptr<PushPullAnswerSink> sink) {
  switch (journal_.Keep(request)) {
    case FillJournal::Kept::kKept: {
      v1::PushPullResponse response;
      response.set_seq(request.seq);
      done(std::move(response));
      return;
    }
    case FillJournal::Kept::kFull:
      done(JournalFull(request.job_id));
      return;
    case FillJournal::Kept::kNotOpen:
      break;
  }
  PushPullToStore(request, std::move(done), std::move(cancelled), std::move(sink));
}

void ParameterStore::PushPullToStore(const PushPullView& request, PushPullDone done,
                                     std::shared_ptr<const std::atomic<bool>> cancelled,
                                     std::shared_ptr<PushPullAnswerSink> sink) {
  absl::StatusOr<std::shared_ptr<JobState>> job =
      FindJobForCaller(request.job_id, request.worker_id, request.pull_encoding, "pull_encoding");
  if (!job.ok()) {
    done(job.status());
    return;
  }
  if (request.step < 0 || request.step > kMaxStep) {
    done(absl::InvalidArgumentError(
        absl::StrCat("step: must be in [0, ", kMaxStep, "], got ", request.step)));
    return;
  }
  std::vector<PullItem> items;
  absl::Status resolved =
      ResolvePulls(**job, request, /*one_message=*/true, options_.max_message_bytes, &items);
  if (!resolved.ok()) {
    done(resolved);
    return;
  }
  absl::StatusOr<PushAck> ack = PushToJob(**job, request);
  if (!ack.ok()) {
    done(ack.status());
    return;
  }
  v1::PushPullResponse response;
  response.set_seq(request.seq);
  response.set_duplicates(ack->duplicates);
  response.set_skipped_non_finite(ack->skipped_non_finite);
  if (items.empty()) {
    done(std::move(response));
    return;
  }
  // The gate wait reaches the answer through this: `waited` runs just before `done`.
  auto gate_wait_ns = std::make_shared<int64_t>(0);
  pulls_->AnswerWhenOpen((*job)->gate, std::move(items), request.pull_encoding,
                         std::move(cancelled),
                         [response = std::move(response), done = std::move(done),
                          gate_wait_ns](absl::StatusOr<std::vector<v1::Slice>> slices) mutable {
                           if (!slices.ok()) {
                             done(slices.status());
                             return;
                           }
                           for (v1::Slice& s : *slices) response.add_weights()->Swap(&s);
                           response.set_gate_wait_us(static_cast<uint64_t>(*gate_wait_ns / 1000));
                           done(std::move(response));
                         },
                         std::move(sink), [gate_wait_ns](int64_t ns) { *gate_wait_ns = ns; });
}

void ParameterStore::Pull(const v1::PullRequest& request, PullDone done,
                          std::shared_ptr<const std::atomic<bool>> cancelled) {
  absl::StatusOr<std::shared_ptr<JobState>> job =
      FindJobForCaller(request.job_id(), request.worker_id(), request.encoding(), "encoding");
  if (!job.ok()) {
    done(job.status());
    return;
  }
  if (request.step() > kMaxStep) {
    done(absl::InvalidArgumentError(
        absl::StrCat("step: must be <= ", kMaxStep, ", got ", request.step())));
    return;
  }
  // Reuse the PushPull resolution: the keys are pulls for request.step.
  PushPullView as_push_pull;
  as_push_pull.step = request.step() < 0 ? -1 : request.step();
  as_push_pull.pull_encoding = request.encoding();
  as_push_pull.pull.reserve(request.keys_size());
  for (const v1::Slice& k : request.keys()) {
    SliceView s;
    s.tensor = k.key().tensor();
    s.index = k.key().index();
    s.row_ids = absl::MakeConstSpan(k.row_ids().data(), k.row_ids().size());
    s.all_rows = k.all_rows();
    as_push_pull.pull.push_back(s);
  }
  std::vector<PullItem> items;
  absl::Status resolved =
      ResolvePulls(**job, as_push_pull, /*one_message=*/false, options_.max_message_bytes, &items);
  if (!resolved.ok()) {
    done(resolved);
    return;
  }
  pulls_->AnswerWhenOpen((*job)->gate, std::move(items), request.encoding(), std::move(cancelled),
                         std::move(done));
}

void ParameterStore::Checkpoint(const v1::CheckpointRequest& request, CheckpointDone done,
                                std::shared_ptr<const std::atomic<bool>> cancelled) {
  absl::Status valid = writer_->CheckRequest(request);
  if (!valid.ok()) {
    done(valid);
    return;
  }
  absl::StatusOr<std::shared_ptr<JobState>> job = FindJob(request.job_id());
  if (!job.ok()) {
    done(job.status());
    return;
  }
  writer_->Checkpoint(*std::move(job), request, std::move(done), std::move(cancelled));
}

absl::StatusOr<v1::RestoreResponse> ParameterStore::Restore(const v1::RestoreRequest& request) {
  // A fill in progress belongs to the state being replaced.
  journal_.Forget(request.job_id());
  TESSERA_ASSIGN_OR_RETURN(
      CheckpointToRestore file,
      ReadCheckpointToRestore(options_.checkpoint_dir, options_.shard_index, request));
  absl::StatusOr<v1::RestoreResponse> restored =
      RestoreJobFromCheckpoint(file.contents, request.min_incarnation(), file.protect_through);
  if (!restored.ok() && restored.status().code() == absl::StatusCode::kDataLoss) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", file.path, ": ", restored.status().message()));
  }
  return restored;
}

absl::StatusOr<v1::RestoreResponse> ParameterStore::RestoreJobFromCheckpoint(
    const CheckpointContents& contents, uint64_t min_incarnation, int64_t protect_through) {
  TESSERA_ASSIGN_OR_RETURN(
      std::shared_ptr<JobState> job,
      BuildJobFromCheckpoint(contents, min_incarnation, protect_through, budget_, counters_));
  const v1::CheckpointHeader& h = contents.header;
  // Captures continue after the restored step.
  writer_->ResumeCaptures(*job, h.step());
  std::shared_ptr<JobState> old;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.ok()) job->gate.Close(closed_);
    std::shared_ptr<JobState>& slot = jobs_[h.job_id()];
    old = std::move(slot);
    slot = job;
  }
  if (old != nullptr) {
    const absl::Status replaced = absl::AbortedError(
        absl::StrCat("job '", h.job_id(), "' was restored from its checkpoint of step ", h.step()));
    old->gate.Close(replaced);
    writer_->RetireCaptures(*old, replaced);
  }
  v1::RestoreResponse response;
  response.set_step(h.step());
  response.set_partitions(job->NumDense());
  response.set_tables(job->NumTables());
  return response;
}

absl::StatusOr<v1::ReadCheckpointResponse> ParameterStore::ReadCheckpoint(
    const v1::ReadCheckpointRequest& request) const {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("this shard keeps no checkpoints (no --data_dir)");
  }
  TESSERA_RETURN_IF_ERROR(ValidateJobId(request.job_id()));
  if (request.step() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("step: must be >= 1, got ", request.step()));
  }
  return ReadFilePage(CheckpointPath(options_.checkpoint_dir, request.job_id(), request.step(),
                                     options_.shard_index),
                      request.offset(), request.max_bytes());
}

absl::StatusOr<v1::FillResponse> ParameterStore::Fill(const v1::FillRequest& page) {
  if (page.open()) {
    TESSERA_RETURN_IF_ERROR(ValidateJobId(page.job_id()));
    if (page.step() < 1) {
      return absl::InvalidArgumentError(absl::StrCat("step: must be >= 1, got ", page.step()));
    }
    fills_.Forget(page.job_id());
    TESSERA_RETURN_IF_ERROR(journal_.Open(page.job_id(), page.step()));
    spdlog::info("shard {}: job {}: keeping its pushes of step {} on until its fill is installed",
                 options_.shard_index, page.job_id(), page.step());
    return v1::FillResponse{};
  }
  std::vector<std::string> files;
  TESSERA_ASSIGN_OR_RETURN(const bool whole, fills_.Add(page, &files));
  v1::FillResponse response;
  if (!whole) return response;
  const absl::Time start = absl::Now();
  std::vector<CheckpointContents> sources;
  uint64_t bytes = 0;
  for (size_t s = 0; s < files.size(); ++s) {
    bytes += files[s].size();
    absl::StatusOr<CheckpointContents> parsed = ParseCheckpointBuffer(std::move(files[s]));
    if (!parsed.ok()) {
      return absl::Status(parsed.status().code(),
                          absl::StrCat("fill source ", s, ": ", parsed.status().message()));
    }
    sources.push_back(*std::move(parsed));
  }
  files.clear();
  const absl::Time parsed = absl::Now();
  TESSERA_ASSIGN_OR_RETURN(CheckpointContents cut, CutFill(sources, options_.shard_index,
                                                           static_cast<int>(page.num_shards()),
                                                           static_cast<int>(page.replicas())));
  const FillOverlap overlap(sources, static_cast<int>(page.num_shards()),
                            static_cast<int>(page.replicas()));
  sources.clear();
  const absl::Time cut_at = absl::Now();
  TESSERA_ASSIGN_OR_RETURN(v1::RestoreResponse restored,
                           RestoreJobFromCheckpoint(cut, cut.header.min_incarnation()));
  const absl::Time installed_at = absl::Now();
  // The pushes kept while the files were copied, in step order, and those that come in while
  // they apply, until none is left (what cannot apply yet waits for the pushes still to come).
  int64_t journaled = 0, slices_held = 0, rows_held = 0;
  absl::StatusOr<bool> opened = journal_.Install(page.job_id(), page.step());
  if (!opened.ok()) {
    (void)DropJob(page.job_id());
    return opened.status();
  }
  if (*opened) {
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<JobState> job, FindJob(page.job_id()));
    const absl::Status drained = journal_.Drain(
        page.job_id(),
        [&](const v1::PushPullRequest& request) {
          // SSP/ASP: a source may hold a faster worker's kept push already.
          absl::flat_hash_set<std::string> held;
          int64_t slices = 0, rows = 0;
          const std::optional<v1::PushPullRequest> unheld =
              overlap.Unheld(request, &held, &slices, &rows);
          const absl::Status applied =
              PushToJob(*job, ViewOf(unheld.has_value() ? *unheld : request), &held).status();
          if (applied.ok()) {  // a push that waits for the next pass counts then
            slices_held += slices;
            rows_held += rows;
          }
          return applied;
        },
        kJournalStall, &journaled);
    if (!drained.ok()) {
      spdlog::error("shard {}: job {}: {}; dropping the job here (the fill has to start over)",
                    options_.shard_index, page.job_id(), drained.ToString());
      (void)DropJob(page.job_id());  // the journal went with the error
      return drained;
    }
  }
  response.set_installed(true);
  response.set_journaled(static_cast<uint64_t>(journaled));
  response.set_held_slices(static_cast<uint64_t>(slices_held));
  response.set_held_rows(static_cast<uint64_t>(rows_held));
  response.set_partitions(restored.partitions());
  response.set_tables(restored.tables());
  uint64_t rows = 0;
  for (const v1::PartitionCheckpoint& pc : cut.header.partitions()) rows += pc.num_rows();
  response.set_rows(rows);
  response.set_bytes(bytes);
  spdlog::info(
      "shard {}: job {} filled at step {}: {} partitions, {} tables, {} rows from {} bytes of {} "
      "snapshots (verified in {} ms, cut in {} ms, installed in {} ms), then caught up with the "
      "{} pushes it kept meanwhile in {} ms ({} partition slices and {} rows of them were in the "
      "snapshots already)",
      options_.shard_index, page.job_id(), page.step(), restored.partitions(), restored.tables(),
      rows, bytes, page.num_sources(), absl::ToInt64Milliseconds(parsed - start),
      absl::ToInt64Milliseconds(cut_at - parsed), absl::ToInt64Milliseconds(installed_at - cut_at),
      journaled, absl::ToInt64Milliseconds(absl::Now() - installed_at), slices_held, rows_held);
  return response;
}

absl::StatusOr<JobStats> ParameterStore::GetJobStats(absl::string_view job_id) const {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<JobState> job, FindJob(job_id));
  JobStats stats;
  stats.duplicates = job->duplicates.load();
  stats.skipped_non_finite = job->skipped_non_finite.load();
  stats.updates_applied = job->updates_applied.load();
  stats.max_staleness_served = job->gate.MaxStalenessServed();
  stats.parked_pulls = job->gate.NumParked();
  return stats;
}

ShardStats ParameterStore::GetShardStats() const {
  std::vector<std::shared_ptr<JobState>> jobs;
  {
    absl::ReaderMutexLock lock(&mu_);
    jobs.reserve(jobs_.size());
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  ShardStats stats;
  stats.jobs = static_cast<int64_t>(jobs.size());
  for (const std::shared_ptr<JobState>& job : jobs) {
    stats.parked_pulls += static_cast<int64_t>(job->gate.NumParked());
    for (const std::shared_ptr<Partition>& p : job->AllPartitions()) {
      if (!p->sparse) continue;
      absl::ReaderMutexLock lock(&p->mu);
      const v1::RowCounts& counts = p->rows->counts();
      stats.tables.push_back({job->id, p->tensor, p->rows->size(), p->rows->pending_size(),
                              counts.admitted(), counts.evicted(), counts.pending_evicted(),
                              counts.dropped_gradients()});
    }
  }
  std::sort(stats.tables.begin(), stats.tables.end(), [](const TableStats& a, const TableStats& b) {
    return std::tie(a.job_id, a.table) < std::tie(b.job_id, b.table);
  });
  stats.fill_journals = journal_.open_journals();
  stats.fill_journal_bytes = journal_.kept_bytes();
  const ShardCounters& c = *counters_;
  stats.bytes_pushed = c.bytes_pushed.load(std::memory_order_relaxed);
  stats.bytes_pulled = c.bytes_pulled.load(std::memory_order_relaxed);
  stats.updates_applied = c.updates_applied.load(std::memory_order_relaxed);
  stats.duplicates = c.duplicates.load(std::memory_order_relaxed);
  stats.skipped_non_finite = c.skipped_non_finite.load(std::memory_order_relaxed);
  stats.weight_copies_on_write = c.weight_copies_on_write.load(std::memory_order_relaxed);
  stats.bsp_wait_ns = c.bsp_wait_ns.snapshot();
  stats.ssp_wait_ns = c.ssp_wait_ns.snapshot();
  stats.ssp_staleness = c.ssp_staleness.snapshot();
  return stats;
}

std::vector<v1::ShardStall> ParameterStore::FindStalls(absl::Duration min_wait) const {
  std::vector<std::shared_ptr<JobState>> jobs;
  {
    absl::ReaderMutexLock lock(&mu_);
    jobs.reserve(jobs_.size());
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  const int64_t now_ns = SteadyNowNs();
  const int64_t min_wait_ns = absl::ToInt64Nanoseconds(min_wait);
  std::vector<v1::ShardStall> stalls;
  for (const std::shared_ptr<JobState>& job : jobs) {
    std::optional<v1::ShardStall> stall =
        job->gate.FindStall(job->AllPartitions(), now_ns, min_wait_ns);
    if (!stall.has_value()) continue;
    stall->set_job_id(job->id);
    stalls.push_back(*std::move(stall));
  }
  std::sort(stalls.begin(), stalls.end(), [](const v1::ShardStall& a, const v1::ShardStall& b) {
    return a.waiting_ms() > b.waiting_ms();
  });
  if (stalls.size() > kMaxStallsReported) stalls.resize(kMaxStallsReported);
  return stalls;
}

void ParameterStore::CloseAll(const absl::Status& status) {
  std::vector<std::shared_ptr<JobState>> jobs;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.ok()) closed_ = status;
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (const std::shared_ptr<JobState>& job : jobs) {
    job->gate.Close(status);
    // A Checkpoint call waiting for a step that will never come is answered now; files being
    // written are still answered by the writer.
    writer_->RetireCaptures(*job, status);
  }
}

}  // namespace tessera::server
