#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"
#include "spec/job_spec.h"

namespace tessera::coordinator {

namespace {

// The longest address, hostname or device a member may register with (a DNS name is at most 253).
constexpr size_t kMaxMemberFieldBytes = 255;

// The longest backoff between two registration attempts of a daemon (MemberAgent's default
// max_backoff). It bounds how late a daemon registers again after a coordinator restart: its
// channel (ClientCredentials::CreateChannel, common/security.cc) reconnects with a backoff
// capped at 2 s, below this, instead of gRPC's default that grows to 120 s.
constexpr absl::Duration kDaemonMaxBackoff = absl::Seconds(5);
// The longest wait between two tries of an owed DropJob on a live shard.
constexpr absl::Duration kMaxDropBackoff = absl::Seconds(60);

constexpr int64_t kProgressEventIntervalMs = 1000;
constexpr int64_t kRecordWriteIntervalMs = 500;
constexpr absl::Duration kTickInterval = absl::Milliseconds(500);
constexpr char kWeightsDropped[] = "weights dropped from the shards";
// CheckpointJob places its step further ahead this many times before it gives up.
constexpr int kCheckpointAttempts = 5;

// Committed checkpoints kept per job: JobSpec.keep_checkpoints, 0 meaning 3.
size_t KeepCheckpoints(const v1::JobSpec& spec) {
  return spec.keep_checkpoints() > 0 ? static_cast<size_t>(spec.keep_checkpoints()) : 3;
}

// Restore errors that mean "this checkpoint is unusable": try the next older one.
bool CheckpointUnusable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kDataLoss ||
         status.code() == absl::StatusCode::kNotFound;
}

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

bool IsLive(const v1::Member& member) {
  return member.state() == v1::MEMBER_STATE_READY || member.state() == v1::MEMBER_STATE_BUSY;
}

// The number in "s-<n>" / "w-<n>"; 0 when the id has another form.
int64_t IdNumber(const std::string& id) {
  int64_t n = 0;
  if (id.size() < 3 || !absl::SimpleAtoi(absl::string_view(id).substr(2), &n)) return 0;
  return n;
}

std::string SecondsText(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), " s"); }

// The ranks of a stored RUNNING job that were handed over at a step the job has not reached, with
// that step (JobEntry::joins, which is not stored). A start and a rewind give every rank
// base + rank as its incarnation; a hand-over gives its rank one above all of them, so the ranks
// with incarnation - rank above the smallest were handed over since. Such a rank's step is its
// join step until it reports, and above it after (in BSP at most one step ahead of the others):
// never below it, so the join is never re-sent earlier than it was made.
std::map<int, int64_t> DerivedJoins(const v1::Job& job) {
  std::map<int, int64_t> joins;
  int64_t base = std::numeric_limits<int64_t>::max();
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    const v1::JobWorker& worker = job.workers(rank);
    if (worker.lost()) continue;
    if (worker.incarnation() == 0) return joins;  // a job from before hand-overs existed
    base = std::min(base, static_cast<int64_t>(worker.incarnation()) - rank);
  }
  for (int rank = 0; rank < job.workers_size(); ++rank) {
    const v1::JobWorker& worker = job.workers(rank);
    if (!worker.lost() && static_cast<int64_t>(worker.incarnation()) - rank > base &&
        worker.step() > job.step()) {
      joins[rank] = worker.step();
    }
  }
  return joins;
}

}  // namespace

// --- JobWatch ------------------------------------------------------------------------------------

JobWatch::Poll JobWatch::Next(v1::WatchJobResponse* out, absl::Status* end) {
  absl::MutexLock lock(&mu_);
  if (replaying_) return Poll::kEmpty;
  if (!queue_.empty()) {
    *out = std::move(queue_.front());
    queue_.pop_front();
    if (replay_left_ > 0) --replay_left_;
    return Poll::kMessage;
  }
  if (ended_) {
    *end = end_status_;
    return Poll::kEnded;
  }
  return Poll::kEmpty;
}

void JobWatch::SetWakeup(std::function<void()> wakeup) {
  absl::MutexLock lock(&wakeup_mu_);
  wakeup_ = std::move(wakeup);
}

void JobWatch::Cancel() {
  absl::MutexLock lock(&mu_);
  ended_ = true;
  queue_.clear();
  held_.clear();
}

bool JobWatch::Push(v1::WatchJobResponse message) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return false;
    std::deque<v1::WatchJobResponse>& target = replaying_ ? held_ : queue_;
    target.push_back(std::move(message));
    const size_t live = replaying_ ? held_.size() : queue_.size() - replay_left_;
    if (live > max_queued_) {
      ended_ = true;
      queue_.clear();
      held_.clear();
      replay_left_ = 0;
      end_status_ = absl::ResourceExhaustedError(
          absl::StrCat("this watcher fell more than ", max_queued_, " events behind; watch again"));
    }
  }
  Wake();
  return true;
}

void JobWatch::End(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    end_status_ = status;
  }
  Wake();
}

void JobWatch::FinishReplay(std::vector<v1::WatchJobResponse> replay) {
  {
    absl::MutexLock lock(&mu_);
    if (!replaying_) return;
    replaying_ = false;
    std::deque<v1::WatchJobResponse> queue(std::make_move_iterator(replay.begin()),
                                           std::make_move_iterator(replay.end()));
    replay_left_ = queue.size();
    for (v1::WatchJobResponse& message : held_) queue.push_back(std::move(message));
    held_.clear();
    queue_.swap(queue);
    if (ended_ && !end_status_.ok()) {
      // Overflowed or failed: the error goes out at once.
      queue_.clear();
      replay_left_ = 0;
    }
  }
  Wake();
}

void JobWatch::Wake() {
  absl::MutexLock lock(&wakeup_mu_);
  if (wakeup_) wakeup_();
}

// --- Coordinator ---------------------------------------------------------------------------------

Coordinator::Coordinator(const CoordinatorOptions& options, JobStore* store, ShardControl* shards)
    : options_(options), store_(store), shards_(shards) {}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorOptions& options,
                                                                 JobStore* store,
                                                                 ShardControl* shards) {
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
  if (store == nullptr || shards == nullptr) {
    return absl::InvalidArgumentError("a store and a shard control are required");
  }
  std::unique_ptr<Coordinator> coordinator(new Coordinator(options, store, shards));
  TESSERA_RETURN_IF_ERROR(coordinator->Load());
  return coordinator;
}

Coordinator::~Coordinator() { Stop(); }

int64_t Coordinator::NowMs() const {
  if (options_.now_ms) return options_.now_ms();
  return absl::ToUnixMillis(absl::Now());
}

absl::Status Coordinator::Load() {
  TESSERA_ASSIGN_OR_RETURN(std::vector<v1::Member> members, store_->LoadMembers());
  TESSERA_ASSIGN_OR_RETURN(std::vector<StoredJob> jobs, store_->LoadJobs());
  TESSERA_ASSIGN_OR_RETURN(std::vector<ShardDrop> drops, store_->LoadDrops());
  // Whether each succeeded job still has weights on the shards: its last event says.
  std::map<std::string, bool> weights;
  for (const StoredJob& stored : jobs) {
    if (stored.job.state() != v1::JOB_STATE_SUCCEEDED) continue;
    TESSERA_ASSIGN_OR_RETURN(
        std::vector<v1::JobEvent> last,
        store_->ReadEvents(stored.job.id(), stored.last_seq - 1, stored.last_seq));
    weights[stored.job.id()] =
        last.empty() || !absl::StartsWith(last.back().message(), kWeightsDropped);
  }
  // The committed checkpoints of the jobs that may still need them.
  std::map<std::string, std::vector<v1::CheckpointRecord>> checkpoints;
  for (const StoredJob& stored : jobs) {
    if (stored.job.state() != v1::JOB_STATE_RUNNING) continue;
    TESSERA_ASSIGN_OR_RETURN(checkpoints[stored.job.id()],
                             store_->LoadCheckpoints(stored.job.id()));
  }
  const int64_t now = NowMs();
  absl::MutexLock lock(&mu_);
  for (ShardDrop& drop : drops) drops_.emplace(std::move(drop), DropRetry{});
  int lost = 0;
  for (v1::Member& member : members) {
    MemberEntry entry;
    entry.n = IdNumber(member.id());
    if (member.role() == v1::MEMBER_ROLE_SERVER) {
      next_shard_n_ = std::max(next_shard_n_, entry.n + 1);
    } else {
      next_worker_n_ = std::max(next_worker_n_, entry.n + 1);
    }
    entry.member = std::move(member);
    // Members are not trusted after a restart: they register again.
    if (IsLive(entry.member)) {
      entry.member.set_state(v1::MEMBER_STATE_LOST);
      QueueMember(entry);
      ++lost;
    }
    members_.emplace(entry.member.id(), std::move(entry));
  }
  int running = 0;
  for (StoredJob& stored : jobs) {
    JobEntry entry;
    entry.n = stored.n;
    entry.last_seq = stored.last_seq;
    entry.job = std::move(stored.job);
    entry.last_write_ms = now;
    if (entry.job.state() == v1::JOB_STATE_RUNNING) {
      // The daemons retry their registration with a backoff capped at 5 s (MemberAgent), so
      // each rank gets that on top of one lease to come back.
      entry.restart_deadline_ms =
          now + absl::ToInt64Milliseconds(options_.lease + kDaemonMaxBackoff);
      entry.rank_seen.assign(entry.job.workers_size(), false);
      entry.checkpoints = std::move(checkpoints[entry.job.id()]);
      // A recovery that was under way goes on (its timeout starts again); a membership change
      // may not have reached the shards.
      if (!entry.job.recovery().empty()) entry.recovery_since_ms = now;
      entry.membership_dirty = true;
      entry.joins = DerivedJoins(entry.job);
      ++running;
    }
    if (entry.job.state() == v1::JOB_STATE_SUCCEEDED)
      entry.weights_on_shards = weights[entry.job.id()];
    job_n_[entry.job.id()] = entry.n;
    jobs_.emplace(entry.n, std::move(entry));
  }
  if (!jobs_.empty() || !members_.empty()) {
    spdlog::info(
        "coordinator: loaded {} jobs ({} running, waiting {} for their workers), {} "
        "members ({} marked LOST until they register again) and {} owed DropJob calls",
        jobs_.size(), running, SecondsText(options_.lease + kDaemonMaxBackoff), members_.size(),
        lost, drops_.size());
  }
  return absl::OkStatus();
}

void Coordinator::Start() {
  absl::MutexLock lock(&mu_);
  if (started_ || stopping_) return;
  started_ = true;
  last_tick_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  thread_ = std::thread([this] { Run(); });
}

