// Replicated shards with the real binaries (issue #16): a coordinator, 2 shards and 3 worker
// daemons on loopback (cli/local_cluster.h) train the Fashion-MNIST MLP in BSP with
// `replication: 2`, and shard 1 is SIGKILLed mid-job and never restarted. Its partitions are
// served by their copies on shard 0: the job succeeds with no recovery and no step rewound, and
// its final weights are bit-identical to a fault-free run of the same seed without replication
// (BSP with a fixed data order and one thread per worker is deterministic, and the copies apply
// the same pushes in the same order). Prints the seconds from the kill to the failover event and
// to the first step past the one the job had reached, with the tests' short lease and with the
// coordinator's defaults.
//
// Every wait is bounded. Skips (with a message) only when Fashion-MNIST is missing.
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/exporter.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/testing/example_jobs.h"
#include "tests/recovery/cluster_fixture.h"
#include "tests/testlib/fashion_mnist.h"

namespace tessera {
namespace {

using ::tessera::testing::Differing;
using ::tessera::testing::NowMs;
using ::tessera::testing::PullWeightsByRow;
using ::tessera::testing::Spec;
using ::tessera::testing::WeightsByRow;
using ::testing::HasSubstr;

class ReplicationE2eTest : public ::tessera::testing::ClusterE2eTest {
 protected:
  // Submits `name` (the demo MLP) with replication 2 and waits until it is RUNNING at step 300;
  // returns that record (another state on failure).
  v1::Job StartReplicatedAtStep300(const std::string& name) {
    v1::JobSpec spec = Spec(name, 0);
    spec.set_replication(2);
    absl::StatusOr<v1::Job> created = client_->CreateJob(spec);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return v1::Job();
    return WaitForJob(created->id(), absl::Seconds(120), [](const v1::Job& j) {
      return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 300);
    });
  }

  // When the records showed the failover, and the first step past the one reached before it.
  struct Failover {
    int64_t reached = 0;      // the largest step a rank reported before the failover
    int64_t failover_ms = 0;  // the first record with down shards (0: none)
    int64_t past_ms = 0;      // the first record whose step is past `reached` after it
  };
  // Waits for `running`'s job to end, watching for the failover.
  v1::Job WaitWatchingFailover(const v1::Job& running, Failover* f) {
    f->reached = running.step();
    return WaitForJob(running.id(), absl::Seconds(240), Ended, [f](const v1::Job& j) {
      if (f->failover_ms == 0) {
        for (const v1::JobWorker& w : j.workers()) f->reached = std::max(f->reached, w.step());
        if (j.down_shards_size() > 0) f->failover_ms = NowMs();
      } else if (f->past_ms == 0 && j.step() > f->reached) {
        f->past_ms = NowMs();
      }
    });
  }

  // Submits `spec` with replication 2, waits until it is RUNNING at step 300, SIGKILLs shard 1,
  // waits for its failover and restarts it on a new port with its data directory. Returns the
  // job's id, sets *restart_ms (when shard 1 was restarted) and *old_address (where it served);
  // empty, with the test failed, on any other outcome.
  std::string RunThenReplaceShard1(v1::JobSpec spec, int64_t* restart_ms,
                                   std::string* old_address = nullptr) {
    spec.set_replication(2);
    absl::StatusOr<v1::Job> created = client_->CreateJob(spec);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return "";
    const std::string id = created->id();
    v1::Job job = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
      return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 300);
    });
    EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
    if (job.state() != v1::JOB_STATE_RUNNING || !cluster_->Kill("shard-1").ok()) return "";
    job = WaitForJob(id, absl::Seconds(60),
                     [](const v1::Job& j) { return Ended(j) || j.down_shards_size() > 0; });
    EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
    EXPECT_EQ(job.down_shards_size(), 1);
    if (job.state() != v1::JOB_STATE_RUNNING || job.down_shards_size() != 1) return "";
    if (old_address != nullptr) *old_address = job.shard_addresses(1);
    *restart_ms = NowMs();
    const absl::Status restarted = cluster_->RestartOnNewPort("shard-1");
    EXPECT_TRUE(restarted.ok()) << restarted;
    return restarted.ok() ? id : "";
  }

  // Waits until job `id`'s restarted shard 1 is filled, then SIGKILLs shard 0 and waits for the
  // end: the job must succeed on the filled shard alone, with no recovery. Returns the ended
  // record (another state, with the test failed, on any other outcome).
  v1::Job FillThenCarryOnAlone(const std::string& id) {
    const v1::Job job = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
      return Ended(j) || j.down_shards_size() == 0;
    });
    EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
    if (job.state() != v1::JOB_STATE_RUNNING || !cluster_->Kill("shard-0").ok()) return job;
    const v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
    EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
    EXPECT_EQ(done.recoveries(), 0);
    EXPECT_THAT(done.down_shards(), ::testing::ElementsAre(0));
    EXPECT_GT(done.step(), job.step());
    return done;
  }

  // The cluster with the coordinator's default lease (10 s) and heartbeat (2 s), 2 workers.
  static cli::LocalCluster::Options DefaultLeases() {
    cli::LocalCluster::Options o = ClusterOptions();
    o.coordinator_args.clear();
    o.num_workers = 2;
    return o;
  }
};

