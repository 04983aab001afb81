// The stall inspector, the progress lease, and members that come back (issue #16): what the
// shards' heartbeats say a step waits for becomes the job's record, events and metric; a rank
// without step progress for the job's stall_timeout is warned about or evicted; a shard that
// restarts on a new port with its data directory replaces its dead instance at once; the restart
// grace ends once every rank is back.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/testing/prometheus_text.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/testing/coordinator_fixture.h"
#include "spec/testing/example_jobs.h"

namespace tessera::coordinator {
namespace {

using ::tessera::coordinator::testing::CoordinatorTest;
using ::tessera::prometheus_text::Sample;
using ::tessera::spec::examples::FashionMlpJob;

class StallTest : public CoordinatorTest {
 protected:
  // A 2-worker job on 2 shards (w-1 on host-0 is rank 0, w-2 on host-1 rank 1), both ranks at
  // step 10.
  std::string StartJob(int stall_timeout_seconds = 0, const std::string& policy = "") {
    RegisterShard(0);
    RegisterShard(1);
    RegisterWorker("host-0");
    RegisterWorker("host-1");
    v1::JobSpec spec = FashionMlpJob("st", 2, "/data");
    spec.set_stall_timeout_seconds(stall_timeout_seconds);
    spec.set_stall_policy(policy);
    auto job = coordinator_->CreateJob(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    coordinator_->Tick();
    EXPECT_EQ(Job(job->id()).state(), v1::JOB_STATE_RUNNING) << Job(job->id()).reason();
    ReportAll(job->id(), 10);
    return job->id();
  }

  // A heartbeat of shard `index` (s-<index + 1>) saying that step `step` of `job_id` has waited
  // `waiting_ms` for rank `rank`, which has not pushed `missing` of its 7 partitions there.
  absl::Status ShardSaysWaiting(int index, const std::string& job_id, int64_t step,
                                int64_t waiting_ms, int rank, int missing) {
    v1::HeartbeatRequest beat;
    beat.set_member_id(absl::StrCat("s-", index + 1));
    v1::ShardStall* stall = beat.add_stalls();
    stall->set_job_id(job_id);
    stall->set_step(step);
    stall->set_waiting_ms(waiting_ms);
    stall->set_partitions(7);
    v1::LaggingRank* lagging = stall->add_lagging();
    lagging->set_rank(rank);
    lagging->set_partitions(missing);
    lagging->set_clock(step);
    return coordinator_->Heartbeat(beat);
  }

  // One second on: heartbeats from the workers and shard 1, shard 0 saying that step 11 has
  // waited `waited_ms` for all 7 partitions of rank 1, and a tick.
  void SecondWithRank1Lagging(const std::string& job_id, int64_t waited_ms) {
    now_ms_ += 1000;
    for (const char* member : {"s-2", "w-1", "w-2"}) {
      v1::HeartbeatRequest beat;
      beat.set_member_id(member);
      ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
    }
    ASSERT_TRUE(ShardSaysWaiting(0, job_id, 11, waited_ms, 1, 7).ok());
    coordinator_->Tick();
  }

  std::vector<std::string> StallEvents(const std::string& job_id) {
    std::vector<std::string> out;
    const std::vector<std::string> messages = Events(job_id);
    const std::vector<v1::JobEventKind> kinds = Kinds(job_id);
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (kinds[i] == v1::JOB_EVENT_KIND_STALL) out.push_back(messages[i]);
    }
    return out;
  }
};

TEST_F(StallTest, TheShardsReportNamesTheLaggardItsHostAndHowLong) {
  auto metrics = Metrics::Create("coordinator", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  RegisterCoordinatorMetrics(metrics->get(), coordinator_.get());
  const std::string id = StartJob();

  // Under kNameStallAfter (2 s): an ordinary wait, not named.
  ASSERT_TRUE(ShardSaysWaiting(0, id, 11, 1500, 1, 3).ok());
  EXPECT_EQ(Job(id).stall(), "");
  EXPECT_TRUE(StallEvents(id).empty());

  ASSERT_TRUE(ShardSaysWaiting(0, id, 11, 2500, 1, 3).ok());
  const std::string named =
      "step 11: waiting 2.5 s for rank 1 (w-2 on host-1), which has not pushed 3 of its 7 "
      "partitions to shard 0";
  EXPECT_EQ(Job(id).stall(), named);
  EXPECT_DOUBLE_EQ(Job(id).workers(1).stalled_seconds(), 2.5);
  EXPECT_EQ(Job(id).workers(0).stalled_seconds(), 0);
  EXPECT_EQ(StallEvents(id), std::vector<std::string>{named});
  const std::string text = (*metrics)->Serialize();
  EXPECT_EQ(
      Sample(text, absl::StrCat("tessera_job_rank_stall_seconds{job=\"", id, "\",rank=\"1\"}")),
      2.5)
      << text;
  EXPECT_EQ(
      Sample(text, absl::StrCat("tessera_job_rank_stall_seconds{job=\"", id, "\",rank=\"0\"}")), 0);

  // The other shard waits for the same rank: one message with both; no second event for the
  // same step and rank.
  now_ms_ += 2000;
  ASSERT_TRUE(ShardSaysWaiting(1, id, 11, 4600, 1, 7).ok());
  EXPECT_EQ(Job(id).stall(),
            "step 11: waiting 4.6 s for rank 1 (w-2 on host-1), which has not pushed 3 of its 7 "
            "partitions to shard 0 and 7 of 7 to shard 1");
  EXPECT_EQ(StallEvents(id).size(), 1u);

  // Both shards' next heartbeats report nothing: the step went through.
  for (const char* shard : {"s-1", "s-2"}) {
    v1::HeartbeatRequest beat;
    beat.set_member_id(shard);
    ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
  }
  EXPECT_EQ(Job(id).stall(), "");
  EXPECT_EQ(Job(id).workers(1).stalled_seconds(), 0);
  EXPECT_EQ(StallEvents(id),
            (std::vector<std::string>{named, "step 11: no longer waiting (waited 4.6 s)"}));
}

TEST_F(StallTest, ARankThatReportsPastTheStepIsNoLongerNamedBeforeTheShardsNextHeartbeat) {
  const std::string id = StartJob();
  ASSERT_TRUE(ShardSaysWaiting(0, id, 11, 3000, 1, 7).ok());
  ASSERT_NE(Job(id).stall(), "");
  // Rank 1 reports 11 steps done: it has still not finished step 11, the report holds.
  ReportRank(id, 1, 11);
  coordinator_->Tick();
  EXPECT_NE(Job(id).stall(), "");
  // 12 steps done (step 11 among them): the shard's report, older, no longer holds.
  now_ms_ += 500;
  ReportRank(id, 1, 12);
  coordinator_->Tick();
  EXPECT_EQ(Job(id).stall(), "");
  EXPECT_EQ(Job(id).workers(1).stalled_seconds(), 0);
  EXPECT_EQ(StallEvents(id).back(), "step 11: no longer waiting (waited 3.0 s)");
}

TEST_F(StallTest, AReportAShardStopsRenewingIsForgotten) {
  const std::string id = StartJob();
  ASSERT_TRUE(ShardSaysWaiting(0, id, 11, 3000, 1, 7).ok());
  EXPECT_NE(Job(id).stall(), "");
  // Two heartbeat intervals and a second without a word from shard 0 (it may be gone): the
  // report no longer holds.
  now_ms_ += 2 * 2000 + 1001;
  coordinator_->Tick();
  EXPECT_EQ(Job(id).stall(), "");
}

TEST_F(StallTest, BadStallReportsAreRefusedNamingTheField) {
  const std::string id = StartJob();
  v1::HeartbeatRequest beat;
  beat.set_member_id("s-1");
  v1::ShardStall* stall = beat.add_stalls();
  stall->set_job_id(id);
  stall->set_waiting_ms(-1);
  absl::Status status = coordinator_->Heartbeat(beat);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "stalls[0]: step, waiting_ms and partitions must be >= 0, got 0, -1, 0");
  stall->set_waiting_ms(5000);
  *beat.add_stalls() = *stall;
  status = coordinator_->Heartbeat(beat);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), absl::StrCat("stalls[1].job_id: job ", id, " reported twice"));
  beat.mutable_stalls()->RemoveLast();
  stall->add_lagging()->set_rank(-3);
  status = coordinator_->Heartbeat(beat);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "stalls[0].lagging[0]: rank, partitions and clock must be >= 0");
  // A worker has no stalls to report.
  beat.set_member_id("w-1");
  stall->mutable_lagging()->Clear();
  status = coordinator_->Heartbeat(beat);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "stalls: only shards report stalls; w-1 is a worker");
  // A rank the job does not have is ignored; nothing was named by any of it.
  ASSERT_TRUE(ShardSaysWaiting(0, id, 11, 3000, 9, 7).ok());
  EXPECT_EQ(Job(id).stall(), "");
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
}

