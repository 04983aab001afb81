#include "server/coordinator/coordinator.h"

#include <stdlib.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/test_specs.h"

namespace tessera::coordinator {
namespace {

using testing::MlpSpec;

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
    absl::MutexLock lock(&mu);
    dropped.push_back(address + " " + job_id);
    return absl::OkStatus();
  }
  absl::Mutex mu;
  std::vector<std::string> created;
  std::vector<std::string> dropped;
  std::map<std::string, v1::JobConfig> configs;
  std::map<std::string, absl::Status> fail;
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

  std::string RegisterWorker(const std::string& host, bool open_stream = true) {
    v1::RegisterRequest request;
    request.set_role(v1::MEMBER_ROLE_WORKER);
    request.set_hostname(host);
    request.set_device("cpu");
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

  // Creates a 2-worker job on 1 shard and starts it; returns its id.
  std::string StartTwoWorkerJob(const std::string& name = "mlp") {
    auto job = coordinator_->CreateJob(MlpSpec(name, 2, "/data"));
    EXPECT_TRUE(job.ok()) << job.status();
    coordinator_->Tick();
    EXPECT_EQ(Job(job->id()).state(), v1::JOB_STATE_RUNNING) << Job(job->id()).reason();
    return job->id();
  }

  std::string dir_;
  int64_t now_ms_ = 1'000'000;
  CoordinatorOptions options_;
  std::unique_ptr<JobStore> store_;
  FakeShards shards_;
  std::unique_ptr<Coordinator> coordinator_;
  std::map<std::string, std::shared_ptr<FakeStream>> streams_;
};

TEST_F(CoordinatorTest, PendingReasonThenGangStart) {
  auto created = coordinator_->CreateJob(MlpSpec("mlp", 2, "/data"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->id(), "mlp-1");
  EXPECT_EQ(created->state(), v1::JOB_STATE_PENDING);
  coordinator_->Tick();
  EXPECT_EQ(Job("mlp-1").reason(), "waiting for shards: none registered");
  RegisterShard(1);
  coordinator_->Tick();
  EXPECT_EQ(Job("mlp-1").reason(), "waiting for shards: indices must run 0..0, shard 0 is missing");
  RegisterShard(0);
  coordinator_->Tick();
  EXPECT_EQ(Job("mlp-1").reason(), "waiting for 2 idle workers, 0 registered");
  const std::string w1 = RegisterWorker("host-a");
  coordinator_->Tick();
  EXPECT_EQ(Job("mlp-1").reason(), "waiting for 2 idle workers, 1 registered");
  const std::string w2 = RegisterWorker("host-b", /*open_stream=*/false);
  coordinator_->Tick();
  EXPECT_EQ(Job("mlp-1").reason(), "waiting for 2 idle workers, 2 registered, 1 idle");
  EXPECT_TRUE(shards_.created.empty());

  OpenStream(w2);
  coordinator_->Tick();
  const v1::Job job = Job("mlp-1");
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  EXPECT_EQ(job.reason(), "");
  EXPECT_EQ(job.start_time_ms(), now_ms_);
  ASSERT_EQ(job.shard_addresses_size(), 2);
  EXPECT_EQ(job.shard_addresses(0), "127.0.0.1:4000");
  EXPECT_EQ(job.shard_addresses(1), "127.0.0.1:4001");
  ASSERT_EQ(job.workers_size(), 2);
  EXPECT_EQ(job.workers(0).member_id(), w1);
  EXPECT_EQ(job.workers(1).member_id(), w2);
  EXPECT_EQ(job.workers(1).hostname(), "host-b");
  EXPECT_EQ(shards_.created,
            (std::vector<std::string>{"127.0.0.1:4000 mlp-1", "127.0.0.1:4001 mlp-1"}));
  EXPECT_EQ(shards_.configs["mlp-1"].num_workers(), 2u);
  EXPECT_EQ(shards_.configs["mlp-1"].consistency(), v1::CONSISTENCY_BSP);
  uint64_t incarnations[2];
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& id = rank == 0 ? w1 : w2;
    ASSERT_EQ(streams_[id]->events.size(), 1u);
    const v1::Task& task = streams_[id]->events[0].assign();
    EXPECT_EQ(task.job_id(), "mlp-1");
    EXPECT_EQ(task.rank(), rank);
    EXPECT_EQ(task.world_size(), 2);
    EXPECT_EQ(task.shard_addresses_size(), 2);
    EXPECT_EQ(task.spec().name(), "mlp");
    incarnations[rank] = task.incarnation();
    EXPECT_EQ(Member(id).state(), v1::MEMBER_STATE_BUSY);
    EXPECT_EQ(Member(id).job_id(), "mlp-1");
    EXPECT_EQ(Member(id).rank(), rank);
  }
  EXPECT_NE(incarnations[0], incarnations[1]);
  EXPECT_EQ(Events("mlp-1"),
            (std::vector<std::string>{"queued", "started on 2 workers and 2 shards"}));
}

TEST_F(CoordinatorTest, StrictFifo) {
  RegisterShard(0);
  RegisterWorker("host-a");
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("big", 2, "/data")).ok());
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("small", 1, "/data")).ok());
  coordinator_->Tick();
  // The one idle worker would fit "small", but "big" is older.
  EXPECT_EQ(Job("big-1").state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job("small-2").state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job("small-2").reason(), "queued behind big-1");
  RegisterWorker("host-b");
  coordinator_->Tick();
  EXPECT_EQ(Job("big-1").state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("small-2").state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job("small-2").reason(), "waiting for 1 idle workers, 2 registered, 0 idle");
}

