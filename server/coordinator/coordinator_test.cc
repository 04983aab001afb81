#include "server/coordinator/coordinator.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/testing/prometheus_text.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/testing/coordinator_fixture.h"
#include "spec/testing/example_jobs.h"

namespace tessera::coordinator {
namespace {

using ::tessera::spec::examples::FashionMlpJob;
using ::testing::ElementsAre;

using ::tessera::coordinator::testing::CoordinatorTest;
using ::tessera::coordinator::testing::FakeShards;
using ::tessera::coordinator::testing::FakeStream;

// A worker whose devices cannot train the job's model is passed over, and the reason says so: a
// pipeline of 2 stages needs one device or two, not cpu:3.
TEST_F(CoordinatorTest, WorkersWhoseDevicesCannotTrainTheModelArePassedOver) {
  v1::JobSpec spec = FashionMlpJob("mlp", 1, "/data");
  spec.mutable_model()->mutable_pipeline()->add_stage_starts("dense_2");
  ASSERT_TRUE(coordinator_->CreateJob(spec).ok());
  RegisterShard(0);
  const std::string three = RegisterWorker("host-a", true, 0, "cpu:3");
  coordinator_->Tick();
  EXPECT_EQ(Job("mlp-1").state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job("mlp-1").reason(),
            "waiting for 1 idle workers whose devices can train the model, 1 registered (1 idle "
            "that cannot: cpu:3: devices: the model's pipeline has 2 stages, one per device, but "
            "the worker drives 3 (use --devices cpu:2, or one device to train the model "
            "unsplit))");
  const std::string two = RegisterWorker("host-b", true, 0, "cpu:2");
  coordinator_->Tick();
  const v1::Job job = Job("mlp-1");
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  ASSERT_EQ(job.workers_size(), 1);
  EXPECT_EQ(job.workers(0).member_id(), two);
  EXPECT_EQ(Member(three).state(), v1::MEMBER_STATE_READY);
}

TEST_F(CoordinatorTest, PendingReasonThenGangStart) {
  auto created = coordinator_->CreateJob(FashionMlpJob("mlp", 2, "/data"));
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
  EXPECT_EQ(Kinds("mlp-1"),
            (std::vector<v1::JobEventKind>{v1::JOB_EVENT_KIND_STATE, v1::JOB_EVENT_KIND_STATE}));
}

TEST_F(CoordinatorTest, StrictFifo) {
  RegisterShard(0);
  RegisterWorker("host-a");
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("big", 2, "/data")).ok());
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("small", 1, "/data")).ok());
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
  EXPECT_FALSE(Job(id).has_test_auc()) << "no AUC reported: none shown";
  now_ms_ += 1000;
  Report(w2, id, 1, v1::TASK_PHASE_TRAINING, 50, 600);
  ASSERT_EQ(Events(id).size(), 5u);
  EXPECT_TRUE(absl::StartsWith(Events(id)[4], "step 50 of 100")) << Events(id)[4];
  EXPECT_EQ(Kinds(id),
            (std::vector<v1::JobEventKind>{v1::JOB_EVENT_KIND_STATE, v1::JOB_EVENT_KIND_STATE,
                                           v1::JOB_EVENT_KIND_EPOCH, v1::JOB_EVENT_KIND_EVALUATION,
                                           v1::JOB_EVENT_KIND_PROGRESS}));

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
  report.set_test_auc(0.7812);  // a binary task's final AUC reaches the record and the event
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(job.evaluated());
  EXPECT_DOUBLE_EQ(job.test_accuracy(), 0.86);
  ASSERT_TRUE(job.has_test_auc());
  EXPECT_DOUBLE_EQ(job.test_auc(), 0.7812);
  EXPECT_EQ(job.end_time_ms(), now_ms_);
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_READY);
  EXPECT_EQ(Events(id).back(),
            "succeeded: test accuracy 0.8600, test loss 0.4000, test AUC 0.7812");
  EXPECT_EQ(Kinds(id).back(), v1::JOB_EVENT_KIND_STATE);
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

// A DropJob the shard could not take is owed, also across a coordinator restart: retried with a
// backoff while the shard is live, at once when a shard registers at the address again, and
// settled by OK or NOT_FOUND.
TEST_F(CoordinatorTest, OwedDropsAreRetriedAndSurviveARestart) {
  const std::string s0 = RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  const std::string drop = "127.0.0.1:4000 " + id;
  shards_.drop_fail["127.0.0.1:4000"] = absl::UnavailableError("connection refused");
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());
  coordinator_->Tick();
  ASSERT_EQ(shards_.dropped, (std::vector<std::string>{drop}));
  auto owed = store_->LoadDrops();
  ASSERT_TRUE(owed.ok()) << owed.status();
  ASSERT_EQ(owed->size(), 1u);
  EXPECT_EQ((*owed)[0].address, "127.0.0.1:4000");
  EXPECT_EQ((*owed)[0].job_id, id);
  // Backoff: 1 s, then 2 s.
  now_ms_ += 999;
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped.size(), 1u);
  now_ms_ += 1;
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped.size(), 2u);
  now_ms_ += 1999;
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped.size(), 2u);

  // After a restart the drop is still owed; it waits until the shard is live again (no call to
  // a shard that would only time out), then runs at once.
  Restart();
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped.size(), 2u);
  EXPECT_EQ(Member(s0).state(), v1::MEMBER_STATE_LOST);
  shards_.drop_fail["127.0.0.1:4000"] = absl::NotFoundError("no job");  // a new shard process
  RegisterShard(0);
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped, (std::vector<std::string>{drop, drop, drop}));
  owed = store_->LoadDrops();
  ASSERT_TRUE(owed.ok()) << owed.status();
  EXPECT_TRUE(owed->empty());
  now_ms_ += 120'000;
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped.size(), 3u);  // settled: never called again
}

// A shard that fails a DropJob costs one call per round: its other owed drops wait for the same
// backoff instead of each running into the failure.
TEST_F(CoordinatorTest, OneFailedDropBacksOffTheWholeAddress) {
  RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  const std::string first = StartTwoWorkerJob("a");
  ASSERT_TRUE(coordinator_->CancelJob(first).ok());
  shards_.drop_fail["127.0.0.1:4000"] = absl::DeadlineExceededError("no answer");
  coordinator_->Tick();  // the first drop fails; the workers stay BUSY until they report
  ASSERT_EQ(shards_.dropped.size(), 1u);
  for (const std::string& w : {std::string("w-1"), std::string("w-2")}) {
    Report(w, first, w == "w-1" ? 0 : 1, v1::TASK_PHASE_FAILED, 1);
  }
  const std::string second = StartTwoWorkerJob("b");
  ASSERT_TRUE(coordinator_->CancelJob(second).ok());
  now_ms_ += 1000;
  coordinator_->Tick();  // both due: one call, the other waits with it
  EXPECT_EQ(shards_.dropped.size(), 2u);
  now_ms_ += 1999;
  coordinator_->Tick();
  EXPECT_EQ(shards_.dropped.size(), 2u);
  shards_.drop_fail.clear();
  now_ms_ += 1;
  coordinator_->Tick();  // the address's backoff is over: both settle
  EXPECT_EQ(shards_.dropped.size(), 4u);
  auto owed = store_->LoadDrops();
  ASSERT_TRUE(owed.ok()) << owed.status();
  EXPECT_TRUE(owed->empty());
}

// The watchdog's probe: OK while the tick loop turns, DEADLINE_EXCEEDED while a tick hangs.
TEST_F(CoordinatorTest, CheckLiveFailsWhileATickHangs) {
  EXPECT_TRUE(coordinator_->CheckLive(absl::Milliseconds(200)).ok());  // not started: no loop
  RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  auto release = std::make_shared<absl::Notification>();
  auto entered = std::make_shared<absl::Notification>();
  {
    absl::MutexLock lock(&shards_.mu);
    shards_.drop_hook = [release, entered] {
      if (!entered->HasBeenNotified()) entered->Notify();
      release->WaitForNotification();
    };
  }
  coordinator_->Start();
  EXPECT_TRUE(coordinator_->CheckLive(absl::Seconds(5)).ok());
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());  // the next tick calls DropJob, which hangs
  ASSERT_TRUE(entered->WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(400));
  const absl::Status stuck = coordinator_->CheckLive(absl::Milliseconds(300));
  EXPECT_EQ(stuck.code(), absl::StatusCode::kDeadlineExceeded) << stuck;
  EXPECT_TRUE(absl::StrContains(stuck.message(), "tick loop has not finished a tick")) << stuck;
  release->Notify();
  absl::Status live = absl::UnknownError("not checked");
  for (int i = 0; i < 100 && !live.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    live = coordinator_->CheckLive(absl::Milliseconds(300));
  }
  EXPECT_TRUE(live.ok()) << live;
  coordinator_->Stop();
}

