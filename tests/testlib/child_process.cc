#include "tests/testlib/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

extern char** environ;

namespace tessera {
namespace testlib {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string FileTail(const std::string& path, size_t max_bytes) {
  const std::string text = ReadWholeFile(path);
  return text.size() <= max_bytes ? text : text.substr(text.size() - max_bytes);
}

int ReadPortFile(const std::string& path) {
  int port = 0;
  if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadWholeFile(path)), &port) && port > 0) {
    return port;
  }
  return 0;
}

ScratchDirectory::ScratchDirectory(const std::string& prefix) {
  std::string tmpl = absl::StrCat("/tmp/", prefix, "-XXXXXX");
  if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
}

ScratchDirectory::~ScratchDirectory() {
  std::error_code ec;
  if (!path_.empty() && !keep_) std::filesystem::remove_all(path_, ec);
}

std::string ScratchDirectory::File(const std::string& name) const {
  return absl::StrCat(path_, "/", name);
}

ChildProcess SpawnChild(const std::vector<std::string>& args, const std::string& dir,
                        const std::string& tag, const SpawnOptions& options) {
  ChildProcess p;
  p.tag = tag;
  p.out_path = absl::StrCat(dir, "/", tag, ".out");
  p.err_path = absl::StrCat(dir, "/", tag, ".err");
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    if (options.scrub_environment &&
        (absl::StartsWith(entry, "TESSERA_") || absl::StartsWith(entry, "NOTIFY_SOCKET=") ||
         absl::StartsWith(entry, "WATCHDOG_") || absl::StartsWith(entry, "JOURNAL_STREAM="))) {
      continue;
    }
    env_strings.emplace_back(entry);
  }
  for (const auto& [name, value] : options.env) {
    env_strings.push_back(absl::StrCat(name, "=", value));
  }
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec (the test process has gRPC threads).
    const int out = open(p.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open(p.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0) _exit(126);
    dup2(out, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    // The test runner may have signals blocked; a daemon blocks what it waits for itself.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  p.pid = pid;
  return p;
}

int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -2;
}

bool WaitForExit(pid_t pid, absl::Duration timeout, int* wait_status) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    if (waitpid(pid, wait_status, WNOHANG) == pid) return true;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void KillAndReap(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
}

bool HasExited(ChildProcess* p) {
  if (p->pid <= 0) return true;
  int status = 0;
  if (waitpid(p->pid, &status, WNOHANG) != p->pid) return false;
  p->pid = -1;
  p->reaped = true;
  p->exit_status = status;
  return true;
}

std::string DescribeEnd(const ChildProcess& p) {
  if (!p.reaped) return p.pid > 0 ? "running" : "stopped";
  if (WIFEXITED(p.exit_status)) return absl::StrCat("exited with ", WEXITSTATUS(p.exit_status));
  if (WIFSIGNALED(p.exit_status)) return absl::StrCat("killed by signal ", WTERMSIG(p.exit_status));
  return "ended";
}

int WaitChild(ChildProcess* p, absl::Duration timeout) {
  if (p->pid <= 0) return -3;
  int status = 0;
  if (!WaitForExit(p->pid, timeout, &status)) {
    KillAndReap(p->pid);
    p->pid = -1;
    return -1;
  }
  p->pid = -1;
  return ExitCode(status);
}

int StopChild(ChildProcess* p, absl::Duration timeout) {
  if (p->pid <= 0) return -1;
  kill(p->pid, SIGTERM);
  int status = 0;
  if (!WaitForExit(p->pid, timeout, &status)) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &status, 0);
  }
  p->pid = -1;
  return ExitCode(status);
}

int WaitForPortFile(const std::string& path, ChildProcess* p, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    const int port = ReadPortFile(path);
    if (port > 0) return port;
    if (p != nullptr && HasExited(p)) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

ChildReaper::~ChildReaper() {
  if (p_->pid > 0) {
    kill(p_->pid, SIGKILL);
    WaitChild(p_, absl::Seconds(5));
  }
}

CommandResult RunToEnd(const std::vector<std::string>& args, const std::string& dir,
                       const std::string& tag, const SpawnOptions& options,
                       absl::Duration timeout) {
  ChildProcess p = SpawnChild(args, dir, tag, options);
  CommandResult r;
  r.code = WaitChild(&p, timeout);
  r.out = ReadWholeFile(p.out_path);
  r.err = ReadWholeFile(p.err_path);
  return r;
}

int64_t ProcStatusField(pid_t pid, absl::string_view field) {
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

int64_t ResidentKib(pid_t pid) { return ProcStatusField(pid, "VmRSS"); }

}  // namespace testlib
}  // namespace tessera