void Coordinator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  ticks_stopped_.store(true, std::memory_order_relaxed);
  // The shard calls in flight (a Checkpoint long-polls for up to checkpoint_timeout, a Restore
  // reads a file) end now, so the joins below do not wait for their deadlines.
  shards_->CancelAll();
  if (thread_.joinable()) thread_.join();
  ReapActions(/*all=*/true);
  (void)FlushWrites();
  absl::MutexLock lock(&mu_);
  const absl::Status down = absl::UnavailableError("the coordinator is shutting down");
  for (auto& [n, entry] : jobs_) {
    for (const std::shared_ptr<JobWatch>& watch : entry.watchers) watch->End(down);
    entry.watchers.clear();
  }
  for (auto& [id, member] : members_) {
    if (member.stream != nullptr) member.stream->Close(down);
    member.stream.reset();
  }
}

void Coordinator::Wake() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { wake_ = true; }

void Coordinator::Run() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](Coordinator* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return c->wake_ || c->stopping_;
                               },
                               this),
                           kTickInterval);
      if (stopping_) return;
      wake_ = false;
    }
    Tick();
    last_tick_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  }
}

absl::Status Coordinator::CheckLive(absl::Duration max_tick_age) const {
  TESSERA_RETURN_IF_ERROR(MutexResponds(&mu_, absl::Seconds(5), "the coordinator's lock"));
  const int64_t last = last_tick_ns_.load(std::memory_order_relaxed);
  if (last == 0 || ticks_stopped_.load(std::memory_order_relaxed)) return absl::OkStatus();
  const absl::Duration age = absl::Nanoseconds(absl::GetCurrentTimeNanos() - last);
  if (age > max_tick_age) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the coordinator's tick loop has not finished a tick for ", absl::FormatDuration(age)));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::FlushWrites() {
  absl::MutexLock write_lock(&write_mu_);
  StoreWrite batch;
  {
    absl::MutexLock lock(&mu_);
    if (!store_error_.ok()) return store_error_;
    if (pending_.empty()) return absl::OkStatus();
    std::swap(batch, pending_);
  }
  // Unlocked: SQLite I/O. write_mu_ keeps batches in the order they were queued.
  absl::Status status = store_->Write(batch);
  if (!status.ok()) {
    spdlog::error("coordinator: the database write failed; refusing further changes: {}",
                  status.ToString());
    absl::MutexLock lock(&mu_);
    if (store_error_.ok()) {
      store_error_ =
          absl::Status(status.code(), absl::StrCat("coordinator database: ", status.message()));
    }
    return store_error_;
  }
  return absl::OkStatus();
}

Coordinator::JobEntry* Coordinator::FindJob(const std::string& job_id) {
  auto it = job_n_.find(job_id);
  if (it == job_n_.end()) return nullptr;
  return &jobs_.at(it->second);
}

Coordinator::MemberEntry* Coordinator::FindMember(const std::string& member_id) {
  auto it = members_.find(member_id);
  return it == members_.end() ? nullptr : &it->second;
}

void Coordinator::QueueJob(JobEntry& entry) {
  pending_.jobs.push_back({entry.n, entry.job});
  entry.dirty = false;
  entry.last_write_ms = NowMs();
}

void Coordinator::QueueMember(const MemberEntry& entry) {
  pending_.members.push_back(entry.member);
}

void Coordinator::AddEvent(JobEntry& entry, const std::string& message) {
  const v1::Job& job = entry.job;
  v1::JobEvent event;
  event.set_job_id(job.id());
  event.set_seq(++entry.last_seq);
  event.set_time_ms(NowMs());
  event.set_state(job.state());
  event.set_message(message);
  event.set_step(job.step());
  event.set_total_steps(job.total_steps());
  event.set_epoch(job.epoch());
  event.set_loss(job.loss());
  event.set_train_accuracy(job.train_accuracy());
  event.set_evaluated(job.evaluated());
  event.set_test_loss(job.test_loss());
  event.set_test_accuracy(job.test_accuracy());
  event.set_samples_per_second(job.samples_per_second());
  event.set_eta_seconds(job.eta_seconds());
  pending_.events.push_back(event);
  QueueJob(entry);
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

std::string Coordinator::WorkerName(const v1::JobWorker& worker) const {
  return absl::StrCat(worker.member_id(), " on ",
                      worker.hostname().empty() ? "?" : worker.hostname());
}

void Coordinator::RecordAssign(MemberEntry& member, const v1::TaskEvent& event) {
  member.assign = event;
  member.assign_durable = false;
}

void Coordinator::SendAssigns(const std::vector<std::pair<std::string, v1::TaskEvent>>& assigns) {
  absl::MutexLock lock(&mu_);
  for (const auto& [member_id, event] : assigns) {
    MemberEntry* member = FindMember(member_id);
    if (member == nullptr || !member->assign.has_value()) continue;
    const v1::Task& current = member->assign->assign();
    if (current.job_id() != event.assign().job_id() || current.rank() != event.assign().rank() ||
        current.incarnation() != event.assign().incarnation() || !StillAssigned(*member)) {
      continue;  // released, reassigned or ended meanwhile
    }
    member->assign_durable = true;
    // Without a stream now, the next one the worker opens gets it (OpenTaskStream).
    if (member->stream != nullptr) member->stream->Send(event);
  }
}

bool Coordinator::StillAssigned(const MemberEntry& member) {
  if (!member.assign.has_value() || member.member.state() != v1::MEMBER_STATE_BUSY) return false;
  const v1::Task& task = member.assign->assign();
  if (member.member.job_id() != task.job_id()) return false;
  const JobEntry* entry = FindJob(task.job_id());
  if (entry == nullptr || entry->job.state() != v1::JOB_STATE_RUNNING ||
      !entry->job.recovery().empty() || entry->stopped_members.count(member.member.id()) > 0 ||
      task.rank() < 0 || task.rank() >= entry->job.workers_size()) {
    return false;
  }
  const v1::JobWorker& worker = entry->job.workers(task.rank());
  return worker.member_id() == member.member.id() && worker.incarnation() == task.incarnation() &&
         !worker.lost() && !worker.done();
}

void Coordinator::ReleaseWorker(MemberEntry& member, const std::string& job_id) {
  if (member.member.job_id() != job_id) return;
  member.assign.reset();
  member.assign_durable = false;
  member.member.clear_job_id();
  member.member.clear_rank();
  if (member.member.state() == v1::MEMBER_STATE_BUSY) {
    member.member.set_state(v1::MEMBER_STATE_READY);
  }
  QueueMember(member);
  Wake();
}

void Coordinator::EndJob(JobEntry& entry, v1::JobState state, const std::string& reason,
                         const std::string& except_member) {
  v1::Job& job = entry.job;
  const bool was_running = job.state() == v1::JOB_STATE_RUNNING;
  job.set_state(state);
  job.set_reason(reason);
  job.set_end_time_ms(NowMs());
  entry.restart_deadline_ms = 0;
  for (const v1::JobWorker& worker : job.workers()) {
    MemberEntry* member = FindMember(worker.member_id());
    if (member == nullptr || member->member.id() == except_member ||
        member->member.job_id() != job.id()) {
      continue;
    }
    if (member->stream != nullptr && member->member.state() == v1::MEMBER_STATE_BUSY &&
        entry.stopped_members.count(member->member.id()) == 0) {
      // It stays BUSY until it reports a terminal phase or its stream ends.
      v1::TaskEvent cancel;
      cancel.mutable_cancel()->set_job_id(job.id());
      cancel.mutable_cancel()->set_reason(reason);
      member->stream->Send(cancel);
    } else {
      ReleaseWorker(*member, job.id());
    }
  }
  entry.stopped_members.clear();
  if (was_running) {
    for (const std::string& address : job.shard_addresses()) QueueDrop(address, job.id());
    ForgetCheckpoints(entry);
  }
  job.clear_recovery();
  const char* verb = state == v1::JOB_STATE_FAILED ? "failed" : "cancelled";
  spdlog::info("coordinator: job {} {}: {}", job.id(), verb, reason);
  AddEvent(entry, state == v1::JOB_STATE_CANCELLED && reason == "cancelled by the user"
                      ? reason
                      : absl::StrCat(verb, ": ", reason));
  Wake();
}

void Coordinator::MemberGone(MemberEntry& member, v1::MemberState state, const std::string& why) {
  member.member.set_state(state);
  if (member.stream != nullptr) {
    member.stream->Close(
        absl::UnavailableError(absl::StrCat("member ", member.member.id(), " ", why)));
    member.stream.reset();
  }
  spdlog::info(
      "coordinator: {} {} ({}) {}",
      member.member.role() == v1::MEMBER_ROLE_SERVER ? "shard" : "worker", member.member.id(),
      member.member.address().empty() ? member.member.hostname() : member.member.address(), why);
  if (member.member.role() == v1::MEMBER_ROLE_WORKER && !member.member.job_id().empty()) {
    JobEntry* entry = FindJob(member.member.job_id());
    if (entry != nullptr && entry->job.state() == v1::JOB_STATE_RUNNING) {
      for (int rank = 0; rank < entry->job.workers_size(); ++rank) {
        const v1::JobWorker& worker = entry->job.workers(rank);
        if (worker.member_id() != member.member.id() || worker.lost()) continue;
        LoseRank(*entry, rank, why);
        break;
      }
    }
    member.member.clear_job_id();
    member.member.clear_rank();
  }
  if (member.member.role() == v1::MEMBER_ROLE_SERVER) {
    const int index = member.member.shard_index();
    for (auto& [n, entry] : jobs_) {
      if (entry.job.state() != v1::JOB_STATE_RUNNING || index >= entry.job.shard_addresses_size() ||
          entry.job.shard_addresses(index) != member.member.address()) {
        continue;
      }
      StartRecovery(entry, absl::StrCat("shard ", index, " (", member.member.address(), ") ", why));
    }
  }
  QueueMember(member);
  Wake();
}

// --- JobService ----------------------------------------------------------------------------------

absl::StatusOr<v1::Job> Coordinator::CreateJob(const v1::JobSpec& spec) {
  {
    absl::MutexLock lock(&mu_);
    if (!store_error_.ok()) return store_error_;
  }
  spec::ValidateOptions validate;
  validate.check_files = options_.check_files;
  validate.distributed = true;
  TESSERA_RETURN_IF_ERROR(spec::ValidateJobSpec(spec, validate));
  v1::Job created;
  {
    absl::MutexLock lock(&mu_);
    JobEntry entry;
    entry.n = jobs_.empty() ? 1 : jobs_.rbegin()->first + 1;
    entry.job.set_id(absl::StrCat(spec.name(), "-", entry.n));
    *entry.job.mutable_spec() = spec;
    entry.job.set_state(v1::JOB_STATE_PENDING);
    entry.job.set_reason("queued");
    entry.job.set_create_time_ms(NowMs());
    JobEntry& stored = jobs_.emplace(entry.n, std::move(entry)).first->second;
    job_n_[stored.job.id()] = stored.n;
    AddEvent(stored, "queued");
    created = stored.job;
    Wake();
  }
  TESSERA_RETURN_IF_ERROR(FlushWrites());
  spdlog::info("coordinator: job {} queued ({} workers)", created.id(),
               spec::NumWorkers(created.spec()));
  return created;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must be set");
  absl::MutexLock lock(&mu_);
  const JobEntry* entry = FindJob(job_id);
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
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> jobs;
  for (const auto& [n, entry] : jobs_) {
    if (wanted[entry.job.state()]) jobs.push_back(entry.job);
  }
  return jobs;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must be set");
  v1::Job result;
  {
    absl::MutexLock lock(&mu_);
    if (!store_error_.ok()) return store_error_;
    JobEntry* entry = FindJob(job_id);
    if (entry == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job ", job_id));
    switch (entry->job.state()) {
      case v1::JOB_STATE_CANCELLED:
        return entry->job;
      case v1::JOB_STATE_SUCCEEDED:
      case v1::JOB_STATE_FAILED:
        return absl::FailedPreconditionError(
            absl::StrCat("job ", job_id, " already ended ", v1::JobState_Name(entry->job.state()),
                         "; only a PENDING or RUNNING job can be cancelled"));
      default:
        EndJob(*entry, v1::JOB_STATE_CANCELLED, "cancelled by the user", "");
        break;
    }
    result = entry->job;
  }
  TESSERA_RETURN_IF_ERROR(FlushWrites());
  return result;
}

absl::StatusOr<std::shared_ptr<JobWatch>> Coordinator::WatchJob(
    const v1::WatchJobRequest& request) {
  if (request.job_id().empty()) return absl::InvalidArgumentError("job_id: must be set");
  if (request.after_seq() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("after_seq: must be >= 0, got ", request.after_seq()));
  }
  auto watch = std::make_shared<JobWatch>(options_.max_watch_queue);
  v1::Job snapshot;
  int64_t last_seq = 0;
  bool terminal = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    JobEntry* entry = FindJob(request.job_id());
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
  absl::Status flushed = FlushWrites();
  absl::StatusOr<std::vector<v1::JobEvent>> events =
      flushed.ok() ? store_->ReadEvents(request.job_id(), request.after_seq(), last_seq)
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

// --- ClusterService ------------------------------------------------------------------------------

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  const v1::MemberRole role = request.role();
  if (role != v1::MEMBER_ROLE_SERVER && role != v1::MEMBER_ROLE_WORKER) {
    return absl::InvalidArgumentError(absl::StrCat(
        "role: must be MEMBER_ROLE_SERVER or MEMBER_ROLE_WORKER, got ", static_cast<int>(role)));
  }
  if (role == v1::MEMBER_ROLE_SERVER) {
    if (request.address().empty() || request.address().find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("address: a shard needs host:port, got '", request.address(), "'"));
    }
    if (request.shard_index() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard_index: must be >= 0, got ", request.shard_index()));
    }
    if (options_.num_shards > 0 && request.shard_index() >= options_.num_shards) {
      return absl::InvalidArgumentError(absl::StrCat("shard_index: must be below --num_shards ",
                                                     options_.num_shards, ", got ",
                                                     request.shard_index()));
    }
  }
  if (request.pid() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pid: must be >= 0, got ", request.pid()));
  }
  // Members are kept (and stored) for as long as they are listed: their strings are bounded.
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"address", &request.address()},
        {"hostname", &request.hostname()},
        {"device", &request.device()}}) {
    if (value->size() > kMaxMemberFieldBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": at most ", kMaxMemberFieldBytes, " bytes, got ", value->size()));
    }
  }
  v1::RegisterResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (!store_error_.ok()) return store_error_;
    if (role == v1::MEMBER_ROLE_SERVER) {
      for (const auto& [id, other] : members_) {
        if (other.member.role() == v1::MEMBER_ROLE_SERVER &&
            other.member.state() == v1::MEMBER_STATE_READY &&
            other.member.shard_index() == request.shard_index() &&
            other.member.address() != request.address()) {
          return absl::AlreadyExistsError(absl::StrCat("shard_index: shard ", request.shard_index(),
                                                       " is already served by ", id, " at ",
                                                       other.member.address()));
        }
      }
    }
    if (role == v1::MEMBER_ROLE_SERVER) {
      // The same index at the same address while the old member is live: the shard restarted
      // (its state is gone), so the old member is lost at once.
      for (auto& [id, other] : members_) {
        if (other.member.role() == v1::MEMBER_ROLE_SERVER &&
            other.member.state() == v1::MEMBER_STATE_READY &&
            other.member.shard_index() == request.shard_index()) {
          MemberGone(other, v1::MEMBER_STATE_LOST, "restarted (registered again)");
        }
      }
    }
    MemberEntry entry;
    const bool server = role == v1::MEMBER_ROLE_SERVER;
    entry.n = server ? next_shard_n_++ : next_worker_n_++;
    v1::Member& member = entry.member;
    member.set_id(absl::StrCat(server ? "s-" : "w-", entry.n));
    member.set_role(role);
    member.set_state(v1::MEMBER_STATE_READY);
    member.set_address(request.address());
    member.set_shard_index(server ? request.shard_index() : 0);
    member.set_hostname(request.hostname());
    member.set_pid(request.pid());
    member.set_device(request.device());
    member.set_registered_ms(NowMs());
    member.set_last_seen_ms(member.registered_ms());
    QueueMember(entry);
    if (server) {
      // What this address is owed is tried at the next tick.
      for (auto& [drop, retry] : drops_) {
        if (drop.address == member.address()) retry.next_try_ms = 0;
      }
    }
    response.set_member_id(member.id());
    spdlog::info("coordinator: {} registered: {}{} (pid {})", member.id(),
                 server ? absl::StrCat("shard ", member.shard_index(), " at ", member.address())
                        : absl::StrCat("worker on ", member.hostname()),
                 member.device().empty() ? "" : absl::StrCat(", ", member.device()), member.pid());
    members_.emplace(member.id(), std::move(entry));
    Wake();
  }
  response.set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
  response.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  TESSERA_RETURN_IF_ERROR(FlushWrites());
  return response;
}