TEST_F(CoordinatorTest, ShardErrorFailsTheJob) {
  RegisterShard(0);
  RegisterShard(1);
  RegisterWorker("host-a");
  shards_.fail["127.0.0.1:4001"] = absl::ResourceExhaustedError("out of memory");
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
  coordinator_->Tick();
  const v1::Job job = Job("mlp-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.reason(), "shard 1 (127.0.0.1:4001): out of memory");
  EXPECT_EQ(Member("w-1").state(), v1::MEMBER_STATE_READY);
  EXPECT_EQ(shards_.dropped.size(), 2u);
}

// A task stream that replaces another gets the worker's assignment again (the old stream may
// have taken it to a worker no longer reading), the very same one; not once the job has ended.
TEST_F(CoordinatorTest, ReplacedTaskStreamGetsTheAssignmentAgain) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  ASSERT_EQ(streams_[w1]->events.size(), 1u);
  const v1::Task first = streams_[w1]->events[0].assign();
  ASSERT_EQ(first.job_id(), id);
  const std::shared_ptr<FakeStream> old_stream = streams_[w1];
  OpenStream(w1);
  EXPECT_TRUE(old_stream->closed());
  ASSERT_EQ(streams_[w1]->events.size(), 1u);
  const v1::Task again = streams_[w1]->events[0].assign();
  EXPECT_EQ(again.job_id(), id);
  EXPECT_EQ(again.rank(), first.rank());
  EXPECT_EQ(again.incarnation(), first.incarnation());
  EXPECT_EQ(again.world_size(), 2);
  EXPECT_EQ(again.shard_addresses(0), "127.0.0.1:4000");
  // The other worker's stream is untouched.
  EXPECT_EQ(streams_[w2]->events.size(), 1u);
  // Once the job is cancelled, a new stream gets nothing (the cancel went out on the old one).
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());
  OpenStream(w2);
  EXPECT_TRUE(streams_[w2]->events.empty());
}

TEST_F(CoordinatorTest, Cancel) {
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 2, "/data")).ok());
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("done", 1, "/data")).ok());
  coordinator_->Tick();
  ASSERT_EQ(Job("done-3").state(), v1::JOB_STATE_RUNNING);
  Report(w1, "done-3", 0, v1::TASK_PHASE_SUCCEEDED, 10);
  EXPECT_EQ(coordinator_->CancelJob("done-3").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, LeaseExpiryLosesTheRankAndTheJobGoesOn) {
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
  EXPECT_EQ(Member(w1).state(), v1::MEMBER_STATE_BUSY);
  EXPECT_EQ(Member(w2).job_id(), "");
  // The job goes on with rank 0; rank 1 leaves the shards' membership at the job's step.
  const v1::Job job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(job.workers(1).lost());
  EXPECT_FALSE(job.workers(0).lost());
  EXPECT_EQ(Events(id).back(),
            "worker rank 1 (w-2 on host-b) lost: no heartbeat for 10 s; continuing with 1 workers");
  EXPECT_EQ(Kinds(id).back(), v1::JOB_EVENT_KIND_MEMBERSHIP);
  ASSERT_EQ(shards_.memberships.size(), 1u);
  EXPECT_EQ(shards_.membership_addresses[0], "127.0.0.1:4000");
  EXPECT_EQ(std::vector<uint32_t>(shards_.memberships[0].live_workers().begin(),
                                  shards_.memberships[0].live_workers().end()),
            (std::vector<uint32_t>{0}));
  EXPECT_EQ(shards_.memberships[0].effective_step(), job.step());
  // A lost rank counts as done.
  EXPECT_TRUE(Report(w1, id, 0, v1::TASK_PHASE_TRAINING_DONE, 100).all_workers_done());
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
    ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("queued", 5, "/data")).ok());  // never fits
  const std::string running = "mlp-2";
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 2, "/data")).ok());
  coordinator_->CancelJob("queued-1").IgnoreError();
  coordinator_->Tick();
  ASSERT_EQ(Job(running).state(), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("later", 1, "/data")).ok());

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
  RegisterShard(0);
  const int64_t restarted_ms = now_ms_;
  now_ms_ += 1000;
  EXPECT_FALSE(Report(w3, running, 0, v1::TASK_PHASE_TRAINING, 20).cancel());
  EXPECT_EQ(Job(running).workers(0).member_id(), w3);
  EXPECT_EQ(Member(w3).state(), v1::MEMBER_STATE_BUSY);
  coordinator_->Tick();
  // No new job starts while the running one waits for its ranks (w-4 looks idle).
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_PENDING);
  // The grace is one lease (10 s) plus the daemons' longest registration backoff (5 s): 1 ms
  // before its end rank 1 still waits, with nobody handed its rank.
  AdvanceWithHeartbeats(restarted_ms + kGraceMs - 1);
  coordinator_->Tick();
  EXPECT_FALSE(Job(running).workers(1).lost());
  EXPECT_EQ(Job(running).workers(1).member_id(), "w-2");
  EXPECT_TRUE(streams_[w4]->events.empty());
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_PENDING);
  AdvanceWithHeartbeats(restarted_ms + kGraceMs);
  coordinator_->Tick();
  // Rank 1 never came back: it is lost and the job goes on; the idle w-4 takes the rank over
  // (hand-overs come before the queue) from rank 0's step plus the margin.
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_RUNNING);
  const std::vector<std::string> events = Events(running);
  EXPECT_NE(std::find(events.begin(), events.end(),
                      "worker rank 1 (w-2 on host-b) lost while the coordinator restarted; "
                      "continuing with 1 workers"),
            events.end());
  EXPECT_EQ(events.back(), "rank 1 handed to w-4 from step 30");
  EXPECT_EQ(Job(running).workers(1).member_id(), w4);
  EXPECT_FALSE(Job(running).workers(1).lost());
  ASSERT_FALSE(streams_[w4]->events.empty());
  EXPECT_EQ(streams_[w4]->events.back().assign().rank(), 1);
  EXPECT_EQ(streams_[w4]->events.back().assign().start_step(), 30);
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_PENDING);
  // Rank 1's old daemon, registered again at lease + 6 s, is too late: the rank stays with w-4.
  AdvanceWithHeartbeats(restarted_ms + kGraceMs + 1000);
  const std::string late = RegisterWorker("host-b");
  EXPECT_TRUE(Report(late, running, 1, v1::TASK_PHASE_TRAINING, 20).cancel());
  EXPECT_EQ(Job(running).workers(1).member_id(), w4);
  EXPECT_EQ(Member(late).state(), v1::MEMBER_STATE_READY);
  // Rank 0 fails (not a shard error): the job fails, and the queue moves on the freed worker.
  EXPECT_FALSE(Report(w3, running, 0, v1::TASK_PHASE_FAILED, 20).cancel());
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Member(w3).state(), v1::MEMBER_STATE_READY);
  coordinator_->Tick();
  EXPECT_EQ(Job("later-3").state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("later-3").workers(0).member_id(), w3);
}

TEST_F(CoordinatorTest, RestartWithEveryRankBackKeepsRunning) {
  RegisterShard(0);
  RegisterWorker("host-a");
  RegisterWorker("host-b");
  const std::string id = StartTwoWorkerJob();
  Restart();
  const int64_t restarted_ms = now_ms_;
  RegisterShard(0);
  // The workers come back late in the grace, at lease + 4 s (their registration backed off),
  // and are still rebound, even though a tick past the lease alone came first.
  AdvanceWithHeartbeats(restarted_ms + kGraceMs - 4000);
  coordinator_->Tick();
  EXPECT_FALSE(Job(id).workers(0).lost());
  EXPECT_FALSE(Job(id).workers(1).lost());
  AdvanceWithHeartbeats(restarted_ms + kGraceMs - 1000);
  const std::string w3 = RegisterWorker("host-a");
  const std::string w4 = RegisterWorker("host-b");
  EXPECT_FALSE(Report(w4, id, 0, v1::TASK_PHASE_TRAINING, 5).cancel());
  EXPECT_FALSE(Report(w3, id, 1, v1::TASK_PHASE_TRAINING, 5).cancel());
  AdvanceWithHeartbeats(restarted_ms + kGraceMs);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(id).workers(0).member_id(), w4);
  EXPECT_EQ(Job(id).workers(1).member_id(), w3);
  EXPECT_FALSE(Job(id).workers(0).lost());
  EXPECT_FALSE(Job(id).workers(1).lost());
  EXPECT_EQ(Member(w4).state(), v1::MEMBER_STATE_BUSY);
  EXPECT_EQ(Member(w3).rank(), 1);
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
  std::vector<Case> cases(6);
  cases[4].request.set_role(v1::MEMBER_ROLE_WORKER);
  cases[4].request.set_hostname(std::string(256, 'h'));
  cases[4].code = absl::StatusCode::kInvalidArgument;
  cases[4].field = "hostname: at most 255 bytes, got 256";
  cases[5].request.set_role(v1::MEMBER_ROLE_WORKER);
  cases[5].request.set_device(std::string(70000, 'd'));
  cases[5].code = absl::StatusCode::kInvalidArgument;
  cases[5].field = "device: at most 255 bytes, got 70000";
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
  v1::JobSpec bad = FashionMlpJob("mlp", 0, "/data");
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
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
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("mlp", 1, "/data")).ok());
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

