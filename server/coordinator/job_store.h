// JobStore: the coordinator's durable state in one SQLite file (DESIGN.md §6).
//
// Tables: jobs (id, n, state, record = serialized v1::Job), events (job_id, seq, time_ms,
// record = serialized v1::JobEvent), members (id, record = serialized v1::Member), checkpoints
// (job_id, step, time_ms, record = serialized v1::CheckpointRecord; key (job_id, step)),
// shard_drops (address, job_id: the DropJob calls the coordinator still owes a shard) and meta
// (schema_version = 3). A schema-1 or schema-2 database is migrated in place on Open. The
// database runs in WAL mode with synchronous=FULL, so a write that returned OK survives the process
// being killed (and the machine losing power). Every Write() is one transaction: all of it lands or
// none of it does.
//
// Thread-safety: all methods may be called from any thread; calls are serialized internally.
// Every call does file I/O and blocks.
#ifndef TESSERA_SERVER_COORDINATOR_JOB_STORE_H_
#define TESSERA_SERVER_COORDINATOR_JOB_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/job.pb.h"

struct sqlite3;
struct sqlite3_stmt;

namespace tessera::coordinator {

// A DropJob call owed to the shard at `address`.
struct ShardDrop {
  std::string address;
  std::string job_id;
  bool operator<(const ShardDrop& o) const {
    return std::tie(job_id, address) < std::tie(o.job_id, o.address);
  }
  bool operator==(const ShardDrop& o) const { return address == o.address && job_id == o.job_id; }
};

// One batch of changes, written in one transaction.
struct StoreWrite {
  struct JobRow {
    int64_t n = 0;  // the job's number ("<name>-<n>")
    v1::Job job;
  };
  std::vector<JobRow> jobs;                       // inserted or replaced
  std::vector<v1::JobEvent> events;               // inserted; (job_id, seq) must be new
  std::vector<v1::Member> members;                // inserted or replaced
  std::vector<std::string> removed_members;       // deleted by id, after the inserts
  std::vector<v1::CheckpointRecord> checkpoints;  // inserted or replaced, by (job_id, step)
  // Checkpoint records deleted after the inserts: one (job_id, step), or (job_id, -1) for every
  // record of the job.
  std::vector<std::pair<std::string, int64_t>> removed_checkpoints;
  std::vector<ShardDrop> drops;          // inserted (kept once)
  std::vector<ShardDrop> removed_drops;  // deleted, after the inserts

  bool empty() const {
    return jobs.empty() && events.empty() && members.empty() && removed_members.empty() &&
           checkpoints.empty() && removed_checkpoints.empty() && drops.empty() &&
           removed_drops.empty();
  }
};

// A job as loaded from the database.
struct StoredJob {
  int64_t n = 0;
  v1::Job job;
  int64_t last_seq = 0;  // the highest event seq stored for the job (0: none)
};

class JobStore {
 public:
  // Opens (creating when missing) the database at `path`, sets WAL, synchronous=FULL and a busy
  // timeout, creates the tables and checks the schema version. INTERNAL with SQLite's message
  // when the file cannot be opened; FAILED_PRECONDITION for a database of a newer (or unknown)
  // schema version. A schema-1 or schema-2 database gets the tables it lacks and becomes schema 3.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();

  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Applies `write` in one transaction (rolled back on any error). INTERNAL on an SQLite error,
  // ALREADY_EXISTS for an event (job_id, seq) that is already stored.
  absl::Status Write(const StoreWrite& write);

  // Every job, oldest (lowest n) first. DATA_LOSS for a record that does not parse.
  absl::StatusOr<std::vector<StoredJob>> LoadJobs();
  // Every member, by id.
  absl::StatusOr<std::vector<v1::Member>> LoadMembers();
  // The events of `job_id` with after_seq < seq <= up_to_seq, in seq order.
  absl::StatusOr<std::vector<v1::JobEvent>> ReadEvents(const std::string& job_id, int64_t after_seq,
                                                       int64_t up_to_seq);
  // The committed checkpoints of `job_id`, newest (highest step) first. DATA_LOSS for a record
  // that does not parse.
  absl::StatusOr<std::vector<v1::CheckpointRecord>> LoadCheckpoints(const std::string& job_id);
  // The owed DropJob calls, by job then address.
  absl::StatusOr<std::vector<ShardDrop>> LoadDrops();

 private:
  explicit JobStore(sqlite3* db) : db_(db) {}
  absl::Status Init() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // meta.schema_version ("" when absent).
  absl::StatusOr<std::string> SchemaVersion() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Prepare(const char* sql, sqlite3_stmt** stmt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteLocked(const StoreWrite& write) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* const db_;
  sqlite3_stmt* put_job_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* put_event_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* put_member_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* delete_member_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* load_jobs_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* load_members_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* read_events_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* last_seq_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* put_checkpoint_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* delete_checkpoint_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* delete_job_checkpoints_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* load_checkpoints_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* put_drop_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* delete_drop_ ABSL_GUARDED_BY(mu_) = nullptr;
  sqlite3_stmt* load_drops_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_JOB_STORE_H_
