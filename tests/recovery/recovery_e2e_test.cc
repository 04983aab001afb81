// Crash recovery with the real binaries (issue #6, tests 1, 2 and 5): a coordinator, 2 shards and
// 3 worker daemons as child processes on loopback (cli/local_cluster.h), training the Fashion-MNIST
// MLP in BSP with a fixed seed; one process is SIGKILLed in the middle of training.
//
//  1. A worker (in a 4-epoch run): the job succeeds; figures: the seconds from the kill to the
//     membership change (the coordinator's "lost" event), the step the idle third worker took
//     the rank over at, and the accuracy against a fault-free run of the same seed (target:
//     within 0.5 percentage points).
//  2. A shard, with checkpoints every 50 steps, restarted on its port as systemd would: the job
//     succeeds; figures: steps lost (<= 50 + what the steps of one checkpoint write take), seconds
//     from the kill to the first step after the rewind, accuracy against the fault-free run.
//  5. The coordinator, down for 3 s: the job still ends SUCCEEDED with all its history (events
//     1..N without a gap, every epoch's evaluation).
//
// Every wait is bounded. Skips (with a message) only when Fashion-MNIST is missing.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/coordinator_client.h"
#include "cli/exporter.h"
#include "cli/local_cluster.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/job_spec_reader.h"
#include "spec/testing/example_jobs.h"
#include "tests/recovery/cluster_fixture.h"
#include "tests/testlib/fashion_mnist.h"

namespace tessera {
namespace {

using RecoveryE2eTest = ::tessera::testing::ClusterE2eTest;
using ::tessera::testing::kLeaseSeconds;
using ::tessera::testing::NowMs;
using ::tessera::testing::Spec;

// Test 1: a worker SIGKILLed in the middle of training.
TEST_F(RecoveryE2eTest, WorkerKilledMidTrainingJobSucceedsAndIdleWorkerTakesTheRank) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  // 4 epochs (1876 steps a rank): long enough for the idle worker to take the rank over and
  // train with it before the end.
  const double baseline = Baseline(4);

  absl::StatusOr<v1::Job> created = client_->CreateJob(Spec("worker-kill", 50, 4));
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job running = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 300);
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  const std::string victim = ChildOfRank(id, 1);
  ASSERT_FALSE(victim.empty()) << "no worker process holds rank 1 of " << id;
  const int64_t kill_step = running.step();
  const int64_t kill_ms = NowMs();
  ASSERT_TRUE(cluster_->Kill(victim).ok());

  v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> lost = FindEvent(events, "worker rank 1", kill_ms);
  ASSERT_TRUE(lost.has_value()) << "no membership change for rank 1 after the kill";
  EXPECT_TRUE(absl::StrContains(lost->message(), "lost")) << lost->message();
  const std::optional<v1::JobEvent> handed = FindEvent(events, "rank 1 handed to", kill_ms);
  EXPECT_TRUE(handed.has_value()) << "the idle worker did not take rank 1 over";
  const double membership_s = (lost->time_ms() - kill_ms) / 1000.0;
  // Nothing hangs longer than the lease plus one step (and the coordinator's 500 ms tick).
  EXPECT_LE(membership_s, 2.0 + 1.5);
  const double delta_pp = std::fabs(done.test_accuracy() - baseline) * 100;
  std::printf(
      "recovery: worker-kill: killed rank 1 at step %lld; membership change after %.2f s "
      "(lease %s s); %s; test accuracy %.4f vs %.4f fault-free (delta %.2f pp)\n",
      static_cast<long long>(kill_step), membership_s, kLeaseSeconds,
      handed.has_value() ? handed->message().c_str() : "no hand-over", done.test_accuracy(),
      baseline, delta_pp);
  // One run's accuracy on the 10,000 test images has a standard error of about 0.34 pp; the
  // difference of two runs (the kill lands at a different step each time) about 0.48 pp. Two of
  // those: a lost rank that hurt training shows, noise does not.
  EXPECT_LE(delta_pp, 1.0);
}