TEST_F(CoordinatorTest, ProgressAggregationAndSuccess) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();

  v1::ProgressReport report;
  report.set_member_id(w1);
  report.set_job_id(id);
  report.set_rank(0);
  report.set_phase(v1::TASK_PHASE_TRAINING);
  report.set_step(10);
  report.set_total_steps(100);
  report.set_epoch(1);
  report.set_loss(0.5);
  report.set_train_accuracy(0.75);
  report.set_samples_per_second(640);
  report.mutable_step_times()->set_compute(0.002);
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  Report(w2, id, 1, v1::TASK_PHASE_TRAINING, 8, 600);
  v1::Job job = Job(id);
  EXPECT_EQ(job.step(), 8);  // the slowest rank
  EXPECT_DOUBLE_EQ(job.samples_per_second(), 1240);
  EXPECT_DOUBLE_EQ(job.loss(), 0.5);
  EXPECT_DOUBLE_EQ(job.train_accuracy(), 0.75);
  EXPECT_EQ(job.total_steps(), 100);
  EXPECT_DOUBLE_EQ(job.step_times().compute(), 0.002);
  // Rank 0: 90 steps left at 640 / 64 = 10 steps per second.
  EXPECT_DOUBLE_EQ(job.eta_seconds(), 9.0);
  EXPECT_EQ(job.workers(0).step(), 10);
  EXPECT_EQ(job.workers(1).step(), 8);

  // An evaluation makes an event; a second plain report within a second does not.
  report.set_step(50);
  report.set_epoch(2);
  report.set_epochs(1);
  report.set_evaluated(true);
  report.set_test_accuracy(0.83);
  report.set_test_loss(0.47);
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  now_ms_ += 200;
  Report(w2, id, 1, v1::TASK_PHASE_TRAINING, 49, 600);
  ASSERT_EQ(Events(id).size(), 4u);
  EXPECT_EQ(Events(id)[2], "epoch 1 of 2");  // rank 0's first report
  EXPECT_EQ(Events(id)[3], "epoch 1: test accuracy 0.8300, test loss 0.4700");
  now_ms_ += 1000;
  Report(w2, id, 1, v1::TASK_PHASE_TRAINING, 50, 600);
  ASSERT_EQ(Events(id).size(), 5u);
  EXPECT_TRUE(absl::StartsWith(Events(id)[4], "step 50 of 100")) << Events(id)[4];

  v1::ProgressAck ack = Report(w2, id, 1, v1::TASK_PHASE_TRAINING_DONE, 100);
  EXPECT_FALSE(ack.all_workers_done());
  EXPECT_FALSE(ack.cancel());
  EXPECT_EQ(Member(w2).state(), v1::MEMBER_STATE_READY);  // rank 1 is free at once
  ack = Report(w1, id, 0, v1::TASK_PHASE_TRAINING_DONE, 100);
  EXPECT_TRUE(ack.all_workers_done());
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_BUSY);  // rank 0 still evaluates

  report.set_phase(v1::TASK_PHASE_SUCCEEDED);
  report.set_step(100);
  report.set_test_accuracy(0.86);
  report.set_test_loss(0.4);
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(job.evaluated());
  EXPECT_DOUBLE_EQ(job.test_accuracy(), 0.86);
  EXPECT_EQ(job.end_time_ms(), now_ms_);
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_READY);
  EXPECT_EQ(Events(id).back(), "succeeded: test accuracy 0.8600, test loss 0.4000");
  coordinator_->Tick();
  EXPECT_TRUE(shards_.dropped.empty());  // the weights stay for export
}