absl::Status Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  if (request.member_id().empty()) return absl::InvalidArgumentError("member_id: must be set");
  absl::MutexLock lock(&mu_);
  MemberEntry* member = FindMember(request.member_id());
  if (member == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("member_id: unknown member ", request.member_id(), "; register again"));
  }
  if (!IsLive(member->member)) {
    return absl::NotFoundError(absl::StrCat("member_id: ", request.member_id(), " is ",
                                            v1::MemberState_Name(member->member.state()),
                                            "; register again"));
  }
  member->member.set_last_seen_ms(NowMs());
  return absl::OkStatus();
}

absl::Status Coordinator::Deregister(const v1::DeregisterRequest& request) {
  if (request.member_id().empty()) return absl::InvalidArgumentError("member_id: must be set");
  {
    absl::MutexLock lock(&mu_);
    MemberEntry* member = FindMember(request.member_id());
    if (member == nullptr) {
      return absl::NotFoundError(absl::StrCat("member_id: unknown member ", request.member_id()));
    }
    if (!IsLive(member->member)) return absl::OkStatus();
    member->member.set_last_seen_ms(NowMs());
    MemberGone(*member, v1::MEMBER_STATE_LEFT, "left the cluster");
  }
  return FlushWrites();
}

std::vector<v1::Member> Coordinator::ListMembers() {
  absl::MutexLock lock(&mu_);
  std::vector<const MemberEntry*> shards, workers;
  for (const auto& [id, entry] : members_) {
    (entry.member.role() == v1::MEMBER_ROLE_SERVER ? shards : workers).push_back(&entry);
  }
  std::sort(shards.begin(), shards.end(), [](const MemberEntry* a, const MemberEntry* b) {
    return std::make_pair(a->member.shard_index(), a->n) <
           std::make_pair(b->member.shard_index(), b->n);
  });
  std::sort(workers.begin(), workers.end(),
            [](const MemberEntry* a, const MemberEntry* b) { return a->n < b->n; });
  std::vector<v1::Member> members;
  for (const MemberEntry* entry : shards) members.push_back(entry->member);
  for (const MemberEntry* entry : workers) members.push_back(entry->member);
  return members;
}

absl::Status Coordinator::OpenTaskStream(const std::string& member_id,
                                         std::shared_ptr<TaskStream> stream) {
  if (member_id.empty()) return absl::InvalidArgumentError("member_id: must be set");
  absl::MutexLock lock(&mu_);
  // Stop() has ended every stream; a new one would stay open until the server's grace runs out.
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  MemberEntry* member = FindMember(member_id);
  if (member == nullptr || !IsLive(member->member)) {
    return absl::NotFoundError(
        absl::StrCat("member_id: no live member ", member_id, "; register again"));
  }
  if (member->member.role() != v1::MEMBER_ROLE_WORKER) {
    return absl::InvalidArgumentError(
        absl::StrCat("member_id: ", member_id, " is a shard; only workers watch tasks"));
  }
  if (member->stream != nullptr) {
    member->stream->Close(absl::AbortedError("replaced by a newer WatchTasks stream"));
  }
  member->stream = std::move(stream);
  member->member.set_last_seen_ms(NowMs());
  if (member->assign.has_value() && member->assign_durable && StillAssigned(*member)) {
    const v1::Task& task = member->assign->assign();
    spdlog::info("coordinator: {}: new task stream; sending job {} rank {} incarnation {} again",
                 member_id, task.job_id(), task.rank(), task.incarnation());
    member->stream->Send(*member->assign);
  }
  Wake();
  return absl::OkStatus();
}

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
    p.checkpoint_step = job.last_checkpoint_step();
    p.recoveries = job.recoveries();
    return p;
  };
  absl::MutexLock lock(&mu_);
  std::vector<const v1::Job*> ended;  // newest first
  for (auto it = jobs_.rbegin(); it != jobs_.rend(); ++it) {
    const v1::Job& job = it->second.job;
    ++out.jobs[job.state()];
    if (IsTerminal(job.state()) && ended.size() < kMetricsRecentJobs) ended.push_back(&job);
  }
  // Oldest first: the recent ended jobs (by creation), interleaved with the running ones.
  auto next_ended = ended.rbegin();
  for (const auto& [n, entry] : jobs_) {
    if (entry.job.state() == v1::JOB_STATE_RUNNING) {
      out.progress.push_back(progress(entry.job));
    } else if (next_ended != ended.rend() && *next_ended == &entry.job) {
      out.progress.push_back(progress(entry.job));
      ++next_ended;
    }
  }
  for (const auto& [id, entry] : members_) {
    ++out.members[{entry.member.role(), entry.member.state()}];
  }
  return out;
}