TEST_F(StallTest, TheProgressLeaseWarnsOnceAboutTheRankTheJobWaitsFor) {
  const std::string id = StartJob(/*stall_timeout_seconds=*/5);
  for (int i = 1; i <= 8; ++i) SecondWithRank1Lagging(id, i * 1000);
  // Rank 0 made no progress either, but it waits for rank 1: only rank 1 is stalled.
  EXPECT_EQ(StallEvents(id).back(),
            "rank 1 (w-2 on host-1) has made no step progress for 5.0 s (last reported step 10; "
            "stall_timeout_seconds 5); stall_policy warn: the job goes on waiting for it");
  int warnings = 0;
  for (const std::string& e : StallEvents(id)) warnings += e.rfind("rank ", 0) == 0 ? 1 : 0;
  EXPECT_EQ(warnings, 1);
  EXPECT_FALSE(Job(id).workers(1).lost());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  // Its step moves: the lease starts again (a later stall warns again).
  ReportAll(id, 11);
  EXPECT_EQ(Job(id).workers(1).progress_ms(), now_ms_);
}

TEST_F(StallTest, EvictLosesTheStalledRankAndStopsItsWorkerWhichIsFreedOnceItsTaskEnds) {
  const std::string id = StartJob(/*stall_timeout_seconds=*/5, "evict");
  const std::string w2 = Job(id).workers(1).member_id();
  for (int i = 1; i <= 5; ++i) SecondWithRank1Lagging(id, i * 1000);
  EXPECT_TRUE(Job(id).workers(1).lost());
  EXPECT_FALSE(Job(id).workers(0).lost());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  const std::vector<std::string> events = Events(id);
  EXPECT_NE(std::find(events.begin(), events.end(),
                      "worker rank 1 (w-2 on host-1) evicted: no step progress for 5.0 s (last "
                      "reported step 10; stall_timeout_seconds 5); continuing with 1 workers"),
            events.end());
  // Its worker, still alive, is told to stop, and stays BUSY with the job meanwhile.
  EXPECT_TRUE(LastTask(w2).has_cancel());
  EXPECT_EQ(LastTask(w2).cancel().reason(),
            "rank 1 evicted: no step progress for 5.0 s (last reported step 10; "
            "stall_timeout_seconds 5)");
  EXPECT_EQ(Member(w2).state(), v1::MEMBER_STATE_BUSY);
  // The shards hear that rank 1 is out.
  EXPECT_EQ(shards_.LiveAt("127.0.0.1:4000", 10), std::vector<uint32_t>{0});
  // Rank 0 waited for rank 1 and made no progress either: its lease starts again now, so the
  // ticks right after the eviction (which name nobody any more) leave it alone.
  for (int i = 0; i < 4; ++i) {
    now_ms_ += 1000;
    HeartbeatAll();
    coordinator_->Tick();
  }
  EXPECT_FALSE(Job(id).workers(0).lost());
  // Its task ends (the cancel got through): the worker is free again.
  v1::ProgressReport ended;
  ended.set_member_id(w2);
  ended.set_job_id(id);
  ended.set_rank(1);
  ended.set_phase(v1::TASK_PHASE_FAILED);
  ended.set_error("rank 1 evicted: ...");
  ended.set_incarnation(Job(id).workers(1).incarnation());
  auto ack = coordinator_->ReportProgress(ended);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_TRUE(ack->cancel());
  EXPECT_EQ(Member(w2).state(), v1::MEMBER_STATE_READY);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
}