using prometheus_text::Sample;

TEST_F(CoordinatorTest, MetricsSnapshotCountsAndProgress) {
  auto metrics = Metrics::Create("coordinator", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  RegisterCoordinatorMetrics(metrics->get(), coordinator_.get());

  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  RegisterWorker("host-c");
  const std::string id = StartTwoWorkerJob();
  ASSERT_TRUE(coordinator_->CreateJob(FashionMlpJob("waiting", 3, "/data")).ok());

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
    auto job = coordinator_->CreateJob(FashionMlpJob(absl::StrCat("j", i), 1, "/data"));
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

// --- Fault tolerance -----------------------------------------------------------------------------

TEST_F(CoordinatorTest, CheckpointsCommitOnlyWhenEveryShardConfirms) {
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/50, /*keep=*/2);
  shards_.durable_through = 0;  // the shards have written nothing yet
  coordinator_->Tick();
  // Before any report total_steps is unknown: nothing is asked ahead of the job.
  EXPECT_TRUE(shards_.checkpoints.empty());
  ReportAll(id, 40);
  coordinator_->Tick();
  // The next multiple is asked for ahead of the reports (a long poll), of both shards at once;
  // the calls ran into their deadline: nothing is committed, no event, and the next tick asks
  // again.
  ASSERT_EQ(shards_.checkpoints.size(), 2u);
  EXPECT_EQ(std::set<std::string>(shards_.checkpoint_addresses.begin(),
                                  shards_.checkpoint_addresses.end()),
            (std::set<std::string>{"127.0.0.1:4000", "127.0.0.1:4001"}));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(shards_.checkpoints[i].step(), 50);
    EXPECT_EQ(shards_.checkpoints[i].retain_from_step(), 0);
    EXPECT_EQ(shards_.timeouts[i], options_.checkpoint_timeout);
  }
  EXPECT_EQ(Job(id).last_checkpoint_step(), 0);
  const size_t events = Events(id).size();
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 4u);
  EXPECT_EQ(shards_.checkpoints[3].step(), 50);
  EXPECT_EQ(Events(id).size(), events);

  // The shards write step 50 while the slowest rank has reported 49: it is committed at once.
  ReportRank(id, 0, 60);
  ReportRank(id, 1, 49);
  shards_.durable_through = 50;
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 6u);
  EXPECT_EQ(std::set<std::string>(shards_.checkpoint_addresses.begin() + 4,
                                  shards_.checkpoint_addresses.end()),
            (std::set<std::string>{"127.0.0.1:4000", "127.0.0.1:4001"}));
  EXPECT_EQ(shards_.checkpoints[5].step(), 50);
  EXPECT_EQ(Job(id).step(), 49);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 50);
  EXPECT_EQ(Job(id).steps_per_epoch(), 40);
  EXPECT_EQ(Events(id).back(), "checkpoint 50 committed: 2 shards, 2000 bytes");
  EXPECT_EQ(Kinds(id).back(), v1::JOB_EVENT_KIND_CHECKPOINT);
  auto records = store_->LoadCheckpoints(id);
  ASSERT_TRUE(records.ok());
  ASSERT_EQ(records->size(), 1u);
  const v1::CheckpointRecord& record = (*records)[0];
  EXPECT_FALSE(record.manual());
  ASSERT_EQ(record.shards_size(), 2);
  EXPECT_EQ(record.shards(1).shard_index(), 1);
  EXPECT_EQ(record.shards(1).address(), "127.0.0.1:4001");
  EXPECT_EQ(record.shards(1).path(), "/data/checkpoints/" + id + "/ckpt-50/127.0.0.1:4001");
  EXPECT_EQ(record.shards(1).bytes(), 1000u);
  ASSERT_EQ(record.positions_size(), 2);  // 50 steps of 40 per epoch: epoch 1, batch 10
  EXPECT_EQ(record.positions(1).epoch(), 1);
  EXPECT_EQ(record.positions(1).batch_offset(), 10);
  EXPECT_EQ(record.positions(1).seed(), 1u);
  // Committed once: the next tick asks for 100 (keep 2, and only 1 committed: the shards keep
  // every file).
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 8u);
  EXPECT_EQ(shards_.checkpoints[7].step(), 100);
  EXPECT_EQ(shards_.checkpoints[7].retain_from_step(), 0);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{50}));

  // A failing shard: nothing is committed, the job goes on, and the step is not asked for
  // again: the next multiple is, at once, although the job has not reached 100 yet.
  shards_.checkpoint_hook = [](const std::string& address, const v1::CheckpointRequest&) {
    return address == "127.0.0.1:4001" ? absl::UnavailableError("disk gone") : absl::OkStatus();
  };
  shards_.durable_through = 100;
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 10u);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 50);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{50}));
  EXPECT_EQ(Events(id).back(), "checkpoint 100 failed: shard 1 (127.0.0.1:4001): disk gone");
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 12u);
  EXPECT_EQ(shards_.checkpoints[11].step(), 150);
  EXPECT_EQ(Events(id).back(), "checkpoint 100 failed: shard 1 (127.0.0.1:4001): disk gone");

  // Retention keeps the 2 newest committed records; the shards keep the files from the 2nd
  // newest committed one before the write on (the new one does not count until committed).
  shards_.checkpoint_hook = nullptr;
  shards_.durable_through = 150;
  coordinator_->Tick();
  EXPECT_EQ(shards_.checkpoints.back().step(), 150);
  EXPECT_EQ(shards_.checkpoints.back().retain_from_step(), 0);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 150);
  shards_.durable_through = 200;
  coordinator_->Tick();
  EXPECT_EQ(shards_.checkpoints.back().step(), 200);
  EXPECT_EQ(shards_.checkpoints.back().retain_from_step(), 50);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{200, 150}));
  EXPECT_EQ(Job(id).last_checkpoint_step(), 200);
  const CoordinatorMetricsSnapshot metrics = coordinator_->MetricsSnapshot();
  ASSERT_EQ(metrics.progress.size(), 1u);
  EXPECT_EQ(metrics.progress[0].checkpoint_step, 200);
}

TEST_F(CoordinatorTest, InterruptedCheckpointCallsAreAskedAgainWithoutAnEvent) {
  const std::string id = StartCheckpointedJob(1, 1, /*every=*/10);
  ReportAll(id, 5);
  for (const absl::StatusCode code : {absl::StatusCode::kDeadlineExceeded,
                                      absl::StatusCode::kAborted, absl::StatusCode::kCancelled}) {
    shards_.checkpoint_hook = [code](const std::string&, const v1::CheckpointRequest&) {
      return absl::Status(code, "cut short");
    };
    const size_t calls = shards_.checkpoints.size();
    const std::vector<std::string> events = Events(id);
    coordinator_->Tick();
    ASSERT_EQ(shards_.checkpoints.size(), calls + 1) << absl::StatusCodeToString(code);
    EXPECT_EQ(shards_.checkpoints.back().step(), 10) << absl::StatusCodeToString(code);
    EXPECT_EQ(Events(id), events) << absl::StatusCodeToString(code);
    EXPECT_EQ(Job(id).last_checkpoint_step(), 0);
  }
  shards_.checkpoint_hook = nullptr;
  coordinator_->Tick();
  EXPECT_EQ(shards_.checkpoints.back().step(), 10);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 10);
  EXPECT_EQ(Events(id).back(), "checkpoint 10 committed: 1 shards, 1000 bytes");
}