absl::StatusOr<v1::ProgressAck> Coordinator::ReportProgress(const v1::ProgressReport& report) {
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
  v1::ProgressAck ack;
  {
    absl::MutexLock lock(&mu_);
    if (!store_error_.ok()) return store_error_;
    JobEntry* entry = FindJob(report.job_id());
    if (entry == nullptr) {
      return absl::NotFoundError(absl::StrCat("job_id: no job ", report.job_id()));
    }
    v1::Job& job = entry->job;
    MemberEntry* member = FindMember(report.member_id());
    const int64_t now = NowMs();
    if (member != nullptr && IsLive(member->member)) member->member.set_last_seen_ms(now);
    const bool terminal_phase = report.phase() != v1::TASK_PHASE_TRAINING;
    if (job.state() != v1::JOB_STATE_RUNNING) {
      ack.set_cancel(true);
      if (terminal_phase && member != nullptr) ReleaseWorker(*member, job.id());
    } else if (report.rank() >= job.workers_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank: job ", job.id(), " has ", job.workers_size(), " ranks, got ", report.rank()));
    } else {
      const int rank = report.rank();
      v1::JobWorker& worker = *job.mutable_workers(rank);
      bool accepted = true;
      if (worker.lost() || (report.incarnation() != 0 && worker.incarnation() != 0 &&
                            report.incarnation() != worker.incarnation())) {
        // A report of an earlier assignment of the rank (before a rewind or a hand-over), or of
        // a rank that was given up: ignored.
        accepted = false;
        ack.set_cancel(true);
      } else if (worker.member_id() != report.member_id()) {
        // After a coordinator restart an idle live worker may report a rank: it is rebound to it.
        // Anyone else (a shard, an unknown or departed member, a worker with another task)
        // would wedge the member or the rank.
        if (entry->restart_deadline_ms > 0 && member != nullptr &&
            member->member.role() == v1::MEMBER_ROLE_WORKER && IsLive(member->member) &&
            member->member.job_id().empty()) {
          if (MemberEntry* previous = FindMember(worker.member_id())) {
            ReleaseWorker(*previous, job.id());
          }
          worker.set_member_id(report.member_id());
          worker.set_hostname(member->member.hostname());
          member->member.set_state(v1::MEMBER_STATE_BUSY);
          member->member.set_job_id(job.id());
          member->member.set_rank(rank);
          QueueMember(*member);
          spdlog::info("coordinator: job {} rank {} rebound to {}", job.id(), rank,
                       report.member_id());
        } else {
          accepted = false;
          ack.set_cancel(true);
        }
      } else if (entry->restart_deadline_ms > 0 && member != nullptr && IsLive(member->member) &&
                 member->member.job_id() != job.id()) {
        member->member.set_state(v1::MEMBER_STATE_BUSY);
        member->member.set_job_id(job.id());
        member->member.set_rank(rank);
        QueueMember(*member);
      }
      if (accepted) {
        if (rank < static_cast<int>(entry->rank_seen.size())) entry->rank_seen[rank] = true;
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
            eta = static_cast<double>(report.total_steps() - report.step()) *
                  job.spec().batch_size() / report.samples_per_second();
          }
          job.set_eta_seconds(eta);
          *job.mutable_step_times() = report.step_times();
        }
        if (report.evaluated()) {
          job.set_evaluated(true);
          job.set_test_loss(report.test_loss());
          job.set_test_accuracy(report.test_accuracy());
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

        switch (report.phase()) {
          case v1::TASK_PHASE_FAILED: {
            const std::string cause =
                absl::StrCat("worker rank ", rank, " (", WorkerName(worker),
                             "): ", report.error().empty() ? "unknown error" : report.error());
            if (!job.recovery().empty()) {
              // The recovery assigns the rank again; its worker stays BUSY with the job.
              spdlog::info("coordinator: job {} is recovering; ignoring the failure of {}",
                           job.id(), cause);
              entry->stopped_members.insert(report.member_id());
              entry->dirty = true;
            } else if (report.shard_error() && !entry->checkpoints.empty()) {
              StartRecovery(*entry, cause);
            } else {
              EndJob(*entry, v1::JOB_STATE_FAILED, cause, report.member_id());
              if (member != nullptr) ReleaseWorker(*member, job.id());
            }
            break;
          }
          case v1::TASK_PHASE_SUCCEEDED:
            worker.set_done(true);
            job.set_state(v1::JOB_STATE_SUCCEEDED);
            job.set_reason("");
            job.set_end_time_ms(now);
            job.set_evaluated(true);
            job.set_test_loss(report.test_loss());
            job.set_test_accuracy(report.test_accuracy());
            entry->weights_on_shards = true;
            entry->restart_deadline_ms = 0;
            AddEvent(*entry, absl::StrFormat("succeeded: test accuracy %.4f, test loss %.4f",
                                             job.test_accuracy(), job.test_loss()));
            spdlog::info("coordinator: job {} succeeded (test accuracy {:.4f})", job.id(),
                         job.test_accuracy());
            if (member != nullptr) ReleaseWorker(*member, job.id());
            ApplyRetention();
            break;
          case v1::TASK_PHASE_TRAINING_DONE:
          case v1::TASK_PHASE_TRAINING:
          default:
            if (report.phase() == v1::TASK_PHASE_TRAINING_DONE && !worker.done()) {
              worker.set_done(true);
              if (rank != 0 && member != nullptr) ReleaseWorker(*member, job.id());
            }
            if (report.evaluated()) {
              AddEvent(*entry, absl::StrFormat("epoch %d: test accuracy %.4f, test loss %.4f",
                                               job.epochs(), job.test_accuracy(), job.test_loss()));
            } else if (rank == 0 && job.epoch() != old_epoch) {
              AddEvent(*entry, absl::StrFormat("epoch %d of %d", job.epoch(), job.spec().epochs()));
            } else if (now - entry->last_progress_event_ms >= kProgressEventIntervalMs) {
              AddEvent(*entry,
                       absl::StrFormat("step %d of %d, loss %.4f, %.0f samples/s", job.step(),
                                       job.total_steps(), job.loss(), job.samples_per_second()));
            } else if (now - entry->last_write_ms >= kRecordWriteIntervalMs) {
              QueueJob(*entry);
            } else {
              entry->dirty = true;
            }
            break;
        }
        if (job.state() == v1::JOB_STATE_RUNNING || job.state() == v1::JOB_STATE_SUCCEEDED) {
          bool all_done = job.workers_size() > 0;
          for (const v1::JobWorker& w : job.workers())
            all_done = all_done && (w.done() || w.lost());
          ack.set_all_workers_done(all_done);
        }
      }
    }
  }
  TESSERA_RETURN_IF_ERROR(FlushWrites());
  return ack;
}

// --- Periodic work -------------------------------------------------------------------------------

void Coordinator::ApplyRetention() {
  std::vector<JobEntry*> kept;
  for (auto& [n, entry] : jobs_) {
    if (entry.weights_on_shards) kept.push_back(&entry);
  }
  const size_t retain = static_cast<size_t>(options_.retain_models);
  for (size_t i = 0; i + retain < kept.size(); ++i) {
    JobEntry& old = *kept[i];
    old.weights_on_shards = false;
    for (const std::string& address : old.job.shard_addresses()) {
      QueueDrop(address, old.job.id());
    }
    ForgetCheckpoints(old);
    AddEvent(old, absl::StrCat(kWeightsDropped, " (--retain_models ", options_.retain_models, ")"));
    Wake();
  }
}

void Coordinator::CheckLeases() {
  const int64_t now = NowMs();
  const int64_t lease_ms = absl::ToInt64Milliseconds(options_.lease);
  for (auto& [id, member] : members_) {
    if (!IsLive(member.member) || now - member.member.last_seen_ms() <= lease_ms) continue;
    MemberGone(member, v1::MEMBER_STATE_LOST,
               absl::StrCat("lost: no heartbeat for ", SecondsText(options_.lease)));
  }
  for (auto& [n, entry] : jobs_) {
    if (entry.job.state() == v1::JOB_STATE_RUNNING && entry.restart_deadline_ms > 0 &&
        now >= entry.restart_deadline_ms) {
      entry.restart_deadline_ms = 0;
      for (int rank = 0; rank < entry.job.workers_size(); ++rank) {
        const bool seen = rank < static_cast<int>(entry.rank_seen.size()) && entry.rank_seen[rank];
        const v1::JobWorker& worker = entry.job.workers(rank);
        if (!seen && !worker.done() && !worker.lost()) {
          if (MemberEntry* member = FindMember(worker.member_id())) {
            ReleaseWorker(*member, entry.job.id());
          }
          LoseRank(entry, rank, "lost while the coordinator restarted");
          if (entry.job.state() != v1::JOB_STATE_RUNNING) break;
        }
      }
    }
    if (entry.dirty && now - entry.last_write_ms >= kRecordWriteIntervalMs) QueueJob(entry);
  }
}

void Coordinator::ForgetDepartedMembers() {
  for (const v1::MemberRole role : {v1::MEMBER_ROLE_SERVER, v1::MEMBER_ROLE_WORKER}) {
    std::vector<std::pair<int64_t, std::string>> departed;  // (n, id)
    for (const auto& [id, member] : members_) {
      if (member.member.role() == role && !IsLive(member.member)) {
        departed.emplace_back(member.n, id);
      }
    }
    if (departed.size() <= options_.max_departed_members) continue;
    std::sort(departed.begin(), departed.end());
    departed.resize(departed.size() - options_.max_departed_members);
    for (const auto& [n, id] : departed) {
      members_.erase(id);
      pending_.removed_members.push_back(id);
    }
  }
}

void Coordinator::ReapStreams() {
  for (auto& [id, member] : members_) {
    if (member.stream == nullptr || !member.stream->closed()) continue;
    member.stream.reset();
    if (member.member.job_id().empty()) continue;
    const JobEntry* entry = FindJob(member.member.job_id());
    if (entry == nullptr || IsTerminal(entry->job.state())) {
      ReleaseWorker(member, member.member.job_id());
    }
  }
}

void Coordinator::SetPendingReason(JobEntry& entry, const std::string& reason) {
  if (entry.job.reason() == reason) return;
  entry.job.set_reason(reason);
  QueueJob(entry);
}

void Coordinator::QueueDrop(const std::string& address, const std::string& job_id) {
  ShardDrop drop{address, job_id};
  // A settle of the same drop still waiting in this batch must not delete the row (a batch
  // deletes after it inserts).
  pending_.removed_drops.erase(
      std::remove(pending_.removed_drops.begin(), pending_.removed_drops.end(), drop),
      pending_.removed_drops.end());
  auto [it, added] = drops_.emplace(drop, DropRetry{});
  if (!added) {
    // Owed again, perhaps while a call for it runs (a Restore recreated the job): that call
    // does not settle it.
    ++it->second.generation;
    it->second.next_try_ms = 0;
  }
  pending_.drops.push_back(std::move(drop));
}