TEST_F(StallTest, ASilentShardHoldsTheProgressLease) {
  const std::string id = StartJob(/*stall_timeout_seconds=*/5, "evict");
  // Seconds `from`..`to` after the start, one tick each, with a heartbeat from `members` (every
  // live member when empty).
  const int64_t start = now_ms_;
  const auto seconds = [&](int from, int to, std::vector<std::string> members = {}) {
    for (int i = from; i <= to; ++i) {
      now_ms_ = start + i * 1000;
      if (members.empty()) HeartbeatAll();
      for (const std::string& member : members) {
        v1::HeartbeatRequest beat;
        beat.set_member_id(member);
        ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
      }
      coordinator_->Tick();
    }
  };
  // Shard 1 says nothing for 8 s (stopped, not yet lost: the lease is 10 s); every rank waits on
  // it, and none is evicted for it.
  seconds(1, 8, {"s-1", "w-1", "w-2"});
  EXPECT_FALSE(Job(id).workers(0).lost());
  EXPECT_FALSE(Job(id).workers(1).lost());
  // It speaks again: the lease counts from then, not from the ranks' last step.
  seconds(9, 12);
  EXPECT_FALSE(Job(id).workers(0).lost());
  EXPECT_FALSE(Job(id).workers(1).lost());
  // Nobody is named by the shards and no rank moves for the whole timeout: both are stalled.
  // One is evicted; the other's lease starts again (it may have waited for the first), and it is
  // evicted once that runs out too.
  seconds(13, 17);
  EXPECT_TRUE(Job(id).workers(0).lost());
  EXPECT_FALSE(Job(id).workers(1).lost());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  seconds(18, 23);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(id).reason().find("evicted: no step progress"), std::string::npos)
      << Job(id).reason();
}