TEST_F(CoordinatorTest, AutomaticCheckpointsMoveOnAfterAStepPassedOrAManualOne) {
  const std::string id = StartCheckpointedJob(2, 1, /*every=*/10);
  shards_.durable_through = 20;
  // Step 10 passed on shard 0 before it was captured (FAILED_PRECONDITION).
  shards_.checkpoint_hook = [](const std::string&, const v1::CheckpointRequest& request) {
    return request.step() == 10 ? absl::FailedPreconditionError("completed 16 steps")
                                : absl::OkStatus();
  };
  ReportAll(id, 14);
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 2u);
  EXPECT_EQ(shards_.checkpoints[0].step(), 10);
  EXPECT_EQ(Events(id).back(),
            "checkpoint 10 failed: shard 0 (127.0.0.1:4000): completed 16 steps");
  // The next tick moves on to 20 (ahead of the job, still at 14), not 10 again.
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 4u);
  EXPECT_EQ(shards_.checkpoints[2].step(), 20);
  EXPECT_EQ(shards_.checkpoints[3].step(), 20);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 20);
  EXPECT_EQ(Events(id).back(), "checkpoint 20 committed: 2 shards, 2000 bytes");
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 6u);
  EXPECT_EQ(shards_.checkpoints[5].step(), 30);  // not written yet: DEADLINE_EXCEEDED

  // A checkpoint by hand lands between two multiples (14 + a margin of 10); the automatic ones
  // stay on the multiples.
  shards_.durable_through = 24;
  auto manual = coordinator_->CheckpointJob(id);
  ASSERT_TRUE(manual.ok()) << manual.status();
  EXPECT_EQ(manual->step(), 24);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 24);
  ASSERT_EQ(shards_.checkpoints.size(), 8u);
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 10u);
  EXPECT_EQ(shards_.checkpoints[9].step(), 30);
  shards_.durable_through = 30;
  coordinator_->Tick();
  EXPECT_EQ(Job(id).last_checkpoint_step(), 30);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{30, 24, 20}));
}

TEST_F(CoordinatorTest, NoAutomaticCheckpointPastTheLastStep) {
  const std::string id = StartCheckpointedJob(1, 1, /*every=*/300);
  ReportAll(id, 990);  // total_steps 1000: 900 is done, 1200 never comes
  coordinator_->Tick();
  ASSERT_EQ(shards_.checkpoints.size(), 1u);
  EXPECT_EQ(shards_.checkpoints[0].step(), 900);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 900);
  coordinator_->Tick();
  EXPECT_EQ(shards_.checkpoints.size(), 1u);
}

// Waits (bounded) until `done` holds; false if it never did.
bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 1000; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

TEST_F(CoordinatorTest, AMembershipChangeDoesNotWaitForAHangingCheckpointCall) {
  options_.inline_actions = false;
  Restart();
  const std::string id = StartCheckpointedJob(1, 2, /*every=*/10);
  // Shared with the action thread, which may outlive a failed assertion here.
  auto entered = std::make_shared<absl::Notification>();
  auto release = std::make_shared<absl::Notification>();
  shards_.checkpoint_hook = [entered, release](const std::string&, const v1::CheckpointRequest&) {
    if (!entered->HasBeenNotified()) entered->Notify();
    release->WaitForNotificationWithTimeout(absl::Seconds(10));
    return absl::OkStatus();
  };
  ReportAll(id, 5);
  coordinator_->Tick();  // asks the shard for step 10: the call waits
  ASSERT_TRUE(entered->WaitForNotificationWithTimeout(absl::Seconds(10)));
  v1::DeregisterRequest leave;
  leave.set_member_id(Job(id).workers(1).member_id());
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  coordinator_->Tick();
  // Rank 1 leaves the shards' membership while the checkpoint call still hangs.
  EXPECT_TRUE(WaitFor([this] {
    absl::MutexLock lock(&shards_.mu);
    return !shards_.memberships.empty();
  }));
  {
    absl::MutexLock lock(&shards_.mu);
    ASSERT_EQ(shards_.memberships.size(), 1u);
    EXPECT_EQ(std::vector<uint32_t>(shards_.memberships[0].live_workers().begin(),
                                    shards_.memberships[0].live_workers().end()),
              (std::vector<uint32_t>{0}));
    EXPECT_EQ(shards_.memberships[0].effective_step(), 5);
    EXPECT_EQ(shards_.checkpoints.size(), 1u);  // one checkpoint call at a time
  }
  EXPECT_EQ(Job(id).last_checkpoint_step(), 0);
  release->Notify();
  EXPECT_TRUE(WaitFor([&] { return Job(id).last_checkpoint_step() == 10; }));
  coordinator_->Stop();
}

TEST_F(CoordinatorTest, ACheckpointWrittenWhileARecoveryStartedIsNotCommitted) {
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/10);
  ReportAll(id, 10);
  coordinator_->Tick();
  ASSERT_EQ(Job(id).last_checkpoint_step(), 10);
  ReportAll(id, 15);
  // While checkpoint 20 is written, shard 1 restarts: the job starts recovering from 10.
  shards_.checkpoint_hook = [this](const std::string& address, const v1::CheckpointRequest&) {
    if (address == "127.0.0.1:4001") RegisterShard(1);
    return absl::OkStatus();
  };
  coordinator_->Tick();
  shards_.checkpoint_hook = nullptr;
  ASSERT_EQ(shards_.checkpoints.size(), 4u);
  EXPECT_EQ(shards_.checkpoints[3].step(), 20);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 10);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{10}));
  // Refused without a failure of its own: the last event is the recovery's.
  EXPECT_EQ(Events(id).back(),
            "shard 1 (127.0.0.1:4001) restarted (registered again): recovering from checkpoint 10");
  EXPECT_EQ(Kinds(id).back(), v1::JOB_EVENT_KIND_RECOVERY);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).recoveries(), 1);
  EXPECT_EQ(Job(id).step(), 10);
  // From the restored state 20 is asked for again. Shard 1 restarts once more during the call,
  // and the call to its old process fails: the recovery overtook the call, so that is no
  // checkpoint failure either (no event, and 20 is not skipped).
  ReportAll(id, 12);
  shards_.checkpoint_hook = [this](const std::string& address, const v1::CheckpointRequest&) {
    if (address != "127.0.0.1:4001") return absl::OkStatus();
    RegisterShard(1);
    return absl::UnavailableError("connection refused");
  };
  coordinator_->Tick();
  shards_.checkpoint_hook = nullptr;
  EXPECT_EQ(shards_.checkpoints.back().step(), 20);
  EXPECT_EQ(Events(id).back(),
            "shard 1 (127.0.0.1:4001) restarted (registered again): recovering from checkpoint 10");
  coordinator_->Tick();
  EXPECT_EQ(Job(id).recoveries(), 2);
  ReportAll(id, 12);
  coordinator_->Tick();
  EXPECT_EQ(shards_.checkpoints.back().step(), 20);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 20);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{20, 10}));
  EXPECT_EQ(Events(id).back(), "checkpoint 20 committed: 2 shards, 2000 bytes");
}

TEST_F(CoordinatorTest, ARecoveryDoesNotWaitForAHangingCheckpointWhichIsThenNotCommitted) {
  options_.inline_actions = false;
  Restart();
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/10);
  {
    absl::MutexLock lock(&shards_.mu);
    shards_.durable_through = 10;
  }
  ReportAll(id, 10);
  coordinator_->Tick();
  ASSERT_TRUE(WaitFor([&] { return Job(id).last_checkpoint_step() == 10; }));
  // Shared with the action thread, which may outlive a failed assertion here.
  auto entered = std::make_shared<absl::Notification>();
  auto release = std::make_shared<absl::Notification>();
  {
    absl::MutexLock lock(&shards_.mu);
    shards_.durable_through = std::numeric_limits<int64_t>::max();
    shards_.checkpoint_hook = [entered, release](const std::string& address,
                                                 const v1::CheckpointRequest&) {
      if (address == "127.0.0.1:4000" && !entered->HasBeenNotified()) {
        entered->Notify();
        release->WaitForNotificationWithTimeout(absl::Seconds(10));
      }
      return absl::OkStatus();
    };
  }
  ReportAll(id, 15);
  // Ticks until checkpoint 20 is asked for (the action that committed 10 may still be ending).
  ASSERT_TRUE(WaitFor([&] {
    coordinator_->Tick();
    return entered->HasBeenNotified();
  }));
  RegisterShard(1);  // shard 1 restarts while the call for 20 hangs on shard 0
  ASSERT_NE(Job(id).recovery(), "");
  coordinator_->Tick();
  EXPECT_TRUE(WaitFor([&] { return Job(id).recoveries() == 1; }));
  EXPECT_EQ(Job(id).step(), 10);
  {
    absl::MutexLock lock(&shards_.mu);
    EXPECT_EQ(shards_.restores.size(), 2u);
    // 10 twice, 20 on both (shard 1 answered, shard 0 still waits).
    EXPECT_EQ(shards_.checkpoints.size(), 4u);
  }
  // Shard 0 then answers for 20 too, but it was taken before the rewind: not committed.
  release->Notify();
  coordinator_->Stop();  // joins the checkpoint action
  EXPECT_EQ(Job(id).last_checkpoint_step(), 10);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{10}));
  for (const std::string& event : Events(id)) {
    EXPECT_FALSE(absl::StartsWith(event, "checkpoint 20")) << event;
  }
  EXPECT_EQ(Events(id).back(), "restored checkpoint 10; workers rewound from step 15 to 10");
  EXPECT_EQ(Kinds(id).back(), v1::JOB_EVENT_KIND_RECOVERY);
}

