// No silent stalls (issue #16), with the real binaries on loopback (tests/recovery/
// cluster_fixture.h), each case printing its figures (docs/reliability.md):
//
//  1. A worker SIGSTOPped in the middle of a BSP job, with the coordinator's default lease (10 s)
//     and heartbeat (2 s): seconds until `tessera get` names the stopped rank (target: under
//     5 s), and, after SIGCONT, until the job steps again; the job succeeds.
//  2. A training loop that hangs while the worker's heartbeats go on (the failpoint
//     trainer.rank1.step, common/failpoint.h), in a job with stall_timeout_seconds 5 and
//     stall_policy "evict": the rank is evicted after the timeout, the idle worker takes it over,
//     and the job succeeds.
//  3. A shard killed and restarted on a new port with its data directory: the coordinator takes
//     it for the same shard at once (no wait for its dead instance's lease); seconds from the
//     restart to the first step after the rewind (target: under 3 s).
//
// Every wait is bounded. Skips (with a message) only when Fashion-MNIST is missing.
#include <signal.h>
#include <stdlib.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/recovery/cluster_fixture.h"
#include "tests/testlib/fashion_mnist.h"

namespace tessera {
namespace {

using ::tessera::cli::LocalCluster;
using ::tessera::testing::ClusterE2eTest;
using ::tessera::testing::NowMs;
using ::tessera::testing::Spec;

class StallE2eTest : public ClusterE2eTest {
 protected:
  // The coordinator's defaults (lease 10 s, heartbeat 2 s): what an operator gets.
  static LocalCluster::Options DefaultLeases(int workers) {
    LocalCluster::Options o = ClusterOptions();
    o.num_workers = workers;
    o.coordinator_args.clear();
    return o;
  }
};

pid_t PidOf(const LocalCluster& cluster, const std::string& name) {
  for (const LocalCluster::Child& child : cluster.children()) {
    if (child.name == name) return child.pid();
  }
  return -1;
}

TEST_F(StallE2eTest, AStoppedWorkerIsNamedWithinSecondsAndTheJobGoesOnWhenItResumes) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster(DefaultLeases(2)));
  absl::StatusOr<v1::Job> created = client_->CreateJob(Spec("sigstop", 0));
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job running = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.step() >= 200);
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  const std::string victim = ChildOfRank(id, 1);
  ASSERT_FALSE(victim.empty()) << "no worker process holds rank 1 of " << id;
  const pid_t pid = PidOf(*cluster_, victim);
  ASSERT_GT(pid, 0);
  const int64_t stop_ms = NowMs();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  // Named well before the 10 s lease would lose it.
  v1::Job named = WaitForJob(id, absl::Seconds(9), [](const v1::Job& j) {
    return Ended(j) || absl::StrContains(j.stall(), "for rank 1 (");
  });
  const int64_t named_ms = NowMs();
  ASSERT_EQ(::kill(pid, SIGCONT), 0);
  ASSERT_TRUE(absl::StrContains(named.stall(), "for rank 1 (")) << named.stall();
  EXPECT_TRUE(absl::StrContains(named.stall(), "which has not pushed")) << named.stall();
  EXPECT_GT(named.workers(1).stalled_seconds(), 0);
  EXPECT_EQ(named.workers(0).stalled_seconds(), 0);
  const double named_s = (named_ms - stop_ms) / 1000.0;
  const int64_t stalled_step = named.step();
  int64_t stepping_ms = 0;
  v1::Job resumed = WaitForJob(
      id, absl::Seconds(30),
      [&](const v1::Job& j) { return Ended(j) || (stepping_ms > 0 && j.stall().empty()); },
      [&](const v1::Job& j) {
        if (stepping_ms == 0 && j.step() > stalled_step) stepping_ms = NowMs();
      });
  const double stepping_s = (stepping_ms - named_ms) / 1000.0;
  const double cleared_s = (NowMs() - named_ms) / 1000.0;
  EXPECT_GT(stepping_ms, 0);
  EXPECT_EQ(resumed.stall(), "");
  v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_FALSE(done.workers(1).lost());
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> stall_event = FindEvent(events, "for rank 1 (", stop_ms);
  ASSERT_TRUE(stall_event.has_value());
  EXPECT_EQ(stall_event->kind(), v1::JOB_EVENT_KIND_STALL);
  EXPECT_TRUE(FindEvent(events, "no longer waiting", stop_ms).has_value());
  std::printf(
      "stall: sigstop: rank 1 stopped at step %lld; named after %.2f s (\"%s\"); after SIGCONT "
      "the job steps again in %.2f s (its reports come every 0.5 s) and the stall is cleared in "
      "%.2f s (the shards' next heartbeat); job SUCCEEDED, test accuracy %.4f\n",
      static_cast<long long>(running.step()), named_s, named.stall().c_str(), stepping_s, cleared_s,
      done.test_accuracy());
  EXPECT_LT(named_s, 5.0);
}

