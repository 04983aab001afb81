#include "server/coordinator/job_store.h"

#include <signal.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

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

v1::CheckpointRecord MakeCheckpoint(const std::string& job_id, int64_t step) {
  v1::CheckpointRecord record;
  record.set_job_id(job_id);
  record.set_step(step);
  record.set_time_ms(5000 + step);
  v1::ShardCheckpoint* shard = record.add_shards();
  shard->set_shard_index(0);
  shard->set_path(absl::StrCat("/d/checkpoints/", job_id, "/ckpt-", step, "/shard-0"));
  shard->set_bytes(100 + static_cast<uint64_t>(step));
  record.add_positions()->set_batch_offset(step);
  return record;
}

std::vector<int64_t> Steps(const std::vector<v1::CheckpointRecord>& records) {
  std::vector<int64_t> steps;
  for (const v1::CheckpointRecord& record : records) steps.push_back(record.step());
  return steps;
}

TEST(JobStoreTest, CheckpointsNewestFirstAndRemoved) {
  const std::string path = TempDir() + "/coordinator.db";
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    StoreWrite write;
    for (int64_t step : {50, 150, 100}) write.checkpoints.push_back(MakeCheckpoint("a-1", step));
    write.checkpoints.push_back(MakeCheckpoint("b-2", 10));
    ASSERT_TRUE((*store)->Write(write).ok());
    StoreWrite remove;
    remove.removed_checkpoints.push_back({"a-1", 50});
    remove.checkpoints.push_back(MakeCheckpoint("a-1", 200));
    ASSERT_TRUE((*store)->Write(remove).ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto a = (*store)->LoadCheckpoints("a-1");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Steps(*a), (std::vector<int64_t>{200, 150, 100}));
  EXPECT_EQ((*a)[1].shards(0).path(), "/d/checkpoints/a-1/ckpt-150/shard-0");
  EXPECT_EQ((*a)[1].shards(0).bytes(), 250u);
  EXPECT_EQ((*a)[1].positions(0).batch_offset(), 150);
  StoreWrite drop_all;
  drop_all.removed_checkpoints.push_back({"a-1", -1});
  ASSERT_TRUE((*store)->Write(drop_all).ok());
  EXPECT_TRUE((*store)->LoadCheckpoints("a-1")->empty());
  EXPECT_EQ(Steps(*(*store)->LoadCheckpoints("b-2")), (std::vector<int64_t>{10}));
}

// The SQL of schema 1 (issues #4 and #5), as that build ran it.
constexpr char kSchema1[] =
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, n INTEGER UNIQUE NOT NULL, "
    "  state INTEGER NOT NULL, record BLOB NOT NULL);"
    "CREATE TABLE IF NOT EXISTS events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, "
    "  time_ms INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (job_id, seq));"
    "CREATE TABLE IF NOT EXISTS members (id TEXT PRIMARY KEY, record BLOB NOT NULL);"
    "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', '1');";

std::string ReadSchemaVersion(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) return "open failed";
  sqlite3_stmt* stmt = nullptr;
  std::string version = "none";
  if (sqlite3_prepare_v2(db, "SELECT value FROM meta WHERE key = 'schema_version'", -1, &stmt,
                         nullptr) == SQLITE_OK &&
      sqlite3_step(stmt) == SQLITE_ROW) {
    version = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return version;
}

TEST(JobStoreTest, MigratesASchema1Database) {
  const std::string path = TempDir() + "/coordinator.db";
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, kSchema1, nullptr, nullptr, nullptr), SQLITE_OK);
    std::string blob;
    MakeJob("old-1", v1::JOB_STATE_RUNNING, 42).SerializeToString(&blob);
    sqlite3_stmt* stmt = nullptr;
    ASSERT_EQ(
        sqlite3_prepare_v2(db, "INSERT INTO jobs (id, n, state, record) VALUES ('old-1', 1, 2, ?1)",
                           -1, &stmt, nullptr),
        SQLITE_OK);
    sqlite3_bind_blob(stmt, 1, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
    ASSERT_EQ(sqlite3_step(stmt), SQLITE_DONE);
    sqlite3_finalize(stmt);
    sqlite3_close(db);
  }
  ASSERT_EQ(ReadSchemaVersion(path), "1");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto jobs = (*store)->LoadJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ(jobs->size(), 1u);
    EXPECT_EQ((*jobs)[0].job.step(), 42);
    EXPECT_TRUE((*store)->LoadCheckpoints("old-1")->empty());
    StoreWrite write;
    write.checkpoints.push_back(MakeCheckpoint("old-1", 40));
    ASSERT_TRUE((*store)->Write(write).ok());
  }
  EXPECT_EQ(ReadSchemaVersion(path), "3");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Steps(*(*store)->LoadCheckpoints("old-1")), (std::vector<int64_t>{40}));
  EXPECT_TRUE((*store)->LoadDrops()->empty());
}

// Schema 2 (issue #6) lacks the shard_drops table: it is added and the rest kept.
TEST(JobStoreTest, MigratesASchema2Database) {
  const std::string path = TempDir() + "/coordinator.db";
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    const std::string schema2 = absl::StrCat(
        kSchema1,
        "CREATE TABLE IF NOT EXISTS checkpoints (job_id TEXT NOT NULL, step INTEGER NOT NULL, "
        "  time_ms INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (job_id, step));"
        "UPDATE meta SET value = '2' WHERE key = 'schema_version';");
    ASSERT_EQ(sqlite3_exec(db, schema2.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
  }
  ASSERT_EQ(ReadSchemaVersion(path), "2");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    StoreWrite write;
    write.checkpoints.push_back(MakeCheckpoint("old-1", 40));
    write.drops.push_back({"127.0.0.1:4000", "old-1"});
    ASSERT_TRUE((*store)->Write(write).ok());
  }
  EXPECT_EQ(ReadSchemaVersion(path), "3");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Steps(*(*store)->LoadCheckpoints("old-1")), (std::vector<int64_t>{40}));
  EXPECT_EQ(*(*store)->LoadDrops(), (std::vector<ShardDrop>{{"127.0.0.1:4000", "old-1"}}));
}

// Owed DropJob calls: kept once however often written, deleted one by one, and read back by job
// then address.
TEST(JobStoreTest, OwedDropsRoundTrip) {
  auto store = JobStore::Open(TempDir() + "/coordinator.db");
  ASSERT_TRUE(store.ok()) << store.status();
  StoreWrite write;
  write.drops = {{"127.0.0.1:4001", "b-2"},
                 {"127.0.0.1:4000", "b-2"},
                 {"127.0.0.1:4000", "a-1"},
                 {"127.0.0.1:4000", "a-1"}};
  ASSERT_TRUE((*store)->Write(write).ok());
  ASSERT_TRUE((*store)->Write(write).ok());
  EXPECT_EQ(*(*store)->LoadDrops(),
            (std::vector<ShardDrop>{
                {"127.0.0.1:4000", "a-1"}, {"127.0.0.1:4000", "b-2"}, {"127.0.0.1:4001", "b-2"}}));
  StoreWrite settle;
  settle.removed_drops = {{"127.0.0.1:4000", "b-2"}, {"127.0.0.1:4009", "x-9"}};
  ASSERT_TRUE((*store)->Write(settle).ok());
  EXPECT_EQ(*(*store)->LoadDrops(),
            (std::vector<ShardDrop>{{"127.0.0.1:4000", "a-1"}, {"127.0.0.1:4001", "b-2"}}));
}

}  // namespace
}  // namespace tessera::coordinator