TEST_F(ReplicationE2eTest, ShardKilledForGoodJobSucceedsWithoutRewindAndTheFaultFreeWeights) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  // No checkpoints: with a copy of every partition, nothing is restored from disk.
  const v1::Job baseline = RunToEnd(Spec("unreplicated", 0));
  ASSERT_EQ(baseline.state(), v1::JOB_STATE_SUCCEEDED) << baseline.reason();
  const WeightsByRow want = PullWeightsByRow(baseline);
  ASSERT_FALSE(want.empty());

  const v1::Job running = StartReplicatedAtStep300("replicated");
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  const std::string id = running.id();
  const int64_t kill_ms = NowMs();
  ASSERT_TRUE(cluster_->Kill("shard-1").ok());
  // The step the job had reached when shard 1 went (the reports trail by up to 0.5 s), and when
  // it went past it.
  Failover f;
  const v1::Job done = WaitWatchingFailover(running, &f);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.recoveries(), 0);
  ASSERT_EQ(done.down_shards_size(), 1);
  EXPECT_EQ(done.down_shards(0), 1);
  for (const v1::JobWorker& w : done.workers()) EXPECT_FALSE(w.lost());
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> failover = FindEvent(events, "no rewind", kill_ms);
  ASSERT_TRUE(failover.has_value()) << "no failover event after the kill";
  EXPECT_EQ(failover->kind(), v1::JOB_EVENT_KIND_RECOVERY);
  EXPECT_FALSE(FindEvent(events, "restored checkpoint").has_value());

  // Shard 0 alone serves every partition now; the weights are those of the fault-free run.
  EXPECT_THAT(Differing(want, PullWeightsByRow(done)), ::testing::IsEmpty())
      << "these differ from the fault-free run";
  EXPECT_EQ(done.test_accuracy(), baseline.test_accuracy());
  const double to_failover_s = (failover->time_ms() - kill_ms) / 1000.0;
  const double to_step_s = f.past_ms > 0 ? (f.past_ms - kill_ms) / 1000.0 : -1;
  std::printf(
      "replication: shard 1 killed at step ~%lld, not restarted; failover event %.2f s after the "
      "kill, first step past %lld seen %.2f s after it (records polled every 50 ms, reports every "
      "0.5 s); 0 recoveries; weights bit-identical to the unreplicated run; test accuracy %.4f; "
      "%.0f vs %.0f samples/s unreplicated\n",
      static_cast<long long>(running.step()), to_failover_s, static_cast<long long>(f.reached),
      to_step_s, done.test_accuracy(), done.samples_per_second(), baseline.samples_per_second());
  EXPECT_GT(to_step_s, 0);
  EXPECT_LT(to_failover_s, 10.0);  // the shortened lease, not a rewind
}

// What an operator gets: the coordinator's default lease (10 s) and heartbeat (2 s). The loss is
// found through the workers' reports and the shortened lease, not the 10 s one.
TEST_F(ReplicationE2eTest, WithTheDefaultLeaseAKilledShardFailsOverWithinSeconds) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster(DefaultLeases()));
  const v1::Job running = StartReplicatedAtStep300("replicated-default-lease");
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  const std::string id = running.id();
  const int64_t kill_ms = NowMs();
  ASSERT_TRUE(cluster_->Kill("shard-1").ok());
  Failover f;
  const v1::Job done = WaitWatchingFailover(running, &f);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.recoveries(), 0);
  const std::optional<v1::JobEvent> failover = FindEvent(Events(id), "no rewind", kill_ms);
  ASSERT_TRUE(failover.has_value());
  const double to_failover_s = (failover->time_ms() - kill_ms) / 1000.0;
  const double to_step_s = f.past_ms > 0 ? (f.past_ms - kill_ms) / 1000.0 : -1;
  std::printf(
      "replication, default lease 10 s and heartbeat 2 s: failover event %.2f s after the kill "
      "(\"%s\"), first step past %lld seen %.2f s after it; 0 recoveries; test accuracy %.4f\n",
      to_failover_s, failover->message().c_str(), static_cast<long long>(f.reached), to_step_s,
      done.test_accuracy());
  EXPECT_GT(to_step_s, 0);
  EXPECT_LT(to_failover_s, 5.0);  // 1.25 heartbeats after the last one, not the 10 s lease
}