TEST_F(CoordinatorTest, ShardRestartRestoresTheNewestUsableCheckpointOnEveryShard) {
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/50);
  ReportAll(id, 50);
  coordinator_->Tick();
  ReportAll(id, 100);
  coordinator_->Tick();
  ASSERT_EQ(Job(id).last_checkpoint_step(), 100);
  ReportAll(id, 130);
  const v1::Job before = Job(id);
  const std::string w0 = before.workers(0).member_id();
  const std::string w1 = before.workers(1).member_id();

  // Shard 1 registers again at its address while its old member is live: a restart.
  RegisterShard(1);
  v1::Job job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(
      job.recovery(),
      "shard 1 (127.0.0.1:4001) restarted (registered again): recovering from checkpoint 100");
  // The new registration took over the dead instance's id: one row, READY.
  EXPECT_EQ(Member("s-2").state(), v1::MEMBER_STATE_READY);
  // Checkpoint 100 is torn on shard 0: every shard goes back to 50.
  shards_.restore_fail[{"127.0.0.1:4000", 100}] = absl::DataLossError("ckpt-100/shard-0: bad crc");
  coordinator_->Tick();
  ASSERT_EQ(shards_.restores.size(), 3u);
  EXPECT_EQ(shards_.restores[0].step(), 100);
  EXPECT_EQ(shards_.restores[1].step(), 50);
  EXPECT_EQ(shards_.restores[2].step(), 50);
  EXPECT_EQ(shards_.restore_addresses[2], "127.0.0.1:4001");
  const uint64_t base = shards_.restores[1].min_incarnation();
  EXPECT_GT(base, before.workers(0).incarnation());
  EXPECT_GT(base, before.workers(1).incarnation());
  job = Job(id);
  EXPECT_EQ(job.recovery(), "");
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.step(), 50);
  EXPECT_EQ(job.last_checkpoint_step(), 50);
  EXPECT_EQ(Events(id).back(), "restored checkpoint 50; workers rewound from step 130 to 50");
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{50}));
  const v1::UpdateMembershipRequest& membership = shards_.memberships.back();
  EXPECT_EQ(membership.effective_step(), 50);
  EXPECT_EQ(membership.live_workers_size(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    const v1::Task task = LastTask(rank == 0 ? w0 : w1).assign();
    EXPECT_EQ(task.rank(), rank);
    EXPECT_EQ(task.start_step(), 50);
    EXPECT_EQ(task.incarnation(), base + rank);
    EXPECT_EQ(task.data_position().epoch(), 1);
    EXPECT_EQ(task.data_position().batch_offset(), 10);
    EXPECT_EQ(task.shard_addresses_size(), 2);
    EXPECT_EQ(job.workers(rank).incarnation(), base + rank);
    EXPECT_EQ(job.workers(rank).step(), 50);
  }
  EXPECT_EQ(coordinator_->MetricsSnapshot().progress[0].recoveries, 1);
  {
    auto metrics = Metrics::Create("coordinator", "");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    RegisterCoordinatorMetrics(metrics->get(), coordinator_.get());
    const std::string text = (*metrics)->Serialize();
    const std::string label = absl::StrCat("{job=\"", id, "\"}");
    EXPECT_EQ(Sample(text, "tessera_job_recoveries_total" + label), 1) << text;
    EXPECT_EQ(Sample(text, "tessera_job_checkpoint_step" + label), 50);
    EXPECT_TRUE(absl::StrContains(text, "# TYPE tessera_job_recoveries_total counter"));
  }

  // A straggling report of the old incarnation is ignored.
  v1::ProgressReport stale;
  stale.set_member_id(w0);
  stale.set_job_id(id);
  stale.set_rank(0);
  stale.set_phase(v1::TASK_PHASE_TRAINING);
  stale.set_step(140);
  stale.set_incarnation(before.workers(0).incarnation());
  auto ack = coordinator_->ReportProgress(stale);
  ASSERT_TRUE(ack.ok());
  EXPECT_TRUE(ack->cancel());
  EXPECT_EQ(Job(id).workers(0).step(), 50);
  EXPECT_FALSE(ReportRank(id, 0, 55).cancel());
  EXPECT_EQ(Job(id).workers(0).step(), 55);

  // A data-plane failure of a rank starts a recovery too; while it recovers, failures of its
  // ranks do not fail the job.
  ReportRank(id, 1, 60, v1::TASK_PHASE_FAILED, /*shard_error=*/true);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_NE(Job(id).recovery(), "");
  ReportRank(id, 0, 60, v1::TASK_PHASE_FAILED, /*shard_error=*/false);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Member(w0).state(), v1::MEMBER_STATE_BUSY);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).recoveries(), 2);
  EXPECT_EQ(LastTask(w0).assign().start_step(), 50);
  EXPECT_GT(LastTask(w0).assign().incarnation(), base + 1);
}

// replication 2 (internal/shard_failover.h): a shard a rank cannot reach gets a short lease; once
// it runs out the shard is down for the job, with no recovery; the acks say so; no checkpoint is
// taken; a neighbour's loss then needs a recovery, which restores every index.
TEST_F(CoordinatorTest, AReplicatedJobRunsOnWithoutALostShard) {
  for (int i = 0; i < 3; ++i) RegisterShard(i);
  for (int i = 0; i < 2; ++i) RegisterWorker(absl::StrCat("host-", i));
  v1::JobSpec spec = FashionMlpJob("rep", 2, "/data");
  spec.set_replication(2);
  spec.set_checkpoint_every_steps(50);
  auto created = coordinator_->CreateJob(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  coordinator_->Tick();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING) << Job(id).reason();
  ReportAll(id, 20);

  // Rank 0 cannot reach shard 1; every member but shard 1 goes on heartbeating.
  v1::ProgressReport report;
  report.set_member_id(Job(id).workers(0).member_id());
  report.set_job_id(id);
  report.set_rank(0);
  report.set_phase(v1::TASK_PHASE_TRAINING);
  report.set_step(21);
  report.set_incarnation(Job(id).workers(0).incarnation());
  report.add_unreachable_shards(1);
  ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  const std::string shard1 = "s-2";
  ASSERT_EQ(Member(shard1).shard_index(), 1);
  // The short lease is 1.25 heartbeat intervals (2 s): 2.5 s, well inside the 10 s one.
  for (int i = 0; i < 6; ++i) {
    now_ms_ += 500;
    for (const v1::Member& m : coordinator_->ListMembers()) {
      if (m.id() == shard1) continue;
      v1::HeartbeatRequest beat;
      beat.set_member_id(m.id());
      ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
    }
    coordinator_->Tick();
  }
  v1::Job job = Job(id);
  // The fake shards answer checkpoint calls at once, ahead of the job: some were committed.
  const int64_t committed = job.last_checkpoint_step();
  EXPECT_GT(committed, 0);
  EXPECT_EQ(Member(shard1).state(), v1::MEMBER_STATE_LOST);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(job.down_shards_size(), 1);
  EXPECT_EQ(job.down_shards(0), 1);
  EXPECT_EQ(job.recovery(), "");
  EXPECT_EQ(job.recoveries(), 0);
  EXPECT_TRUE(absl::StrContains(Events(id).back(),
                                "served by their copies on shard 2 and shard 0, "
                                "no rewind"))
      << Events(id).back();
  // The ranks hear it in their acks.
  const v1::ProgressAck ack = ReportRank(id, 1, 22);
  ASSERT_EQ(ack.down_shards_size(), 1);
  EXPECT_EQ(ack.down_shards(0), 1);
  // No checkpoint while a shard is down.
  ReportAll(id, 60);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).last_checkpoint_step(), committed);
  const absl::StatusOr<v1::CheckpointRecord> manual = coordinator_->CheckpointJob(id);
  EXPECT_EQ(manual.status().code(), absl::StatusCode::kFailedPrecondition) << manual.status();
  EXPECT_TRUE(absl::StrContains(manual.status().message(), "shard 1 down")) << manual.status();

  // Shard 2 holds the only live copy of shard 1's partitions: its loss cannot fail over, so the
  // job recovers from its newest checkpoint (taken with every shard) once every index is served
  // again, and the restore clears the down set.
  v1::DeregisterRequest leave;
  leave.set_member_id("s-3");
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(absl::StrContains(job.recovery(), "shard 2")) << job.recovery();
  RegisterShard(1);
  RegisterShard(2);
  coordinator_->Tick();
  job = Job(id);
  EXPECT_EQ(job.recovery(), "");
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.step(), committed);
  EXPECT_EQ(job.down_shards_size(), 0);
}

