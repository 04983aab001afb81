// Coordinator (coordinator.h): the façade that loads the store, runs the tick loop and hands
// each call to its room in internal/.
#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "server/coordinator/internal/action_threads.h"
#include "server/coordinator/internal/checkpoint_planner.h"
#include "server/coordinator/internal/cluster_state.h"
#include "server/coordinator/internal/gang_scheduler.h"
#include "server/coordinator/internal/job_events.h"
#include "server/coordinator/internal/job_lifecycle.h"
#include "server/coordinator/internal/member_registry.h"
#include "server/coordinator/internal/progress_reports.h"
#include "server/coordinator/internal/recovery.h"
#include "server/coordinator/internal/shard_drops.h"
#include "server/coordinator/internal/shard_refill.h"
#include "server/coordinator/internal/stall_inspector.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator {

using internal::ClusterState;
using internal::JobEntry;
using internal::MemberEntry;

namespace {

// The longest backoff between two registration attempts of a daemon (MemberAgent's default
// max_backoff). It bounds how late a daemon registers again after a coordinator restart: its
// channel (ClientCredentials::CreateChannel, common/security.cc) reconnects with a backoff
// capped at 2 s, below this, instead of gRPC's default that grows to 120 s.
constexpr absl::Duration kDaemonMaxBackoff = absl::Seconds(5);
constexpr absl::Duration kTickInterval = absl::Milliseconds(500);

// The number in "s-<n>" / "w-<n>"; 0 when the id has another form.
int64_t IdNumber(const std::string& id) {
  int64_t n = 0;
  if (id.size() < 3 || !absl::SimpleAtoi(absl::string_view(id).substr(2), &n)) return 0;
  return n;
}

absl::Status ValidateOptions(const CoordinatorOptions& options) {
  if (options.num_shards < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards: must be >= 0, got ", options.num_shards));
  }
  if (options.lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_seconds: must be > 0, got ", absl::ToDoubleSeconds(options.lease)));
  }
  if (options.heartbeat_interval <= absl::ZeroDuration() ||
      options.heartbeat_interval >= options.lease) {
    return absl::InvalidArgumentError(
        absl::StrCat("heartbeat_seconds: must be > 0 and below lease_seconds (",
                     absl::ToDoubleSeconds(options.lease), "), got ",
                     absl::ToDoubleSeconds(options.heartbeat_interval)));
  }
  if (options.retain_models < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retain_models: must be >= 0, got ", options.retain_models));
  }
  if (options.max_departed_members == 0) {
    return absl::InvalidArgumentError("max_departed_members: must be > 0");
  }
  if (options.max_watch_queue == 0) {
    return absl::InvalidArgumentError("max_watch_queue: must be > 0");
  }
  if (options.recovery_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recovery_timeout: must be > 0, got ", absl::ToDoubleSeconds(options.recovery_timeout)));
  }
  if (options.checkpoint_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_timeout: must be > 0, got ",
                     absl::ToDoubleSeconds(options.checkpoint_timeout)));
  }
  if (options.max_recoveries < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_recoveries: must be >= 0, got ", options.max_recoveries));
  }
  return absl::OkStatus();
}

// What the store holds, read before the state is touched.
struct StoredState {
  std::vector<v1::Member> members;
  std::vector<StoredJob> jobs;
  std::vector<ShardDrop> drops;
  // Whether each succeeded job still has weights on the shards: its last event says.
  std::map<std::string, bool> weights;
  // The committed checkpoints of the RUNNING jobs, which may still need them.
  std::map<std::string, std::vector<v1::CheckpointRecord>> checkpoints;
};

absl::StatusOr<StoredState> ReadStore(JobStore& store) {
  StoredState stored;
  TESSERA_ASSIGN_OR_RETURN(stored.members, store.LoadMembers());
  TESSERA_ASSIGN_OR_RETURN(stored.jobs, store.LoadJobs());
  TESSERA_ASSIGN_OR_RETURN(stored.drops, store.LoadDrops());
  for (const StoredJob& job : stored.jobs) {
    if (job.job.state() != v1::JOB_STATE_SUCCEEDED) continue;
    TESSERA_ASSIGN_OR_RETURN(std::vector<v1::JobEvent> last,
                             store.ReadEvents(job.job.id(), job.last_seq - 1, job.last_seq));
    stored.weights[job.job.id()] =
        last.empty() || !absl::StartsWith(last.back().message(), internal::kWeightsDropped);
  }
  for (const StoredJob& job : stored.jobs) {
    if (job.job.state() != v1::JOB_STATE_RUNNING) continue;
    TESSERA_ASSIGN_OR_RETURN(stored.checkpoints[job.job.id()], store.LoadCheckpoints(job.job.id()));
  }
  return stored;
}

