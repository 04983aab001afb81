// ShardProcess: one real tessera-server child process on loopback that a test can SIGKILL and start
// again on the same port with the same --data_dir, as systemd's Restart=on-failure would (the e2e
// LocalShards has no restart). Start() returns once the port file exists and the gRPC health
// service answers SERVING. The log goes to <work_dir>/shard-<index>.log (appended across restarts).
//
// Life cycle: kRunning after Start(); Kill() (SIGKILL) or Terminate() (SIGTERM) reap it; Start()
// may be called again afterwards. The destructor SIGKILLs and reaps whatever still runs.
// Thread-compatible (one thread drives it).
#ifndef TESSERA_TESTS_FAULTS_SHARD_PROCESS_H_
#define TESSERA_TESTS_FAULTS_SHARD_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace tessera {
namespace faults {

class ShardProcess {
 public:
  struct Options {
    std::string server_path;  // the tessera-server binary
    std::string work_dir;     // exists; holds the log, the port file and data-<index>/
    int shard_index = 0;
    std::vector<std::string> extra_args;
    absl::Duration start_timeout = absl::Seconds(30);
  };

  explicit ShardProcess(const Options& options) : options_(options) {}
  ~ShardProcess();
  ShardProcess(const ShardProcess&) = delete;
  ShardProcess& operator=(const ShardProcess&) = delete;

  // Starts the shard on 127.0.0.1:`port` (0: a port picked at run time, kept for later restarts).
  // FAILED_PRECONDITION when it already runs; DEADLINE_EXCEEDED (with the log tail) when it does
  // not serve within start_timeout; INTERNAL when it exits early or cannot be spawned.
  absl::Status Start(int port = 0);
  // SIGKILL and reap. No-op when not running.
  void Kill();
  // SIGTERM, then wait up to `timeout`; OK only for a clean exit with status 0.
  absl::Status Terminate(absl::Duration timeout);

  int port() const { return port_; }
  std::string address() const;
  std::string data_dir() const;
  std::string log_path() const;
  pid_t pid() const { return process_.pid(); }

 private:
  const Options options_;
  ChildProcess process_;
  int port_ = 0;
};

}  // namespace faults
}  // namespace tessera

#endif  // TESSERA_TESTS_FAULTS_SHARD_PROCESS_H_
