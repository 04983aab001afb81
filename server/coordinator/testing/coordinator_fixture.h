// The coordinator's test fixture: a fake ShardControl that records every call, a fake task
// stream, and CoordinatorTest (a coordinator over a real SQLite store in a temporary directory,
// with a clock the test moves and the actions run inline). Shared by the coordinator's tests.
#ifndef TESSERA_SERVER_COORDINATOR_TESTING_COORDINATOR_FIXTURE_H_
#define TESSERA_SERVER_COORDINATOR_TESTING_COORDINATOR_FIXTURE_H_

#include <stdlib.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/shard_control.h"
#include "server/coordinator/task_stream.h"
#include "spec/testing/example_jobs.h"

namespace tessera::coordinator::testing {

using ::tessera::spec::examples::FashionMlpJob;

class FakeShards : public ShardControl {
 public:
  absl::Status CreateJobState(const std::string& address, const std::string& job_id,
                              const v1::JobConfig& config) override {
    absl::MutexLock lock(&mu);
    created.push_back(address + " " + job_id);
    configs[job_id] = config;
    auto it = fail.find(address);
    return it == fail.end() ? absl::OkStatus() : it->second;
  }
  absl::Status DropJob(const std::string& address, const std::string& job_id) override {
    std::function<void()> hook;
    {
      absl::MutexLock lock(&mu);
      hook = drop_hook;
    }
    if (hook) hook();
    absl::MutexLock lock(&mu);
    dropped.push_back(address + " " + job_id);
    auto it = drop_fail.find(address);
    return it == drop_fail.end() ? absl::OkStatus() : it->second;
  }
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& address,
                                                    const v1::CheckpointRequest& request,
                                                    absl::Duration timeout) override {
    std::function<absl::Status(const std::string&, const v1::CheckpointRequest&)> hook;
    {
      absl::MutexLock lock(&mu);
      checkpoints.push_back(request);
      checkpoint_addresses.push_back(address);
      timeouts.push_back(timeout);
      hook = checkpoint_hook;
    }
    // Unlocked: a hook may block (a call that hangs) while the coordinator makes other calls.
    if (hook) {
      absl::Status status = hook(address, request);
      if (!status.ok()) return status;
    }
    absl::MutexLock lock(&mu);
    if (model_files) {
      // The shard writes the step, then deletes its files older than retain_from_step.
      std::set<int64_t>& steps = files[address];
      steps.insert(request.step());
      steps.erase(steps.begin(), steps.lower_bound(request.retain_from_step()));
    }
    if (request.step() > durable_through) {
      // A real shard would hold the call until the step is written; with the actions inline the
      // fake answers as the call's deadline would.
      return absl::DeadlineExceededError(
          absl::StrCat("checkpoint ", request.step(), " not written before the deadline"));
    }
    v1::CheckpointResponse response;
    response.set_path(absl::StrCat("/data/checkpoints/", request.job_id(), "/ckpt-", request.step(),
                                   "/", address));
    response.set_bytes(1000);
    response.set_crc32c(7);
    response.set_step(request.step());
    return response;
  }
  absl::StatusOr<v1::RestoreResponse> Restore(const std::string& address,
                                              const v1::RestoreRequest& request) override {
    std::function<void(const std::string&)> hook;
    {
      absl::MutexLock lock(&mu);
      hook = restore_hook;
    }
    if (hook) hook(address);  // unlocked: it may call the coordinator
    absl::MutexLock lock(&mu);
    restores.push_back(request);
    restore_addresses.push_back(address);
    auto it = restore_fail.find({address, request.step()});
    if (it != restore_fail.end()) return it->second;
    if (model_files && files[address].count(request.step()) == 0) {
      return absl::NotFoundError(absl::StrCat("no file of checkpoint ", request.step()));
    }
    v1::RestoreResponse response;
    response.set_step(request.step());
    return response;
  }
  absl::StatusOr<v1::UpdateMembershipResponse> UpdateMembership(
      const std::string& address, const v1::UpdateMembershipRequest& request) override {
    absl::MutexLock lock(&mu);
    memberships.push_back(request);
    membership_addresses.push_back(address);
    // As the shard's ConsistencyGate: the set applies from effective_step on, and later entries
    // of the history are replaced.
    std::map<int64_t, std::vector<uint32_t>>& h = history[address];
    h.erase(h.lower_bound(request.effective_step()), h.end());
    h[request.effective_step()].assign(request.live_workers().begin(),
                                       request.live_workers().end());
    v1::UpdateMembershipResponse response;
    response.set_completed_steps(completed_steps);
    return response;
  }
  absl::Status OpenFill(const std::string& target, const v1::FillRequest& shape) override {
    absl::MutexLock lock(&mu);
    opened_fills.push_back({{}, target, shape});
    return open_fill_error;
  }
  absl::StatusOr<v1::FillResponse> CopyFill(const std::vector<std::string>& sources,
                                            const std::string& target, const v1::FillRequest& shape,
                                            absl::Duration timeout) override {
    absl::MutexLock lock(&mu);
    fills.push_back({sources, target, shape});
    if (!fill_error.ok()) return fill_error;
    v1::FillResponse response;
    response.set_installed(true);
    response.set_partitions(8);
    response.set_bytes(3000000);
    return response;
  }
  void CancelAll() override {
    std::shared_ptr<absl::Notification> n;
    {
      absl::MutexLock lock(&mu);
      n = cancelled;
    }
    if (!n->HasBeenNotified()) n->Notify();
  }
  // The live workers of the shard at `address` for `step`, as its gate would have them.
  std::vector<uint32_t> LiveAt(const std::string& address, int64_t step) {
    absl::MutexLock lock(&mu);
    const std::map<int64_t, std::vector<uint32_t>>& h = history[address];
    auto it = h.upper_bound(step);
    if (it == h.begin()) return {};
    return std::prev(it)->second;
  }