// A shard SIGSTOPped with the default lease: it answers nothing, not even the pushes a live
// shard answers at once; a worker names it once one has waited 1 s (unanswered_push_suspect), and
// the coordinator then gives it the short lease (1.25 heartbeats after its last one), not 10 s.
TEST_F(ReplicationE2eTest, AStoppedShardFailsOverWithinSeconds) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster(DefaultLeases()));
  const v1::Job running = StartReplicatedAtStep300("replicated-sigstop");
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  const std::string id = running.id();
  pid_t pid = -1;
  for (const cli::LocalCluster::Child& child : cluster_->children()) {
    if (child.name == "shard-1") pid = child.pid();
  }
  ASSERT_GT(pid, 0);
  const int64_t stop_ms = NowMs();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  Failover f;
  const v1::Job done = WaitWatchingFailover(running, &f);
  ::kill(pid, SIGCONT);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.recoveries(), 0);
  const std::optional<v1::JobEvent> failover = FindEvent(Events(id), "no rewind", stop_ms);
  ASSERT_TRUE(failover.has_value());
  const double to_failover_s = (failover->time_ms() - stop_ms) / 1000.0;
  const double to_step_s = f.past_ms > 0 ? (f.past_ms - stop_ms) / 1000.0 : -1;
  std::printf(
      "replication, default lease: shard 1 SIGSTOPped at step ~%lld; failover event %.2f s "
      "later (\"%s\"), first step past %lld seen %.2f s after it; 0 recoveries; test accuracy "
      "%.4f\n",
      static_cast<long long>(running.step()), to_failover_s, failover->message().c_str(),
      static_cast<long long>(f.reached), to_step_s, done.test_accuracy());
  EXPECT_THAT(failover->message(), HasSubstr("unreachable from a worker"));
  EXPECT_GT(to_step_s, 0);
  EXPECT_LT(to_failover_s, 5.0);  // 1 s unanswered, then the short lease: not the 10 s one
}

// The lost shard comes back (on a new port, its data directory kept): it is filled from shard 0
// while the job trains and holds its copies again; then shard 0 is killed too, and shard 1 alone
// carries the job to the end. The weights are still the fault-free run's: the fill installed
// exactly what shard 1 would have held, and it applied every push after it.
TEST_F(ReplicationE2eTest, ARestartedShardIsFilledWhileTheJobTrainsAndThenCarriesItAlone) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  const v1::Job baseline = RunToEnd(Spec("unreplicated", 0, 8));
  ASSERT_EQ(baseline.state(), v1::JOB_STATE_SUCCEEDED) << baseline.reason();
  const WeightsByRow want = PullWeightsByRow(baseline);
  ASSERT_FALSE(want.empty());

  int64_t restart_ms = 0;
  std::string old_address;
  const std::string id = RunThenReplaceShard1(Spec("refilled", 0, 8), &restart_ms, &old_address);
  ASSERT_FALSE(id.empty());
  int64_t filled_ms = 0;
  const v1::Job job = WaitForJob(id, absl::Seconds(120), [&](const v1::Job& j) {
    if (j.down_shards_size() == 0 && filled_ms == 0) filled_ms = NowMs();
    return Ended(j) || j.down_shards_size() == 0;
  });
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  ASSERT_EQ(job.down_shards_size(), 0);
  EXPECT_NE(job.shard_addresses(1), old_address);  // the new port
  const int64_t filled_at_step = job.step();

  // (Events() waits for the job's end: its history is read after it.)
  ASSERT_TRUE(cluster_->Kill("shard-0").ok());
  const v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.recoveries(), 0);
  ASSERT_EQ(done.down_shards_size(), 1);
  EXPECT_EQ(done.down_shards(0), 0);
  EXPECT_GT(done.step(), filled_at_step);
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> began = FindEvent(events, "filling its copies", restart_ms);
  const std::optional<v1::JobEvent> filled = FindEvent(events, "holds its copies again");
  ASSERT_TRUE(began.has_value());
  ASSERT_TRUE(filled.has_value());
  EXPECT_TRUE(FindEvent(events, "shard 0 (", filled->time_ms()).has_value());  // its failover
  EXPECT_FALSE(FindEvent(events, "restored checkpoint").has_value());

  // Shard 1 alone, filled mid-job, ends with the weights of the fault-free run.
  EXPECT_THAT(Differing(want, PullWeightsByRow(done)), ::testing::IsEmpty())
      << "these differ from the fault-free run";
  EXPECT_EQ(done.test_accuracy(), baseline.test_accuracy());
  std::printf(
      "replication fill: shard 1 restarted on a new port; \"%s\" %.2f s after the restart; "
      "\"%s\" %.2f s after it (seen in the records %.2f s after it, at step %lld); shard 0 then "
      "killed: 0 recoveries, weights bit-identical to the unreplicated run, test accuracy %.4f; "
      "%.0f vs %.0f samples/s unreplicated\n",
      began->message().c_str(), (began->time_ms() - restart_ms) / 1000.0, filled->message().c_str(),
      (filled->time_ms() - restart_ms) / 1000.0, (filled_ms - restart_ms) / 1000.0,
      static_cast<long long>(filled_at_step), done.test_accuracy(), done.samples_per_second(),
      baseline.samples_per_second());
}

