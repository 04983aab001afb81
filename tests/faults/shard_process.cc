#include "tests/faults/shard_process.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace faults {

ShardProcess::~ShardProcess() { Kill(); }

std::string ShardProcess::address() const { return absl::StrCat("127.0.0.1:", port_); }
std::string ShardProcess::data_dir() const {
  return absl::StrCat(options_.work_dir, "/data-", options_.shard_index);
}
std::string ShardProcess::log_path() const {
  return absl::StrCat(options_.work_dir, "/shard-", options_.shard_index, ".log");
}

absl::Status ShardProcess::Start(int port) {
  if (process_.running()) return absl::FailedPreconditionError("the shard already runs");
  if (port == 0) port = port_;
  const std::string port_file =
      absl::StrCat(options_.work_dir, "/shard-", options_.shard_index, ".port");
  unlink(port_file.c_str());
  ChildProcess::Options child;
  child.name = absl::StrCat("shard ", options_.shard_index);
  child.log_path = log_path();
  child.append_log = true;
  child.argv = {options_.server_path,
                "--listen",
                absl::StrCat("127.0.0.1:", port),
                "--port_file",
                port_file,
                "--shard_index",
                absl::StrCat(options_.shard_index),
                "--data_dir",
                data_dir()};
  child.argv.insert(child.argv.end(), options_.extra_args.begin(), options_.extra_args.end());
  absl::StatusOr<ChildProcess> process = ChildProcess::Spawn(std::move(child));
  if (!process.ok()) return process.status();
  process_ = *std::move(process);
  absl::StatusOr<int> bound = WaitUntilServing(process_, port_file, options_.start_timeout);
  if (!bound.ok()) {
    Kill();
    return bound.status();
  }
  port_ = *bound;
  return absl::OkStatus();
}

void ShardProcess::Kill() { process_.Kill(); }

absl::Status ShardProcess::Terminate(absl::Duration timeout) {
  if (!process_.running()) return absl::OkStatus();
  if (!process_.Terminate(timeout)) {
    return absl::InternalError(absl::StrCat("shard ", options_.shard_index, " did not exit within ",
                                            absl::FormatDuration(timeout), " of SIGTERM"));
  }
  if (process_.exit_code() != 0) {
    return absl::InternalError(absl::StrCat("shard ", options_.shard_index, " ",
                                            process_.DescribeExit(), "; log:\n",
                                            process_.LogTail(2000)));
  }
  return absl::OkStatus();
}

}  // namespace faults
}  // namespace tessera