void Coordinator::RunShardDrops() {
  std::vector<std::pair<ShardDrop, uint64_t>> due;  // with the generation it had
  {
    absl::MutexLock lock(&mu_);
    if (drops_.empty()) return;
    // A shard that is not live would only make the call wait for its deadline; its drops wait
    // until a shard registers at the address again.
    std::set<std::string> live;
    for (const auto& [id, member] : members_) {
      if (member.member.role() == v1::MEMBER_ROLE_SERVER && IsLive(member.member)) {
        live.insert(member.member.address());
      }
    }
    const int64_t now = NowMs();
    for (const auto& [drop, retry] : drops_) {
      if (retry.next_try_ms <= now && live.count(drop.address) > 0) {
        due.emplace_back(drop, retry.generation);
      }
    }
  }
  // Unlocked: RPCs. After a failure the address's other drops wait for its backoff, so a shard
  // that cannot be called costs one deadline per tick, not one per drop.
  std::vector<std::optional<absl::Status>> results(due.size());  // empty: not tried
  std::set<std::string> failed;
  for (size_t i = 0; i < due.size(); ++i) {
    const ShardDrop& drop = due[i].first;
    if (failed.count(drop.address) > 0) continue;
    results[i] = shards_->DropJob(drop.address, drop.job_id);
    if (!results[i]->ok() && results[i]->code() != absl::StatusCode::kNotFound) {
      failed.insert(drop.address);
    }
  }
  absl::MutexLock lock(&mu_);
  const int64_t now = NowMs();
  for (size_t i = 0; i < due.size(); ++i) {
    const auto& [drop, generation] = due[i];
    auto it = drops_.find(drop);
    if (it == drops_.end()) continue;
    if (!results[i].has_value()) continue;  // not tried this round
    const absl::Status& status = *results[i];
    if (status.ok() || status.code() == absl::StatusCode::kNotFound) {
      if (it->second.generation != generation) continue;  // owed again meanwhile
      pending_.drops.erase(std::remove(pending_.drops.begin(), pending_.drops.end(), drop),
                           pending_.drops.end());
      pending_.removed_drops.push_back(drop);
      drops_.erase(it);
      continue;
    }
    // The backoff applies to every drop the address is owed.
    const int64_t backoff = std::clamp<int64_t>(2 * it->second.backoff_ms, 1000,
                                                absl::ToInt64Milliseconds(kMaxDropBackoff));
    for (auto& [other, retry] : drops_) {
      if (other.address != drop.address) continue;
      retry.backoff_ms = backoff;
      retry.next_try_ms = now + backoff;
    }
    spdlog::warn("coordinator: dropping job {} on shard {} failed, trying again in {}: {}",
                 drop.job_id, drop.address, SecondsText(absl::Milliseconds(backoff)),
                 status.ToString());
  }
}

bool Coordinator::Schedule() {
  std::string job_id;
  v1::JobConfig config;
  std::vector<std::string> addresses;
  std::vector<std::string> picked;
  std::vector<std::pair<std::string, v1::TaskEvent>> assigns;
  {
    absl::MutexLock lock(&mu_);
    JobEntry* entry = nullptr;
    for (auto& [n, candidate] : jobs_) {
      // After a restart, wait until the running jobs' workers are known again: they would look
      // idle before they report.
      if (candidate.restart_deadline_ms > 0) return false;
    }
    for (auto& [n, candidate] : jobs_) {
      if (candidate.job.state() == v1::JOB_STATE_PENDING) {
        entry = &candidate;
        break;
      }
    }
    if (entry == nullptr) return false;
    for (auto& [n, other] : jobs_) {
      if (n > entry->n && other.job.state() == v1::JOB_STATE_PENDING) {
        SetPendingReason(other, absl::StrCat("queued behind ", entry->job.id()));
      }
    }
    const int want_workers = spec::NumWorkers(entry->job.spec());
    std::map<int, const MemberEntry*> live_shards;
    int registered_workers = 0;
    std::vector<MemberEntry*> idle;
    for (auto& [id, member] : members_) {
      const v1::Member& m = member.member;
      if (m.role() == v1::MEMBER_ROLE_SERVER) {
        if (m.state() == v1::MEMBER_STATE_READY) live_shards[m.shard_index()] = &member;
      } else if (IsLive(m)) {
        ++registered_workers;
        if (m.state() == v1::MEMBER_STATE_READY && member.stream != nullptr &&
            !member.stream->closed()) {
          idle.push_back(&member);
        }
      }
    }
    const int num_shards =
        options_.num_shards > 0 ? options_.num_shards : static_cast<int>(live_shards.size());
    int present = 0;
    int missing = -1;
    for (int i = 0; i < num_shards; ++i) {
      if (live_shards.count(i) != 0) {
        ++present;
      } else if (missing < 0) {
        missing = i;
      }
    }
    if (num_shards == 0) {
      SetPendingReason(*entry, "waiting for shards: none registered");
      return false;
    }
    if (missing >= 0) {
      SetPendingReason(
          *entry,
          options_.num_shards > 0
              ? absl::StrCat("waiting for shards: ", present, " of ", num_shards, " registered")
              : absl::StrCat("waiting for shards: indices must run 0..", num_shards - 1, ", shard ",
                             missing, " is missing"));
      return false;
    }
    if (static_cast<int>(idle.size()) < want_workers) {
      SetPendingReason(*entry, absl::StrCat("waiting for ", want_workers, " idle workers, ",
                                            registered_workers, " registered",
                                            registered_workers > static_cast<int>(idle.size())
                                                ? absl::StrCat(", ", idle.size(), " idle")
                                                : std::string()));
      return false;
    }
    std::sort(idle.begin(), idle.end(),
              [](const MemberEntry* a, const MemberEntry* b) { return a->n < b->n; });
    job_id = entry->job.id();
    for (int rank = 0; rank < want_workers; ++rank) {
      v1::Member& m = idle[rank]->member;
      m.set_state(v1::MEMBER_STATE_BUSY);
      m.set_job_id(job_id);
      m.set_rank(rank);
      QueueMember(*idle[rank]);
      picked.push_back(m.id());
    }
    for (int i = 0; i < num_shards; ++i) addresses.push_back(live_shards[i]->member.address());
    config = spec::MakeJobConfig(entry->job.spec());
    entry->starting = true;
  }

  // Unlocked: RPCs to the shards. The workers are marked BUSY, so nothing else takes them.
  absl::Status shard_error;
  for (size_t i = 0; i < addresses.size() && shard_error.ok(); ++i) {
    absl::Status status = shards_->CreateJobState(addresses[i], job_id, config);
    if (!status.ok()) {
      shard_error = absl::Status(
          status.code(), absl::StrCat("shard ", i, " (", addresses[i], "): ", status.message()));
    }
  }

  {
    absl::MutexLock lock(&mu_);
    JobEntry* entry = FindJob(job_id);
    entry->starting = false;
    auto release_picked = [&] {
      for (const std::string& id : picked) {
        if (MemberEntry* member = FindMember(id)) ReleaseWorker(*member, job_id);
      }
    };
    if (entry->job.state() != v1::JOB_STATE_PENDING) {
      // Cancelled while the shards were called.
      release_picked();
      for (const std::string& address : addresses) QueueDrop(address, job_id);
      return true;  // the queue moved
    } else if (!shard_error.ok()) {
      release_picked();
      for (const std::string& address : addresses) QueueDrop(address, job_id);
      EndJob(*entry, v1::JOB_STATE_FAILED, std::string(shard_error.message()), "");
      return true;
    } else {
      bool all_there = true;
      for (const std::string& id : picked) {
        const MemberEntry* member = FindMember(id);
        all_there = all_there && member != nullptr && member->stream != nullptr &&
                    !member->stream->closed() && member->member.state() == v1::MEMBER_STATE_BUSY &&
                    member->member.job_id() == job_id;
      }
      if (!all_there) {
        // A worker went away meanwhile: the job stays queued and the next pass tries again.
        release_picked();
      } else {
        v1::Job& job = entry->job;
        const int64_t now = NowMs();
        job.set_state(v1::JOB_STATE_RUNNING);
        job.set_reason("");
        job.set_start_time_ms(now);
        job.clear_shard_addresses();
        for (const std::string& address : addresses) job.add_shard_addresses(address);
        job.clear_workers();
        for (size_t rank = 0; rank < picked.size(); ++rank) {
          MemberEntry& member = *FindMember(picked[rank]);
          v1::JobWorker* worker = job.add_workers();
          worker->set_rank(static_cast<int>(rank));
          worker->set_member_id(member.member.id());
          worker->set_hostname(member.member.hostname());
          worker->set_incarnation(static_cast<uint64_t>(now) * 1024 + rank);
        }
        AddEvent(*entry, absl::StrCat("started on ", picked.size(), " workers and ",
                                      addresses.size(), " shards"));
        spdlog::info("coordinator: job {} started on {} workers and {} shards", job_id,
                     picked.size(), addresses.size());
        for (size_t rank = 0; rank < picked.size(); ++rank) {
          MemberEntry& member = *FindMember(picked[rank]);
          v1::TaskEvent event;
          v1::Task* task = event.mutable_assign();
          task->set_job_id(job_id);
          task->set_rank(static_cast<int>(rank));
          task->set_world_size(static_cast<int>(picked.size()));
          for (const std::string& address : addresses) task->add_shard_addresses(address);
          *task->mutable_spec() = job.spec();
          task->set_incarnation(job.workers(static_cast<int>(rank)).incarnation());
          RecordAssign(member, event);
          assigns.emplace_back(member.member.id(), std::move(event));
        }
      }
    }
  }
  if (assigns.empty()) return false;
  // The workers hear of the task only once RUNNING (and their BUSY records) is durable: a
  // coordinator killed before that restarts with the job PENDING, and nobody trains it. A cancel
  // that lands in between may reach a worker before its assign; its next report then gets
  // ack.cancel.
  absl::Status flushed = FlushWrites();
  if (!flushed.ok()) {
    spdlog::error("coordinator: job {} not started: {}", job_id, flushed.ToString());
    return false;
  }
  SendAssigns(assigns);
  return true;
}

void Coordinator::Tick() {
  absl::MutexLock tick_lock(&tick_mu_);
  RunShardDrops();
  ReapActions(/*all=*/false);
  std::vector<std::function<void()>> actions;
  {
    absl::MutexLock lock(&mu_);
    ReapStreams();
    CheckLeases();
    ForgetDepartedMembers();
    actions = PlanActions();
  }
  (void)FlushWrites();
  for (std::function<void()>& action : actions) RunAction(std::move(action));
  // Start as many queued jobs as fit, oldest first; each pass starts at most one.
  for (size_t passes = 0; passes < 1000 && Schedule(); ++passes) {
  }
  RunShardDrops();
  (void)FlushWrites();
}

// --- Fault tolerance -----------------------------------------------------------------------------

void Coordinator::RunAction(std::function<void()> action) {
  if (options_.inline_actions) {
    action();
    return;
  }
  absl::MutexLock lock(&actions_mu_);
  if (actions_stopped_) return;
  auto done = std::make_shared<bool>(false);
  std::thread thread([this, done, action = std::move(action)] {
    action();
    absl::MutexLock lock(&actions_mu_);
    *done = true;
  });
  actions_.push_back({std::move(thread), std::move(done)});
}

