#include "cli/job_format.h"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "absl/strings/str_split.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace tessera::cli {
namespace {

v1::Job FinishedJob() {
  v1::Job job;
  job.set_id("fashion-mlp-3");
  job.mutable_spec()->set_name("fashion-mlp");
  job.mutable_spec()->set_num_workers(2);
  job.set_state(v1::JOB_STATE_SUCCEEDED);
  job.set_step(938);
  job.set_total_steps(938);
  job.set_epochs(2);
  job.set_epoch(2);
  job.set_evaluated(true);
  job.set_test_accuracy(0.8625);
  job.set_test_loss(0.3875);
  job.set_samples_per_second(5120);
  job.set_start_time_ms(1000);
  job.set_end_time_ms(24000);
  return job;
}

TEST(JobFormatTest, RecordJsonRoundTripsAndHasThePlainKeys) {
  const v1::Job job = FinishedJob();
  const std::string json = JobRecordJson(job);
  EXPECT_EQ(json.find('\n'), std::string::npos);
  EXPECT_NE(json.find("\"state\":\"JOB_STATE_SUCCEEDED\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"test_accuracy\":0.8625"), std::string::npos) << json;
  EXPECT_NE(json.find("\"test_loss\":0.3875"), std::string::npos) << json;
  EXPECT_NE(json.find("\"epochs\":2"), std::string::npos) << json;
  EXPECT_NE(json.find("\"samples_per_second\":5120"), std::string::npos) << json;
  EXPECT_NE(json.find("\"steps\":938,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"state_name\":\"SUCCEEDED\"}"), std::string::npos) << json;

  v1::Job parsed;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed, options).ok());
  EXPECT_EQ(parsed.SerializeAsString(), job.SerializeAsString());
}

TEST(JobFormatTest, EventJsonWrapsOneEventOnOneLine) {
  v1::JobEvent event;
  event.set_job_id("fashion-mlp-3");
  event.set_seq(7);
  event.set_epoch(1);
  event.set_evaluated(true);
  event.set_test_accuracy(0.8125);
  event.set_time_ms(123456);
  const std::string json = JobEventJson(event);
  EXPECT_EQ(json.find('\n'), std::string::npos);
  ASSERT_EQ(json.rfind("{\"event\":", 0), 0u) << json;
  v1::JobEvent back;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(json.substr(9, json.size() - 10), &back).ok())
      << json;
  EXPECT_EQ(back.seq(), 7);
  EXPECT_EQ(back.epoch(), 1);
  EXPECT_TRUE(back.evaluated());
  EXPECT_DOUBLE_EQ(back.test_accuracy(), 0.8125);
  EXPECT_EQ(back.time_ms(), 123456);
}

TEST(JobFormatTest, ListJsonHoldsEveryJob) {
  v1::Job a = FinishedJob();
  v1::Job b = FinishedJob();
  b.set_id("fashion-mlp-4");
  b.set_state(v1::JOB_STATE_PENDING);
  v1::ListJobsResponse parsed;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(JobListJson({a, b}), &parsed, options).ok());
  ASSERT_EQ(parsed.jobs_size(), 2);
  EXPECT_EQ(parsed.jobs(1).id(), "fashion-mlp-4");
  EXPECT_EQ(parsed.jobs(1).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(JobListJson({}), "{\"jobs\":[]}");
  EXPECT_EQ(MemberListJson({}), "{\"members\":[]}");
}

