// Child daemons for tests that run the real binaries (tessera-coordinator, tessera-server,
// tessera-worker) on ports picked at run time: start one with its stdout and stderr in files,
// wait for its --port_file, read its resident memory, and stop it. The same helpers as
// tests/e2e/metrics_e2e_test.cc, shared here so that reliability tests need not copy them again.
//
// Header-only. Not thread-safe per Process; distinct Process objects may be used from different
// threads.
#ifndef TESSERA_TESTS_HOSTILE_DAEMON_PROCESSES_H_
#define TESSERA_TESTS_HOSTILE_DAEMON_PROCESSES_H_

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

extern char** environ;

namespace tessera::testing {

// The whole file, or "" when it cannot be read.
inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The last `max_bytes` of `path` (a daemon's log, for failure messages).
inline std::string FileTail(const std::string& path, size_t max_bytes = 4000) {
  const std::string text = ReadWholeFile(path);
  return text.size() <= max_bytes ? text : text.substr(text.size() - max_bytes);
}

// A child process. pid is -1 once it is reaped, so that nothing signals a PID the kernel may
// have given to another process.
struct DaemonProcess {
  pid_t pid = -1;
  std::string tag;
  std::string err_path;
  bool reaped = false;  // by HasExited(): it ended on its own
  int exit_status = 0;  // its wait status then
};

// Starts `args` (args[0] is the binary) with stdout and stderr in <dir>/<tag>.out and .err, and
// this process's environment minus TESSERA_*, NOTIFY_SOCKET, WATCHDOG_* and JOURNAL_STREAM (a
// caller's TESSERA_LISTEN or systemd socket must not reach the daemons). Never blocks.
inline DaemonProcess SpawnDaemon(const std::vector<std::string>& args, const std::string& dir,
                                 const std::string& tag) {
  DaemonProcess p;
  p.tag = tag;
  const std::string out_path = absl::StrCat(dir, "/", tag, ".out");
  p.err_path = absl::StrCat(dir, "/", tag, ".err");
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    if (absl::StartsWith(entry, "TESSERA_") || absl::StartsWith(entry, "NOTIFY_SOCKET=") ||
        absl::StartsWith(entry, "WATCHDOG_") || absl::StartsWith(entry, "JOURNAL_STREAM=")) {
      continue;
    }
    env_strings.emplace_back(entry);
  }
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec (the parent has gRPC threads).
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open(p.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0) _exit(126);
    dup2(out, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  p.pid = pid;
  return p;
}

// Whether `p` has exited; reaps it then (pid -1, exit_status set).
inline bool HasExited(DaemonProcess* p) {
  if (p->pid <= 0) return true;
  int status = 0;
  if (waitpid(p->pid, &status, WNOHANG) != p->pid) return false;
  p->pid = -1;
  p->reaped = true;
  p->exit_status = status;
  return true;
}

// How `p` ended, for messages: "running", "exited with 1", "killed by signal 11".
inline std::string DescribeEnd(const DaemonProcess& p) {
  if (!p.reaped) return p.pid > 0 ? "running" : "stopped";
  if (WIFEXITED(p.exit_status)) return absl::StrCat("exited with ", WEXITSTATUS(p.exit_status));
  if (WIFSIGNALED(p.exit_status)) return absl::StrCat("killed by signal ", WTERMSIG(p.exit_status));
  return "ended";
}

// SIGTERM, then SIGKILL after `timeout`. Returns the exit status, 128 + the signal when a signal
// ended it, or -1 when it was not running.
inline int StopDaemon(DaemonProcess* p, absl::Duration timeout) {
  if (p->pid <= 0) return -1;
  kill(p->pid, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(p->pid, &status, WNOHANG);
    if (r == p->pid) break;
    if (absl::Now() > deadline) {
      kill(p->pid, SIGKILL);
      waitpid(p->pid, &status, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  p->pid = -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -2;
}

// The port written to `path` once it holds one; 0 after `timeout` or once `p` exited.
inline int WaitForPortFile(const std::string& path, DaemonProcess* p, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int port = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadWholeFile(path)), &port) && port > 0) {
      return port;
    }
    if (HasExited(p)) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

// A number field of /proc/<pid>/status ("VmRSS" in KiB, "Threads"); -1 when it cannot be read.
inline int64_t ProcStatusField(pid_t pid, absl::string_view field) {
  const std::string status = ReadWholeFile(absl::StrCat("/proc/", pid, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, field) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, "kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib)) return kib;
  }
  return -1;
}

// VmRSS of `pid` in KiB; -1 when it cannot be read.
inline int64_t ResidentKib(pid_t pid) { return ProcStatusField(pid, "VmRSS"); }

// A fresh directory under /tmp, removed with its contents on destruction (unless keep()).
class ScratchDirectory {
 public:
  explicit ScratchDirectory(const std::string& prefix) {
    std::string tmpl = absl::StrCat("/tmp/", prefix, "-XXXXXX");
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~ScratchDirectory() {
    std::error_code ec;
    if (!path_.empty() && !keep_) std::filesystem::remove_all(path_, ec);
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;

  // Empty when it could not be made.
  const std::string& path() const { return path_; }
  // Leave the directory (daemons' logs) for a post-mortem.
  void keep() { keep_ = true; }

 private:
  std::string path_;
  bool keep_ = false;
};

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_HOSTILE_DAEMON_PROCESSES_H_