  absl::Mutex mu;
  // Notified by CancelAll (what a blocking hook waits on to end early).
  std::shared_ptr<absl::Notification> cancelled = std::make_shared<absl::Notification>();
  std::map<std::string, std::map<int64_t, std::vector<uint32_t>>> history;
  // When set, each shard keeps the steps it wrote (minus retention) and Restore of another step is
  // NOT_FOUND.
  bool model_files = false;
  std::map<std::string, std::set<int64_t>> files;
  std::function<void(const std::string&)> restore_hook;
  std::vector<std::string> created;
  std::vector<std::string> dropped;
  std::map<std::string, v1::JobConfig> configs;
  std::map<std::string, absl::Status> fail;
  std::map<std::string, absl::Status> drop_fail;  // DropJob's answer, by address (default OK)
  std::function<void()> drop_hook;                // runs in DropJob, unlocked
  std::vector<v1::CheckpointRequest> checkpoints;
  std::vector<std::string> checkpoint_addresses;
  std::vector<absl::Duration> timeouts;
  std::function<absl::Status(const std::string&, const v1::CheckpointRequest&)> checkpoint_hook;
  // Checkpoint answers OK for steps up to this one (the shards have written them); a later step
  // gets DEADLINE_EXCEEDED.
  int64_t durable_through = std::numeric_limits<int64_t>::max();
  std::vector<v1::RestoreRequest> restores;
  std::vector<std::string> restore_addresses;
  std::map<std::pair<std::string, int64_t>, absl::Status> restore_fail;
  std::vector<v1::UpdateMembershipRequest> memberships;
  std::vector<std::string> membership_addresses;
  int64_t completed_steps = 0;
  // CopyFill calls, and what they answer when not OK.
  struct Fill {
    std::vector<std::string> sources;
    std::string target;
    v1::FillRequest shape;
  };
  std::vector<Fill> fills;
  absl::Status fill_error;
  // OpenFill calls (without sources), and what they answer.
  std::vector<Fill> opened_fills;
  absl::Status open_fill_error;
};

