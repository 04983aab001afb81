#include "server/coordinator/internal/progress_reports.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/job_lifecycle.h"
#include "server/coordinator/internal/recovery.h"
#include "server/coordinator/internal/shard_failover.h"
#include "server/coordinator/internal/shard_refill.h"
#include "server/coordinator/internal/task_assignments.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::coordinator::internal {
namespace {

// The evaluation's binary AUC, when the report has one (a task without it clears the job's).
void SetAuc(const v1::ProgressReport& report, v1::Job* job) {
  if (report.has_test_auc()) {
    job->set_test_auc(report.test_auc());
  } else {
    job->clear_test_auc();
  }
}

// "test accuracy 0.8312, test loss 0.4421" (", test AUC 0.7902" for binary tasks).
std::string EvaluationText(const v1::Job& job) {
  std::string text =
      absl::StrFormat("test accuracy %.4f, test loss %.4f", job.test_accuracy(), job.test_loss());
  if (job.has_test_auc()) absl::StrAppendFormat(&text, ", test AUC %.4f", job.test_auc());
  return text;
}

constexpr int64_t kProgressEventIntervalMs = 1000;
constexpr int64_t kRecordWriteIntervalMs = 500;

absl::Status ValidateReport(const v1::ProgressReport& report) {
  if (report.job_id().empty()) return absl::InvalidArgumentError("job_id: must be set");
  if (report.member_id().empty()) return absl::InvalidArgumentError("member_id: must be set");
  if (report.phase() < v1::TASK_PHASE_TRAINING || report.phase() > v1::TASK_PHASE_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat("phase: unknown task phase ", static_cast<int>(report.phase())));
  }
  if (report.rank() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("rank: must be >= 0, got ", report.rank()));
  }
  if (report.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step: must be >= 0, got ", report.step()));
  }
  if (report.total_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("total_steps: must be >= 0, got ", report.total_steps()));
  }
  if (!std::isfinite(report.samples_per_second()) || report.samples_per_second() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "samples_per_second: must be finite and >= 0, got ", report.samples_per_second()));
  }
  if (report.phase() == v1::TASK_PHASE_SUCCEEDED && report.rank() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "phase: TASK_PHASE_SUCCEEDED comes from rank 0 only, got rank ", report.rank()));
  }
  return absl::OkStatus();
}

// Whether the report speaks for rank `rank`'s current assignment. After a coordinator restart it
// binds the rank to the reporting member: the rank's own worker, or a live idle worker (the
// same daemon registered again under a new id).
bool AcceptReport(ClusterState& state, JobEntry& entry, int rank, const v1::ProgressReport& report,
                  MemberEntry* member) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  v1::JobWorker& worker = *job.mutable_workers(rank);
  if (worker.lost() || (report.incarnation() != 0 && worker.incarnation() != 0 &&
                        report.incarnation() != worker.incarnation())) {
    // A report of an earlier assignment of the rank (before a rewind or a hand-over), or of
    // a rank that was given up: ignored.
    return false;
  }
  if (worker.member_id() != report.member_id()) {
    // After a coordinator restart an idle live worker may report a rank: it is rebound to it.
    // So it is when the rank's member is the same daemon (host and pid) registered again under
    // a new id: a worker that finds itself LOST after a restart re-registers while its task runs
    // on, and its last reports may come after the restart's grace has ended (every rank seen).
    // Anyone else (a shard, an unknown or departed member, a worker with another task)
    // would wedge the member or the rank.
    MemberEntry* previous = state.FindMember(worker.member_id());
    const bool same_daemon = previous != nullptr && member != nullptr &&
                             !IsLive(previous->member) && member->member.pid() != 0 &&
                             member->member.pid() == previous->member.pid() &&
                             member->member.hostname() == previous->member.hostname();
    if ((entry.restart_deadline_ms > 0 || same_daemon) && member != nullptr &&
        member->member.role() == v1::MEMBER_ROLE_WORKER && IsLive(member->member) &&
        member->member.job_id().empty()) {
      if (previous != nullptr) ReleaseWorker(state, *previous, job.id());
      worker.set_member_id(report.member_id());
      worker.set_hostname(member->member.hostname());
      ReserveWorker(state, *member, job.id(), rank);
      spdlog::info("coordinator: job {} rank {} rebound to {}", job.id(), rank, report.member_id());
      return true;
    }
    return false;
  }
  if (entry.restart_deadline_ms > 0 && member != nullptr && IsLive(member->member) &&
      member->member.job_id() != job.id()) {
    ReserveWorker(state, *member, job.id(), rank);
  }
  return true;
}