// A shard restarted with its data directory on a new port replaces its dead instance at once and
// keeps its id; another shard claiming the index is refused while the first lives.
TEST_F(CoordinatorTest, AShardBackWithItsIdentityOnANewPortReplacesItsDeadInstance) {
  const std::string w1 = RegisterWorker("host-a");
  const std::string w2 = RegisterWorker("host-b");
  v1::RegisterRequest shard;
  shard.set_role(v1::MEMBER_ROLE_SERVER);
  shard.set_address("127.0.0.1:4000");
  shard.set_shard_index(0);
  shard.set_identity("0123456789abcdef0123456789abcdef");
  ASSERT_EQ(coordinator_->Register(shard)->member_id(), "s-1");
  v1::JobSpec spec = FashionMlpJob("id", 2, "/data");
  spec.set_checkpoint_every_steps(10);
  auto job = coordinator_->CreateJob(spec);
  ASSERT_TRUE(job.ok());
  coordinator_->Tick();
  ASSERT_EQ(Job(job->id()).state(), v1::JOB_STATE_RUNNING);

  v1::RegisterRequest stranger = shard;
  stranger.set_address("127.0.0.1:4100");
  stranger.set_identity("ffffffffffffffffffffffffffffffff");
  EXPECT_EQ(coordinator_->Register(stranger).status().code(), absl::StatusCode::kAlreadyExists);

  v1::RegisterRequest restarted = shard;
  restarted.set_address("127.0.0.1:4200");
  auto again = coordinator_->Register(restarted);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->member_id(), "s-1");
  int shard_rows = 0;
  for (const v1::Member& m : coordinator_->ListMembers()) {
    if (m.role() == v1::MEMBER_ROLE_SERVER) {
      ++shard_rows;
      EXPECT_EQ(m.state(), v1::MEMBER_STATE_READY);
      EXPECT_EQ(m.address(), "127.0.0.1:4200");
    }
  }
  EXPECT_EQ(shard_rows, 1);
  // Its jobs' state on it is gone: they fail without a checkpoint (or recover with one).
  EXPECT_EQ(Job(job->id()).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job->id()).reason().find("shard 0 (127.0.0.1:4000) restarted at 127.0.0.1:4200"),
            std::string::npos)
      << Job(job->id()).reason();
  // The identity is stored with the member, so a coordinator restart still knows it.
  Restart();
  EXPECT_EQ(Member("s-1").identity(), "0123456789abcdef0123456789abcdef");
  EXPECT_FALSE(w1.empty() || w2.empty());
}

