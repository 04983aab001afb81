// ChildProcess: one program started as a child process, and everything a launcher does with it:
// its logs in files, its environment, its --port_file, signals, bounded waits, and no child left
// behind. `tessera local` (cli/local_cluster.h), the shards of the end-to-end tests and
// benchmarks (worker/client/local_shards.h) and the tests' own children (tests/testlib/) all
// start their processes through it.
//
// Spawn() prepares everything before fork() (argv, the environment, the opened log files), so
// the child calls only async-signal-safe functions until execve(): safe in a multi-threaded
// parent. The child starts with no blocked signals and SIGINT, SIGTERM, SIGHUP, SIGPIPE and
// SIGCHLD at their defaults (a daemon blocks what it waits for itself), and stdin on /dev/null.
//
// Life cycle: not started (default-constructed or moved from) -> running (Spawn) -> ended (reaped
// by HasExited(), Wait(), Terminate() or Kill()). pid() is -1 once it has been reaped, so nothing
// signals a PID the kernel may have given to another process. The destructor SIGKILLs and reaps a
// child that still runs.
//
// Thread-safety: not thread-safe; one thread drives a ChildProcess. Distinct objects may be used
// from different threads.
#ifndef TESSERA_COMMON_CHILD_PROCESS_H_
#define TESSERA_COMMON_CHILD_PROCESS_H_

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

class ChildProcess {
 public:
  struct Options {
    // For messages: "coordinator", "shard-0", a test's tag.
    std::string name;
    // argv[0] is the path of the binary.
    std::vector<std::string> argv;
    // stdout goes to this file, and stderr too unless err_path is set; empty: both inherited.
    std::string log_path;
    // stderr's own file; empty: with stdout.
    std::string err_path;
    // Append to the log files (a restarted daemon keeps its history); otherwise truncate them.
    bool append_log = false;
    // The environment is this process's, without every `NAME=value` entry that starts with one
    // of these ("TESSERA_" drops a family, "NOTIFY_SOCKET=" one variable), and with `set_env`
    // added (replacing an inherited variable of the same name).
    std::vector<std::string> drop_env;
    std::map<std::string, std::string> set_env;
    // setpgid(0, 0): a Ctrl-C on the terminal reaches only the parent.
    bool own_process_group = false;
    // PR_SET_PDEATHSIG(SIGTERM): the child is stopped when the thread that spawned it ends (a
    // parent killed outright still takes its children along). Spawn from a thread that lives as
    // long as the child should.
    bool die_with_parent = false;
  };

  // Starts the child; returns once it has exec'd the binary. FAILED_PRECONDITION naming the file
  // when a log file cannot be opened; INTERNAL naming the binary when fork or execve fails (the
  // binary is missing or not executable, say). INVALID_ARGUMENT for an empty argv.
  static absl::StatusOr<ChildProcess> Spawn(Options options);

  // Not started: running() is false and nothing is signalled or waited for.
  ChildProcess() = default;
  // SIGKILL and reap when it still runs (Kill()).
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  // Kill()s what this object ran, then takes `other`'s child.
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  const Options& options() const { return options_; }
  const std::string& name() const { return options_.name; }
  // The file stdout goes to (log_path); empty when inherited.
  const std::string& stdout_path() const { return options_.log_path; }
  // The file stderr goes to (err_path, else log_path); empty when inherited.
  const std::string& stderr_path() const;

  // The child's pid while it runs (until it is reaped); -1 otherwise.
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  // Whether it was started and has been reaped since: wait_status() and exit_code() hold then.
  bool ended() const { return ended_; }
  // The waitpid() status. REQUIRES: ended().
  int wait_status() const { return wait_status_; }
  // Its exit status, 128 + the signal when a signal ended it; -1 unless ended().
  int exit_code() const;
  // How it ended, for messages: "exited with status 3", "was killed by signal 9 (Killed)"; "is
  // running" or "was not started" otherwise.
  std::string DescribeExit() const;

  // Reaps the child when it has ended. True when it is not running (ended, or never started).
  // Does not block.
  bool HasExited();
  // Polls HasExited() every 10 ms for up to `timeout`; true once it is not running.
  bool Wait(absl::Duration timeout);
  // Sends `signal`; false when it is not running (or kill() failed).
  bool Signal(int signal);
  // SIGTERM, up to `grace` for it to end, then SIGKILL; reaped either way. True when it ended
  // within the grace; false when it was killed, or was not running.
  bool Terminate(absl::Duration grace);
  // SIGKILL and reap (blocks until the kernel has ended it). No-op when not running.
  void Kill();

  // The port written to `path` once it holds one (ReadPortFile); 0 after `timeout` or as soon
  // as the child has exited (reaped as by HasExited()).
  int WaitForPortFile(const std::string& path, absl::Duration timeout);

  // The last `max_bytes` of stderr's file, "..." first when cut; "" when unreadable.
  std::string LogTail(size_t max_bytes = 3000) const;
  // INTERNAL: "<name> <DescribeExit()>; the end of <stderr file>:\n<LogTail()>".
  absl::Status ExitedError() const;

 private:
  Options options_;
  pid_t pid_ = -1;
  bool ended_ = false;
  int wait_status_ = 0;
};

// Waits until `child` has written a port to `port_file` and 127.0.0.1:<port> answers the gRPC
// health check SERVING over plaintext (IsServing); returns the port. Polls every 20 ms.
// INTERNAL (ChildProcess::ExitedError) when the child exits first; DEADLINE_EXCEEDED after
// `timeout`: "<name> is not serving after <timeout>[ (no port in <port_file>)]; the end of
// <log>:\n<tail>"; CANCELLED when `interrupted` (may be null, polled) returns true. Blocks.
absl::StatusOr<int> WaitUntilServing(ChildProcess& child, const std::string& port_file,
                                     absl::Duration timeout,
                                     const std::function<bool()>& interrupted = nullptr);

// The port a daemon wrote to its --port_file (common/process.h WritePortFile), or 0 while the
// file is missing, empty or holds no port in [1, 65535].
int ReadPortFile(const std::string& path);

// The last `max_bytes` of the file at `path`, "..." first when cut; "" when unreadable.
std::string ReadFileTail(const std::string& path, size_t max_bytes);

// A waitpid() status as ChildProcess::DescribeExit() words it.
std::string DescribeWaitStatus(int wait_status);

}  // namespace tessera

#endif  // TESSERA_COMMON_CHILD_PROCESS_H_
