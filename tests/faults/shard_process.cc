#include "tests/faults/shard_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testlib/child_process.h"
#include "worker/client/local_shards.h"

namespace tessera {
namespace faults {
namespace {

std::string LogTail(const std::string& path) { return testlib::FileTail(path, 2000); }

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
  const std::string log = log_path();
  absl::StatusOr<pid_t> pid =
      client::SpawnWithLog(options_.server_path, std::move(args), log, /*append=*/true);
  if (!pid.ok()) return pid.status();
  pid_ = *pid;
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
    if (bound == 0) bound = testlib::ReadPortFile(port_file);
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
  testlib::KillAndReap(pid_);
  pid_ = -1;
}

absl::Status ShardProcess::Terminate(absl::Duration timeout) {
  if (pid_ <= 0) return absl::OkStatus();
  kill(pid_, SIGTERM);
  int status = 0;
  if (!testlib::WaitForExit(pid_, timeout, &status)) {
    Kill();
    return absl::InternalError(absl::StrCat("shard ", options_.shard_index, " did not exit within ",
                                            absl::FormatDuration(timeout), " of SIGTERM"));
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