TEST(JobFormatTest, TextForPeople) {
  const absl::Time now = absl::FromUnixMillis(100000);
  EXPECT_EQ(StateName(v1::JOB_STATE_CANCELLED), "CANCELLED");
  EXPECT_EQ(MemberStateName(v1::MEMBER_STATE_LOST), "LOST");
  EXPECT_EQ(Ago(0, now), "never");
  EXPECT_EQ(Ago(97000, now), "3s ago");
  EXPECT_EQ(Ago(815000, absl::FromUnixMillis(1000000)), "3m ago");
  EXPECT_EQ(JobResultLine(FinishedJob()),
            "job fashion-mlp-3 SUCCEEDED: 938 steps, 2 epochs, test accuracy 0.8625, test loss "
            "0.3875, 5120 samples/s, 0:23");
  // A binary task shows its AUC, in the result line and in `get`.
  v1::Job ctr = FinishedJob();
  ctr.set_test_auc(0.79125);
  EXPECT_EQ(JobResultLine(ctr),
            "job fashion-mlp-3 SUCCEEDED: 938 steps, 2 epochs, test accuracy 0.8625, test loss "
            "0.3875, test AUC 0.7913, 5120 samples/s, 0:23");
  EXPECT_NE(JobDetails(ctr, now).find("test:       accuracy 0.8625, loss 0.3875, AUC 0.7913\n"),
            std::string::npos)
      << JobDetails(ctr, now);
  v1::Job pending;
  pending.set_id("p-1");
  pending.set_state(v1::JOB_STATE_PENDING);
  pending.set_reason("waiting for 2 idle workers, 1 registered");
  pending.set_create_time_ms(95000);
  const std::string details = JobDetails(pending, now);
  EXPECT_NE(details.find("state:      PENDING\n"), std::string::npos) << details;
  EXPECT_NE(details.find("reason:     waiting for 2 idle workers, 1 registered\n"),
            std::string::npos)
      << details;
  const std::string table = JobTable({pending, FinishedJob()}, now);
  const std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << table;
  EXPECT_EQ(lines[1].rfind("p-1", 0), 0u);
  EXPECT_NE(lines[1].find("PENDING"), std::string::npos);
  EXPECT_NE(lines[2].find("938/938 100%"), std::string::npos) << lines[2];
  EXPECT_NE(lines[2].find("0.8625"), std::string::npos) << lines[2];

  v1::Member shard;
  shard.set_id("s-1");
  shard.set_role(v1::MEMBER_ROLE_SERVER);
  shard.set_state(v1::MEMBER_STATE_READY);
  shard.set_address("127.0.0.1:4001");
  shard.set_shard_index(1);
  shard.set_last_seen_ms(99000);
  const std::string members = MemberTable({shard}, now);
  EXPECT_NE(members.find("s-1     server  READY  127.0.0.1:4001 #1"), std::string::npos) << members;
  EXPECT_NE(members.find("1s ago"), std::string::npos) << members;
}

// What a plain-lines printer (not a terminal) writes for the updates that `feed` gives it.
std::string PrintedText(const std::function<void(JobProgressPrinter&)>& feed) {
  char* buffer = nullptr;
  size_t size = 0;
  std::FILE* out = open_memstream(&buffer, &size);
  EXPECT_NE(out, nullptr);
  if (out == nullptr) return "";
  {
    JobProgressPrinter printer(out, /*terminal=*/false);
    feed(printer);
    printer.Finish();
  }
  std::fclose(out);
  std::string text(buffer, size);
  std::free(buffer);
  return text;
}