void Coordinator::ReapActions(bool all) {
  std::vector<ActionThread> finished;
  {
    absl::MutexLock lock(&actions_mu_);
    if (all) actions_stopped_ = true;
    std::vector<ActionThread> running;
    for (ActionThread& action : actions_) {
      (all || *action.done ? finished : running).push_back(std::move(action));
    }
    actions_.swap(running);
  }
  // Unlocked: an action takes actions_mu_ as it ends.
  for (ActionThread& action : finished) action.thread.join();
}

int64_t Coordinator::MaxRankStep(const v1::Job& job) const {
  int64_t max_step = 0;
  for (const v1::JobWorker& worker : job.workers()) {
    if (!worker.lost()) max_step = std::max(max_step, worker.step());
  }
  return max_step;
}

int64_t Coordinator::StepMargin(const JobEntry& entry, int attempt) const {
  const v1::Job& job = entry.job;
  int live = 0;
  for (const v1::JobWorker& worker : job.workers()) live += worker.lost() ? 0 : 1;
  const double per_step = static_cast<double>(job.spec().batch_size()) * std::max(1, live);
  const double rate = per_step > 0 ? job.samples_per_second() / per_step : 0;  // steps/s a rank
  // One second of steps: the reports trail the workers by at most one progress interval
  // (0.5 s). Doubled after each attempt that came too late.
  int64_t margin = std::max<int64_t>(10, static_cast<int64_t>(std::ceil(rate)));
  for (int i = 0; i < attempt && margin < (int64_t{1} << 40); ++i) margin *= 2;
  if (job.total_steps() > 0) margin = std::min(margin, job.total_steps());
  return margin;
}

uint64_t Coordinator::NextIncarnation(const v1::Job& job) const {
  uint64_t next = static_cast<uint64_t>(NowMs()) * 1024;
  next = std::max(next, static_cast<uint64_t>(job.start_time_ms()) * 1024 +
                            static_cast<uint64_t>(job.workers_size()));
  for (const v1::JobWorker& worker : job.workers()) {
    next = std::max(next, worker.incarnation() + 1);
  }
  return next;
}

v1::DataPosition Coordinator::PositionAt(const v1::Job& job, int64_t step) const {
  // The trainer derives the pass itself (it knows its split's size) and checks the rest.
  v1::DataPosition position;
  const int64_t spe = job.steps_per_epoch();
  position.set_epoch(spe > 0 ? static_cast<int32_t>(step / spe) : 0);
  position.set_batch_offset(spe > 0 ? step % spe : step);
  position.set_pass(0);
  position.set_seed(job.spec().seed());
  return position;
}

void Coordinator::ForgetCheckpoints(JobEntry& entry) {
  if (entry.checkpoints.empty() && entry.job.last_checkpoint_step() == 0) return;
  entry.checkpoints.clear();
  pending_.removed_checkpoints.push_back({entry.job.id(), -1});
}

void Coordinator::StartRecovery(JobEntry& entry, const std::string& cause) {
  v1::Job& job = entry.job;
  if (!job.recovery().empty()) {
    spdlog::info("coordinator: job {} is already recovering; also: {}", job.id(), cause);
    return;
  }
  if (entry.checkpoints.empty()) {
    EndJob(entry, v1::JOB_STATE_FAILED, cause, "");
    return;
  }
  if (job.recoveries() >= options_.max_recoveries) {
    EndJob(entry, v1::JOB_STATE_FAILED,
           absl::StrCat(cause, " (recovered ", job.recoveries(), " times already; giving up)"), "");
    return;
  }
  job.set_recovery(
      absl::StrCat(cause, ": recovering from checkpoint ", entry.checkpoints.front().step()));
  entry.recovery_since_ms = NowMs();
  spdlog::info("coordinator: job {}: {}", job.id(), job.recovery());
  AddEvent(entry, job.recovery());
  Wake();
}

void Coordinator::LoseRank(JobEntry& entry, int rank, const std::string& why) {
  v1::Job& job = entry.job;
  v1::JobWorker& worker = *job.mutable_workers(rank);
  const std::string what = absl::StrCat("worker rank ", rank, " (", WorkerName(worker), ") ", why);
  worker.set_lost(true);
  worker.set_samples_per_second(0);
  int live = 0;
  for (const v1::JobWorker& w : job.workers()) live += w.lost() ? 0 : 1;
  if (live == 0) {
    EndJob(entry, v1::JOB_STATE_FAILED, what, "");
    return;
  }
  entry.membership_dirty = true;
  spdlog::info("coordinator: job {}: {}; continuing with {} workers", job.id(), what, live);
  AddEvent(entry, absl::StrCat(what, "; continuing with ", live, " workers"));
  Wake();
}

std::vector<std::function<void()>> Coordinator::PlanActions() {
  std::vector<std::function<void()>> actions;
  const int64_t now = NowMs();
  std::map<int, std::string> live_shards;  // index -> address
  std::vector<MemberEntry*> idle;
  for (auto& [id, member] : members_) {
    const v1::Member& m = member.member;
    if (m.role() == v1::MEMBER_ROLE_SERVER) {
      if (m.state() == v1::MEMBER_STATE_READY) live_shards[m.shard_index()] = m.address();
    } else if (m.state() == v1::MEMBER_STATE_READY && m.job_id().empty() &&
               member.stream != nullptr && !member.stream->closed()) {
      idle.push_back(&member);
    }
  }
  std::sort(idle.begin(), idle.end(),
            [](const MemberEntry* a, const MemberEntry* b) { return a->n < b->n; });
  size_t next_idle = 0;
  for (auto& [n, entry] : jobs_) {
    v1::Job& job = entry.job;
    if (job.state() != v1::JOB_STATE_RUNNING || entry.restart_deadline_ms > 0) continue;
    // Automatic checkpoints have a slot of their own: the call waits on the shards until the step
    // is written, and membership changes and recoveries must not queue behind it.
    const int64_t every = job.spec().checkpoint_every_steps();
    if (every > 0 && !entry.checkpoint_running && job.recovery().empty()) {
      // The next multiple to commit: the newest one the job has reached if it is not committed
      // yet, else the first one after the newest commit (a manual one may lie between two
      // multiples), and never one that failed (the one after it instead). The call is made ahead
      // of time (a long poll: a shard answers once that step's file is durable), so the commit
      // follows the write at once instead of the workers' next progress report.
      const int64_t last = job.last_checkpoint_step();
      const int64_t reached = job.step() / every * every;
      int64_t next = reached > last ? reached : (last / every + 1) * every;
      if (next <= entry.checkpoint_failed_step) {
        next = (entry.checkpoint_failed_step / every + 1) * every;
      }
      // Ahead of the job only while total_steps is known (the workers report it): a step past
      // the end never comes, and its call would hold a thread until its deadline.
      const int64_t limit = job.total_steps() > 0 ? job.total_steps() : job.step();
      if (next <= limit) {
        absl::StatusOr<CheckpointPlan> plan = PlanCheckpoint(entry, next, /*manual=*/false);
        if (plan.ok()) {
          entry.checkpoint_running = true;
          actions.push_back([this, plan = *plan] { AutoCheckpoint(plan); });
        }
      }
    }
    if (entry.action_running) continue;
    std::vector<uint32_t> live_ranks;
    int lost_rank = -1;
    for (int rank = 0; rank < job.workers_size(); ++rank) {
      if (!job.workers(rank).lost()) {
        live_ranks.push_back(static_cast<uint32_t>(rank));
      } else if (lost_rank < 0) {
        lost_rank = rank;
      }
    }
    const std::string job_id = job.id();

    if (!job.recovery().empty()) {
      // Recovery: every shard index of the job needs a live shard.
      std::vector<std::string> addresses;
      int missing = -1;
      for (int i = 0; i < job.shard_addresses_size() && missing < 0; ++i) {
        auto it = live_shards.find(i);
        if (it == live_shards.end()) {
          missing = i;
        } else {
          addresses.push_back(it->second);
        }
      }
      if (now - entry.recovery_since_ms >= absl::ToInt64Milliseconds(options_.recovery_timeout)) {
        EndJob(entry, v1::JOB_STATE_FAILED,
               absl::StrCat("not recovered within ", SecondsText(options_.recovery_timeout), " (",
                            job.recovery(), ")"),
               "");
        continue;
      }
      if (missing >= 0) continue;
      for (int i = 0; i < job.shard_addresses_size(); ++i) {
        if (job.shard_addresses(i) != addresses[i]) {
          spdlog::info("coordinator: job {}: shard {} is now at {}", job_id, i, addresses[i]);
          job.set_shard_addresses(i, addresses[i]);
        }
      }
      RecoveryPlan plan;
      plan.job_id = job_id;
      for (const v1::CheckpointRecord& record : entry.checkpoints)
        plan.steps.push_back(record.step());
      plan.addresses = std::move(addresses);
      plan.live_ranks = live_ranks;
      plan.incarnation_base = NextIncarnation(job);
      entry.action_running = true;
      QueueJob(entry);
      actions.push_back([this, plan] { Recover(plan); });
      continue;
    }

    const std::vector<std::string> addresses(job.shard_addresses().begin(),
                                             job.shard_addresses().end());
    // Joins the job has reached are history (and a rank lost again has left anyway).
    for (auto it = entry.joins.begin(); it != entry.joins.end();) {
      const bool over = it->second <= job.step() || it->first >= job.workers_size() ||
                        job.workers(it->first).lost();
      it = over ? entry.joins.erase(it) : std::next(it);
    }
    // A lost rank leaves the shards' membership first (so the steps in between do not wait for
    // it), then joins again with an idle worker at a step ahead of the job. The live ranks are
    // sent from the job's step on, except that a rank handed over at a later step joins there
    // again (the shards replace their history from each update's step on).
    const bool send_membership = entry.membership_dirty;
    MembershipLayers layers;
    if (send_membership) layers = LayeredMembership(entry, live_ranks, job.step());
    if (lost_rank >= 0 && next_idle < idle.size()) {
      MemberEntry& member = *idle[next_idle++];
      member.member.set_state(v1::MEMBER_STATE_BUSY);
      member.member.set_job_id(job_id);
      member.member.set_rank(lost_rank);
      QueueMember(member);
      HandoverPlan plan;
      plan.job_id = job_id;
      plan.rank = lost_rank;
      plan.member_id = member.member.id();
      // After a join that came too late, the shards' answer (the steps they had done) is a
      // fresher floor than the workers' reports, which trail by up to one progress interval.
      const int64_t margin = StepMargin(entry, entry.handover_attempts);
      plan.start_step = std::max(MaxRankStep(job), entry.handover_floor) + margin;
      if (job.total_steps() > 0) plan.start_step = std::min(plan.start_step, job.total_steps());
      plan.addresses = addresses;
      plan.live_ranks = live_ranks;
      plan.resend = std::move(layers);
      entry.membership_dirty = false;
      entry.action_running = true;
      actions.push_back([this, plan] {
        if (!plan.resend.empty()) SendMembership(plan.job_id, plan.addresses, plan.resend);
        Handover(plan);
      });
      continue;
    }
    if (send_membership) {
      entry.membership_dirty = false;
      entry.action_running = true;
      actions.push_back([this, job_id, addresses, layers = std::move(layers)] {
        SendMembership(job_id, addresses, layers);
        absl::MutexLock lock(&mu_);
        if (JobEntry* e = FindJob(job_id)) e->action_running = false;
        Wake();
      });
      continue;
    }
  }
  return actions;
}