// The stored members, not trusted: READY and BUSY ones become LOST until they register again.
// Returns how many did.
int AdoptMembers(ClusterState& state, std::vector<v1::Member>& members)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  int lost = 0;
  for (v1::Member& member : members) {
    MemberEntry entry;
    entry.n = IdNumber(member.id());
    if (member.role() == v1::MEMBER_ROLE_SERVER) {
      state.next_shard_n = std::max(state.next_shard_n, entry.n + 1);
    } else {
      state.next_worker_n = std::max(state.next_worker_n, entry.n + 1);
    }
    entry.member = std::move(member);
    if (internal::IsLive(entry.member)) {
      entry.member.set_state(v1::MEMBER_STATE_LOST);
      state.QueueMember(entry);
      ++lost;
    }
    state.members.emplace(entry.member.id(), std::move(entry));
  }
  return lost;
}

// The stored jobs; a RUNNING one gets the restart grace for its ranks to report, its committed
// checkpoints, its pending joins, and its membership sent to the shards again. Returns how many
// were RUNNING.
int AdoptJobs(ClusterState& state, StoredState& stored, int64_t now_ms)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  int running = 0;
  for (StoredJob& job : stored.jobs) {
    JobEntry entry;
    entry.n = job.n;
    entry.last_seq = job.last_seq;
    entry.job = std::move(job.job);
    entry.last_write_ms = now_ms;
    if (entry.job.state() == v1::JOB_STATE_RUNNING) {
      // The daemons retry their registration with a backoff capped at 5 s (MemberAgent), so
      // each rank gets that on top of one lease to come back.
      entry.restart_deadline_ms =
          now_ms + absl::ToInt64Milliseconds(state.options.lease + kDaemonMaxBackoff);
      entry.rank_seen.assign(entry.job.workers_size(), false);
      entry.checkpoints = std::move(stored.checkpoints[entry.job.id()]);
      // A recovery that was under way goes on (its timeout starts again); a membership change
      // may not have reached the shards.
      if (!entry.job.recovery().empty()) entry.recovery_since_ms = now_ms;
      entry.membership_dirty = true;
      entry.joins = internal::DerivedJoins(entry.job);
      internal::ResetStalls(entry, now_ms);
      ++running;
    }
    if (entry.job.state() == v1::JOB_STATE_SUCCEEDED) {
      entry.weights_on_shards = stored.weights[entry.job.id()];
    }
    state.job_n[entry.job.id()] = entry.n;
    state.jobs.emplace(entry.n, std::move(entry));
  }
  return running;
}

// Lease expiry, the end of the restart grace, and the throttled record writes.
void CheckLeases(ClusterState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  const int64_t now = state.NowMs();
  internal::ExpireLeases(state, now);
  internal::InspectStalls(state, now);
  for (auto& [n, entry] : state.jobs) {
    internal::EndRestartGrace(state, entry, now);
    internal::WriteThrottledRecord(state, entry, now);
  }
}

// This tick's actions, at most one checkpoint call and one other action per RUNNING job past its
// restart grace, in the order of the jobs.
std::vector<std::function<void()>> PlanActions(ClusterState& state)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  std::vector<std::function<void()>> actions;
  internal::LiveMembers live = internal::SurveyLiveMembers(state);
  for (auto& [n, entry] : state.jobs) {
    if (entry.job.state() != v1::JOB_STATE_RUNNING || entry.restart_deadline_ms > 0) continue;
    if (std::optional<internal::CheckpointPlan> plan = internal::PlanAutoCheckpoint(state, entry)) {
      actions.push_back(
          [state = &state, plan = *std::move(plan)] { internal::RunAutoCheckpoint(*state, plan); });
    }
    if (std::function<void()> action = internal::PlanRecoveryAction(state, entry, live)) {
      actions.push_back(std::move(action));
    } else if (std::function<void()> fill = internal::PlanFill(state, entry, live)) {
      actions.push_back(std::move(fill));
    }
  }
  return actions;
}

}  // namespace

Coordinator::Coordinator(const CoordinatorOptions& options, JobStore* store, ShardControl* shards)
    : state_(std::make_unique<ClusterState>(options, store, shards)),
      actions_(std::make_unique<internal::ActionThreads>(options.inline_actions)) {}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorOptions& options,
                                                                 JobStore* store,
                                                                 ShardControl* shards) {
  TESSERA_RETURN_IF_ERROR(ValidateOptions(options));
  if (store == nullptr || shards == nullptr) {
    return absl::InvalidArgumentError("a store and a shard control are required");
  }
  std::unique_ptr<Coordinator> coordinator(new Coordinator(options, store, shards));
  TESSERA_RETURN_IF_ERROR(coordinator->Load());
  return coordinator;
}

