#include "server/coordinator/job_store.h"

#include <sqlite3.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera::coordinator {
namespace {

constexpr int kSchemaVersion = 3;
// Schema 2 (issue #6) added the checkpoints table, schema 3 the owed DropJob calls.
constexpr char kCreateLaterTables[] =
    "CREATE TABLE IF NOT EXISTS checkpoints (job_id TEXT NOT NULL, step INTEGER NOT NULL, "
    "  time_ms INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (job_id, step));"
    "CREATE TABLE IF NOT EXISTS shard_drops (address TEXT NOT NULL, job_id TEXT NOT NULL, "
    "  PRIMARY KEY (address, job_id));";
constexpr int kBusyTimeoutMs = 5000;

// Resets a prepared statement (and its bindings) when the scope ends.
class StatementScope {
 public:
  explicit StatementScope(sqlite3_stmt* stmt) : stmt_(stmt) {}
  ~StatementScope() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }

 private:
  sqlite3_stmt* stmt_;
};

void BindText(sqlite3_stmt* stmt, int index, const std::string& text) {
  sqlite3_bind_text(stmt, index, text.data(), static_cast<int>(text.size()), SQLITE_TRANSIENT);
}

void BindBlob(sqlite3_stmt* stmt, int index, const std::string& blob) {
  sqlite3_bind_blob(stmt, index, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
}

template <typename Message>
absl::Status ParseColumn(sqlite3_stmt* stmt, int column, Message* out, absl::string_view what) {
  const void* data = sqlite3_column_blob(stmt, column);
  const int size = sqlite3_column_bytes(stmt, column);
  if (!out->ParseFromArray(data, size)) {
    return absl::DataLossError(absl::StrCat("coordinator database: a ", what,
                                            " record does not parse (", size, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    std::string message = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return absl::InternalError(absl::StrCat("cannot open ", path, ": ", message));
  }
  std::unique_ptr<JobStore> store(new JobStore(db));
  absl::MutexLock lock(&store->mu_);
  absl::Status init = store->Init();
  if (!init.ok()) return absl::Status(init.code(), absl::StrCat(path, ": ", init.message()));
  return store;
}

JobStore::~JobStore() {
  absl::MutexLock lock(&mu_);
  for (sqlite3_stmt* stmt :
       {put_job_, put_event_, put_member_, delete_member_, load_jobs_, load_members_, read_events_,
        last_seq_, put_checkpoint_, delete_checkpoint_, delete_job_checkpoints_, load_checkpoints_,
        put_drop_, delete_drop_, load_drops_}) {
    sqlite3_finalize(stmt);
  }
  sqlite3_close(db_);
}

absl::Status JobStore::Error(const char* what) {
  return absl::InternalError(absl::StrCat("sqlite ", what, ": ", sqlite3_errmsg(db_)));
}

absl::Status JobStore::Exec(const char* sql) {
  char* message = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &message) != SQLITE_OK) {
    absl::Status status = absl::InternalError(
        absl::StrCat("sqlite: ", message != nullptr ? message : "error", " in: ", sql));
    sqlite3_free(message);
    return status;
  }
  return absl::OkStatus();
}

absl::Status JobStore::Prepare(const char* sql, sqlite3_stmt** stmt) {
  if (sqlite3_prepare_v2(db_, sql, -1, stmt, nullptr) != SQLITE_OK) return Error(sql);
  return absl::OkStatus();
}

absl::Status JobStore::Init() {
  sqlite3_busy_timeout(db_, kBusyTimeoutMs);
  TESSERA_RETURN_IF_ERROR(Exec("PRAGMA journal_mode=WAL"));
  TESSERA_RETURN_IF_ERROR(Exec("PRAGMA synchronous=FULL"));
  // 512 KiB of page cache: the coordinator reads little after its start (WatchJob replays).
  TESSERA_RETURN_IF_ERROR(Exec("PRAGMA cache_size=-512"));
  TESSERA_RETURN_IF_ERROR(
      Exec("BEGIN IMMEDIATE;"
           "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
           "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, n INTEGER UNIQUE NOT NULL, "
           "  state INTEGER NOT NULL, record BLOB NOT NULL);"
           "CREATE TABLE IF NOT EXISTS events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, "
           "  time_ms INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (job_id, seq));"
           "CREATE TABLE IF NOT EXISTS members (id TEXT PRIMARY KEY, record BLOB NOT NULL);"
           "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', '3');"
           "COMMIT;"));
  TESSERA_ASSIGN_OR_RETURN(std::string found, SchemaVersion());
  if (found == "1" || found == "2") {
    // Schema 1 (issues #4, #5) lacks the checkpoints and shard_drops tables, schema 2 (issue #6)
    // the shard_drops table; everything else is unchanged.
    TESSERA_RETURN_IF_ERROR(
        Exec(absl::StrCat("BEGIN IMMEDIATE;", kCreateLaterTables,
                          "UPDATE meta SET value = '3' WHERE key = 'schema_version';"
                          "COMMIT;")
                 .c_str()));
    TESSERA_ASSIGN_OR_RETURN(found, SchemaVersion());
  } else if (found == std::to_string(kSchemaVersion)) {
    TESSERA_RETURN_IF_ERROR(Exec(kCreateLaterTables));
  }
  if (found != std::to_string(kSchemaVersion)) {
    return absl::FailedPreconditionError(absl::StrCat("coordinator database has schema version '",
                                                      found, "', this build reads ",
                                                      kSchemaVersion));
  }
  TESSERA_RETURN_IF_ERROR(Prepare(
      "INSERT OR REPLACE INTO jobs (id, n, state, record) VALUES (?1, ?2, ?3, ?4)", &put_job_));
  TESSERA_RETURN_IF_ERROR(Prepare(
      "INSERT INTO events (job_id, seq, time_ms, record) VALUES (?1, ?2, ?3, ?4)", &put_event_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("INSERT OR REPLACE INTO members (id, record) VALUES (?1, ?2)", &put_member_));
  TESSERA_RETURN_IF_ERROR(Prepare("DELETE FROM members WHERE id = ?1", &delete_member_));
  TESSERA_RETURN_IF_ERROR(Prepare("SELECT n, record FROM jobs ORDER BY n", &load_jobs_));
  TESSERA_RETURN_IF_ERROR(Prepare("SELECT record FROM members ORDER BY id", &load_members_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("SELECT record FROM events WHERE job_id = ?1 AND seq > ?2 AND seq <= ?3 ORDER BY seq",
              &read_events_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?1", &last_seq_));
  TESSERA_RETURN_IF_ERROR(Prepare(
      "INSERT OR REPLACE INTO checkpoints (job_id, step, time_ms, record) VALUES (?1, ?2, ?3, ?4)",
      &put_checkpoint_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("DELETE FROM checkpoints WHERE job_id = ?1 AND step = ?2", &delete_checkpoint_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("DELETE FROM checkpoints WHERE job_id = ?1", &delete_job_checkpoints_));
  TESSERA_RETURN_IF_ERROR(Prepare(
      "SELECT record FROM checkpoints WHERE job_id = ?1 ORDER BY step DESC", &load_checkpoints_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("INSERT OR IGNORE INTO shard_drops (address, job_id) VALUES (?1, ?2)", &put_drop_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("DELETE FROM shard_drops WHERE address = ?1 AND job_id = ?2", &delete_drop_));
  TESSERA_RETURN_IF_ERROR(
      Prepare("SELECT address, job_id FROM shard_drops ORDER BY job_id, address", &load_drops_));
  return absl::OkStatus();
}

absl::StatusOr<std::string> JobStore::SchemaVersion() {
  sqlite3_stmt* version = nullptr;
  TESSERA_RETURN_IF_ERROR(Prepare("SELECT value FROM meta WHERE key = 'schema_version'", &version));
  std::string found;
  if (sqlite3_step(version) == SQLITE_ROW) {
    found = reinterpret_cast<const char*>(sqlite3_column_text(version, 0));
  }
  sqlite3_finalize(version);
  return found;
}

absl::Status JobStore::Write(const StoreWrite& write) {
  absl::MutexLock lock(&mu_);
  TESSERA_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  absl::Status status = WriteLocked(write);
  if (!status.ok()) {
    (void)Exec("ROLLBACK");
    return status;
  }
  status = Exec("COMMIT");
  if (!status.ok()) (void)Exec("ROLLBACK");
  return status;
}

absl::Status JobStore::WriteLocked(const StoreWrite& write) {
  std::string blob;
  for (const StoreWrite::JobRow& row : write.jobs) {
    StatementScope scope(put_job_);
    BindText(put_job_, 1, row.job.id());
    sqlite3_bind_int64(put_job_, 2, row.n);
    sqlite3_bind_int(put_job_, 3, static_cast<int>(row.job.state()));
    row.job.SerializeToString(&blob);
    BindBlob(put_job_, 4, blob);
    if (sqlite3_step(put_job_) != SQLITE_DONE) return Error("writing a job");
  }
  for (const v1::JobEvent& event : write.events) {
    StatementScope scope(put_event_);
    BindText(put_event_, 1, event.job_id());
    sqlite3_bind_int64(put_event_, 2, event.seq());
    sqlite3_bind_int64(put_event_, 3, event.time_ms());
    event.SerializeToString(&blob);
    BindBlob(put_event_, 4, blob);
    const int rc = sqlite3_step(put_event_);
    if (rc == SQLITE_CONSTRAINT) {
      return absl::AlreadyExistsError(
          absl::StrCat("event ", event.seq(), " of job ", event.job_id(), " is already stored"));
    }
    if (rc != SQLITE_DONE) return Error("writing an event");
  }
  for (const v1::Member& member : write.members) {
    StatementScope scope(put_member_);
    BindText(put_member_, 1, member.id());
    member.SerializeToString(&blob);
    BindBlob(put_member_, 2, blob);
    if (sqlite3_step(put_member_) != SQLITE_DONE) return Error("writing a member");
  }
  for (const std::string& id : write.removed_members) {
    StatementScope scope(delete_member_);
    BindText(delete_member_, 1, id);
    if (sqlite3_step(delete_member_) != SQLITE_DONE) return Error("removing a member");
  }
  for (const v1::CheckpointRecord& record : write.checkpoints) {
    StatementScope scope(put_checkpoint_);
    BindText(put_checkpoint_, 1, record.job_id());
    sqlite3_bind_int64(put_checkpoint_, 2, record.step());
    sqlite3_bind_int64(put_checkpoint_, 3, record.time_ms());
    record.SerializeToString(&blob);
    BindBlob(put_checkpoint_, 4, blob);
    if (sqlite3_step(put_checkpoint_) != SQLITE_DONE) return Error("writing a checkpoint");
  }
  for (const auto& [job_id, step] : write.removed_checkpoints) {
    sqlite3_stmt* stmt = step < 0 ? delete_job_checkpoints_ : delete_checkpoint_;
    StatementScope scope(stmt);
    BindText(stmt, 1, job_id);
    if (step >= 0) sqlite3_bind_int64(stmt, 2, step);
    if (sqlite3_step(stmt) != SQLITE_DONE) return Error("removing a checkpoint");
  }
  for (const ShardDrop& drop : write.drops) {
    StatementScope scope(put_drop_);
    BindText(put_drop_, 1, drop.address);
    BindText(put_drop_, 2, drop.job_id);
    if (sqlite3_step(put_drop_) != SQLITE_DONE) return Error("writing an owed DropJob");
  }
  for (const ShardDrop& drop : write.removed_drops) {
    StatementScope scope(delete_drop_);
    BindText(delete_drop_, 1, drop.address);
    BindText(delete_drop_, 2, drop.job_id);
    if (sqlite3_step(delete_drop_) != SQLITE_DONE) return Error("removing an owed DropJob");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StoredJob>> JobStore::LoadJobs() {
  absl::MutexLock lock(&mu_);
  std::vector<StoredJob> jobs;
  {
    StatementScope scope(load_jobs_);
    int rc;
    while ((rc = sqlite3_step(load_jobs_)) == SQLITE_ROW) {
      StoredJob stored;
      stored.n = sqlite3_column_int64(load_jobs_, 0);
      TESSERA_RETURN_IF_ERROR(ParseColumn(load_jobs_, 1, &stored.job, "job"));
      jobs.push_back(std::move(stored));
    }
    if (rc != SQLITE_DONE) return Error("reading jobs");
  }
  for (StoredJob& stored : jobs) {
    StatementScope scope(last_seq_);
    BindText(last_seq_, 1, stored.job.id());
    if (sqlite3_step(last_seq_) != SQLITE_ROW) return Error("reading events");
    stored.last_seq = sqlite3_column_int64(last_seq_, 0);
  }
  return jobs;
}

absl::StatusOr<std::vector<v1::Member>> JobStore::LoadMembers() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Member> members;
  StatementScope scope(load_members_);
  int rc;
  while ((rc = sqlite3_step(load_members_)) == SQLITE_ROW) {
    v1::Member member;
    TESSERA_RETURN_IF_ERROR(ParseColumn(load_members_, 0, &member, "member"));
    members.push_back(std::move(member));
  }
  if (rc != SQLITE_DONE) return Error("reading members");
  return members;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::ReadEvents(const std::string& job_id,
                                                               int64_t after_seq,
                                                               int64_t up_to_seq) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::JobEvent> events;
  StatementScope scope(read_events_);
  BindText(read_events_, 1, job_id);
  sqlite3_bind_int64(read_events_, 2, after_seq);
  sqlite3_bind_int64(read_events_, 3, up_to_seq);
  int rc;
  while ((rc = sqlite3_step(read_events_)) == SQLITE_ROW) {
    v1::JobEvent event;
    TESSERA_RETURN_IF_ERROR(ParseColumn(read_events_, 0, &event, "event"));
    events.push_back(std::move(event));
  }
  if (rc != SQLITE_DONE) return Error("reading events");
  return events;
}

absl::StatusOr<std::vector<v1::CheckpointRecord>> JobStore::LoadCheckpoints(
    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::CheckpointRecord> records;
  StatementScope scope(load_checkpoints_);
  BindText(load_checkpoints_, 1, job_id);
  int rc;
  while ((rc = sqlite3_step(load_checkpoints_)) == SQLITE_ROW) {
    v1::CheckpointRecord record;
    TESSERA_RETURN_IF_ERROR(ParseColumn(load_checkpoints_, 0, &record, "checkpoint"));
    records.push_back(std::move(record));
  }
  if (rc != SQLITE_DONE) return Error("reading checkpoints");
  return records;
}

absl::StatusOr<std::vector<ShardDrop>> JobStore::LoadDrops() {
  absl::MutexLock lock(&mu_);
  std::vector<ShardDrop> drops;
  StatementScope scope(load_drops_);
  int rc;
  while ((rc = sqlite3_step(load_drops_)) == SQLITE_ROW) {
    ShardDrop drop;
    drop.address = reinterpret_cast<const char*>(sqlite3_column_text(load_drops_, 0));
    drop.job_id = reinterpret_cast<const char*>(sqlite3_column_text(load_drops_, 1));
    drops.push_back(std::move(drop));
  }
  if (rc != SQLITE_DONE) return Error("reading owed DropJob calls");
  return drops;
}

}  // namespace tessera::coordinator
