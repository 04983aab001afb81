#include "server/coordinator/job_store.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

std::string TempDir() {
  std::string dir = ::testing::TempDir() + "/job_store_XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) return "";
  return dir;
}

v1::Job MakeJob(const std::string& id, v1::JobState state, int64_t step) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  job.set_step(step);
  job.mutable_spec()->set_name("mlp");
  return job;
}

v1::JobEvent MakeEvent(const std::string& job_id, int64_t seq, const std::string& message) {
  v1::JobEvent event;
  event.set_job_id(job_id);
  event.set_seq(seq);
  event.set_time_ms(1000 + seq);
  event.set_message(message);
  return event;
}

TEST(JobStoreTest, RoundTripAcrossReopen) {
  const std::string path = TempDir() + "/coordinator.db";
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    StoreWrite write;
    write.jobs.push_back({2, MakeJob("mlp-2", v1::JOB_STATE_PENDING, 0)});
    write.jobs.push_back({1, MakeJob("mlp-1", v1::JOB_STATE_RUNNING, 5)});
    write.events.push_back(MakeEvent("mlp-1", 1, "queued"));
    write.events.push_back(MakeEvent("mlp-1", 2, "started"));
    write.events.push_back(MakeEvent("mlp-2", 1, "queued"));
    v1::Member member;
    member.set_id("w-1");
    member.set_hostname("host-a");
    write.members.push_back(member);
    ASSERT_TRUE((*store)->Write(write).ok());
    // A later write replaces the record.
    StoreWrite update;
    update.jobs.push_back({1, MakeJob("mlp-1", v1::JOB_STATE_SUCCEEDED, 9)});
    update.events.push_back(MakeEvent("mlp-1", 3, "succeeded"));
    ASSERT_TRUE((*store)->Write(update).ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_EQ((*jobs)[0].n, 1);  // by n, oldest first
  EXPECT_EQ((*jobs)[0].job.id(), "mlp-1");
  EXPECT_EQ((*jobs)[0].job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ((*jobs)[0].job.step(), 9);
  EXPECT_EQ((*jobs)[0].last_seq, 3);
  EXPECT_EQ((*jobs)[1].job.id(), "mlp-2");
  EXPECT_EQ((*jobs)[1].last_seq, 1);
  auto events = (*store)->ReadEvents("mlp-1", 1, 3);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[0].message(), "started");
  EXPECT_EQ((*events)[1].message(), "succeeded");
  EXPECT_EQ((*events)[1].time_ms(), 1003);
  auto members = (*store)->LoadMembers();
  ASSERT_TRUE(members.ok());
  ASSERT_EQ(members->size(), 1u);
  EXPECT_EQ((*members)[0].hostname(), "host-a");
}

TEST(JobStoreTest, AFailedWriteLeavesNothing) {
  auto store = JobStore::Open(TempDir() + "/coordinator.db");
  ASSERT_TRUE(store.ok());
  StoreWrite first;
  first.events.push_back(MakeEvent("mlp-1", 1, "queued"));
  ASSERT_TRUE((*store)->Write(first).ok());
  StoreWrite second;
  second.jobs.push_back({1, MakeJob("mlp-1", v1::JOB_STATE_RUNNING, 0)});
  second.events.push_back(MakeEvent("mlp-1", 1, "again"));  // duplicate (job_id, seq)
  const absl::Status status = (*store)->Write(second);
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_TRUE(jobs->empty());  // rolled back with the event
  auto events = (*store)->ReadEvents("mlp-1", 0, 100);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].message(), "queued");
}

TEST(JobStoreTest, WritesSurviveSigkill) {
  const std::string path = TempDir() + "/coordinator.db";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto store = JobStore::Open(path);
    if (!store.ok()) ::_exit(3);
    for (int i = 1; i <= 20; ++i) {
      StoreWrite write;
      const std::string id = absl::StrCat("mlp-", i);
      write.jobs.push_back({i, MakeJob(id, v1::JOB_STATE_PENDING, i)});
      write.events.push_back(MakeEvent(id, 1, "queued"));
      if (!(*store)->Write(write).ok()) ::_exit(4);
    }
    ::raise(SIGKILL);  // no close, no checkpoint of the WAL
    ::_exit(5);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 20u);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ((*jobs)[i].job.id(), absl::StrCat("mlp-", i + 1));
    EXPECT_EQ((*jobs)[i].job.step(), i + 1);
    EXPECT_EQ((*jobs)[i].last_seq, 1);
  }
}

TEST(JobStoreTest, RefusesAnotherSchemaVersion) {
  const std::string path = TempDir() + "/coordinator.db";
  { ASSERT_TRUE(JobStore::Open(path).ok()); }
  {
    // Hand-edit the version the way a future build would.
    const std::string command = absl::StrCat(
        "python3 -c \"import sqlite3; c = sqlite3.connect('", path,
        "'); c.execute(\\\"UPDATE meta SET value = '99' WHERE key = 'schema_version'\\\"); "
        "c.commit()\"");
    if (std::system(command.c_str()) != 0) GTEST_SKIP() << "python3 sqlite3 unavailable";
  }
  auto store = JobStore::Open(path);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
}

}  // namespace
}  // namespace tessera::coordinator