Coordinator::~Coordinator() { Stop(); }

absl::Status Coordinator::Load() {
  TESSERA_ASSIGN_OR_RETURN(StoredState stored, ReadStore(*state_->store));
  const int64_t now = state_->NowMs();
  absl::MutexLock lock(&state_->mu);
  for (ShardDrop& drop : stored.drops) {
    state_->drops.emplace(std::move(drop), internal::DropRetry{});
  }
  const int lost = AdoptMembers(*state_, stored.members);
  const int running = AdoptJobs(*state_, stored, now);
  if (!state_->jobs.empty() || !state_->members.empty()) {
    spdlog::info(
        "coordinator: loaded {} jobs ({} running, waiting {} for their workers), {} "
        "members ({} marked LOST until they register again) and {} owed DropJob calls",
        state_->jobs.size(), running,
        internal::SecondsText(state_->options.lease + kDaemonMaxBackoff), state_->members.size(),
        lost, state_->drops.size());
  }
  return absl::OkStatus();
}

void Coordinator::Start() {
  absl::MutexLock lock(&state_->mu);
  if (state_->started || state_->stopping) return;
  state_->started = true;
  last_tick_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  thread_ = std::thread([this] { Run(); });
}

void Coordinator::Stop() {
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->stopping && !thread_.joinable()) return;
    state_->stopping = true;
  }
  ticks_stopped_.store(true, std::memory_order_relaxed);
  // The shard calls in flight (a Checkpoint long-polls for up to checkpoint_timeout, a Restore
  // reads a file) end now, so the joins below do not wait for their deadlines.
  state_->shards->CancelAll();
  if (thread_.joinable()) thread_.join();
  actions_->Reap(/*all=*/true);
  (void)state_->FlushWrites();
  absl::MutexLock lock(&state_->mu);
  const absl::Status down = absl::UnavailableError("the coordinator is shutting down");
  internal::EndJobWatches(*state_, down);
  internal::CloseTaskStreams(*state_, down);
}

void Coordinator::Run() {
  while (true) {
    {
      absl::MutexLock lock(&state_->mu);
      state_->mu.AwaitWithTimeout(absl::Condition(
                                      +[](ClusterState* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                        return s->wake || s->stopping;
                                      },
                                      state_.get()),
                                  kTickInterval);
      if (state_->stopping) return;
      state_->wake = false;
    }
    Tick();
    last_tick_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  }
}

absl::Status Coordinator::CheckLive(absl::Duration max_tick_age) const {
  TESSERA_RETURN_IF_ERROR(MutexResponds(&state_->mu, absl::Seconds(5), "the coordinator's lock"));
  const int64_t last = last_tick_ns_.load(std::memory_order_relaxed);
  if (last == 0 || ticks_stopped_.load(std::memory_order_relaxed)) return absl::OkStatus();
  const absl::Duration age = absl::Nanoseconds(absl::GetCurrentTimeNanos() - last);
  if (age > max_tick_age) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the coordinator's tick loop has not finished a tick for ", absl::FormatDuration(age)));
  }
  return absl::OkStatus();
}

void Coordinator::Tick() {
  absl::MutexLock tick_lock(&tick_mu_);
  internal::RunShardDrops(*state_);
  actions_->Reap(/*all=*/false);
  std::vector<std::function<void()>> actions;
  {
    absl::MutexLock lock(&state_->mu);
    internal::ReapStreams(*state_);
    CheckLeases(*state_);
    internal::ForgetDepartedMembers(*state_);
    actions = PlanActions(*state_);
  }
  (void)state_->FlushWrites();
  for (std::function<void()>& action : actions) actions_->Run(std::move(action));
  // Start as many queued jobs as fit, oldest first; each pass starts at most one.
  for (size_t passes = 0; passes < 1000 && internal::ScheduleOldestPending(*state_); ++passes) {
  }
  internal::RunShardDrops(*state_);
  (void)state_->FlushWrites();
}

// --- JobService ----------------------------------------------------------------------------------

absl::StatusOr<v1::Job> Coordinator::CreateJob(const v1::JobSpec& spec) {
  return internal::CreateJob(*state_, spec);
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must be set");
  absl::MutexLock lock(&state_->mu);
  const JobEntry* entry = state_->FindJob(job_id);
  if (entry == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job ", job_id));
  return entry->job;
}

absl::StatusOr<std::vector<v1::Job>> Coordinator::ListJobs(const v1::ListJobsRequest& request) {
  std::vector<bool> wanted(v1::JobState_ARRAYSIZE, request.states().empty());
  for (int i = 0; i < request.states_size(); ++i) {
    const int state = request.states(i);
    if (!v1::JobState_IsValid(state) || state == v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("states[", i, "]: unknown job state ", state));
    }
    wanted[state] = true;
  }
  absl::MutexLock lock(&state_->mu);
  std::vector<v1::Job> jobs;
  for (const auto& [n, entry] : state_->jobs) {
    if (wanted[entry.job.state()]) jobs.push_back(entry.job);
  }
  return jobs;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const std::string& job_id) {
  return internal::CancelJob(*state_, job_id);
}

