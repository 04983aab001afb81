// What tests that run the real binaries (tessera, tessera-coordinator, tessera-server,
// tessera-worker) add on top of common/child_process.h: a scratch directory removed at the end,
// a child with its stdout and stderr in <dir>/<tag>.out and <dir>/<tag>.err and the caller's
// TESSERA_* and systemd variables kept from it, exit codes as one int for EXPECT_EQ, and
// /proc/<pid>/status fields. Every wait is bounded in time.
//
// Thread-compatible: distinct ChildProcess objects may be used from different threads.
#ifndef TESSERA_TESTS_TESTLIB_CHILD_PROCESS_H_
#define TESSERA_TESTS_TESTLIB_CHILD_PROCESS_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace tessera {
namespace testlib {

// The whole file, or "" when it cannot be read.
std::string ReadWholeFile(const std::string& path);

// The last `max_bytes` of `path` (a daemon's log, for failure messages), "..." first when cut;
// "" when unreadable.
std::string FileTail(const std::string& path, size_t max_bytes = 4000);

// A fresh directory /tmp/<prefix>-XXXXXX, removed with its contents on destruction unless keep()
// was called. Thread-compatible.
class ScratchDirectory {
 public:
  explicit ScratchDirectory(const std::string& prefix);
  ~ScratchDirectory();
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;

  // Empty when it could not be made.
  const std::string& path() const { return path_; }
  // <path>/<name>.
  std::string File(const std::string& name) const;
  // Leave the directory (daemons' logs) for a post-mortem.
  void keep() { keep_ = true; }

 private:
  std::string path_;
  bool keep_ = false;
};

struct SpawnOptions {
  // Added to the child's environment (after the scrub below).
  std::map<std::string, std::string> env;
  // Drop TESSERA_*, NOTIFY_SOCKET, WATCHDOG_* and JOURNAL_STREAM from the inherited environment,
  // so that a caller's TESSERA_LISTEN or systemd socket does not reach the daemons.
  bool scrub_environment = true;
};

// Starts `args` (args[0] is the path of the binary) named `tag`, with stdout and stderr in
// <dir>/<tag>.out and <dir>/<tag>.err (truncated) and this process's environment as `options`
// says. Returns once it runs; when it cannot be started, a ChildProcess that is not running,
// with the reason written to <dir>/<tag>.err.
ChildProcess SpawnChild(const std::vector<std::string>& args, const std::string& dir,
                        const std::string& tag, const SpawnOptions& options = {});

// Waits up to `timeout` for `p` to end. Returns its exit code (128 + the signal when a signal
// ended it); -1 after SIGKILLing it on timeout; -3 when it was not running.
int WaitChild(ChildProcess* p, absl::Duration timeout);

// SIGTERM, then SIGKILL after `timeout`. Returns its exit code (137 when it had to be killed),
// or -1 when it was not running.
int StopChild(ChildProcess* p, absl::Duration timeout);

// What a command that ran to its end left: its exit code (or WaitChild()'s -1 on timeout, -3
// when it could not be started), stdout, stderr.
struct CommandResult {
  int code = 0;
  std::string out;
  std::string err;
};

// SpawnChild(), then WaitChild() for up to `timeout`, then its two files.
CommandResult RunToEnd(const std::vector<std::string>& args, const std::string& dir,
                       const std::string& tag, const SpawnOptions& options = {},
                       absl::Duration timeout = absl::Seconds(30));

// A number field of /proc/<pid>/status ("VmRSS" in KiB, "Threads"); -1 when it cannot be read.
int64_t ProcStatusField(pid_t pid, absl::string_view field);

// VmRSS of `pid` in KiB; -1 when it cannot be read.
int64_t ResidentKib(pid_t pid);

}  // namespace testlib
}  // namespace tessera

#endif  // TESSERA_TESTS_TESTLIB_CHILD_PROCESS_H_