// Plain lines (not a terminal): the first record, every state change and evaluation, and one
// progress line at the start and at each tenth of the run.
TEST(JobFormatTest, ProgressPrinterWritesLinesAtEveryTenth) {
  const std::string text = PrintedText([](JobProgressPrinter& printer) {
    v1::WatchJobResponse first;
    first.mutable_job()->set_id("j-1");
    first.mutable_job()->set_state(v1::JOB_STATE_PENDING);
    first.mutable_job()->set_reason("waiting for 2 idle workers, 0 registered");
    printer.Update(first);
    v1::WatchJobResponse started;
    started.mutable_job()->set_state(v1::JOB_STATE_RUNNING);
    started.mutable_event()->set_state(v1::JOB_STATE_RUNNING);
    started.mutable_event()->set_message("started on 2 workers");
    printer.Update(started);
    for (int step = 1; step <= 200; ++step) {
      v1::WatchJobResponse u;
      u.mutable_job()->set_state(v1::JOB_STATE_RUNNING);
      u.mutable_job()->set_step(step);
      u.mutable_job()->set_total_steps(200);
      u.mutable_event()->set_state(v1::JOB_STATE_RUNNING);
      u.mutable_event()->set_step(step);
      if (step >= 100) {
        // An evaluation at step 100, carried by every later event.
        u.mutable_event()->set_evaluated(true);
        u.mutable_event()->set_epoch(1);
        u.mutable_event()->set_test_accuracy(0.8125);
        u.mutable_event()->set_test_loss(0.5);
        if (step == 100) u.mutable_event()->set_message("epoch 1: test accuracy 0.8125");
      }
      printer.Update(u);
    }
    v1::WatchJobResponse done;
    done.mutable_job()->set_state(v1::JOB_STATE_SUCCEEDED);
    done.mutable_event()->set_state(v1::JOB_STATE_SUCCEEDED);
    done.mutable_event()->set_evaluated(true);
    done.mutable_event()->set_message("succeeded: test accuracy 0.8600");
    printer.Update(done);
  });
  const std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u + 11u + 1u + 1u) << text;
  EXPECT_EQ(lines[0], "job j-1: PENDING (waiting for 2 idle workers, 0 registered)");
  EXPECT_EQ(lines[1], "RUNNING: started on 2 workers");
  EXPECT_EQ(lines[2].rfind("step 1/200 (0%)", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3].rfind("step 20/200 (10%)", 0), 0u) << lines[3];
  EXPECT_EQ(lines[7], "RUNNING: epoch 1: test accuracy 0.8125");
  EXPECT_EQ(lines[8].rfind("step 100/200 (50%)", 0), 0u) << lines[8];
  EXPECT_EQ(lines[13].rfind("step 200/200 (100%)", 0), 0u) << lines[13];
  EXPECT_EQ(lines[14], "SUCCEEDED: succeeded: test accuracy 0.8600");
  EXPECT_EQ(text.find('\r'), std::string::npos);
}