// A down shard of a replicated job that serves again is filled (internal/shard_refill.h): its
// neighbours snapshot a step ahead, their files are copied to it, every rank writes it from that
// step, and then it is up again. A rank that missed the step gives the fill up: what was
// installed is dropped, and the next attempt is further ahead.
TEST_F(CoordinatorTest, AReplicatedJobFillsAShardThatServesAgain) {
  for (int i = 0; i < 3; ++i) RegisterShard(i);
  for (int i = 0; i < 2; ++i) RegisterWorker(absl::StrCat("host-", i));
  v1::JobSpec spec = FashionMlpJob("fill", 2, "/data");
  spec.set_replication(2);
  auto created = coordinator_->CreateJob(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  coordinator_->Tick();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING) << Job(id).reason();
  ReportAll(id, 20);
  v1::DeregisterRequest leave;
  leave.set_member_id("s-2");  // shard 1
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  ASSERT_EQ(Job(id).down_shards_size(), 1);
  coordinator_->Tick();
  EXPECT_TRUE(shards_.fills.empty());  // nothing serves index 1

  RegisterShard(1);
  coordinator_->Tick();
  ASSERT_EQ(shards_.fills.size(), 1u);
  const FakeShards::Fill fill = shards_.fills[0];
  EXPECT_EQ(fill.target, "127.0.0.1:4001");
  EXPECT_THAT(fill.sources, ElementsAre("127.0.0.1:4002", "127.0.0.1:4000"));
  EXPECT_EQ(fill.shape.num_shards(), 3u);
  EXPECT_EQ(fill.shape.replicas(), 2u);
  const int64_t step = fill.shape.step();
  EXPECT_GT(step, 20);
  // The neighbours were asked to snapshot that step.
  int snapshots = 0;
  for (const v1::CheckpointRequest& c : shards_.checkpoints) snapshots += c.step() == step;
  EXPECT_EQ(snapshots, 2);
  // The shard kept the ranks' pushes of that step on while the files were copied.
  ASSERT_EQ(shards_.opened_fills.size(), 1u);
  EXPECT_EQ(shards_.opened_fills[0].target, "127.0.0.1:4001");
  EXPECT_EQ(shards_.opened_fills[0].shape.step(), step);
  EXPECT_EQ(shards_.opened_fills[0].shape.job_id(), id);
  EXPECT_TRUE(absl::StrContains(Events(id).back(), "filling its copies from shard 2 and 0"))
      << Events(id).back();
  // Still down until every rank writes it; the acks say so.
  auto writes = [step](v1::ProgressReport* r) { r->set_fill_from_step(step); };
  v1::ProgressAck ack = ReportRank(id, 0, 21, v1::TASK_PHASE_TRAINING, false, writes);
  ASSERT_TRUE(ack.has_fill());
  EXPECT_EQ(ack.fill().shard(), 1);
  EXPECT_EQ(ack.fill().address(), "127.0.0.1:4001");
  EXPECT_EQ(ack.fill().from_step(), step);
  EXPECT_THAT(ack.down_shards(), ElementsAre(1));
  ack = ReportRank(id, 1, 21);  // not yet
  EXPECT_TRUE(ack.has_fill());
  EXPECT_EQ(Job(id).down_shards_size(), 1);
  ack = ReportRank(id, 1, 22, v1::TASK_PHASE_TRAINING, false, writes);
  EXPECT_FALSE(ack.has_fill());
  EXPECT_EQ(ack.down_shards_size(), 0);
  EXPECT_EQ(Job(id).down_shards_size(), 0);
  EXPECT_EQ(Job(id).recoveries(), 0);
  EXPECT_TRUE(absl::StrContains(Events(id).back(), "shard 1 (127.0.0.1:4001) holds its copies"))
      << Events(id).back();

  // Lost again; this time rank 1 had pushed the step before it heard of the fill.
  for (const v1::Member& m : coordinator_->ListMembers()) {
    if (m.role() == v1::MEMBER_ROLE_SERVER && m.shard_index() == 1 &&
        m.state() == v1::MEMBER_STATE_READY) {
      leave.set_member_id(m.id());
    }
  }
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  ASSERT_EQ(Job(id).down_shards_size(), 1);
  RegisterShard(1);
  coordinator_->Tick();
  ASSERT_EQ(shards_.fills.size(), 2u);
  const int64_t second = shards_.fills[1].shape.step();
  ReportRank(id, 0, 30, v1::TASK_PHASE_TRAINING, false,
             [second](v1::ProgressReport* r) { r->set_fill_from_step(second); });
  ack = ReportRank(id, 1, 30, v1::TASK_PHASE_TRAINING, false, [second](v1::ProgressReport* r) {
    r->set_fill_from_step(second);
    r->set_fill_missed(true);
  });
  EXPECT_FALSE(ack.has_fill());
  EXPECT_THAT(ack.down_shards(), ElementsAre(1));
  EXPECT_EQ(Events(id).back(),
            absl::StrCat("filling shard 1 at step ", second, " is given up: rank 1 had pushed step ",
                         second, " before it heard of filling shard 1; trying again further ahead"));
  const size_t drops = shards_.dropped.size();
  coordinator_->Tick();  // drops what it installed
  ASSERT_EQ(shards_.dropped.size(), drops + 1);
  EXPECT_EQ(shards_.dropped.back(), "127.0.0.1:4001 " + id);
  coordinator_->Tick();
  EXPECT_EQ(shards_.fills.size(), 2u);  // not before a second has passed
  now_ms_ += 1500;
  ReportAll(id, 30);
  coordinator_->Tick();
  ASSERT_EQ(shards_.fills.size(), 3u);
  EXPECT_GT(shards_.fills[2].shape.step() - 30, second - 20);  // a wider margin
  EXPECT_TRUE(absl::StrContains(Events(id).back(), "(attempt 2)")) << Events(id).back();
}

TEST_F(CoordinatorTest, WithoutACheckpointAShardLossOrShardErrorFailsTheJob) {
  const std::string id = StartCheckpointedJob(1, 2, /*every=*/50);
  ReportAll(id, 30);
  ReportRank(id, 1, 30, v1::TASK_PHASE_FAILED, /*shard_error=*/true);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(id).reason(),
            "worker rank 1 (w-2 on host-1): shard 1 (127.0.0.1:4001): unavailable");
}

TEST_F(CoordinatorTest, RecoveryWaitsForTheShardThenTimesOutOrRunsOutOfCheckpoints) {
  options_.recovery_timeout = absl::Seconds(30);
  Restart();
  const std::string id = StartCheckpointedJob(2, 1, /*every=*/10);
  ReportAll(id, 10);
  coordinator_->Tick();
  ASSERT_EQ(Job(id).last_checkpoint_step(), 10);
  v1::DeregisterRequest leave;
  leave.set_member_id("s-2");
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  ReportRank(id, 0, 11, v1::TASK_PHASE_FAILED, /*shard_error=*/true);
  EXPECT_EQ(Member(Job(id).workers(0).member_id()).state(), v1::MEMBER_STATE_BUSY);
  for (int i = 0; i < 4; ++i) {
    now_ms_ += 5'000;
    HeartbeatAll();
    coordinator_->Tick();
  }
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(shards_.restores.empty());  // shard 1 is not back
  for (int i = 0; i < 2; ++i) {
    now_ms_ += 5'000;
    HeartbeatAll();
    coordinator_->Tick();
  }
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(id).reason(),
            "not recovered within 30 s (shard 1 (127.0.0.1:4001) left the cluster: recovering "
            "from checkpoint 10)");
  // The worker that reported its failure while the job recovered is free again.
  EXPECT_EQ(Member(Job(id).workers(0).member_id()).state(), v1::MEMBER_STATE_READY);
  EXPECT_TRUE(StoredCheckpoints(id).empty());  // its weights were dropped

  // Every checkpoint unusable: FAILED, naming them.
  RegisterShard(1);
  v1::JobSpec spec = FashionMlpJob("next", 1, "/data");
  spec.set_checkpoint_every_steps(10);
  auto next = coordinator_->CreateJob(spec);
  ASSERT_TRUE(next.ok());
  coordinator_->Tick();
  ASSERT_EQ(Job(next->id()).state(), v1::JOB_STATE_RUNNING);
  ReportAll(next->id(), 10);
  coordinator_->Tick();
  ASSERT_EQ(Job(next->id()).last_checkpoint_step(), 10);
  shards_.restore_fail[{"127.0.0.1:4001", 10}] = absl::NotFoundError("no ckpt-10/shard-1");
  ReportRank(next->id(), 0, 12, v1::TASK_PHASE_FAILED, /*shard_error=*/true);
  coordinator_->Tick();
  EXPECT_EQ(Job(next->id()).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(next->id()).reason(),
            "no checkpoint could be restored: checkpoint 10 on shard 1 (127.0.0.1:4001): no "
            "ckpt-10/shard-1");
}

