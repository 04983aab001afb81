#include "common/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/health_probe.h"

extern char** environ;

namespace tessera {
namespace {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file descriptor, closed when it goes out of scope.
class ScopedFd {
 public:
  ScopedFd() = default;
  ~ScopedFd() { reset(); }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// The child's environment: Options::drop_env and Options::set_env applied to this process's.
std::vector<std::string> ChildEnvironment(const ChildProcess::Options& options) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    bool drop = options.set_env.count(std::string(entry.substr(0, entry.find('=')))) > 0;
    for (const std::string& prefix : options.drop_env) {
      drop = drop || absl::StartsWith(entry, prefix);
    }
    if (!drop) env.emplace_back(entry);
  }
  for (const auto& [name, value] : options.set_env) env.push_back(absl::StrCat(name, "=", value));
  return env;
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// In the child: reports errno to the parent through `fd` and exits 127.
[[noreturn]] void FailInChild(int fd) {
  const int error = errno;
  const ssize_t written = ::write(fd, &error, sizeof error);
  static_cast<void>(written);
  ::_exit(127);
}

}  // namespace

absl::StatusOr<ChildProcess> ChildProcess::Spawn(Options options) {
  if (options.argv.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no program to start for ", options.name));
  }
  // Everything the child needs is made before fork: between fork and exec only
  // async-signal-safe calls are allowed in a multi-threaded parent.
  std::vector<std::string> args = options.argv;
  std::vector<char*> argv = Pointers(args);
  std::vector<std::string> env = ChildEnvironment(options);
  std::vector<char*> envp = Pointers(env);
  const int log_flags = O_WRONLY | O_CREAT | O_CLOEXEC | (options.append_log ? O_APPEND : O_TRUNC);
  ScopedFd out, err;
  for (auto [path, fd] :
       {std::make_pair(&options.log_path, &out), std::make_pair(&options.err_path, &err)}) {
    if (path->empty()) continue;
    fd->reset(::open(path->c_str(), log_flags, 0644));
    if (fd->get() < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open ", *path, " for ", options.name, ": ", std::strerror(errno)));
    }
  }
  ScopedFd null_in;
  null_in.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  // The child writes errno here when it cannot exec; a successful exec closes it (O_CLOEXEC).
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe for ", options.name, ": ", std::strerror(errno)));
  }
  ScopedFd report_read, report_write;
  report_read.reset(report[0]);
  report_write.reset(report[1]);
  const int err_fd = err.get() >= 0 ? err.get() : out.get();
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) {
    return absl::InternalError(absl::StrCat("fork for ", options.name, ": ", std::strerror(errno)));
  }
  if (pid == 0) {
    if (options.die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);
    }
    if (options.own_process_group) ::setpgid(0, 0);
    if (null_in.get() >= 0) ::dup2(null_in.get(), STDIN_FILENO);
    if (out.get() >= 0 && ::dup2(out.get(), STDOUT_FILENO) < 0) FailInChild(report_write.get());
    if (err_fd >= 0 && ::dup2(err_fd, STDERR_FILENO) < 0) FailInChild(report_write.get());
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD}) ::sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(argv[0], argv.data(), envp.data());
    FailInChild(report_write.get());
  }
  report_write.reset();
  int error = 0;
  ssize_t n;
  do {
    n = ::read(report_read.get(), &error, sizeof error);
  } while (n < 0 && errno == EINTR);
  if (n > 0) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return absl::InternalError(absl::StrCat("cannot start ", options.name, ": ", options.argv[0],
                                            ": ", std::strerror(error)));
  }
  ChildProcess child;
  child.options_ = std::move(options);
  child.pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() { Kill(); }

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : options_(std::move(other.options_)),
      pid_(std::exchange(other.pid_, -1)),
      ended_(std::exchange(other.ended_, false)),
      wait_status_(std::exchange(other.wait_status_, 0)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    Kill();
    options_ = std::move(other.options_);
    pid_ = std::exchange(other.pid_, -1);
    ended_ = std::exchange(other.ended_, false);
    wait_status_ = std::exchange(other.wait_status_, 0);
  }
  return *this;
}

const std::string& ChildProcess::stderr_path() const {
  return options_.err_path.empty() ? options_.log_path : options_.err_path;
}

int ChildProcess::exit_code() const {
  if (!ended_) return -1;
  if (WIFEXITED(wait_status_)) return WEXITSTATUS(wait_status_);
  if (WIFSIGNALED(wait_status_)) return 128 + WTERMSIG(wait_status_);
  return -1;
}

std::string ChildProcess::DescribeExit() const {
  if (running()) return "is running";
  if (!ended_) return "was not started";
  return DescribeWaitStatus(wait_status_);
}

bool ChildProcess::HasExited() {
  if (pid_ <= 0) return true;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  // ECHILD: someone else reaped it (a SIGCHLD set to SIG_IGN); nothing more can be known.
  if (r != pid_ && !(r < 0 && errno == ECHILD)) return false;
  pid_ = -1;
  ended_ = true;
  wait_status_ = r > 0 ? status : 0;
  return true;
}

bool ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!HasExited()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

bool ChildProcess::Signal(int signal) { return pid_ > 0 && ::kill(pid_, signal) == 0; }

bool ChildProcess::Terminate(absl::Duration grace) {
  if (!Signal(SIGTERM)) return false;
  if (Wait(grace)) return true;
  Kill();
  return false;
}

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, 0);
  } while (r < 0 && errno == EINTR);
  pid_ = -1;
  ended_ = true;
  wait_status_ = r > 0 ? status : 0;
}

int ChildProcess::WaitForPortFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    const int port = ReadPortFile(path);
    if (port > 0) return port;
    if (HasExited()) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

std::string ChildProcess::LogTail(size_t max_bytes) const {
  return ReadFileTail(stderr_path(), max_bytes);
}

absl::Status ChildProcess::ExitedError() const {
  return absl::InternalError(
      absl::StrCat(name(), " ", DescribeExit(), "; the end of ", stderr_path(), ":\n", LogTail()));
}

absl::StatusOr<int> WaitUntilServing(ChildProcess& child, const std::string& port_file,
                                     absl::Duration timeout,
                                     const std::function<bool()>& interrupted) {
  const absl::Time deadline = absl::Now() + timeout;
  int port = 0;
  for (;;) {
    if (child.HasExited()) return child.ExitedError();
    if (interrupted && interrupted()) {
      return absl::CancelledError(
          absl::StrCat("interrupted while waiting for ", child.name(), " to serve"));
    }
    if (port == 0) port = ReadPortFile(port_file);
    if (port != 0 && IsServing(absl::StrCat("127.0.0.1:", port), absl::Milliseconds(500))) {
      return port;
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(child.name(), " is not serving after ", absl::FormatDuration(timeout),
                       port == 0 ? absl::StrCat(" (no port in ", port_file, ")") : "",
                       "; the end of ", child.stderr_path(), ":\n", child.LogTail()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

int ReadPortFile(const std::string& path) {
  int port = 0;
  if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadWholeFile(path)), &port) && port > 0 &&
      port < 65536) {
    return port;
  }
  return 0;
}

std::string ReadFileTail(const std::string& path, size_t max_bytes) {
  std::string text = ReadWholeFile(path);
  if (text.size() > max_bytes) text = "..." + text.substr(text.size() - max_bytes);
  return text;
}

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(wait_status), " (",
                        strsignal(WTERMSIG(wait_status)), ")");
  }
  return absl::StrCat("ended with wait status ", wait_status);
}

}  // namespace tessera