TEST_F(CoordinatorTest, WorkerFailureCancelsTheOthersAndDropsTheJob) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  v1::ProgressReport report;
  report.set_member_id(w2);
  report.set_job_id(id);
  report.set_rank(1);
  report.set_phase(v1::TASK_PHASE_FAILED);
  report.set_error("data: truncated file");
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  v1::Job job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.reason(), "worker rank 1 (w-2 on host-b): data: truncated file");
  EXPECT_EQ(Member(w2).state(), v1::MEMBER_STATE_READY);
  // Rank 0 is told to stop, on its stream and in its next ack.
  ASSERT_EQ(streams_[w1]->events.size(), 2u);
  EXPECT_EQ(streams_[w1]->events[1].cancel().job_id(), id);
  EXPECT_TRUE(streams_[w2]->events.size() == 1u);
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_BUSY);
  EXPECT_TRUE(Report(w1, id, 0, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_BUSY);
  EXPECT_TRUE(Report(w1, id, 0, v1::TASK_PHASE_FAILED, 5).cancel());
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_READY);
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped, (std::vector<std::string>{"127.0.0.1:4000 " + id}));
}

TEST_F(CoordinatorTest, ShardErrorFailsTheJob) {
  RegisterShard(0);
  RegisterShard(1);
  RegisterWorker("host-a");
  shards_.fail["127.0.0.1:4001"] = absl::ResourceExhaustedError("out of memory");
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
  coordinator_->Tick();
  const v1::Job job = Job("mlp-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.reason(), "shard 1 (127.0.0.1:4001): out of memory");
  EXPECT_EQ(Member("w-1").state(), v1::MEMBER_STATE_READY);
  EXPECT_EQ(shards_.dropped.size(), 2u);
}

TEST_F(CoordinatorTest, Cancel) {
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 2, "/data")).ok());
  auto cancelled = coordinator_->CancelJob("mlp-1");
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled->reason(), "cancelled by the user");
  auto again = coordinator_->CancelJob("mlp-1");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->end_time_ms(), cancelled->end_time_ms());
  EXPECT_EQ(Events("mlp-1").size(), 2u);  // no second event

  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(streams_[w1]->events.back().cancel().reason(), "cancelled by the user");
  EXPECT_EQ(streams_[w2]->events.back().cancel().job_id(), id);
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped, (std::vector<std::string>{"127.0.0.1:4000 " + id}));
  // A worker whose stream ends goes back to READY.
  streams_[w2]->Close(absl::CancelledError("gone"));
  coordinator_->Tick();
  EXPECT_EQ(Member(w2).state(), v1::MEMBER_STATE_READY);

  EXPECT_EQ(coordinator_->CancelJob("nope-9").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->CancelJob("").status().code(), absl::StatusCode::kInvalidArgument);
  // A finished job cannot be cancelled.
  Report(w1, id, 0, v1::TASK_PHASE_FAILED, 0);
  OpenStream(w2);
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("done", 1, "/data")).ok());
  coordinator_->Tick();
  ASSERT_EQ(Job("done-3").state(), v1::JOB_STATE_RUNNING);
  Report(w1, "done-3", 0, v1::TASK_PHASE_SUCCEEDED, 10);
  EXPECT_EQ(coordinator_->CancelJob("done-3").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, LeaseExpiryFailsTheRunningJob) {
  const std::string s0 = RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  for (int i = 0; i < 6; ++i) {
    now_ms_ += 2000;
    v1::HeartbeatRequest beat;
    beat.set_member_id(w1);
    ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
    beat.set_member_id(s0);
    ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
    coordinator_->Tick();
  }
  EXPECT_EQ(Member(w2).state(), v1::MEMBER_STATE_LOST);
  EXPECT_EQ(Member(w2).last_seen_ms(), 1'000'000);
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_BUSY);  // until it reports or its stream ends
  const v1::Job job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.reason(), "worker rank 1 (w-2 on host-b) lost: no heartbeat for 10 s");
  EXPECT_TRUE(streams_[w2]->closed());
  v1::HeartbeatRequest beat;
  beat.set_member_id(w2);
  EXPECT_EQ(coordinator_->Heartbeat(beat).code(), absl::StatusCode::kNotFound);
  // A departed shard fails its running job too.
  const std::string w3 = RegisterWorker("host-c");
  Report(w1, id, 0, v1::TASK_PHASE_FAILED, 0);
  const std::string id2 = StartTwoWorkerJob("next");
  v1::DeregisterRequest leave;
  leave.set_member_id(s0);
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  EXPECT_EQ(Member(s0).state(), v1::MEMBER_STATE_LEFT);
  EXPECT_EQ(Job(id2).reason(), "shard 0 (127.0.0.1:4000) left the cluster");
}