// The report's numbers in the rank's and the job's record; the job's epoch before them. A step
// that moved renews the rank's progress lease (stall_inspector.h).
int RecordProgress(JobEntry& entry, int rank, const v1::ProgressReport& report, int64_t now_ms) {
  v1::Job& job = entry.job;
  v1::JobWorker& worker = *job.mutable_workers(rank);
  if (rank < static_cast<int>(entry.rank_seen.size())) entry.rank_seen[rank] = true;
  if (report.step() != worker.step() || worker.progress_ms() == 0) {
    worker.set_progress_ms(now_ms);
    entry.stall_warned.erase(rank);
  }
  worker.set_step(report.step());
  worker.set_samples_per_second(report.samples_per_second());
  if (report.total_steps() > 0) job.set_total_steps(report.total_steps());
  if (report.steps_per_epoch() > 0) job.set_steps_per_epoch(report.steps_per_epoch());
  const int old_epoch = job.epoch();
  if (rank == 0) {
    job.set_loss(report.loss());
    job.set_train_accuracy(report.train_accuracy());
    job.set_epoch(report.epoch());
    job.set_epochs(report.epochs());
    // ProgressReport carries no ETA: rank 0's remaining steps at its current rate.
    double eta = 0;
    if (report.phase() == v1::TASK_PHASE_TRAINING && report.samples_per_second() > 0 &&
        report.total_steps() > report.step()) {
      eta = static_cast<double>(report.total_steps() - report.step()) * job.spec().batch_size() /
            report.samples_per_second();
    }
    job.set_eta_seconds(eta);
    *job.mutable_step_times() = report.step_times();
  }
  if (report.evaluated()) {
    job.set_evaluated(true);
    job.set_test_loss(report.test_loss());
    job.set_test_accuracy(report.test_accuracy());
    SetAuc(report, &job);
  }
  int64_t min_step = worker.step();
  double samples_per_second = 0;
  for (const v1::JobWorker& w : job.workers()) {
    if (w.lost()) continue;
    min_step = std::min(min_step, w.step());
    samples_per_second += w.samples_per_second();
  }
  job.set_step(min_step);
  job.set_samples_per_second(samples_per_second);
  return old_epoch;
}

// TASK_PHASE_FAILED: the job fails, unless it recovers (or starts to, for a shard error).
void ReportFailure(ClusterState& state, JobEntry& entry, int rank, const v1::ProgressReport& report,
                   MemberEntry* member) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  const std::string cause =
      absl::StrCat("worker rank ", rank, " (", WorkerName(job.workers(rank)),
                   "): ", report.error().empty() ? "unknown error" : report.error());
  if (!job.recovery().empty()) {
    // The recovery assigns the rank again; its worker stays BUSY with the job.
    spdlog::info("coordinator: job {} is recovering; ignoring the failure of {}", job.id(), cause);
    entry.stopped_members.insert(report.member_id());
    entry.dirty = true;
  } else if (report.shard_error() && !entry.checkpoints.empty()) {
    StartRecovery(state, entry, cause);
  } else {
    EndJob(state, entry, v1::JOB_STATE_FAILED, cause, report.member_id());
    if (member != nullptr) ReleaseWorker(state, *member, job.id());
  }
}

// TASK_PHASE_SUCCEEDED (rank 0): the job succeeded with its final evaluation.
void ReportSuccess(ClusterState& state, JobEntry& entry, int rank, const v1::ProgressReport& report,
                   MemberEntry* member, int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  job.mutable_workers(rank)->set_done(true);
  job.set_state(v1::JOB_STATE_SUCCEEDED);
  job.set_reason("");
  job.set_end_time_ms(now_ms);
  job.set_evaluated(true);
  job.set_test_loss(report.test_loss());
  job.set_test_accuracy(report.test_accuracy());
  SetAuc(report, &job);
  entry.weights_on_shards = true;
  entry.restart_deadline_ms = 0;
  AddEvent(state, entry, v1::JOB_EVENT_KIND_STATE,
           absl::StrCat("succeeded: ", EvaluationText(job)));
  spdlog::info("coordinator: job {} succeeded (test accuracy {:.4f})", job.id(),
               job.test_accuracy());
  if (member != nullptr) ReleaseWorker(state, *member, job.id());
  ApplyRetention(state);
}