TEST_F(StallE2eTest, AHungTrainingLoopWithLiveHeartbeatsIsEvictedAndTheJobSucceeds) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  // Every worker would hang before rank 1's step 150; the idle worker that takes the rank over
  // starts past it.
  LocalCluster::Options o = DefaultLeases(3);
  o.worker_env.assign(3, {{"TESSERA_FAILPOINTS", "trainer.rank1.step=hang@150"}});
  ASSERT_NO_FATAL_FAILURE(StartCluster(o));
  v1::JobSpec spec = Spec("hung", 0);
  spec.set_stall_timeout_seconds(5);
  spec.set_stall_policy("evict");
  absl::StatusOr<v1::Job> created = client_->CreateJob(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job hung = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || absl::StrContains(j.stall(), "for rank 1 (");
  });
  ASSERT_TRUE(absl::StrContains(hung.stall(), "for rank 1 (")) << hung.stall();
  v1::Job done = WaitForJob(id, absl::Seconds(240), Ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  const std::vector<v1::JobEvent> events = Events(id);
  const std::optional<v1::JobEvent> evicted = FindEvent(events, "evicted: no step progress");
  ASSERT_TRUE(evicted.has_value()) << "rank 1 was not evicted";
  EXPECT_TRUE(absl::StartsWith(evicted->message(), "worker rank 1 (")) << evicted->message();
  const std::optional<v1::JobEvent> handed = FindEvent(events, "rank 1 handed to");
  EXPECT_TRUE(handed.has_value()) << "the idle worker did not take rank 1 over";
  const std::optional<v1::JobEvent> first_named = FindEvent(events, "for rank 1 (");
  ASSERT_TRUE(first_named.has_value());
  const double evict_s = (evicted->time_ms() - first_named->time_ms()) / 1000.0;
  std::printf(
      "stall: hung loop: rank 1 hung at step 150 with heartbeats on; named, then \"%s\" %.2f s "
      "after it was named (stall_timeout_seconds 5); %s; job SUCCEEDED at step %lld, test "
      "accuracy %.4f\n",
      evicted->message().c_str(), evict_s,
      handed.has_value() ? handed->message().c_str() : "no hand-over",
      static_cast<long long>(done.step()), done.test_accuracy());
  // Named about 2-4 s into the hang; evicted once it has lasted 5 s.
  EXPECT_GT(evict_s, 0.5);
  EXPECT_LT(evict_s, 8.0);
  EXPECT_GT(done.test_accuracy(), 0.8);
}

TEST_F(StallE2eTest, AShardRestartedOnANewPortIsTakenBackAtOnce) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ASSERT_NO_FATAL_FAILURE(StartCluster(DefaultLeases(2)));
  absl::StatusOr<v1::Job> created = client_->CreateJob(Spec("new-port", 50));
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  v1::Job running = WaitForJob(id, absl::Seconds(120), [](const v1::Job& j) {
    return Ended(j) || (j.state() == v1::JOB_STATE_RUNNING && j.last_checkpoint_step() >= 100);
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  const std::string old_address = cluster_->shard_addresses()[1];
  ASSERT_TRUE(cluster_->Kill("shard-1").ok());
  const int64_t restart_ms = NowMs();
  ASSERT_TRUE(cluster_->RestartOnNewPort("shard-1").ok());
  const std::string new_address = cluster_->shard_addresses()[1];
  EXPECT_NE(new_address, old_address);
  int64_t restored = -1;
  int64_t first_step_ms = 0;
  v1::Job done = WaitForJob(id, absl::Seconds(240), Ended, [&](const v1::Job& j) {
    if (restored < 0 && j.recoveries() > 0) restored = j.last_checkpoint_step();
    if (restored >= 0 && first_step_ms == 0) {
      for (const v1::JobWorker& w : j.workers()) {
        if (w.step() > restored) first_step_ms = NowMs();
      }
    }
  });
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.shard_addresses(1), new_address);
  // One row for shard 1: the new registration took over its id.
  absl::StatusOr<std::vector<v1::Member>> members = client_->ListMembers();
  ASSERT_TRUE(members.ok()) << members.status();
  int rows = 0;
  for (const v1::Member& m : *members) {
    if (m.role() == v1::MEMBER_ROLE_SERVER && m.shard_index() == 1) {
      ++rows;
      EXPECT_EQ(m.address(), new_address);
    }
  }
  EXPECT_EQ(rows, 1);
  ASSERT_GT(first_step_ms, 0);
  const double stall_s = (first_step_ms - restart_ms) / 1000.0;
  std::printf(
      "stall: shard on a new port: shard 1 restarted at %s (was %s); first step after the rewind "
      "to checkpoint %lld %.2f s after the restart (the dead instance's lease is 10 s); job "
      "SUCCEEDED\n",
      new_address.c_str(), old_address.c_str(), static_cast<long long>(restored), stall_s);
  EXPECT_LT(stall_s, 3.0);
}

}  // namespace
}  // namespace tessera