absl::StatusOr<Coordinator::CheckpointPlan> Coordinator::PlanCheckpoint(JobEntry& entry,
                                                                        int64_t step, bool manual) {
  const v1::Job& job = entry.job;
  if (job.state() != v1::JOB_STATE_RUNNING) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job.id(), " is ",
                                                      v1::JobState_Name(job.state()),
                                                      "; only a RUNNING job takes checkpoints"));
  }
  if (!job.recovery().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id(), " is recovering (", job.recovery(), "); try again later"));
  }
  CheckpointPlan plan;
  plan.job_id = job.id();
  plan.step = step;
  plan.addresses.assign(job.shard_addresses().begin(), job.shard_addresses().end());
  plan.recoveries = job.recoveries();
  plan.manual = manual;
  // The shards delete the files older than the K-th newest COMMITTED checkpoint once they have
  // written this one: the one being written does not count, because it may still fail on another
  // shard and then the committed ones are all the job has.
  std::vector<int64_t> steps;
  for (const v1::CheckpointRecord& record : entry.checkpoints) {
    if (record.step() != step) steps.push_back(record.step());
  }
  std::sort(steps.rbegin(), steps.rend());
  const size_t keep = KeepCheckpoints(job.spec());
  plan.retain_from_step = steps.size() >= keep ? steps[keep - 1] : 0;
  return plan;
}

absl::StatusOr<std::vector<v1::CheckpointResponse>> Coordinator::CallCheckpoint(
    const CheckpointPlan& plan) {
  // Every shard at once: each call answers only once that shard has written the step, and the
  // shards train in lockstep, so a shard asked after another one answered would be past the step.
  const size_t n = plan.addresses.size();
  std::vector<absl::StatusOr<v1::CheckpointResponse>> results(
      n, absl::StatusOr<v1::CheckpointResponse>(absl::UnknownError("not called")));
  auto call = [this, &plan, &results](size_t i) {
    v1::CheckpointRequest request;
    request.set_job_id(plan.job_id);
    request.set_step(plan.step);
    request.set_retain_from_step(plan.retain_from_step);
    results[i] = shards_->Checkpoint(plan.addresses[i], request, options_.checkpoint_timeout);
  };
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 1; i < n; ++i) threads.emplace_back(call, i);
  if (n > 0) call(0);  // shard 0 on this thread
  for (std::thread& thread : threads) thread.join();
  std::vector<v1::CheckpointResponse> responses;
  for (size_t i = 0; i < n; ++i) {
    if (!results[i].ok()) {
      return absl::Status(
          results[i].status().code(),
          absl::StrCat("shard ", i, " (", plan.addresses[i], "): ", results[i].status().message()));
    }
    responses.push_back(*std::move(results[i]));
  }
  return responses;
}

absl::StatusOr<v1::CheckpointRecord> Coordinator::CommitCheckpoint(
    const CheckpointPlan& plan, const std::vector<v1::CheckpointResponse>& responses) {
  v1::CheckpointRecord record;
  {
    absl::MutexLock lock(&mu_);
    if (!store_error_.ok()) return store_error_;
    JobEntry* entry = FindJob(plan.job_id);
    if (entry == nullptr || entry->job.state() != v1::JOB_STATE_RUNNING ||
        entry->job.recoveries() != plan.recoveries || !entry->job.recovery().empty()) {
      return absl::AbortedError(absl::StrCat("job ", plan.job_id,
                                             " ended or recovered while checkpoint ", plan.step,
                                             " was written; not committed"));
    }
    v1::Job& job = entry->job;
    record.set_job_id(job.id());
    record.set_step(plan.step);
    record.set_time_ms(NowMs());
    record.set_manual(plan.manual);
    uint64_t bytes = 0;
    for (size_t i = 0; i < responses.size(); ++i) {
      v1::ShardCheckpoint* shard = record.add_shards();
      shard->set_shard_index(static_cast<int32_t>(i));
      shard->set_address(plan.addresses[i]);
      shard->set_path(responses[i].path());
      shard->set_bytes(responses[i].bytes());
      shard->set_crc32c(responses[i].crc32c());
      bytes += responses[i].bytes();
    }
    for (int rank = 0; rank < job.workers_size(); ++rank) {
      *record.add_positions() = PositionAt(job, plan.step);
    }
    std::vector<v1::CheckpointRecord>& kept = entry->checkpoints;
    kept.erase(std::remove_if(kept.begin(), kept.end(),
                              [&](const v1::CheckpointRecord& r) { return r.step() == plan.step; }),
               kept.end());
    kept.insert(std::upper_bound(
                    kept.begin(), kept.end(), plan.step,
                    [](int64_t step, const v1::CheckpointRecord& r) { return step > r.step(); }),
                record);
    const size_t keep = KeepCheckpoints(job.spec());
    while (kept.size() > keep) {
      pending_.removed_checkpoints.push_back({job.id(), kept.back().step()});
      kept.pop_back();
    }
    pending_.checkpoints.push_back(record);
    job.set_last_checkpoint_step(kept.front().step());
    if (plan.step == entry->checkpoint_failed_step) entry->checkpoint_failed_step = 0;
    spdlog::info("coordinator: job {}: checkpoint {} committed ({} shards, {} bytes)", job.id(),
                 plan.step, responses.size(), bytes);
    AddEvent(*entry,
             absl::StrCat("checkpoint ", plan.step, " committed", plan.manual ? " (by hand)" : "",
                          ": ", responses.size(), " shards, ", bytes, " bytes"));
  }
  TESSERA_RETURN_IF_ERROR(FlushWrites());
  return record;
}

void Coordinator::AutoCheckpoint(const CheckpointPlan& plan) {
  absl::StatusOr<std::vector<v1::CheckpointResponse>> responses = CallCheckpoint(plan);
  absl::Status status = responses.status();
  if (responses.ok()) status = CommitCheckpoint(plan, *responses).status();
  absl::MutexLock lock(&mu_);
  JobEntry* entry = FindJob(plan.job_id);
  if (entry == nullptr) return;
  entry->checkpoint_running = false;
  // A call cut short (its deadline, a shutdown, or the job restored or dropped under it) is
  // simply made again on a later tick when it still makes sense. So is one that a recovery
  // overtook: its error is most likely the lost shard's, and the step is still worth taking
  // from the restored state.
  const bool interrupted = status.code() == absl::StatusCode::kDeadlineExceeded ||
                           status.code() == absl::StatusCode::kAborted ||
                           status.code() == absl::StatusCode::kCancelled ||
                           entry->job.recoveries() != plan.recoveries ||
                           !entry->job.recovery().empty();
  if (!status.ok() && !interrupted && entry->job.state() == v1::JOB_STATE_RUNNING) {
    // Nothing is committed; the job goes on, and the next multiple is tried.
    entry->checkpoint_failed_step = plan.step;
    spdlog::warn("coordinator: job {}: checkpoint {} failed: {}", plan.job_id, plan.step,
                 status.ToString());
    AddEvent(*entry, absl::StrCat("checkpoint ", plan.step, " failed: ", status.message()));
  }
  Wake();
}

absl::StatusOr<v1::CheckpointRecord> Coordinator::CheckpointJob(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must be set");
  absl::Status last;
  for (int attempt = 0; attempt < kCheckpointAttempts; ++attempt) {
    CheckpointPlan plan;
    {
      absl::MutexLock lock(&mu_);
      if (!store_error_.ok()) return store_error_;
      if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
      JobEntry* entry = FindJob(job_id);
      if (entry == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job ", job_id));
      if (entry->restart_deadline_ms > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", job_id, " waits for its workers after a coordinator restart; try again later"));
      }
      const v1::Job& job = entry->job;
      const int64_t max_step = MaxRankStep(job);
      int64_t step = max_step + StepMargin(*entry, attempt);
      if (job.total_steps() > 0) step = std::min(step, job.total_steps());
      if (job.state() == v1::JOB_STATE_RUNNING && step <= max_step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", job_id, " has done its ", job.total_steps(), " steps; nothing to checkpoint"));
      }
      TESSERA_ASSIGN_OR_RETURN(plan, PlanCheckpoint(*entry, step, /*manual=*/true));
    }
    // Unlocked: the shards answer once the job has reached the step and the files are durable.
    absl::StatusOr<std::vector<v1::CheckpointResponse>> responses = CallCheckpoint(plan);
    if (responses.ok()) return CommitCheckpoint(plan, *responses);
    if (responses.status().code() != absl::StatusCode::kFailedPrecondition) {
      return responses.status();
    }
    last = responses.status();
    spdlog::info("coordinator: job {}: checkpoint {} came too late ({}); trying further ahead",
                 job_id, plan.step, std::string(last.message()));
  }
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, ": no checkpoint after ",
                                                    kCheckpointAttempts,
                                                    " tries, each too late: ", last.message()));
}

Coordinator::MembershipLayers Coordinator::LayeredMembership(
    const JobEntry& entry, const std::vector<uint32_t>& live_ranks, int64_t effective_step) const {
  std::map<int64_t, std::vector<uint32_t>> joining;  // join step -> the ranks joining there
  std::set<uint32_t> pending;
  for (const auto& [rank, step] : entry.joins) {
    const uint32_t r = static_cast<uint32_t>(rank);
    if (step > effective_step &&
        std::find(live_ranks.begin(), live_ranks.end(), r) != live_ranks.end()) {
      joining[step].push_back(r);
      pending.insert(r);
    }
  }
  MembershipLayers layers;
  std::vector<uint32_t> live;
  for (uint32_t rank : live_ranks) {
    if (pending.count(rank) == 0) live.push_back(rank);
  }
  // Without a rank live before the first join (the others are all lost) that layer cannot be
  // sent (the shards refuse an empty set); the joins still are.
  if (!live.empty()) layers.emplace_back(effective_step, live);
  for (auto& [step, ranks] : joining) {
    live.insert(live.end(), ranks.begin(), ranks.end());
    std::sort(live.begin(), live.end());
    layers.emplace_back(step, live);
  }
  return layers;
}