// Test 2: a shard SIGKILLed in the middle of training, checkpoints every 50 steps.
TEST_F(RecoveryE2eTest, ShardKilledMidTrainingJobResumesFromTheLastCheckpoint) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  const double baseline = Baseline();

  absl::StatusOr<v1::Job> created = client_->CreateJob(Spec("shard-kill", 50));
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job running = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 300 &&
                        j.last_checkpoint_step() >= 100);
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  // `tessera checkpoint`: a checkpoint by hand, between the automatic ones, on both real shards.
  absl::StatusOr<v1::CheckpointRecord> manual = client_->CheckpointJob(id);
  ASSERT_TRUE(manual.ok()) << manual.status();
  EXPECT_TRUE(manual->manual());
  EXPECT_EQ(manual->shards_size(), 2);
  EXPECT_GT(manual->step(), running.step());
  for (const v1::ShardCheckpoint& shard : manual->shards()) {
    EXPECT_GT(shard.bytes(), 0u);
    EXPECT_EQ(access(shard.path().c_str(), R_OK), 0) << shard.path();
  }
  const int64_t kill_ms = NowMs();
  ASSERT_TRUE(cluster_->Kill("shard-1").ok());
  // systemd's Restart=on-failure with its default RestartSec=100ms.
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(cluster_->Restart("shard-1").ok());

  // The largest step any rank reported before the rewind: the progress that was lost.
  int64_t reached = running.step();
  int64_t restored = -1;
  int64_t first_step_ms = 0;
  v1::Job done = WaitForJob(id, absl::Seconds(240), Ended, [&](const v1::Job& j) {
    if (restored < 0 && j.recoveries() == 0) {
      for (const v1::JobWorker& w : j.workers()) reached = std::max(reached, w.step());
    }
    if (restored < 0 && j.recoveries() > 0) restored = j.last_checkpoint_step();
    if (restored >= 0 && first_step_ms == 0) {
      for (const v1::JobWorker& w : j.workers()) {
        if (w.step() > restored) first_step_ms = NowMs();
      }
    }
  });
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_GE(done.recoveries(), 1);
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> rewind = FindEvent(events, "restored checkpoint", kill_ms);
  ASSERT_TRUE(rewind.has_value()) << "no rewind event after the kill";
  // The event names the step it restored: "restored checkpoint S; ...".
  int64_t step = -1;
  ASSERT_EQ(std::sscanf(rewind->message().c_str(), "restored checkpoint %lld",
                        reinterpret_cast<long long*>(&step)),
            1)
      << rewind->message();
  // An automatic multiple of 50, or the checkpoint taken by hand.
  EXPECT_TRUE(step % 50 == 0 || step == manual->step()) << rewind->message();
  // The reports trail the workers by up to 0.5 s, while the coordinator commits as soon as the
  // shards have written a checkpoint: the step reached is at least the one restored.
  reached = std::max(reached, step);
  const int64_t lost = reached - step;
  const double first_push_s = first_step_ms > 0 ? (first_step_ms - kill_ms) / 1000.0 : -1;
  const double delta_pp = std::fabs(done.test_accuracy() - baseline) * 100;
  std::printf(
      "recovery: shard-kill: shard 1 killed with %lld steps reached; restored checkpoint %lld "
      "(%lld steps lost); first step after the rewind %.2f s after the kill (progress reports "
      "every 0.5 s); test accuracy %.4f vs %.4f fault-free (delta %.2f pp)\n",
      static_cast<long long>(reached), static_cast<long long>(step), static_cast<long long>(lost),
      first_push_s, done.test_accuracy(), baseline, delta_pp);
  EXPECT_LE(lost, 50 + 25);  // one interval, plus the steps run while the last one was written
  EXPECT_GT(first_push_s, 0);
  EXPECT_LE(delta_pp, 1.0);
}

