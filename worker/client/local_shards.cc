#include "worker/client/local_shards.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tessera {
namespace client {

absl::StatusOr<std::unique_ptr<LocalShards>> LocalShards::Start(const Options& options) {
  if (options.num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards must be >= 1, got ", options.num_shards));
  }
  if (access(options.server_path.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("server_path '", options.server_path, "' is not an executable file"));
  }
  char tmpl[] = "/tmp/tessera-shards-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  std::unique_ptr<LocalShards> shards(new LocalShards());
  shards->work_dir_ = tmpl;
  const std::string& dir = shards->work_dir_;
  auto port_file = [&dir](int i) { return absl::StrCat(dir, "/shard-", i, ".port"); };
  for (int i = 0; i < options.num_shards; ++i) {
    ChildProcess::Options child;
    child.name = absl::StrCat("shard ", i);
    child.log_path = absl::StrCat(dir, "/shard-", i, ".log");
    child.argv = {options.server_path,
                  "--listen",
                  "127.0.0.1:0",
                  "--port_file",
                  port_file(i),
                  "--shard_index",
                  absl::StrCat(i),
                  "--data_dir",
                  absl::StrCat(dir, "/shard-", i, "-data"),
                  "--max_message_bytes",
                  absl::StrCat(options.max_message_bytes)};
    child.argv.insert(child.argv.end(), options.extra_args.begin(), options.extra_args.end());
    absl::StatusOr<ChildProcess> shard = ChildProcess::Spawn(std::move(child));
    if (!shard.ok()) return shard.status();
    shards->shards_.push_back(*std::move(shard));
  }

  const absl::Time deadline = absl::Now() + options.start_timeout;
  for (int i = 0; i < options.num_shards; ++i) {
    absl::StatusOr<int> port =
        WaitUntilServing(shards->shards_[i], port_file(i), deadline - absl::Now());
    if (!port.ok()) return port.status();
    shards->addresses_.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  return shards;
}

absl::Status LocalShards::Stop(absl::Duration timeout) {
  for (ChildProcess& shard : shards_) shard.Signal(SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status result;
  for (ChildProcess& shard : shards_) {
    if (!shard.running()) continue;
    if (!shard.Wait(deadline - absl::Now())) {
      shard.Kill();
      if (result.ok()) {
        result =
            absl::InternalError(absl::StrCat(shard.name(), " did not exit within ",
                                             absl::FormatDuration(timeout), " of SIGTERM; killed"));
      }
      continue;
    }
    if (result.ok() && shard.exit_code() != 0) {
      result = absl::InternalError(absl::StrCat(shard.name(), " ", shard.DescribeExit(),
                                                " after SIGTERM; log:\n", shard.LogTail(2000)));
    }
  }
  return result;
}

LocalShards::~LocalShards() {
  shards_.clear();  // SIGKILL and reap what still runs, before its directory goes
  if (!work_dir_.empty() && std::getenv("TESSERA_KEEP_SHARD_LOGS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(work_dir_, ec);
  }
}

}  // namespace client
}  // namespace tessera
