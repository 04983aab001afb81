// LocalShards: real tessera-server processes on loopback, for end-to-end tests and benchmarks.
//
// Each shard is a child process (common/child_process.h) started with --listen 127.0.0.1:0 and
// --port_file, so ports are picked at run time; Start() returns once every shard's port file
// exists and its gRPC health service answers SERVING. Logs go to <work_dir>/shard-<i>.log.
//
// Life cycle: kRunning after Start(); Stop() sends SIGTERM and reaps (kStopped); the destructor
// SIGKILLs and reaps whatever still runs, so no child outlives the object, and removes the work
// directory unless TESSERA_KEEP_SHARD_LOGS is set.
// Thread-compatible: one thread drives a LocalShards.
#ifndef TESSERA_WORKER_CLIENT_LOCAL_SHARDS_H_
#define TESSERA_WORKER_CLIENT_LOCAL_SHARDS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace tessera {
namespace client {

class LocalShards {
 public:
  struct Options {
    std::string server_path;  // the tessera-server binary
    int num_shards = 1;
    int64_t max_message_bytes = 64 << 20;
    std::vector<std::string> extra_args;
    absl::Duration start_timeout = absl::Seconds(30);
  };

  // INVALID_ARGUMENT for a missing binary or num_shards < 1; DEADLINE_EXCEEDED (with the shard's
  // log tail) when a shard does not serve within start_timeout; INTERNAL when one exits early or
  // cannot be started.
  static absl::StatusOr<std::unique_ptr<LocalShards>> Start(const Options& options);

  ~LocalShards();

  // "127.0.0.1:<port>" of shard i, in shard-index order.
  const std::vector<std::string>& addresses() const { return addresses_; }
  // -1 once reaped.
  pid_t pid(int shard) const { return shards_[shard].pid(); }
  const std::string& work_dir() const { return work_dir_; }

  // SIGTERM to every shard, then waits up to `timeout` for each. OK only when every shard exited
  // with status 0; otherwise INTERNAL naming the shard and how it ended (a SIGKILL after the
  // timeout counts as a failure).
  absl::Status Stop(absl::Duration timeout);

 private:
  LocalShards() = default;

  std::string work_dir_;
  std::vector<ChildProcess> shards_;  // in shard-index order
  std::vector<std::string> addresses_;
};

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_LOCAL_SHARDS_H_