class FakeStream : public TaskStream {
 public:
  void Send(const v1::TaskEvent& event) override {
    absl::MutexLock lock(&mu);
    events.push_back(event);
  }
  void Close(const absl::Status& status) override {
    absl::MutexLock lock(&mu);
    is_closed = true;
    close_status = status;
  }
  bool closed() const override {
    absl::MutexLock lock(&mu);
    return is_closed;
  }
  mutable absl::Mutex mu;
  std::vector<v1::TaskEvent> events;
  bool is_closed = false;
  absl::Status close_status;
};

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/coordinator_XXXXXX";
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
    auto store = JobStore::Open(dir_ + "/coordinator.db");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    options_.now_ms = [this] { return now_ms_; };
    options_.check_files = false;
    options_.inline_actions = true;
    Restart();
  }

  // A new coordinator over the same database, as after a crash.
  void Restart() {
    coordinator_.reset();
    auto coordinator = Coordinator::Create(options_, store_.get(), &shards_);
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = std::move(*coordinator);
  }

  std::string RegisterShard(int index) {
    v1::RegisterRequest request;
    request.set_role(v1::MEMBER_ROLE_SERVER);
    request.set_address(absl::StrCat("127.0.0.1:", 4000 + index));
    request.set_shard_index(index);
    request.set_hostname("host-s");
    auto response = coordinator_->Register(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? response->member_id() : "";
  }

  std::string RegisterWorker(const std::string& host, bool open_stream = true, int64_t pid = 0,
                             const std::string& device = "cpu") {
    v1::RegisterRequest request;
    request.set_role(v1::MEMBER_ROLE_WORKER);
    request.set_hostname(host);
    request.set_pid(pid);
    request.set_device(device);
    auto response = coordinator_->Register(request);
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok()) return "";
    if (open_stream) OpenStream(response->member_id());
    return response->member_id();
  }

  void OpenStream(const std::string& member_id) {
    auto stream = std::make_shared<FakeStream>();
    streams_[member_id] = stream;
    EXPECT_TRUE(coordinator_->OpenTaskStream(member_id, stream).ok());
  }

  v1::Job Job(const std::string& id) {
    auto job = coordinator_->GetJob(id);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  v1::Member Member(const std::string& id) {
    for (const v1::Member& member : coordinator_->ListMembers()) {
      if (member.id() == id) return member;
    }
    ADD_FAILURE() << "no member " << id;
    return v1::Member();
  }

  v1::ProgressAck Report(const std::string& member, const std::string& job, int rank,
                         v1::TaskPhase phase, int64_t step, double sps = 0) {
    v1::ProgressReport report;
    report.set_member_id(member);
    report.set_job_id(job);
    report.set_rank(rank);
    report.set_phase(phase);
    report.set_step(step);
    report.set_total_steps(100);
    report.set_samples_per_second(sps);
    report.set_epoch(1);
    auto ack = coordinator_->ReportProgress(report);
    EXPECT_TRUE(ack.ok()) << ack.status();
    return ack.ok() ? *ack : v1::ProgressAck();
  }

  // Every stored event message of `job_id`, in order.
  std::vector<std::string> Events(const std::string& job_id) {
    auto events = store_->ReadEvents(job_id, 0, 1 << 30);
    EXPECT_TRUE(events.ok());
    std::vector<std::string> messages;
    int64_t seq = 0;
    for (const v1::JobEvent& event : *events) {
      EXPECT_EQ(event.seq(), ++seq);
      messages.push_back(event.message());
    }
    return messages;
  }

  // The kind of every stored event of `job_id`, in order.
  std::vector<v1::JobEventKind> Kinds(const std::string& job_id) {
    auto events = store_->ReadEvents(job_id, 0, 1 << 30);
    EXPECT_TRUE(events.ok());
    std::vector<v1::JobEventKind> kinds;
    for (const v1::JobEvent& event : *events) kinds.push_back(event.kind());
    return kinds;
  }

  // A job of `workers` ranks on `shards` shards (registered here, with as many workers) with
  // automatic checkpoints every `every` steps; started. Returns its id.
  std::string StartCheckpointedJob(int shards, int workers, int64_t every, int keep = 0) {
    for (int i = 0; i < shards; ++i) RegisterShard(i);
    for (int i = 0; i < workers; ++i) RegisterWorker(absl::StrCat("host-", i));
    v1::JobSpec spec = FashionMlpJob("ft", workers, "/data");
    spec.set_checkpoint_every_steps(every);
    spec.set_keep_checkpoints(keep);
    auto job = coordinator_->CreateJob(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    coordinator_->Tick();
    EXPECT_EQ(Job(job->id()).state(), v1::JOB_STATE_RUNNING) << Job(job->id()).reason();
    return job->id();
  }

  // A TRAINING report of `rank` of `job_id` from its current worker with its incarnation.
  // `edit` (optional) changes the report before it is sent.
  v1::ProgressAck ReportRank(const std::string& job_id, int rank, int64_t step,
                             v1::TaskPhase phase = v1::TASK_PHASE_TRAINING,
                             bool shard_error = false,
                             const std::function<void(v1::ProgressReport*)>& edit = nullptr) {
    const v1::JobWorker worker = Job(job_id).workers(rank);
    v1::ProgressReport report;
    report.set_member_id(worker.member_id());
    report.set_job_id(job_id);
    report.set_rank(rank);
    report.set_phase(phase);
    report.set_step(step);
    report.set_total_steps(1000);
    report.set_steps_per_epoch(40);
    report.set_incarnation(worker.incarnation());
    report.set_shard_error(shard_error);
    if (phase == v1::TASK_PHASE_FAILED) report.set_error("shard 1 (127.0.0.1:4001): unavailable");
    if (edit) edit(&report);
    auto ack = coordinator_->ReportProgress(report);
    EXPECT_TRUE(ack.ok()) << ack.status();
    return ack.ok() ? *ack : v1::ProgressAck();
  }

  void ReportAll(const std::string& job_id, int64_t step) {
    for (int rank = 0; rank < Job(job_id).workers_size(); ++rank) {
      if (!Job(job_id).workers(rank).lost()) ReportRank(job_id, rank, step);
    }
  }

  std::vector<int64_t> StoredCheckpoints(const std::string& job_id) {
    auto records = store_->LoadCheckpoints(job_id);
    EXPECT_TRUE(records.ok()) << records.status();
    std::vector<int64_t> steps;
    for (const v1::CheckpointRecord& record : *records) steps.push_back(record.step());
    return steps;
  }

  // A heartbeat from every live member.
  void HeartbeatAll() {
    for (const v1::Member& member : coordinator_->ListMembers()) {
      if (member.state() != v1::MEMBER_STATE_READY && member.state() != v1::MEMBER_STATE_BUSY) {
        continue;
      }
      v1::HeartbeatRequest beat;
      beat.set_member_id(member.id());
      EXPECT_TRUE(coordinator_->Heartbeat(beat).ok()) << member.id();
    }
  }

  // Moves the clock to `to_ms` in steps of at most 2 s, with a heartbeat from every live member
  // at each (no tick).
  void AdvanceWithHeartbeats(int64_t to_ms) {
    while (now_ms_ < to_ms) {
      now_ms_ = std::min(to_ms, now_ms_ + 2000);
      HeartbeatAll();
    }
  }

  // The last task event sent to `member_id`.
  v1::TaskEvent LastTask(const std::string& member_id) {
    auto it = streams_.find(member_id);
    if (it == streams_.end() || it->second->events.empty()) {
      ADD_FAILURE() << "no task for " << member_id;
      return v1::TaskEvent();
    }
    return it->second->events.back();
  }

  // Creates a 2-worker job on 1 shard and starts it; returns its id.
  std::string StartTwoWorkerJob(const std::string& name = "mlp") {
    auto job = coordinator_->CreateJob(FashionMlpJob(name, 2, "/data"));
    EXPECT_TRUE(job.ok()) << job.status();
    coordinator_->Tick();
    EXPECT_EQ(Job(job->id()).state(), v1::JOB_STATE_RUNNING) << Job(job->id()).reason();
    return job->id();
  }

  // After a restart RUNNING jobs wait this long for their ranks: the default lease (10 s) plus
  // the daemons' longest registration backoff (5 s).
  static constexpr int64_t kGraceMs = 15'000;

  std::string dir_;
  int64_t now_ms_ = 1'000'000;
  CoordinatorOptions options_;
  std::unique_ptr<JobStore> store_;
  FakeShards shards_;
  std::unique_ptr<Coordinator> coordinator_;
  std::map<std::string, std::shared_ptr<FakeStream>> streams_;
};

}  // namespace tessera::coordinator::testing

#endif  // TESSERA_SERVER_COORDINATOR_TESTING_COORDINATOR_FIXTURE_H_