void Coordinator::SendMembership(const std::string& job_id,
                                 const std::vector<std::string>& addresses,
                                 const MembershipLayers& layers) {
  bool failed = false;
  for (size_t i = 0; i < addresses.size(); ++i) {
    // In order: each update replaces the shard's history from its step on.
    for (const auto& [effective_step, live_ranks] : layers) {
      v1::UpdateMembershipRequest request;
      request.set_job_id(job_id);
      for (uint32_t rank : live_ranks) request.add_live_workers(rank);
      request.set_effective_step(effective_step);
      absl::StatusOr<v1::UpdateMembershipResponse> response =
          shards_->UpdateMembership(addresses[i], request);
      if (!response.ok()) {
        failed = true;
        spdlog::warn("coordinator: job {}: UpdateMembership at step {} on shard {} ({}) failed: {}",
                     job_id, effective_step, i, addresses[i], response.status().ToString());
        break;
      }
    }
  }
  if (failed) {
    // Tried again on a later tick; a shard that is gone is noticed by its lease.
    absl::MutexLock lock(&mu_);
    if (JobEntry* entry = FindJob(job_id)) entry->membership_dirty = true;
  }
}

void Coordinator::Recover(const RecoveryPlan& plan) {
  // Unlocked: Restore on every shard (the live ones too, so the cut is consistent), newest
  // checkpoint first.
  int64_t restored = -1;
  absl::Status retry;  // a failure that is not the checkpoint's fault: try again later
  std::vector<std::string> unusable;
  for (int64_t step : plan.steps) {
    bool usable = true;
    for (size_t i = 0; i < plan.addresses.size() && usable && retry.ok(); ++i) {
      v1::RestoreRequest request;
      request.set_job_id(plan.job_id);
      request.set_step(step);
      request.set_min_incarnation(plan.incarnation_base);
      absl::StatusOr<v1::RestoreResponse> response = shards_->Restore(plan.addresses[i], request);
      if (response.ok()) continue;
      const std::string what = absl::StrCat("checkpoint ", step, " on shard ", i, " (",
                                            plan.addresses[i], "): ", response.status().message());
      if (CheckpointUnusable(response.status())) {
        usable = false;
        unusable.push_back(what);
        spdlog::warn("coordinator: job {}: {}; trying an older checkpoint", plan.job_id, what);
      } else {
        retry = absl::Status(response.status().code(), what);
      }
    }
    if (!retry.ok()) break;
    if (usable) {
      restored = step;
      break;
    }
  }
  if (restored >= 0) {
    v1::UpdateMembershipRequest request;
    request.set_job_id(plan.job_id);
    for (uint32_t rank : plan.live_ranks) request.add_live_workers(rank);
    request.set_effective_step(restored);
    for (size_t i = 0; i < plan.addresses.size() && retry.ok(); ++i) {
      absl::StatusOr<v1::UpdateMembershipResponse> response =
          shards_->UpdateMembership(plan.addresses[i], request);
      if (!response.ok()) {
        retry = absl::Status(response.status().code(),
                             absl::StrCat("UpdateMembership on shard ", i, " (", plan.addresses[i],
                                          "): ", response.status().message()));
      }
    }
  }

  std::vector<std::pair<std::string, v1::TaskEvent>> assigns;
  {
    absl::MutexLock lock(&mu_);
    JobEntry* entry = FindJob(plan.job_id);
    if (entry == nullptr) return;
    entry->action_running = false;
    Wake();
    v1::Job& job = entry->job;
    if (job.state() != v1::JOB_STATE_RUNNING) {
      // Ended meanwhile: what Restore created on the shards goes too.
      for (const std::string& address : plan.addresses) QueueDrop(address, job.id());
      return;
    }
    if (!retry.ok()) {
      spdlog::warn("coordinator: job {}: recovery attempt failed, trying again: {}", job.id(),
                   retry.ToString());
      return;
    }
    if (restored < 0) {
      EndJob(*entry, v1::JOB_STATE_FAILED,
             absl::StrCat("no checkpoint could be restored: ", absl::StrJoin(unusable, "; ")), "");
    } else {
      // Checkpoints newer than the restored one are unusable: forget them.
      std::vector<v1::CheckpointRecord>& kept = entry->checkpoints;
      while (!kept.empty() && kept.front().step() > restored) {
        pending_.removed_checkpoints.push_back({job.id(), kept.front().step()});
        kept.erase(kept.begin());
      }
      job.set_last_checkpoint_step(restored);
      const int64_t from = job.step();
      job.set_step(restored);
      job.set_recoveries(job.recoveries() + 1);
      job.clear_recovery();
      // The shards have just heard plan.live_ranks, every one from the checkpoint on: no join is
      // pending any more. A rank of them lost while the restore ran is still live there, so
      // they must hear the live ranks again.
      entry->joins.clear();
      entry->membership_dirty = false;
      for (uint32_t rank : plan.live_ranks) {
        if (job.workers(static_cast<int>(rank)).lost()) entry->membership_dirty = true;
      }
      entry->checkpoint_failed_step = 0;
      entry->stopped_members.clear();
      AddEvent(*entry, absl::StrCat("restored checkpoint ", restored,
                                    "; workers rewound from step ", from, " to ", restored));
      spdlog::info("coordinator: job {}: restored checkpoint {}; workers rewound from step {}",
                   job.id(), restored, from);
      for (uint32_t rank : plan.live_ranks) {
        v1::JobWorker& worker = *job.mutable_workers(static_cast<int>(rank));
        if (worker.lost()) continue;  // lost meanwhile: its membership change is pending
        MemberEntry* member = FindMember(worker.member_id());
        const bool usable =
            member != nullptr && IsLive(member->member) && member->stream != nullptr &&
            !member->stream->closed() &&
            (member->member.job_id() == job.id() || member->member.job_id().empty());
        if (!usable) {
          LoseRank(*entry, static_cast<int>(rank), "is gone (no live worker with a task stream)");
          if (job.state() != v1::JOB_STATE_RUNNING) return;
          continue;
        }
        worker.set_step(restored);
        worker.set_done(false);
        worker.set_incarnation(plan.incarnation_base + rank);
        member->member.set_state(v1::MEMBER_STATE_BUSY);
        member->member.set_job_id(job.id());
        member->member.set_rank(static_cast<int>(rank));
        QueueMember(*member);
        v1::TaskEvent event;
        v1::Task* task = event.mutable_assign();
        task->set_job_id(job.id());
        task->set_rank(static_cast<int>(rank));
        task->set_world_size(job.workers_size());
        for (const std::string& address : job.shard_addresses()) task->add_shard_addresses(address);
        *task->mutable_spec() = job.spec();
        task->set_incarnation(worker.incarnation());
        task->set_start_step(restored);
        *task->mutable_data_position() = PositionAt(job, restored);
        RecordAssign(*member, event);
        assigns.emplace_back(member->member.id(), std::move(event));
      }
      QueueJob(*entry);
    }
  }
  // As in Schedule: the tasks go out once the rewind is durable.
  if (!FlushWrites().ok()) return;
  SendAssigns(assigns);
}

void Coordinator::Handover(const HandoverPlan& plan) {
  // Unlocked: the join, and its undo when a shard is already past the start step.
  v1::UpdateMembershipRequest join;
  join.set_job_id(plan.job_id);
  for (uint32_t rank : plan.live_ranks) join.add_live_workers(rank);
  join.add_live_workers(static_cast<uint32_t>(plan.rank));
  std::sort(join.mutable_live_workers()->begin(), join.mutable_live_workers()->end());
  join.set_effective_step(plan.start_step);
  absl::Status failed;
  int64_t completed = 0;
  for (size_t i = 0; i < plan.addresses.size() && failed.ok(); ++i) {
    absl::StatusOr<v1::UpdateMembershipResponse> response =
        shards_->UpdateMembership(plan.addresses[i], join);
    if (!response.ok()) {
      failed = response.status();
    } else {
      completed = std::max(completed, response->completed_steps());
    }
  }
  const bool too_late = failed.ok() && completed > plan.start_step;
  if (!failed.ok() || too_late) {
    SendMembership(plan.job_id, plan.addresses, {{plan.start_step, plan.live_ranks}});
  }

  std::vector<std::pair<std::string, v1::TaskEvent>> assigns;
  {
    absl::MutexLock lock(&mu_);
    JobEntry* entry = FindJob(plan.job_id);
    MemberEntry* member = FindMember(plan.member_id);
    if (entry == nullptr) return;
    entry->action_running = false;
    Wake();
    v1::Job& job = entry->job;
    const bool reserved = member != nullptr && IsLive(member->member) &&
                          member->member.job_id() == job.id() && member->member.rank() == plan.rank;
    const bool usable = reserved && member->stream != nullptr && !member->stream->closed();
    if (!failed.ok() || too_late || !usable || job.state() != v1::JOB_STATE_RUNNING ||
        !job.recovery().empty() || !job.workers(plan.rank).lost()) {
      if (reserved) ReleaseWorker(*member, job.id());
      if (job.state() != v1::JOB_STATE_RUNNING) return;
      if (too_late) {
        ++entry->handover_attempts;
        entry->handover_floor = std::max(entry->handover_floor, completed);
        spdlog::info(
            "coordinator: job {}: handing rank {} over at step {} came too late (a shard has "
            "done {} steps); trying further ahead",
            job.id(), plan.rank, plan.start_step, completed);
      } else if (!failed.ok()) {
        spdlog::warn("coordinator: job {}: handing rank {} over failed: {}", job.id(), plan.rank,
                     failed.ToString());
      } else {
        // The join reached the shards but the rank cannot be handed over now: the shards hear
        // the live ranks again.
        entry->membership_dirty = true;
      }
      return;
    }
    v1::JobWorker& worker = *job.mutable_workers(plan.rank);
    const std::string old = WorkerName(worker);
    worker.set_lost(false);
    worker.set_member_id(member->member.id());
    worker.set_hostname(member->member.hostname());
    worker.set_step(plan.start_step);
    worker.set_done(false);
    worker.set_samples_per_second(0);
    worker.set_incarnation(NextIncarnation(job));
    entry->handover_attempts = 0;
    entry->handover_floor = 0;
    // Live on the shards from start_step only, until the job gets there.
    entry->joins[plan.rank] = plan.start_step;
    AddEvent(*entry, absl::StrCat("rank ", plan.rank, " handed to ", member->member.id(),
                                  " from step ", plan.start_step));
    spdlog::info("coordinator: job {}: rank {} (was {}) handed to {} from step {}", job.id(),
                 plan.rank, old, member->member.id(), plan.start_step);
    v1::TaskEvent event;
    v1::Task* task = event.mutable_assign();
    task->set_job_id(job.id());
    task->set_rank(plan.rank);
    task->set_world_size(job.workers_size());
    for (const std::string& address : job.shard_addresses()) task->add_shard_addresses(address);
    *task->mutable_spec() = job.spec();
    task->set_incarnation(worker.incarnation());
    task->set_start_step(plan.start_step);
    *task->mutable_data_position() = PositionAt(job, plan.start_step);
    RecordAssign(*member, event);
    assigns.emplace_back(member->member.id(), std::move(event));
  }
  if (!FlushWrites().ok()) return;
  SendAssigns(assigns);
}

}  // namespace tessera::coordinator