TEST_F(CoordinatorTest, TheRestartGraceEndsOnceEveryRankIsBack) {
  const std::string id = StartCheckpointedJob(/*shards=*/1, /*workers=*/2, /*every=*/10);
  ReportAll(id, 5);
  Restart();
  const int64_t restarted_ms = now_ms_;
  RegisterShard(0);
  now_ms_ += 1000;
  const std::string w3 = RegisterWorker("host-0");
  const std::string w4 = RegisterWorker("host-1");
  const size_t calls = shards_.checkpoints.size();
  EXPECT_FALSE(Report(w3, id, 0, v1::TASK_PHASE_TRAINING, 12).cancel());
  coordinator_->Tick();
  // One rank back: still in the grace, no checkpoint yet.
  EXPECT_EQ(shards_.checkpoints.size(), calls);
  EXPECT_FALSE(Report(w4, id, 1, v1::TASK_PHASE_TRAINING, 12).cancel());
  coordinator_->Tick();
  // Both back 1 s after the restart, far inside the 15 s grace: it is over, and the automatic
  // checkpoint the job is due for is taken.
  EXPECT_LT(now_ms_ - restarted_ms, kGraceMs);
  EXPECT_GT(shards_.checkpoints.size(), calls);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  // A report from a stranger is no longer rebound.
  const std::string w5 = RegisterWorker("host-2");
  EXPECT_TRUE(Report(w5, id, 0, v1::TASK_PHASE_TRAINING, 13).cancel());
}

// After a restart the ranks report under their old member ids (their daemons do not know yet
// that those are LOST), which ends the grace; then each daemon registers again, under a new id,
// and its last reports come from that id. Same host and pid: the same daemon, which keeps its
// rank, and the job ends. (Before, the rank's final report was refused and the job hung.)
TEST_F(CoordinatorTest, ADaemonRegisteredAgainAfterTheGraceKeepsItsRank) {
  RegisterShard(0);
  const std::string w1 = RegisterWorker("host-0", true, 4100);
  const std::string w2 = RegisterWorker("host-1", true, 4101);
  v1::JobSpec spec = FashionMlpJob("ft", 2, "/data");
  spec.set_checkpoint_every_steps(10);
  auto job = coordinator_->CreateJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  coordinator_->Tick();
  const std::string id = job->id();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING) << Job(id).reason();
  Restart();
  RegisterShard(0);
  EXPECT_FALSE(Report(w1, id, 0, v1::TASK_PHASE_TRAINING, 12).cancel());
  EXPECT_FALSE(Report(w2, id, 1, v1::TASK_PHASE_TRAINING, 12).cancel());
  coordinator_->Tick();
  const std::string w3 = RegisterWorker("host-0", true, 4100);
  const std::string w4 = RegisterWorker("host-1", true, 4101);
  ASSERT_NE(w3, w1);
  // Another daemon on the host (another pid) is still a stranger.
  const std::string other = RegisterWorker("host-0", true, 4999);
  EXPECT_TRUE(Report(other, id, 0, v1::TASK_PHASE_TRAINING, 13).cancel());
  EXPECT_FALSE(Report(w4, id, 1, v1::TASK_PHASE_TRAINING_DONE, 100).cancel());
  EXPECT_FALSE(Report(w3, id, 0, v1::TASK_PHASE_SUCCEEDED, 100).cancel());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_SUCCEEDED) << Job(id).reason();
  EXPECT_EQ(Job(id).workers(0).member_id(), w3);
}

}  // namespace
}  // namespace tessera::coordinator