TEST_F(CoordinatorTest, ALostRankIsHandedToAnIdleWorkerAfterATooLateJoinIsUndone) {
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/0);
  ReportAll(id, 40);
  const std::string w0 = Job(id).workers(0).member_id();
  v1::DeregisterRequest leave;
  leave.set_member_id(Job(id).workers(1).member_id());
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  EXPECT_EQ(Events(id).back(),
            "worker rank 1 (w-2 on host-1) left the cluster; continuing with 1 workers");
  // A new worker comes, but every shard has already done more steps than the join's start.
  const std::string w3 = RegisterWorker("host-3");
  shards_.completed_steps = 55;
  coordinator_->Tick();
  // Per shard: the removal at step 40, the join at 40 + 10, its undo.
  ASSERT_EQ(shards_.memberships.size(), 6u);
  EXPECT_EQ(shards_.memberships[0].live_workers_size(), 1);
  EXPECT_EQ(shards_.memberships[0].effective_step(), 40);
  EXPECT_EQ(shards_.memberships[2].live_workers_size(), 2);
  EXPECT_EQ(shards_.memberships[2].effective_step(), 50);
  EXPECT_EQ(shards_.memberships[4].live_workers_size(), 1);
  EXPECT_EQ(shards_.memberships[4].effective_step(), 50);
  EXPECT_TRUE(Job(id).workers(1).lost());
  EXPECT_EQ(Member(w3).state(), v1::MEMBER_STATE_READY);
  EXPECT_TRUE(streams_[w3]->events.empty());
  // The next try starts from the shards' own count (55, fresher than the reports), goes further
  // ahead (a margin of 20) and lands.
  shards_.completed_steps = 45;
  coordinator_->Tick();
  ASSERT_EQ(shards_.memberships.size(), 8u);
  EXPECT_EQ(shards_.memberships[7].effective_step(), 75);
  const v1::Job job = Job(id);
  EXPECT_FALSE(job.workers(1).lost());
  EXPECT_EQ(job.workers(1).member_id(), w3);
  EXPECT_GT(job.workers(1).incarnation(), job.workers(0).incarnation());
  EXPECT_EQ(Events(id).back(), "rank 1 handed to w-3 from step 75");
  EXPECT_EQ(Kinds(id).back(), v1::JOB_EVENT_KIND_MEMBERSHIP);
  const v1::Task task = LastTask(w3).assign();
  EXPECT_EQ(task.rank(), 1);
  EXPECT_EQ(task.start_step(), 75);
  EXPECT_EQ(task.incarnation(), job.workers(1).incarnation());
  EXPECT_EQ(task.data_position().epoch(), 1);
  EXPECT_EQ(task.data_position().batch_offset(), 35);
  EXPECT_EQ(Member(w3).job_id(), id);
  // The job goes on and succeeds with the new rank 1.
  ReportRank(id, 1, 1000, v1::TASK_PHASE_TRAINING_DONE);
  EXPECT_TRUE(ReportRank(id, 0, 1000, v1::TASK_PHASE_TRAINING_DONE).all_workers_done());
  ReportRank(id, 0, 1000, v1::TASK_PHASE_SUCCEEDED);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(Member(w0).state(), v1::MEMBER_STATE_READY);
}

TEST_F(CoordinatorTest, EveryRankLostFailsTheJob) {
  const std::string id = StartCheckpointedJob(1, 1, /*every=*/0);
  v1::DeregisterRequest leave;
  leave.set_member_id(Job(id).workers(0).member_id());
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(id).reason(), "worker rank 0 (w-1 on host-0) left the cluster");
}

TEST_F(CoordinatorTest, ACoordinatorRestartedMidRecoveryFinishesIt) {
  const std::string id = StartCheckpointedJob(1, 2, /*every=*/20);
  ReportAll(id, 20);
  coordinator_->Tick();
  ReportAll(id, 25);
  const v1::Job before = Job(id);
  RegisterShard(0);  // the shard restarted; the coordinator dies before it recovers the job
  ASSERT_NE(Job(id).recovery(), "");
  Restart();
  const int64_t restarted_ms = now_ms_;
  EXPECT_NE(Job(id).recovery(), "");
  RegisterShard(0);
  const std::string a = RegisterWorker("host-0");
  const std::string b = RegisterWorker("host-1");
  // The workers report again under new ids, with their incarnations.
  for (int rank = 0; rank < 2; ++rank) {
    v1::ProgressReport report;
    report.set_member_id(rank == 0 ? a : b);
    report.set_job_id(id);
    report.set_rank(rank);
    report.set_phase(v1::TASK_PHASE_FAILED);
    report.set_shard_error(true);
    report.set_step(25);
    report.set_incarnation(before.workers(rank).incarnation());
    ASSERT_TRUE(coordinator_->ReportProgress(report).ok());
  }
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  // Every rank is back: the restart grace is over at the next tick, long before its 15 s, and
  // the recovery runs.
  EXPECT_TRUE(shards_.restores.empty());
  now_ms_ += 100;
  coordinator_->Tick();
  EXPECT_LT(now_ms_ - restarted_ms, kGraceMs);
  ASSERT_EQ(shards_.restores.size(), 1u);
  EXPECT_EQ(shards_.restores[0].step(), 20);
  EXPECT_EQ(Job(id).recoveries(), 1);
  EXPECT_EQ(Job(id).recovery(), "");
  EXPECT_EQ(LastTask(a).assign().rank(), 0);
  EXPECT_EQ(LastTask(b).assign().rank(), 1);
  EXPECT_EQ(LastTask(b).assign().start_step(), 20);
  // And it goes on committing checkpoints.
  ReportAll(id, 40);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).last_checkpoint_step(), 40);
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{40, 20}));
}

TEST_F(CoordinatorTest, ActionsRunOnThreadsOfTheirOwn) {
  options_.inline_actions = false;
  Restart();
  const std::string id = StartCheckpointedJob(1, 1, /*every=*/10);
  absl::Notification release;
  shards_.checkpoint_hook = [&release](const std::string&, const v1::CheckpointRequest&) {
    // The tick that started the checkpoint must not wait for it.
    release.WaitForNotificationWithTimeout(absl::Seconds(10));
    return absl::OkStatus();
  };
  ReportAll(id, 10);
  coordinator_->Tick();
  coordinator_->Tick();  // returns although the checkpoint call still blocks
  EXPECT_EQ(Job(id).last_checkpoint_step(), 0);
  release.Notify();
  for (int i = 0; i < 500 && Job(id).last_checkpoint_step() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Job(id).last_checkpoint_step(), 10);
  coordinator_->Stop();
  EXPECT_EQ(shards_.checkpoints.size(), 1u);
}

