#include "server/coordinator/internal/job_events.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tessera::coordinator::internal {

void AddEvent(ClusterState& state, JobEntry& entry, v1::JobEventKind kind,
              const std::string& message) {
  const v1::Job& job = entry.job;
  v1::JobEvent event;
  event.set_job_id(job.id());
  event.set_seq(++entry.last_seq);
  event.set_time_ms(state.NowMs());
  event.set_state(job.state());
  event.set_kind(kind);
  event.set_message(message);
  event.set_step(job.step());
  event.set_total_steps(job.total_steps());
  event.set_epoch(job.epoch());
  event.set_loss(job.loss());
  event.set_train_accuracy(job.train_accuracy());
  event.set_evaluated(job.evaluated());
  event.set_test_loss(job.test_loss());
  event.set_test_accuracy(job.test_accuracy());
  if (job.has_test_auc()) event.set_test_auc(job.test_auc());
  event.set_samples_per_second(job.samples_per_second());
  event.set_eta_seconds(job.eta_seconds());
  state.pending.events.push_back(event);
  state.QueueJob(entry);
  entry.last_progress_event_ms = event.time_ms();

  v1::WatchJobResponse update;
  *update.mutable_job() = job;
  *update.mutable_event() = std::move(event);
  std::vector<std::shared_ptr<JobWatch>> alive;
  for (std::shared_ptr<JobWatch>& watch : entry.watchers) {
    if (watch->Push(update)) alive.push_back(std::move(watch));
  }
  entry.watchers.swap(alive);
  if (IsTerminal(job.state())) {
    for (const std::shared_ptr<JobWatch>& watch : entry.watchers) watch->End(absl::OkStatus());
    entry.watchers.clear();
  }
}

absl::StatusOr<std::shared_ptr<JobWatch>> OpenJobWatch(ClusterState& state,
                                                       const v1::WatchJobRequest& request) {
  if (request.job_id().empty()) return absl::InvalidArgumentError("job_id: must be set");
  if (request.after_seq() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("after_seq: must be >= 0, got ", request.after_seq()));
  }
  auto watch = std::make_shared<JobWatch>(state.options.max_watch_queue);
  v1::Job snapshot;
  int64_t last_seq = 0;
  bool terminal = false;
  {
    absl::MutexLock lock(&state.mu);
    if (state.stopping) return absl::UnavailableError("the coordinator is shutting down");
    JobEntry* entry = state.FindJob(request.job_id());
    if (entry == nullptr) {
      return absl::NotFoundError(absl::StrCat("job_id: no job ", request.job_id()));
    }
    snapshot = entry->job;
    last_seq = entry->last_seq;
    terminal = IsTerminal(entry->job.state());
    // Live events (seq > last_seq) are held back by the watch until the replay is queued.
    if (!terminal) entry->watchers.push_back(watch);
  }
  // Every event up to last_seq was queued before the lock was released; make them durable, then
  // read them back. Unlocked: SQLite I/O.
  absl::Status flushed = state.FlushWrites();
  absl::StatusOr<std::vector<v1::JobEvent>> events =
      flushed.ok() ? state.store->ReadEvents(request.job_id(), request.after_seq(), last_seq)
                   : absl::StatusOr<std::vector<v1::JobEvent>>(flushed);
  if (!events.ok()) {
    watch->End(events.status());
    watch->FinishReplay({});
    return watch;
  }
  std::vector<v1::WatchJobResponse> replay;
  replay.reserve(events->size() + 1);
  replay.emplace_back();
  *replay.back().mutable_job() = snapshot;
  for (v1::JobEvent& event : *events) {
    replay.emplace_back();
    // The record as it stands now: past records are not stored, only past events.
    *replay.back().mutable_job() = snapshot;
    *replay.back().mutable_event() = std::move(event);
  }
  watch->FinishReplay(std::move(replay));
  if (terminal) watch->End(absl::OkStatus());
  return watch;
}

void EndJobWatches(ClusterState& state, const absl::Status& status) {
  for (auto& [n, entry] : state.jobs) {
    for (const std::shared_ptr<JobWatch>& watch : entry.watchers) watch->End(status);
    entry.watchers.clear();
  }
}

}  // namespace tessera::coordinator::internal