// What happens to a running job on the way (a checkpoint, a lost shard and its rewind, a lost or
// handed-over rank) gets a line of its own as it comes; progress reports do not.
TEST(JobFormatTest, ProgressPrinterShowsCheckpointsRecoveriesAndRanks) {
  const std::string text = PrintedText([](JobProgressPrinter& printer) {
    v1::WatchJobResponse first;
    first.mutable_job()->set_id("j-2");
    first.mutable_job()->set_state(v1::JOB_STATE_RUNNING);
    first.mutable_job()->set_step(10);
    first.mutable_job()->set_total_steps(1000);
    printer.Update(first);
    const auto event = [&](v1::JobEventKind kind, int step, const std::string& message) {
      v1::WatchJobResponse u;
      u.mutable_job()->set_state(v1::JOB_STATE_RUNNING);
      u.mutable_job()->set_step(step);
      u.mutable_job()->set_total_steps(1000);
      u.mutable_event()->set_state(v1::JOB_STATE_RUNNING);
      u.mutable_event()->set_kind(kind);
      u.mutable_event()->set_step(step);
      u.mutable_event()->set_message(message);
      printer.Update(u);
    };
    event(v1::JOB_EVENT_KIND_PROGRESS, 20, "step 20 of 1000, loss 1.2, 900 samples/s");
    event(v1::JOB_EVENT_KIND_CHECKPOINT, 30, "checkpoint 30 committed: 2 shards, 2000 bytes");
    event(v1::JOB_EVENT_KIND_PROGRESS, 40, "step 40 of 1000, loss 1.1, 900 samples/s");
    event(v1::JOB_EVENT_KIND_RECOVERY, 45,
          "shard 1 (127.0.0.1:4001) lost: recovering from checkpoint 30");
    event(v1::JOB_EVENT_KIND_RECOVERY, 45,
          "restored checkpoint 30; workers rewound from step 45 to 30");
    event(v1::JOB_EVENT_KIND_MEMBERSHIP, 50,
          "worker rank 1 (w-2 on host-b) lost: no heartbeat for 10 s; continuing with 1 workers");
    event(v1::JOB_EVENT_KIND_EPOCH, 60, "epoch 2 of 4");
    event(v1::JOB_EVENT_KIND_MEMBERSHIP, 70, "rank 1 handed to w-3 from step 70");
    event(v1::JOB_EVENT_KIND_STALL, 80,
          "step 81: waiting 2.4 s for rank 1 (w-3 on host-c), which has not pushed 7 of its 7 "
          "partitions to shard 0");
  });
  const std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  // The record, the first progress line (step 20 is past no tenth but the first), and the six.
  ASSERT_EQ(lines.size(), 8u) << text;
  EXPECT_EQ(lines[0], "job j-2: RUNNING, step 10/1000");
  EXPECT_EQ(lines[1].rfind("step 20/1000 (2%)", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2], "RUNNING: checkpoint 30 committed: 2 shards, 2000 bytes");
  EXPECT_EQ(lines[3], "RUNNING: shard 1 (127.0.0.1:4001) lost: recovering from checkpoint 30");
  EXPECT_EQ(lines[4], "RUNNING: restored checkpoint 30; workers rewound from step 45 to 30");
  EXPECT_EQ(lines[5],
            "RUNNING: worker rank 1 (w-2 on host-b) lost: no heartbeat for 10 s; continuing with 1 "
            "workers");
  EXPECT_EQ(lines[6], "RUNNING: rank 1 handed to w-3 from step 70");
  EXPECT_EQ(lines[7],
            "RUNNING: step 81: waiting 2.4 s for rank 1 (w-3 on host-c), which has not pushed 7 of "
            "its 7 partitions to shard 0");
}

// `tessera get` marks a replicated job's down shard.
TEST(JobFormatTest, DetailsMarkADownShardOfAReplicatedJob) {
  v1::Job job;
  job.set_id("r-2");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.mutable_spec()->set_replication(2);
  job.add_shard_addresses("127.0.0.1:4000");
  job.add_shard_addresses("127.0.0.1:4001");
  job.add_down_shards(1);
  const std::string details = JobDetails(job, absl::FromUnixMillis(1000));
  EXPECT_NE(details.find("shards:     127.0.0.1:4000 127.0.0.1:4001 (DOWN); 2 copies of every "
                         "partition\n"),
            std::string::npos)
      << details;
}