// A sparse BSP job (a hashed embedding table) with checkpoints every 50 steps, shard 1 SIGKILLed
// and restarted mid-job: rows, their optimizer slots and update counts come back from the same
// checkpoint as the dense tensors, and the job ends with exactly the weights of a fault-free run
// (BSP, a fixed data order, one thread per worker: the replay is deterministic).
TEST_F(RecoveryE2eTest, ShardKilledInASparseJobEndsWithTheFaultFreeWeights) {
  v1::JobSpec spec;
  ASSERT_NO_FATAL_FAILURE(spec = StartSparseCluster(/*epochs=*/2, /*checkpoint_every=*/50));
  const auto weights = [](const v1::Job& job) { return ::tessera::testing::PullWeightsByRow(job); };
  spec.set_name("sparse-baseline");
  const v1::Job baseline = RunToEnd(spec);
  ASSERT_EQ(baseline.state(), v1::JOB_STATE_SUCCEEDED) << baseline.reason();
  const auto want = weights(baseline);
  ASSERT_EQ(want.count("embedding_bag_1/embeddings"), 1u);
  EXPECT_GT(want.at("embedding_bag_1/embeddings").size(), 390u);

  spec.set_name("sparse-shard-kill");
  absl::StatusOr<v1::Job> created = client_->CreateJob(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job running = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 300 &&
                        j.last_checkpoint_step() >= 100);
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  ASSERT_TRUE(cluster_->Kill("shard-1").ok());
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(cluster_->Restart("shard-1").ok());
  const v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_GE(done.recoveries(), 1);
  ASSERT_TRUE(FindEvent(Events(id), "restored checkpoint", 0).has_value());
  const auto got = weights(done);
  ASSERT_EQ(got.size(), want.size());
  int differing = 0;
  for (const auto& [name, tensor] : want) {
    if (tensor != got.at(name)) {
      ++differing;
      ADD_FAILURE() << name << " differs from the fault-free run (" << got.at(name).size()
                    << " rows against " << tensor.size() << ")";
    }
  }
  EXPECT_EQ(differing, 0);
  EXPECT_EQ(done.test_auc(), baseline.test_auc());
  std::printf(
      "recovery: sparse shard-kill at step %lld, %d recoveries, %zu table rows, test AUC "
      "%.4f (fault-free %.4f)\n",
      static_cast<long long>(running.step()), done.recoveries(),
      want.at("embedding_bag_1/embeddings").size(), done.test_auc(), baseline.test_auc());
}

// Test 5: the coordinator SIGKILLed while a job runs, back 3 s later.
TEST_F(RecoveryE2eTest, CoordinatorKilledJobStillSucceedsWithItsWholeHistory) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  absl::StatusOr<v1::Job> created = client_->CreateJob(Spec("coordinator-kill", 50));
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job running = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 200);
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  ASSERT_TRUE(cluster_->KillCoordinator().ok());
  const absl::Time down = absl::Now();
  absl::SleepFor(absl::Seconds(3));
  ASSERT_TRUE(cluster_->RestartCoordinator().ok());
  const double down_s = absl::ToDoubleSeconds(absl::Now() - down);

  v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  const std::vector<v1::JobEvent> events = Events(id);
  ASSERT_FALSE(events.empty());
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].seq(), static_cast<int64_t>(i) + 1) << events[i].message();
  }
  EXPECT_TRUE(FindEvent(events, "started").has_value());
  // Epoch 1's evaluation happened while the coordinator was down or around it: buffered, not lost.
  EXPECT_TRUE(FindEvent(events, "epoch 1: test accuracy").has_value());
  EXPECT_TRUE(absl::StartsWith(events.back().message(), "succeeded")) << events.back().message();
  EXPECT_EQ(done.step(), done.total_steps());
  std::printf(
      "recovery: coordinator-kill: down %.1f s at step %lld; job SUCCEEDED at step %lld with %zu "
      "events (seq 1..%zu, no gap); test accuracy %.4f\n",
      down_s, static_cast<long long>(running.step()), static_cast<long long>(done.step()),
      events.size(), events.size(), done.test_accuracy());
  EXPECT_GT(done.test_accuracy(), 0.8);
}

}  // namespace
}  // namespace tessera