// The same under ASP: the neighbour's snapshot of the fill's step is taken once its slowest rank
// reaches it, so it may already hold the faster rank's pushes of that step and later, which the
// filled shard also kept; it applies only what its cut lacks. ASP runs are not deterministic, so
// the check is the outcome: no recovery, and the test accuracy of an unreplicated ASP run.
TEST_F(ReplicationE2eTest, AnAspJobsRestartedShardIsFilledAndThenCarriesItAlone) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  v1::JobSpec spec = Spec("asp-unreplicated", 0, 8);
  spec.set_consistency("asp");
  const v1::Job baseline = RunToEnd(spec);
  ASSERT_EQ(baseline.state(), v1::JOB_STATE_SUCCEEDED) << baseline.reason();

  spec.set_name("asp-refilled");
  int64_t restart_ms = 0;
  const std::string id = RunThenReplaceShard1(spec, &restart_ms);
  ASSERT_FALSE(id.empty());
  const v1::Job done = FillThenCarryOnAlone(id);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> filled =
      FindEvent(events, "holds its copies again", restart_ms);
  ASSERT_TRUE(filled.has_value());
  EXPECT_FALSE(FindEvent(events, "restored checkpoint").has_value());
  EXPECT_FALSE(FindEvent(events, "only BSP").has_value());
  // One run's accuracy on 10,000 test images has a standard error of about 0.34 points.
  EXPECT_NEAR(done.test_accuracy(), baseline.test_accuracy(), 0.015);
  std::printf(
      "replication fill, ASP: \"%s\" %.2f s after the restart; shard 0 then killed: 0 "
      "recoveries, test accuracy %.4f against %.4f unreplicated\n",
      filled->message().c_str(), (filled->time_ms() - restart_ms) / 1000.0, done.test_accuracy(),
      baseline.test_accuracy());
}

