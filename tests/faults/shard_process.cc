#include "tests/faults/shard_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "worker/client/local_shards.h"

extern char** environ;

namespace tessera {
namespace faults {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string LogTail(const std::string& path) {
  std::string log = ReadFile(path);
  if (log.size() > 2000) log = log.substr(log.size() - 2000);
  return log;
}

}  // namespace

ShardProcess::~ShardProcess() { Kill(); }

std::string ShardProcess::address() const { return absl::StrCat("127.0.0.1:", port_); }
std::string ShardProcess::data_dir() const {
  return absl::StrCat(options_.work_dir, "/data-", options_.shard_index);
}
std::string ShardProcess::log_path() const {
  return absl::StrCat(options_.work_dir, "/shard-", options_.shard_index, ".log");
}

absl::Status ShardProcess::Start(int port) {
  if (pid_ > 0) return absl::FailedPreconditionError("the shard already runs");
  if (port == 0) port = port_;
  const std::string port_file =
      absl::StrCat(options_.work_dir, "/shard-", options_.shard_index, ".port");
  unlink(port_file.c_str());
  std::vector<std::string> args = {options_.server_path,
                                   "--listen",
                                   absl::StrCat("127.0.0.1:", port),
                                   "--port_file",
                                   port_file,
                                   "--shard_index",
                                   absl::StrCat(options_.shard_index),
                                   "--data_dir",
                                   data_dir()};
  args.insert(args.end(), options_.extra_args.begin(), options_.extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = log_path();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  const int err =
      posix_spawn(&pid_, options_.server_path.c_str(), &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (err != 0) {
    pid_ = -1;
    return absl::InternalError(
        absl::StrCat("posix_spawn ", options_.server_path, ": ", std::strerror(err)));
  }
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  int bound = 0;
  for (;;) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("shard ", options_.shard_index,
                                              " exited before serving (wait status ", status,
                                              "); log:\n", LogTail(log)));
    }
    if (bound == 0) {
      int parsed = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(port_file)), &parsed) &&
          parsed > 0) {
        bound = parsed;
      }
    }
    if (bound != 0 &&
        client::IsServing(absl::StrCat("127.0.0.1:", bound), absl::Milliseconds(500))) {
      port_ = bound;
      return absl::OkStatus();
    }
    if (absl::Now() > deadline) {
      Kill();
      return absl::DeadlineExceededError(absl::StrCat(
          "shard ", options_.shard_index, " not serving in time; log:\n", LogTail(log)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void ShardProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

absl::Status ShardProcess::Terminate(absl::Duration timeout) {
  if (pid_ <= 0) return absl::OkStatus();
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (waitpid(pid_, &status, WNOHANG) != pid_) {
    if (absl::Now() > deadline) {
      Kill();
      return absl::InternalError(absl::StrCat("shard ", options_.shard_index,
                                              " did not exit within ",
                                              absl::FormatDuration(timeout), " of SIGTERM"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  pid_ = -1;
  if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    return absl::InternalError(absl::StrCat("shard ", options_.shard_index,
                                            " ended with wait status ", status, "; log:\n",
                                            LogTail(log_path())));
  }
  return absl::OkStatus();
}

}  // namespace faults
}  // namespace tessera