TEST_F(CoordinatorTest, CheckpointJobGoesFurtherAheadWhenTooLate) {
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/0);
  ReportAll(id, 20);
  shards_.checkpoint_hook = [](const std::string&, const v1::CheckpointRequest& request) {
    return request.step() < 35 ? absl::FailedPreconditionError("completed 35 steps")
                               : absl::OkStatus();
  };
  auto record = coordinator_->CheckpointJob(id);
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(record->step(), 40);  // 20 + 10 was too late; 20 + 20 was not
  EXPECT_TRUE(record->manual());
  EXPECT_EQ(record->shards_size(), 2);
  ASSERT_EQ(shards_.checkpoints.size(), 4u);  // both shards at once, each time
  EXPECT_EQ(shards_.checkpoints[0].step(), 30);
  EXPECT_EQ(shards_.checkpoints[1].step(), 30);
  EXPECT_EQ(shards_.checkpoints[2].step(), 40);
  EXPECT_EQ(shards_.checkpoints[3].step(), 40);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 40);
  EXPECT_EQ(Events(id).back(), "checkpoint 40 committed (by hand): 2 shards, 2000 bytes");
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{40}));

  shards_.checkpoint_hook = [](const std::string&, const v1::CheckpointRequest&) {
    return absl::FailedPreconditionError("always too late");
  };
  EXPECT_EQ(coordinator_->CheckpointJob(id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shards_.checkpoints.size(), 14u);  // 5 tries, both shards each
  EXPECT_EQ(coordinator_->CheckpointJob("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(coordinator_->CheckpointJob("nope-1").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(coordinator_->CancelJob(id).ok());
  EXPECT_EQ(coordinator_->CheckpointJob(id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(StoredCheckpoints(id).empty());
}

// Review finding 1: a pending join survives later membership updates, also after a restart.
TEST_F(CoordinatorTest, ALaterMembershipUpdateKeepsAPendingJoinAtItsStep) {
  const std::string id = StartCheckpointedJob(1, 3, /*every=*/0);
  const std::string shard = "127.0.0.1:4000";
  ReportAll(id, 40);
  v1::DeregisterRequest leave;
  leave.set_member_id(Job(id).workers(1).member_id());
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  RegisterWorker("host-3");
  coordinator_->Tick();  // rank 1 out at 40, then handed over from 50
  ASSERT_EQ(Events(id).back(), "rank 1 handed to w-4 from step 50");
  EXPECT_EQ(shards_.LiveAt(shard, 45), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(shards_.LiveAt(shard, 50), (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(Job(id).step(), 40);
  // Rank 2 is lost before the others reach 50: the shards hear (40, {0}) and (50, {0, 1}), so
  // the new rank 1 (which starts at 50) is still not waited for at steps 40..49.
  leave.set_member_id(Job(id).workers(2).member_id());
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  coordinator_->Tick();
  EXPECT_EQ(shards_.LiveAt(shard, 45), (std::vector<uint32_t>{0}));
  EXPECT_EQ(shards_.LiveAt(shard, 49), (std::vector<uint32_t>{0}));
  EXPECT_EQ(shards_.LiveAt(shard, 50), (std::vector<uint32_t>{0, 1}));

  // A restarted coordinator sends every RUNNING job's membership again: the join is re-derived
  // and not moved earlier.
  const v1::Job before = Job(id);
  Restart();
  const int64_t restarted_ms = now_ms_;
  RegisterShard(0);
  const std::string a = RegisterWorker("host-0");
  const std::string b = RegisterWorker("host-3");
  for (const auto& [rank, member, step] :
       std::vector<std::tuple<int, std::string, int64_t>>{{0, a, 42}, {1, b, 50}}) {
    v1::ProgressReport report;
    report.set_member_id(member);
    report.set_job_id(id);
    report.set_rank(rank);
    report.set_phase(v1::TASK_PHASE_TRAINING);
    report.set_step(step);
    report.set_incarnation(before.workers(rank).incarnation());
    auto ack = coordinator_->ReportProgress(report);
    ASSERT_TRUE(ack.ok()) << ack.status();
    EXPECT_FALSE(ack->cancel());
  }
  AdvanceWithHeartbeats(restarted_ms + kGraceMs);
  const size_t sent = shards_.memberships.size();
  coordinator_->Tick();
  ASSERT_GT(shards_.memberships.size(), sent);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(shards_.LiveAt(shard, 42), (std::vector<uint32_t>{0}));
  EXPECT_EQ(shards_.LiveAt(shard, 49), (std::vector<uint32_t>{0}));
  EXPECT_EQ(shards_.LiveAt(shard, 50), (std::vector<uint32_t>{0, 1}));
  // Once the job has reached the join, it is history: a full update from the job's step.
  ReportRank(id, 0, 55);
  ReportRank(id, 1, 55);
  leave.set_member_id(Job(id).workers(1).member_id());
  ASSERT_TRUE(coordinator_->Deregister(leave).ok());
  coordinator_->Tick();
  EXPECT_EQ(shards_.LiveAt(shard, 50), (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(shards_.LiveAt(shard, 55), (std::vector<uint32_t>{0}));
}

// Review finding 2: a rank lost while the restore RPCs ran leaves the shards' membership after.
TEST_F(CoordinatorTest, ARankLostDuringTheRestoreLeavesTheMembershipAfterIt) {
  const std::string id = StartCheckpointedJob(1, 3, /*every=*/10);
  const std::string shard = "127.0.0.1:4000";
  ReportAll(id, 10);
  coordinator_->Tick();
  ASSERT_EQ(Job(id).last_checkpoint_step(), 10);
  ReportAll(id, 14);
  RegisterShard(0);  // restarted: recovery from 10
  ASSERT_NE(Job(id).recovery(), "");
  const std::string gone = Job(id).workers(2).member_id();
  shards_.restore_hook = [this, gone](const std::string&) {
    v1::DeregisterRequest leave;
    leave.set_member_id(gone);
    EXPECT_TRUE(coordinator_->Deregister(leave).ok());
  };
  coordinator_->Tick();
  shards_.restore_hook = nullptr;
  ASSERT_EQ(Job(id).recoveries(), 1);
  EXPECT_TRUE(Job(id).workers(2).lost());
  // The recovery sent the ranks it planned with (rank 2 among them) ...
  EXPECT_EQ(shards_.LiveAt(shard, 10), (std::vector<uint32_t>{0, 1, 2}));
  // ... so the next tick sends the live ones again.
  coordinator_->Tick();
  EXPECT_EQ(shards_.LiveAt(shard, 10), (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(shards_.LiveAt(shard, 11), (std::vector<uint32_t>{0, 1}));
}

// Review finding 3: the step being written does not count toward keep_checkpoints.
TEST_F(CoordinatorTest, RetentionKeepsTheCommittedFallbackWhileANewCheckpointIsWritten) {
  shards_.model_files = true;
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/10, /*keep=*/1);
  ReportAll(id, 10);
  coordinator_->Tick();
  ASSERT_EQ(Job(id).last_checkpoint_step(), 10);
  // Checkpoint 20: shard 0 writes it, shard 1 fails; 10 must survive on shard 0.
  shards_.checkpoint_hook = [](const std::string& address, const v1::CheckpointRequest&) {
    return address == "127.0.0.1:4001" ? absl::UnavailableError("disk gone") : absl::OkStatus();
  };
  ReportAll(id, 20);
  coordinator_->Tick();
  shards_.checkpoint_hook = nullptr;
  ASSERT_EQ(shards_.checkpoints.back().step(), 20);
  EXPECT_EQ(shards_.checkpoints.back().retain_from_step(), 10);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 10);
  EXPECT_EQ(shards_.files["127.0.0.1:4000"], (std::set<int64_t>{10, 20}));
  // Shard 1 restarts: the job is restored from 10 on both shards.
  RegisterShard(1);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING) << Job(id).reason();
  EXPECT_EQ(Job(id).recoveries(), 1);
  EXPECT_EQ(Job(id).step(), 10);
  // Committed 30 with keep 1: the shards then drop 10, and the record of 10 goes.
  ReportAll(id, 30);
  coordinator_->Tick();
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{30}));
  coordinator_->Tick();  // 40, asked ahead of the job (and written at once by the fake)
  EXPECT_EQ(StoredCheckpoints(id), (std::vector<int64_t>{40}));
  EXPECT_EQ(shards_.files["127.0.0.1:4000"], (std::set<int64_t>{30, 40}));
}

// Review finding 4: a checkpoint by hand with shards that answer once the step is written and
// refuse a step already passed (they train in lockstep meanwhile).
TEST_F(CoordinatorTest, CheckpointJobAsksEveryShardAtOnce) {
  const std::string id = StartCheckpointedJob(2, 2, /*every=*/0);
  ReportAll(id, 20);
  auto trained = std::make_shared<std::atomic<int64_t>>(20);  // steps done by every shard
  auto stop = std::make_shared<std::atomic<bool>>(false);
  std::thread trainer([trained, stop] {
    for (int i = 0; i < 4000 && !*stop; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
      ++*trained;
    }
  });
  shards_.checkpoint_hook = [trained](const std::string&, const v1::CheckpointRequest& request) {
    if (*trained > request.step()) {
      return absl::FailedPreconditionError(absl::StrCat("completed ", trained->load(), " steps"));
    }
    for (int i = 0; i < 2000 && *trained <= request.step(); ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::OkStatus();
  };
  auto record = coordinator_->CheckpointJob(id);
  *stop = true;
  trainer.join();
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(record->step(), 30);
  EXPECT_EQ(record->shards_size(), 2);
  EXPECT_EQ(shards_.checkpoints.size(), 2u);
  EXPECT_EQ(Job(id).last_checkpoint_step(), 30);
}

// Review finding 5: Stop() cancels the shard calls in flight and returns promptly.
TEST_F(CoordinatorTest, StopCancelsBlockedShardCallsPromptly) {
  options_.inline_actions = false;
  options_.checkpoint_timeout = absl::Seconds(120);
  Restart();
  shards_.cancelled = std::make_shared<absl::Notification>();
  const std::string id = StartCheckpointedJob(1, 1, /*every=*/10);
  auto cancelled = shards_.cancelled;
  auto entered = std::make_shared<std::atomic<int>>(0);
  shards_.checkpoint_hook = [cancelled, entered](const std::string&, const v1::CheckpointRequest&) {
    ++*entered;
    // A long poll for a step that does not come: only a cancel ends it (bounded for the test).
    if (cancelled->WaitForNotificationWithTimeout(absl::Seconds(20))) {
      return absl::CancelledError("cancelled");
    }
    return absl::DeadlineExceededError("deadline");
  };
  ReportAll(id, 5);
  coordinator_->Tick();  // the automatic checkpoint of 10 blocks on its own thread
  absl::StatusOr<v1::CheckpointRecord> manual;
  std::thread by_hand([&] { manual = coordinator_->CheckpointJob(id); });
  ASSERT_TRUE(WaitFor([&] { return *entered == 2; }));
  const absl::Time start = absl::Now();
  coordinator_->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  by_hand.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(manual.status().code(), absl::StatusCode::kCancelled) << manual.status();
  EXPECT_EQ(*entered, 2);  // no further try after the cancel
  EXPECT_EQ(Job(id).last_checkpoint_step(), 0);
}

}  // namespace
}  // namespace tessera::coordinator