// A rank that hears of the fill only after it pushed the fill's step without the shard
// (failpoint worker.rank1.fill=at@1: rank 1 takes the first fill late) has missed it: the fill
// is given up and tried again further ahead, and the second one fills the shard. Nothing the
// first one installed stays: the weights are still the fault-free run's.
TEST_F(ReplicationE2eTest, AFillARankHeardOfLateIsTriedAgainFurtherAhead) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  cli::LocalCluster::Options o = ClusterOptions();
  o.worker_env.assign(o.num_workers, {{"TESSERA_FAILPOINTS", "worker.rank1.fill=at@1"}});
  ASSERT_NO_FATAL_FAILURE(StartCluster(o));
  const v1::Job baseline = RunToEnd(Spec("unreplicated", 0, 8));
  ASSERT_EQ(baseline.state(), v1::JOB_STATE_SUCCEEDED) << baseline.reason();
  const WeightsByRow want = PullWeightsByRow(baseline);
  ASSERT_FALSE(want.empty());

  int64_t restart_ms = 0;
  const std::string id = RunThenReplaceShard1(Spec("refilled-late", 0, 8), &restart_ms);
  ASSERT_FALSE(id.empty());
  const v1::Job job = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || j.down_shards_size() == 0;
  });
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  ASSERT_EQ(job.down_shards_size(), 0);

  const v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.recoveries(), 0);
  const std::vector<v1::JobEvent> events = Events(id);
  // Given up either way: rank 1 reports that it missed the step, or the shard's catch-up finds
  // the step that rank 1's pushes never completed there, whichever comes first.
  const std::optional<v1::JobEvent> missed =
      FindEvent(events, "filling shard 1 at step ", restart_ms);
  const std::optional<v1::JobEvent> again = FindEvent(events, "(attempt 2)", restart_ms);
  const std::optional<v1::JobEvent> filled = FindEvent(events, "holds its copies again");
  ASSERT_TRUE(missed.has_value());
  ASSERT_TRUE(again.has_value());
  ASSERT_TRUE(filled.has_value());
  EXPECT_THAT(missed->message(), HasSubstr("is given up"));
  EXPECT_THAT(missed->message(), ::testing::AnyOf(HasSubstr("rank 1 had pushed step"),
                                                  HasSubstr("a rank that missed the fill")));
  EXPECT_GE(again->time_ms(), missed->time_ms());
  EXPECT_GE(filled->time_ms(), again->time_ms());
  EXPECT_THAT(Differing(want, PullWeightsByRow(done)), ::testing::IsEmpty())
      << "these differ from the fault-free run";
  EXPECT_EQ(done.test_accuracy(), baseline.test_accuracy());
  std::printf(
      "replication fill, rank 1 late: \"%s\"; \"%s\"; \"%s\" %.2f s after the restart; 0 "
      "recoveries, weights bit-identical to the unreplicated run, test accuracy %.4f\n",
      missed->message().c_str(), again->message().c_str(), filled->message().c_str(),
      (filled->time_ms() - restart_ms) / 1000.0, done.test_accuracy());
}

// The same with a sparse model (a hashed embedding table with Adagrad; 12 epochs, so that a fill
// tried again further ahead, after a rank missed its step under load, still ends well before the
// job): the fill cuts the rows
// (and their slots and update counts) that shard 1 holds out of shard 0's snapshot, and after
// shard 0 is killed too, every row and tensor is the fault-free run's.
TEST_F(ReplicationE2eTest, ASparseJobsRestartedShardIsFilledAndThenCarriesItAlone) {
  v1::JobSpec spec;
  ASSERT_NO_FATAL_FAILURE(spec = StartSparseCluster(/*epochs=*/12, /*checkpoint_every=*/0));
  spec.set_name("sparse-unreplicated");
  const v1::Job baseline = RunToEnd(spec);
  ASSERT_EQ(baseline.state(), v1::JOB_STATE_SUCCEEDED) << baseline.reason();
  const WeightsByRow want = PullWeightsByRow(baseline);
  ASSERT_EQ(want.count("embedding_bag_1/embeddings"), 1u);

  spec.set_name("sparse-refilled");
  int64_t restart_ms = 0;
  const std::string id = RunThenReplaceShard1(spec, &restart_ms);
  ASSERT_FALSE(id.empty());
  const v1::Job done = FillThenCarryOnAlone(id);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  const std::optional<v1::JobEvent> filled =
      FindEvent(Events(id), "holds its copies again", restart_ms);
  ASSERT_TRUE(filled.has_value());
  EXPECT_THAT(filled->message(), ::testing::HasSubstr("1 tables"));
  const WeightsByRow got = PullWeightsByRow(done);
  EXPECT_THAT(Differing(want, got), ::testing::IsEmpty());
  EXPECT_EQ(done.test_auc(), baseline.test_auc());
  std::printf(
      "replication fill, sparse: \"%s\" (%.2f s after the restart); shard 0 then killed: 0 "
      "recoveries, %zu table rows bit-identical to the unreplicated run, test AUC %.4f\n",
      filled->message().c_str(), (filled->time_ms() - restart_ms) / 1000.0,
      want.at("embedding_bag_1/embeddings").size(), done.test_auc());
}

TEST_F(ReplicationE2eTest, AReplicatedJobNeedsTwoShards) {
  cli::LocalCluster::Options o = ClusterOptions();
  o.num_shards = 1;
  o.num_workers = 2;
  ASSERT_NO_FATAL_FAILURE(StartCluster(o));
  v1::JobSpec spec = Spec("one-shard", 0);
  spec.set_replication(2);
  absl::StatusOr<v1::Job> created = client_->CreateJob(spec);
  ASSERT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument) << created.status();
  EXPECT_NE(created.status().message().find("replication"), std::string::npos) << created.status();
}

}  // namespace
}  // namespace tessera