// TASK_PHASE_TRAINING or TRAINING_DONE: a throttled event, or the record written or marked.
void ReportTraining(ClusterState& state, JobEntry& entry, int rank,
                    const v1::ProgressReport& report, MemberEntry* member, int64_t now_ms,
                    int old_epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  v1::JobWorker& worker = *job.mutable_workers(rank);
  if (report.phase() == v1::TASK_PHASE_TRAINING_DONE && !worker.done()) {
    worker.set_done(true);
    if (rank != 0 && member != nullptr) ReleaseWorker(state, *member, job.id());
  }
  if (report.evaluated()) {
    AddEvent(state, entry, v1::JOB_EVENT_KIND_EVALUATION,
             absl::StrCat("epoch ", job.epochs(), ": ", EvaluationText(job)));
  } else if (rank == 0 && job.epoch() != old_epoch) {
    AddEvent(state, entry, v1::JOB_EVENT_KIND_EPOCH,
             absl::StrFormat("epoch %d of %d", job.epoch(), job.spec().epochs()));
  } else if (now_ms - entry.last_progress_event_ms >= kProgressEventIntervalMs) {
    AddEvent(state, entry, v1::JOB_EVENT_KIND_PROGRESS,
             absl::StrFormat("step %d of %d, loss %.4f, %.0f samples/s", job.step(),
                             job.total_steps(), job.loss(), job.samples_per_second()));
  } else if (now_ms - entry.last_write_ms >= kRecordWriteIntervalMs) {
    state.QueueJob(entry);
  } else {
    entry.dirty = true;
  }
}

bool AllWorkersDone(const v1::Job& job) {
  bool all_done = job.workers_size() > 0;
  for (const v1::JobWorker& w : job.workers()) all_done = all_done && (w.done() || w.lost());
  return all_done;
}

// The report of a RUNNING job's rank. INVALID_ARGUMENT for a rank the job does not have.
absl::Status ApplyReport(ClusterState& state, JobEntry& entry, const v1::ProgressReport& report,
                         MemberEntry* member, int64_t now_ms, v1::ProgressAck* ack)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  v1::Job& job = entry.job;
  if (report.rank() >= job.workers_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank: job ", job.id(), " has ", job.workers_size(), " ranks, got ", report.rank()));
  }
  const int rank = report.rank();
  if (!AcceptReport(state, entry, rank, report, member)) {
    ack->set_cancel(true);
    // The worker of a rank it no longer holds (evicted by the progress lease, then lost or handed
    // over) stayed BUSY with the job until its task ended: now it has.
    const v1::JobWorker& worker = job.workers(rank);
    if (report.phase() != v1::TASK_PHASE_TRAINING && member != nullptr &&
        member->member.job_id() == job.id() && member->member.rank() == rank &&
        (worker.lost() || worker.member_id() != member->member.id())) {
      ReleaseWorker(state, *member, job.id());
    }
    return absl::OkStatus();
  }
  const int old_epoch = RecordProgress(entry, rank, report, now_ms);
  SuspectShards(state, entry, report, now_ms);
  switch (report.phase()) {
    case v1::TASK_PHASE_FAILED:
      ReportFailure(state, entry, rank, report, member);
      break;
    case v1::TASK_PHASE_SUCCEEDED:
      ReportSuccess(state, entry, rank, report, member, now_ms);
      break;
    case v1::TASK_PHASE_TRAINING_DONE:
    case v1::TASK_PHASE_TRAINING:
    default:
      ReportTraining(state, entry, rank, report, member, now_ms, old_epoch);
      break;
  }
  if (job.state() == v1::JOB_STATE_RUNNING || job.state() == v1::JOB_STATE_SUCCEEDED) {
    ack->set_all_workers_done(AllWorkersDone(job));
  }
  NoteFillReport(state, entry, report, ack);
  *ack->mutable_down_shards() = job.down_shards();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ProgressAck> ReportProgress(ClusterState& state,
                                               const v1::ProgressReport& report) {
  TESSERA_RETURN_IF_ERROR(ValidateReport(report));
  v1::ProgressAck ack;
  {
    absl::MutexLock lock(&state.mu);
    if (!state.store_error.ok()) return state.store_error;
    JobEntry* entry = state.FindJob(report.job_id());
    if (entry == nullptr) {
      return absl::NotFoundError(absl::StrCat("job_id: no job ", report.job_id()));
    }
    MemberEntry* member = state.FindMember(report.member_id());
    const int64_t now = state.NowMs();
    if (member != nullptr && IsLive(member->member)) member->member.set_last_seen_ms(now);
    if (entry->job.state() != v1::JOB_STATE_RUNNING) {
      ack.set_cancel(true);
      const bool terminal_phase = report.phase() != v1::TASK_PHASE_TRAINING;
      if (terminal_phase && member != nullptr) ReleaseWorker(state, *member, entry->job.id());
    } else {
      TESSERA_RETURN_IF_ERROR(ApplyReport(state, *entry, report, member, now, &ack));
    }
  }
  TESSERA_RETURN_IF_ERROR(state.FlushWrites());
  return ack;
}

void WriteThrottledRecord(ClusterState& state, JobEntry& entry, int64_t now_ms) {
  if (entry.dirty && now_ms - entry.last_write_ms >= kRecordWriteIntervalMs) state.QueueJob(entry);
}

}  // namespace tessera::coordinator::internal