TEST_F(CoordinatorTest, RetainModelsDropsTheOldestWeights) {
  options_.retain_models = 1;
  Restart();
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
    coordinator_->Tick();
    ids.push_back(absl::StrCat("mlp-", i + 1));
    ASSERT_EQ(Job(ids.back()).state(), v1::JOB_STATE_RUNNING);
    Report(w1, ids.back(), 0, v1::TASK_PHASE_SUCCEEDED, 10);
  }
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped, (std::vector<std::string>{"127.0.0.1:4000 mlp-1"}));
  EXPECT_EQ(Events("mlp-1").back(), "weights dropped from the shards (--retain_models 1)");
  EXPECT_EQ(Job("mlp-1").state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(absl::StartsWith(Events("mlp-2").back(), "succeeded"));
  // After a restart the dropped job is not counted again.
  Restart();
  RegisterWorker("host-a");
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
  RegisterShard(0);
  coordinator_->Tick();
  ASSERT_EQ(Job("mlp-3").state(), v1::JOB_STATE_RUNNING);
  Report("w-2", "mlp-3", 0, v1::TASK_PHASE_SUCCEEDED, 10);
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped,
            (std::vector<std::string>{"127.0.0.1:4000 mlp-1", "127.0.0.1:4000 mlp-2"}));
}

TEST_F(CoordinatorTest, RestartKeepsJobsAndRebindsRanks) {
  RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("queued", 5, "/data")).ok());  // never fits
  const std::string running = "mlp-2";
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 2, "/data")).ok());
  coordinator_->CancelJob("queued-1").IgnoreError();
  coordinator_->Tick();
  ASSERT_EQ(Job(running).state(), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("later", 1, "/data")).ok());

  Restart();
  EXPECT_EQ(Job("queued-1").state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_PENDING);
  for (const v1::Member& member : coordinator_->ListMembers()) {
    EXPECT_EQ(member.state(), v1::MEMBER_STATE_LOST) << member.id();
  }
  // The workers register again with new ids; rank 0 reports, rank 1 does not.
  const std::string w3 = RegisterWorker("host-a");
  const std::string w4 = RegisterWorker("host-b");
  EXPECT_EQ(w3, "w-3");
  const std::string s2 = RegisterShard(0);
  now_ms_ += 1000;
  EXPECT_FALSE(Report(w3, running, 0, v1::TASK_PHASE_TRAINING, 20).cancel());
  EXPECT_EQ(Job(running).workers(0).member_id(), w3);
  EXPECT_EQ(Member(w3).state(), v1::MEMBER_STATE_BUSY);
  coordinator_->Tick();
  // No new job starts while the running one waits for its ranks (w-4 looks idle).
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_PENDING);
  now_ms_ += 10'000;
  v1::HeartbeatRequest beat;
  for (const std::string& id : {w3, w4, s2}) {
    beat.set_member_id(id);
    ASSERT_TRUE(coordinator_->Heartbeat(beat).ok()) << id;
  }
  coordinator_->Tick();
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(running).reason(), "worker rank 1 lost while the coordinator restarted");
  // The grace is over: the queue moves again, on the idle worker (w-3 is BUSY until it reports).
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("later-3").workers(0).member_id(), w4);
  EXPECT_TRUE(Report(w3, running, 0, v1::TASK_PHASE_FAILED, 20).cancel());
  EXPECT_EQ(Member(w3).state(), v1::MEMBER_STATE_READY);
}

TEST_F(CoordinatorTest, RestartWithEveryRankBackKeepsRunning) {
  RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  Restart();
  const std::string w3 = RegisterWorker("host-a");
  const std::string w4 = RegisterWorker("host-b");
  Report(w4, id, 0, v1::TASK_PHASE_TRAINING, 5);
  Report(w3, id, 1, v1::TASK_PHASE_TRAINING, 5);
  now_ms_ += 10'001;
  for (const std::string& member : {w3, w4}) {
    v1::HeartbeatRequest beat;
    beat.set_member_id(member);
    ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
  }
  coordinator_->Tick();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(id).workers(0).member_id(), w4);
  EXPECT_EQ(Job(id).workers(1).member_id(), w3);
  // Outside the restart grace a stranger's report is told to stop and changes nothing.
  const std::string w5 = RegisterWorker("host-c");
  EXPECT_TRUE(Report(w5, id, 0, v1::TASK_PHASE_TRAINING, 7).cancel());
  EXPECT_EQ(Job(id).workers(0).member_id(), w4);
}