// `tessera get` says what recovery the job is in, its checkpoints and recoveries, and which rank
// was lost.
TEST(JobFormatTest, DetailsShowRecoveryCheckpointsAndLostRanks) {
  const absl::Time now = absl::FromUnixMillis(100000);
  v1::Job job;
  job.set_id("r-1");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_create_time_ms(90000);
  job.set_recovery("shard 1 (127.0.0.1:4001) lost: recovering from checkpoint 450");
  job.set_last_checkpoint_step(450);
  job.set_recoveries(2);
  v1::JobWorker* w0 = job.add_workers();
  w0->set_rank(0);
  w0->set_member_id("w-1");
  w0->set_step(469);
  v1::JobWorker* w1 = job.add_workers();
  w1->set_rank(1);
  w1->set_member_id("w-2");
  w1->set_hostname("host-b");
  w1->set_step(469);
  w1->set_done(true);
  w1->set_lost(true);
  const std::string details = JobDetails(job, now);
  EXPECT_NE(details.find("recovery:   shard 1 (127.0.0.1:4001) lost: recovering from checkpoint "
                         "450\n"),
            std::string::npos)
      << details;
  EXPECT_NE(details.find("checkpoint: last committed at step 450; 2 recoveries so far\n"),
            std::string::npos)
      << details;
  EXPECT_NE(details.find("worker 0:   w-1, step 469, 0 samples/s\n"), std::string::npos) << details;
  EXPECT_NE(details.find("worker 1:   w-2 on host-b, step 469, 0 samples/s, LOST (out of the job "
                         "until a worker takes the rank)\n"),
            std::string::npos)
      << details;

  v1::Job fresh;
  fresh.set_id("f-1");
  fresh.set_state(v1::JOB_STATE_RUNNING);
  const std::string plain = JobDetails(fresh, now);
  EXPECT_EQ(plain.find("recovery:"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("checkpoint:"), std::string::npos) << plain;
  job.set_recoveries(1);
  job.set_last_checkpoint_step(0);
  EXPECT_NE(JobDetails(job, now).find("checkpoint: none committed; 1 recovery so far\n"),
            std::string::npos);
}

// The step times, and the last request's round trip with its part at the gate once reported.
TEST(JobFormatTest, DetailsShowTheStepTimesAndTheLastRequestsRoundTrip) {
  const absl::Time now = absl::FromUnixMillis(100000);
  v1::Job job;
  job.set_id("s-1");
  job.set_state(v1::JOB_STATE_RUNNING);
  v1::StepTimes* t = job.mutable_step_times();
  t->set_compute(0.00125);
  t->set_exchange(0.002);
  t->set_install(0.00005);
  t->set_data(0.0001);
  std::string details = JobDetails(job, now);
  EXPECT_NE(details.find("step time:  compute 1.25 ms, exchange 2.00 ms, install 0.05 ms, data "
                         "0.10 ms (rank 0)\n"),
            std::string::npos)
      << details;
  EXPECT_EQ(details.find("round trip"), std::string::npos) << "not reported: not shown";
  t->set_round_trip(0.0025);
  t->set_gate_wait(0.0009);
  details = JobDetails(job, now);
  EXPECT_NE(details.find("last request of a step: 2.50 ms round trip, 0.90 ms of it at the "
                         "shards' gate\n"),
            std::string::npos)
      << details;
}

// `tessera get` names the rank a step waits for, how long, and a rank without step progress.
TEST(JobFormatTest, DetailsShowTheStallAndRanksWithoutProgress) {
  const absl::Time now = absl::FromUnixMillis(100000);
  v1::Job job;
  job.set_id("s-1");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_stall(
      "step 812: waiting 6.0 s for rank 1 (w-2 on host-b), which has not pushed 3 of its 7 "
      "partitions to shard 0");
  v1::JobWorker* w0 = job.add_workers();
  w0->set_rank(0);
  w0->set_member_id("w-1");
  w0->set_step(811);
  w0->set_progress_ms(99000);  // 1 s ago: not worth telling
  v1::JobWorker* w1 = job.add_workers();
  w1->set_rank(1);
  w1->set_member_id("w-2");
  w1->set_hostname("host-b");
  w1->set_step(811);
  w1->set_stalled_seconds(6);
  w1->set_progress_ms(55000);  // 45 s ago
  const std::string details = JobDetails(job, now);
  EXPECT_NE(details.find("stall:      step 812: waiting 6.0 s for rank 1 (w-2 on host-b), which "
                         "has not pushed 3 of its 7 partitions to shard 0\n"),
            std::string::npos)
      << details;
  EXPECT_NE(details.find("worker 0:   w-1, step 811, 0 samples/s\n"), std::string::npos) << details;
  EXPECT_NE(details.find("worker 1:   w-2 on host-b, step 811, 0 samples/s, STALLED: the step "
                         "has waited 6 s for it, no step progress for 45 s\n"),
            std::string::npos)
      << details;
  // A finished job tells neither.
  job.set_state(v1::JOB_STATE_SUCCEEDED);
  job.clear_stall();
  EXPECT_EQ(JobDetails(job, now).find("STALLED"), std::string::npos);
  EXPECT_EQ(JobDetails(job, now).find("no step progress"), std::string::npos);
}

}  // namespace
}  // namespace tessera::cli
