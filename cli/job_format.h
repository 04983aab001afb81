// How the `tessera` CLI shows jobs and members: JSON lines for scripts, text for people, and a
// progress display (a redrawn bar on a terminal, plain lines otherwise) for a job being watched.
#ifndef TESSERA_CLI_JOB_FORMAT_H_
#define TESSERA_CLI_JOB_FORMAT_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tessera/v1/job.pb.h"

namespace tessera::cli {

// "SUCCEEDED", "RUNNING", ... (the enum name without its JOB_STATE_ prefix).
std::string StateName(v1::JobState state);
// "READY", "BUSY", ...; "server" / "worker".
std::string MemberStateName(v1::MemberState state);
std::string RoleName(v1::MemberRole role);

// The job record as one line of JSON: the Job message in proto3 JSON (field names as in
// job.proto, every field present, enums by name, 64-bit integers as strings), plus the plain
// numbers "steps" (= step) and "state_name" ("SUCCEEDED"). It holds state, test_accuracy,
// test_loss, steps, epochs and samples_per_second.
std::string JobRecordJson(const v1::Job& job);
// One event as one line of JSON: {"event": <the JobEvent in proto3 JSON>}. `watch`, `submit
// --watch` and `local` print one per event before the final record, so a script can follow a
// job's evaluations and their times.
std::string JobEventJson(const v1::JobEvent& event);
// {"jobs": [...]} and {"members": [...]} in the same form, on one line.
std::string JobListJson(const std::vector<v1::Job>& jobs);
std::string MemberListJson(const std::vector<v1::Member>& members);

// A table with one job per line: id, state, progress, accuracy, age.
std::string JobTable(const std::vector<v1::Job>& jobs, absl::Time now);
// Everything about one job, for `tessera get`.
std::string JobDetails(const v1::Job& job, absl::Time now);
// A table with one member per line: id, role, state, address, device, job, last seen.
std::string MemberTable(const std::vector<v1::Member>& members, absl::Time now);
// One line for the end of a run: "job fashion-mlp-1 SUCCEEDED: 938 steps, 2 epochs, test
// accuracy 0.8612, test loss 0.3921, 5123 samples/s, 0:23".
std::string JobResultLine(const v1::Job& job);
// "checkpoint 150 of fashion-mlp-1 committed (2 shards, 1.4 MiB)".
std::string CheckpointLine(const v1::CheckpointRecord& record);
// The record as one JSON line: {"checkpoint":{...}}.
std::string CheckpointJson(const v1::CheckpointRecord& record);
// "812 bytes", "4.0 KiB", "1.4 MiB", "2.0 GiB".
std::string HumanBytes(uint64_t bytes);
// "3s ago", "2m ago", "never".
std::string Ago(int64_t time_ms, absl::Time now);

// Whether `tessera watch` shows an event of `kind` as a line of its own whenever one comes (a
// checkpoint, a recovery and its rewind, a lost or handed-over rank, dropped weights).
bool ShownAsLine(v1::JobEventKind kind);

// Shows the updates of a WatchJob stream. On a terminal it redraws one bar at most every 100 ms;
// otherwise it writes a line at every tenth of the run. State changes, evaluations and the
// events ShownAsLine() names always get a line. Writes to `out` (not owned). Not thread-safe.
class JobProgressPrinter {
 public:
  JobProgressPrinter(std::FILE* out, bool terminal) : out_(out), terminal_(terminal) {}
  void Update(const v1::WatchJobResponse& update);
  // Ends a bar that is still on screen.
  void Finish();

 private:
  void Line(const std::string& text);
  void DrawBar(const v1::Job& job);

  std::FILE* out_;
  bool terminal_;
  bool bar_on_screen_ = false;
  bool seen_record_ = false;
  v1::JobState last_state_ = v1::JOB_STATE_UNSPECIFIED;
  int last_tenth_ = -1;
  bool shown_evaluation_ = false;
  double shown_accuracy_ = 0;
  double shown_loss_ = 0;
  absl::Time last_draw_ = absl::InfinitePast();
};

}  // namespace tessera::cli

#endif  // TESSERA_CLI_JOB_FORMAT_H_