TEST_F(CoordinatorTest, ValidatesEveryRequest) {
  struct Case {
    v1::RegisterRequest request;
    absl::StatusCode code;
    std::string field;
  };
  std::vector<Case> cases(4);
  cases[0].request.set_role(static_cast<v1::MemberRole>(7));
  cases[0].code = absl::StatusCode::kInvalidArgument;
  cases[0].field = "role:";
  cases[1].request.set_role(v1::MEMBER_ROLE_SERVER);
  cases[1].code = absl::StatusCode::kInvalidArgument;
  cases[1].field = "address:";
  cases[2].request.set_role(v1::MEMBER_ROLE_SERVER);
  cases[2].request.set_address("127.0.0.1:1");
  cases[2].request.set_shard_index(-1);
  cases[2].code = absl::StatusCode::kInvalidArgument;
  cases[2].field = "shard_index:";
  RegisterShard(0);
  cases[3].request.set_role(v1::MEMBER_ROLE_SERVER);
  cases[3].request.set_address("127.0.0.1:2");
  cases[3].code = absl::StatusCode::kAlreadyExists;
  cases[3].field = "shard_index: shard 0 is already served by s-1";
  for (const Case& c : cases) {
    auto response = coordinator_->Register(c.request);
    EXPECT_EQ(response.status().code(), c.code) << response.status();
    EXPECT_TRUE(absl::StartsWith(response.status().message(), c.field)) << response.status();
  }
  v1::ProgressReport report;
  report.set_member_id("w-1");
  report.set_job_id("nope-1");
  report.set_phase(v1::TASK_PHASE_TRAINING);
  EXPECT_EQ(coordinator_->ReportProgress(report).status().code(), absl::StatusCode::kNotFound);
  report.set_phase(static_cast<v1::TaskPhase>(9));
  EXPECT_EQ(coordinator_->ReportProgress(report).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::ListJobsRequest list;
  list.add_states(static_cast<v1::JobState>(42));
  EXPECT_TRUE(absl::StartsWith(coordinator_->ListJobs(list).status().message(), "states[0]:"));
  v1::HeartbeatRequest beat;
  EXPECT_EQ(coordinator_->Heartbeat(beat).code(), absl::StatusCode::kInvalidArgument);
  beat.set_member_id("w-77");
  EXPECT_EQ(coordinator_->Heartbeat(beat).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->OpenTaskStream("s-1", std::make_shared<FakeStream>()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(coordinator_->OpenTaskStream("w-9", std::make_shared<FakeStream>()).code(),
            absl::StatusCode::kNotFound);
  v1::JobSpec bad = MlpSpec("mlp", 0, "/data");
  auto refused = coordinator_->CreateJob(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "num_workers:")) << refused.status();
  auto none = coordinator_->ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST_F(CoordinatorTest, ANewStreamReplacesTheOld) {
  const std::string w1 = RegisterWorker("host-a");
  auto first = streams_[w1];
  OpenStream(w1);
  EXPECT_TRUE(first->closed());
  EXPECT_EQ(first->close_status.code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(streams_[w1]->closed());
}

TEST_F(CoordinatorTest, WatchReplaysThenFollowsInOrder) {
  RegisterShard(0);
  RegisterWorker("host-a");
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
  coordinator_->Tick();
  v1::WatchJobRequest request;
  request.set_job_id("mlp-1");
  auto watch = coordinator_->WatchJob(request);
  ASSERT_TRUE(watch.ok()) << watch.status();
  Report("w-1", "mlp-1", 0, v1::TASK_PHASE_TRAINING, 3);  // first report: an event after 1 s
  now_ms_ += 1500;
  Report("w-1", "mlp-1", 0, v1::TASK_PHASE_TRAINING, 6);
  Report("w-1", "mlp-1", 0, v1::TASK_PHASE_SUCCEEDED, 9);

  std::vector<int64_t> seqs;
  std::vector<std::string> messages;
  v1::WatchJobResponse response;
  absl::Status end;
  ASSERT_EQ((*watch)->Next(&response, &end), JobWatch::Poll::kMessage);
  EXPECT_FALSE(response.has_event());
  EXPECT_EQ(response.job().state(), v1::JOB_STATE_RUNNING);
  JobWatch::Poll poll;
  while ((poll = (*watch)->Next(&response, &end)) == JobWatch::Poll::kMessage) {
    seqs.push_back(response.event().seq());
    messages.push_back(response.event().message());
  }
  ASSERT_EQ(poll, JobWatch::Poll::kEnded);
  EXPECT_TRUE(end.ok()) << end;
  EXPECT_EQ(seqs, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(messages.front(), "queued");
  EXPECT_TRUE(absl::StartsWith(messages.back(), "succeeded")) << messages.back();
  EXPECT_EQ(response.event().state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(response.job().state(), v1::JOB_STATE_SUCCEEDED);

  // A watch of a finished job replays from after_seq and ends.
  request.set_after_seq(3);
  auto late = coordinator_->WatchJob(request);
  ASSERT_TRUE(late.ok());
  ASSERT_EQ((*late)->Next(&response, &end), JobWatch::Poll::kMessage);
  EXPECT_EQ(response.job().state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_EQ((*late)->Next(&response, &end), JobWatch::Poll::kMessage);
  EXPECT_EQ(response.event().seq(), 4);
  ASSERT_EQ((*late)->Next(&response, &end), JobWatch::Poll::kMessage);
  EXPECT_EQ(response.event().seq(), 5);
  EXPECT_EQ((*late)->Next(&response, &end), JobWatch::Poll::kEnded);
}

TEST_F(CoordinatorTest, ASlowWatcherIsDropped) {
  options_.max_watch_queue = 3;
  Restart();
  RegisterShard(0);
  RegisterWorker("host-a");
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
  v1::WatchJobRequest request;
  request.set_job_id("mlp-1");
  auto slow = coordinator_->WatchJob(request);
  ASSERT_TRUE(slow.ok());
  coordinator_->Tick();  // started
  for (int i = 1; i <= 4; ++i) {
    now_ms_ += 1500;
    Report("w-1", "mlp-1", 0, v1::TASK_PHASE_TRAINING, i);
  }
  v1::WatchJobResponse response;
  absl::Status end;
  EXPECT_EQ((*slow)->Next(&response, &end), JobWatch::Poll::kEnded);
  EXPECT_EQ(end.code(), absl::StatusCode::kResourceExhausted);
  // The job carries on.
  EXPECT_EQ(Job("mlp-1").state(), v1::JOB_STATE_RUNNING);
}

// The assign must not reach a worker before the RUNNING record is durable: a coordinator killed
// in between would restart with the job PENDING while its workers train it.
class DurabilityProbeStream : public FakeStream {
 public:
  explicit DurabilityProbeStream(JobStore* store) : store_(store) {}
  void Send(const v1::TaskEvent& event) override {
    if (event.has_assign()) {
      auto jobs = store_->LoadJobs();
      ASSERT_TRUE(jobs.ok()) << jobs.status();
      for (const StoredJob& stored : *jobs) {
        if (stored.job.id() == event.assign().job_id()) stored_state = stored.job.state();
      }
    }
    FakeStream::Send(event);
  }
  v1::JobState stored_state = v1::JOB_STATE_UNSPECIFIED;

 private:
  JobStore* const store_;
};

TEST_F(CoordinatorTest, TheAssignGoesOutOnlyOnceTheStartIsDurable) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a", /*open_stream=*/false);
  auto probe = std::make_shared<DurabilityProbeStream>(store_.get());
  ASSERT_TRUE(coordinator_->OpenTaskStream(w1, probe).ok());
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
  coordinator_->Tick();
  ASSERT_EQ(probe->events.size(), 1u);
  EXPECT_EQ(probe->stored_state, v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorTest, ProgressReportsWithImpossibleNumbersAreRefused) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  struct Case {
    std::function<void(v1::ProgressReport*)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](v1::ProgressReport* r) { r->set_step(-1); }, "step:"},
      {[](v1::ProgressReport* r) { r->set_total_steps(-5); }, "total_steps:"},
      {[](v1::ProgressReport* r) { r->set_samples_per_second(std::nan("")); },
       "samples_per_second:"},
      {[](v1::ProgressReport* r) { r->set_samples_per_second(-1); }, "samples_per_second:"},
      {[](v1::ProgressReport* r) { r->set_samples_per_second(INFINITY); }, "samples_per_second:"},
      // Only rank 0 reports success; the refused report changes nothing.
      {[](v1::ProgressReport* r) {
         r->set_rank(1);
         r->set_phase(v1::TASK_PHASE_SUCCEEDED);
       },
       "phase:"},
  };
  for (const Case& c : cases) {
    v1::ProgressReport report;
    report.set_member_id(w1);
    report.set_job_id(id);
    report.set_rank(0);
    report.set_phase(v1::TASK_PHASE_TRAINING);
    report.set_step(77);
    report.set_total_steps(100);
    report.set_samples_per_second(640);
    c.mutate(&report);
    if (report.rank() == 1) report.set_member_id(w2);
    auto ack = coordinator_->ReportProgress(report);
    EXPECT_EQ(ack.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_TRUE(absl::StartsWith(ack.status().message(), c.field)) << ack.status();
    const v1::Job job = Job(id);
    EXPECT_EQ(job.workers(0).step(), 0) << c.field;
    EXPECT_EQ(job.workers(1).step(), 0) << c.field;
  }
  // A diverged loss is a fact to show, not a bad request.
  v1::ProgressReport report;
  report.set_member_id(w1);
  report.set_job_id(id);
  report.set_phase(v1::TASK_PHASE_TRAINING);
  report.set_step(3);
  report.set_loss(std::nan(""));
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  EXPECT_TRUE(std::isnan(Job(id).loss()));
}

TEST_F(CoordinatorTest, StreamsOpenedAfterStopEndAtOnce) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a", /*open_stream=*/false);
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("mlp", 1, "/data")).ok());
  coordinator_->Stop();
  // Otherwise they stay open until the server's shutdown grace runs out.
  EXPECT_EQ(coordinator_->OpenTaskStream(w1, std::make_shared<FakeStream>()).code(),
            absl::StatusCode::kUnavailable);
  v1::WatchJobRequest request;
  request.set_job_id("mlp-1");
  auto watch = coordinator_->WatchJob(request);
  EXPECT_EQ(watch.status().code(), absl::StatusCode::kUnavailable) << watch.status();
}

TEST_F(CoordinatorTest, RestartRebindsRanksOnlyToIdleWorkers) {
  const std::string s1 = RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  Restart();
  const std::string s2 = RegisterShard(0);
  const std::string w3 = RegisterWorker("host-a");
  const std::string w4 = RegisterWorker("host-b");
  // A shard, a stranger and a departed member cannot take a rank.
  EXPECT_TRUE(Report(s2, id, 0, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_EQ(Member(s2).state(), v1::MEMBER_STATE_READY);
  EXPECT_TRUE(Report("w-99", id, 0, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_TRUE(Report("w-2", id, 0, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_EQ(Job(id).workers(0).member_id(), "w-1");
  // A worker that holds rank 0 cannot take rank 1 as well.
  EXPECT_FALSE(Report(w3, id, 0, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_TRUE(Report(w3, id, 1, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_EQ(Job(id).workers(1).member_id(), "w-2");
  EXPECT_EQ(Member(w3).rank(), 0);
  // A rank that moves to another worker frees the one that had it.
  EXPECT_FALSE(Report(w4, id, 0, v1::TASK_PHASE_TRAINING, 6).cancel());
  EXPECT_EQ(Job(id).workers(0).member_id(), w4);
  EXPECT_EQ(Member(w3).state(), v1::MEMBER_STATE_READY);
  EXPECT_EQ(Member(w3).job_id(), "");
}

TEST_F(CoordinatorTest, DepartedMembersDoNotPileUp) {
  options_.max_departed_members = 2;
  Restart();
  const std::string s1 = RegisterShard(0);
  const std::string live = RegisterWorker("host-live");
  for (int i = 0; i < 5; ++i) {
    v1::DeregisterRequest leave;
    leave.set_member_id(RegisterWorker(absl::StrCat("host-", i)));
    ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  }
  coordinator_->Tick();
  auto ids = [this] {
    std::vector<std::string> ids;
    for (const v1::Member& member : coordinator_->ListMembers()) ids.push_back(member.id());
    return ids;
  };
  EXPECT_EQ(ids(), (std::vector<std::string>{s1, live, "w-5", "w-6"}));
  // The database forgot them too, and ids are not handed out again.
  Restart();
  EXPECT_EQ(ids(), (std::vector<std::string>{s1, live, "w-5", "w-6"}));
  EXPECT_EQ(RegisterWorker("host-new"), "w-7");
}

// --- Metrics ------------------------------------------------------------------------------

// The value of the sample line `series` in `text`, or -1.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, series)) continue;
    absl::string_view rest = line.substr(series.size());
    if (rest.empty() || rest[0] != ' ') continue;
    double value = 0;
    if (absl::SimpleAtod(rest.substr(1), &value)) return value;
  }
  return -1;
}

TEST_F(CoordinatorTest, MetricsSnapshotCountsAndProgress) {
  auto metrics = Metrics::Create("coordinator", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  RegisterCoordinatorMetrics(metrics->get(), coordinator_.get());

  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  RegisterWorker("host-c");
  const std::string id = StartTwoWorkerJob();
  ASSERT_TRUE(coordinator_->CreateJob(MlpSpec("waiting", 3, "/data")).ok());

  v1::ProgressReport report;
  report.set_member_id(w1);
  report.set_job_id(id);
  report.set_rank(0);
  report.set_phase(v1::TASK_PHASE_TRAINING);
  report.set_step(10);
  report.set_total_steps(100);
  report.set_epoch(1);
  report.set_loss(0.5);
  report.set_train_accuracy(0.75);
  report.set_samples_per_second(640);
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  Report(w2, id, 1, v1::TASK_PHASE_TRAINING, 8, 640);

  CoordinatorMetricsSnapshot snapshot = coordinator_->MetricsSnapshot();
  EXPECT_EQ(snapshot.jobs[v1::JOB_STATE_RUNNING], 1);
  EXPECT_EQ(snapshot.jobs[v1::JOB_STATE_PENDING], 1);
  EXPECT_EQ(snapshot.jobs[v1::JOB_STATE_SUCCEEDED], 0);
  EXPECT_EQ(snapshot.members[std::make_pair(v1::MEMBER_ROLE_WORKER, v1::MEMBER_STATE_BUSY)], 2);
  EXPECT_EQ(snapshot.members[std::make_pair(v1::MEMBER_ROLE_WORKER, v1::MEMBER_STATE_READY)], 1);
  EXPECT_EQ(snapshot.members[std::make_pair(v1::MEMBER_ROLE_SERVER, v1::MEMBER_STATE_READY)], 1);
  ASSERT_EQ(snapshot.progress.size(), 1u);  // the pending job has no progress
  EXPECT_EQ(snapshot.progress[0].job_id, id);
  EXPECT_EQ(snapshot.progress[0].step, 8);
  // 1280 samples/s over batch 64 * 2 workers.
  EXPECT_DOUBLE_EQ(snapshot.progress[0].step_rate, 10.0);

  const std::string text = (*metrics)->Serialize();
  EXPECT_EQ(Sample(text, "tessera_jobs{state=\"running\"}"), 1) << text;
  EXPECT_EQ(Sample(text, "tessera_jobs{state=\"pending\"}"), 1);
  EXPECT_EQ(Sample(text, "tessera_jobs{state=\"cancelled\"}"), 0);
  EXPECT_EQ(Sample(text, "tessera_members{role=\"worker\",state=\"busy\"}"), 2);
  EXPECT_EQ(Sample(text, "tessera_members{role=\"server\",state=\"lost\"}"), 0);
  const std::string job = absl::StrCat("{job=\"", id, "\"}");
  EXPECT_EQ(Sample(text, "tessera_job_step" + job), 8);
  EXPECT_EQ(Sample(text, "tessera_job_total_steps" + job), 100);
  EXPECT_EQ(Sample(text, "tessera_job_step_rate" + job), 10);
  EXPECT_EQ(Sample(text, "tessera_job_loss" + job), 0.5);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_job_accuracy{job=\"", id, "\",split=\"train\"}")),
            0.75);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_job_accuracy{job=\"", id, "\",split=\"test\"}")),
            -1);

  // Cancelled: still reported, at rate 0, until newer ended jobs push it out.
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());
  snapshot = coordinator_->MetricsSnapshot();
  EXPECT_EQ(snapshot.jobs[v1::JOB_STATE_CANCELLED], 1);
  ASSERT_EQ(snapshot.progress.size(), 1u);
  EXPECT_EQ(snapshot.progress[0].state, v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(snapshot.progress[0].step_rate, 0);
}

TEST_F(CoordinatorTest, MetricsKeepOnlyTheNewestEndedJobs) {
  const size_t total = Coordinator::kMetricsRecentJobs + 5;
  std::vector<std::string> ids;
  for (size_t i = 0; i < total; ++i) {
    auto job = coordinator_->CreateJob(MlpSpec(absl::StrCat("j", i), 1, "/data"));
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_TRUE(coordinator_->CancelJob(job->id()).ok());
    ids.push_back(job->id());
  }
  const CoordinatorMetricsSnapshot snapshot = coordinator_->MetricsSnapshot();
  EXPECT_EQ(snapshot.jobs.at(v1::JOB_STATE_CANCELLED), static_cast<int64_t>(total));
  ASSERT_EQ(snapshot.progress.size(), Coordinator::kMetricsRecentJobs);
  EXPECT_EQ(snapshot.progress.front().job_id, ids[5]);
  EXPECT_EQ(snapshot.progress.back().job_id, ids.back());
}

}  // namespace
}  // namespace tessera::coordinator