absl::StatusOr<std::shared_ptr<JobWatch>> Coordinator::WatchJob(
    const v1::WatchJobRequest& request) {
  return internal::OpenJobWatch(*state_, request);
}

absl::StatusOr<v1::CheckpointRecord> Coordinator::CheckpointJob(const std::string& job_id) {
  return internal::CheckpointByHand(*state_, job_id);
}

// --- ClusterService ------------------------------------------------------------------------------

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  return internal::RegisterMember(*state_, request);
}

absl::Status Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  return internal::RenewLease(*state_, request);
}

absl::Status Coordinator::Deregister(const v1::DeregisterRequest& request) {
  return internal::DeregisterMember(*state_, request);
}

std::vector<v1::Member> Coordinator::ListMembers() { return internal::ListMembers(*state_); }

absl::Status Coordinator::OpenTaskStream(const std::string& member_id,
                                         std::shared_ptr<TaskStream> stream) {
  return internal::OpenTaskStream(*state_, member_id, std::move(stream));
}

absl::StatusOr<v1::ProgressAck> Coordinator::ReportProgress(const v1::ProgressReport& report) {
  return internal::ReportProgress(*state_, report);
}

// --- Metrics -------------------------------------------------------------------------------------

CoordinatorMetricsSnapshot Coordinator::MetricsSnapshot() const {
  CoordinatorMetricsSnapshot out;
  for (int state = v1::JOB_STATE_PENDING; state <= v1::JOB_STATE_CANCELLED; ++state) {
    out.jobs[static_cast<v1::JobState>(state)] = 0;
  }
  for (v1::MemberRole role : {v1::MEMBER_ROLE_SERVER, v1::MEMBER_ROLE_WORKER}) {
    for (int state = v1::MEMBER_STATE_READY; state <= v1::MEMBER_STATE_LEFT; ++state) {
      out.members[{role, static_cast<v1::MemberState>(state)}] = 0;
    }
  }
  auto progress = [](const v1::Job& job) {
    CoordinatorMetricsSnapshot::JobProgress p;
    p.job_id = job.id();
    p.state = job.state();
    p.step = job.step();
    p.total_steps = job.total_steps();
    // Every rank takes one batch a step: the job's samples/s over batch * ranks.
    const double per_step = static_cast<double>(job.spec().batch_size()) *
                            std::max(1, static_cast<int>(job.spec().num_workers()));
    if (job.state() == v1::JOB_STATE_RUNNING && per_step > 0) {
      p.step_rate = job.samples_per_second() / per_step;
    }
    p.loss = job.loss();
    p.train_accuracy = job.train_accuracy();
    p.evaluated = job.evaluated();
    p.test_accuracy = job.test_accuracy();
    if (job.has_test_auc()) p.test_auc = job.test_auc();
    p.checkpoint_step = job.last_checkpoint_step();
    p.recoveries = job.recoveries();
    if (job.state() == v1::JOB_STATE_RUNNING) {
      for (const v1::JobWorker& worker : job.workers()) {
        p.rank_stalled_seconds.push_back(worker.stalled_seconds());
      }
    }
    return p;
  };
  absl::MutexLock lock(&state_->mu);
  std::vector<const v1::Job*> ended;  // newest first
  for (auto it = state_->jobs.rbegin(); it != state_->jobs.rend(); ++it) {
    const v1::Job& job = it->second.job;
    ++out.jobs[job.state()];
    if (internal::IsTerminal(job.state()) && ended.size() < kMetricsRecentJobs) {
      ended.push_back(&job);
    }
  }
  // Oldest first: the recent ended jobs (by creation), interleaved with the running ones.
  auto next_ended = ended.rbegin();
  for (const auto& [n, entry] : state_->jobs) {
    if (entry.job.state() == v1::JOB_STATE_RUNNING) {
      out.progress.push_back(progress(entry.job));
    } else if (next_ended != ended.rend() && *next_ended == &entry.job) {
      out.progress.push_back(progress(entry.job));
      ++next_ended;
    }
  }
  for (const auto& [id, entry] : state_->members) {
    ++out.members[{entry.member.role(), entry.member.state()}];
  }
  return out;
}

}  // namespace tessera::coordinator
