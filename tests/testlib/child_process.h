// Child processes for tests that run the real binaries (tessera, tessera-coordinator,
// tessera-server, tessera-worker) on ports picked at run time: a scratch directory removed at the
// end, starting a binary with its stdout and stderr in files, waiting for its --port_file, and
// stopping and reaping it, every wait bounded in time.
//
// A ChildProcess's pid is -1 once it is reaped, so that nothing signals a PID the kernel may have
// given to another process. Not thread-safe per ChildProcess; distinct ChildProcess objects may be
// used from different threads.
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

namespace tessera {
namespace testlib {

// The whole file, or "" when it cannot be read.
std::string ReadWholeFile(const std::string& path);

// The last `max_bytes` of `path` (a daemon's log, for failure messages); "" when unreadable.
std::string FileTail(const std::string& path, size_t max_bytes = 4000);

// The port a daemon wrote to its --port_file, or 0 while the file is missing, empty or partial.
int ReadPortFile(const std::string& path);

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

// A child process started by SpawnChild().
struct ChildProcess {
  pid_t pid = -1;  // -1 once reaped
  std::string tag;
  std::string out_path;
  std::string err_path;
  bool reaped = false;  // by HasExited(): it ended on its own
  int exit_status = 0;  // its wait status then
};

struct SpawnOptions {
  // Added to the child's environment (after the scrub below).
  std::map<std::string, std::string> env;
  // Drop TESSERA_*, NOTIFY_SOCKET, WATCHDOG_* and JOURNAL_STREAM from the inherited environment,
  // so that a caller's TESSERA_LISTEN or systemd socket does not reach the daemons.
  bool scrub_environment = true;
};

// Starts `args` (args[0] is the path of the binary) with stdout and stderr in <dir>/<tag>.out and
// <dir>/<tag>.err (truncated), this process's environment as `options` says, and no blocked
// signals. Never blocks; a binary that cannot be executed exits 127 (126: the log files could not
// be opened).
ChildProcess SpawnChild(const std::vector<std::string>& args, const std::string& dir,
                        const std::string& tag, const SpawnOptions& options = {});

// The exit status in `wait_status`, 128 + the signal when a signal ended it, -2 otherwise.
int ExitCode(int wait_status);

// Polls waitpid(`pid`) every 10 ms for up to `timeout`. True once it has been reaped, with its
// wait status in *wait_status; false when it still runs.
bool WaitForExit(pid_t pid, absl::Duration timeout, int* wait_status);

// SIGKILL and reap `pid` (blocks until the kernel has ended it). No-op for pid <= 0.
void KillAndReap(pid_t pid);

// Whether `p` has exited; reaps it then (pid -1, reaped, exit_status set). True when not running.
bool HasExited(ChildProcess* p);

// How `p` ended, for messages: "running", "stopped", "exited with 1", "killed by signal 11".
std::string DescribeEnd(const ChildProcess& p);

// Waits up to `timeout` for `p` to end. Returns ExitCode(); -1 after SIGKILLing it on timeout;
// -3 when it was not running.
int WaitChild(ChildProcess* p, absl::Duration timeout);

// SIGTERM, then SIGKILL after `timeout`. Returns ExitCode(), or -1 when it was not running.
int StopChild(ChildProcess* p, absl::Duration timeout);

// The port written to `path` once it holds one; 0 after `timeout` or once `p` exited (reaped as
// by HasExited()). `p` may be null: then only the file is watched.
int WaitForPortFile(const std::string& path, ChildProcess* p, absl::Duration timeout);

// SIGKILLs and reaps (within 5 s) a child the test left running, on scope exit.
class ChildReaper {
 public:
  explicit ChildReaper(ChildProcess* p) : p_(p) {}
  ~ChildReaper();
  ChildReaper(const ChildReaper&) = delete;
  ChildReaper& operator=(const ChildReaper&) = delete;

 private:
  ChildProcess* const p_;
};

// What a command that ran to its end left: ExitCode() (or WaitChild()'s -1 on timeout), stdout,
// stderr.
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
