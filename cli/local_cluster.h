// LocalCluster: a whole Tessera cluster on loopback as child processes (`tessera local`, and the
// end-to-end tests): one tessera-coordinator, N tessera-server shards and M tessera-worker
// daemons, on ports picked at run time.
//
// Life cycle: Start() creates the work directory (mkdtemp under $TMPDIR, or /tmp), starts the
// coordinator (--data_dir in the work directory) and waits for its port file and gRPC health,
// then the shards (--coordinator ADDR, waiting for each the same way), then the workers, and
// returns once the coordinator lists every shard and every worker READY. Stop() sends SIGTERM to
// the workers, then the shards, then the coordinator, each group with a grace period before
// SIGKILL, and reaps them. The destructor does the same for whatever still runs and removes the
// work directory, so no child outlives the object. Each child also gets PR_SET_PDEATHSIG
// (SIGTERM) and its own process group, so a Ctrl-C on the terminal reaches only the parent, which
// shuts the cluster down in order, and a parent killed outright still takes its children along.
//
// Every child's stdout and stderr go to <work_dir>/<name>.log (coordinator, shard-<i>,
// worker-<i>).
//
// The children are started by common/child_process.h (fork-safe in a multi-threaded parent).
// Thread-safety: not thread-safe; one thread drives a LocalCluster, and it must live as long as
// the cluster (PR_SET_PDEATHSIG follows the spawning thread).
#ifndef TESSERA_CLI_LOCAL_CLUSTER_H_
#define TESSERA_CLI_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace tessera::cli {

class LocalCluster {
 public:
  struct Options {
    // Folder with tessera-coordinator, tessera-server and tessera-worker.
    std::string bin_dir;
    int num_shards = 2;
    int num_workers = 2;
    // --threads of each worker; 0 means max(1, online cores / num_workers).
    int worker_threads = 0;
    // --log_level of every daemon.
    std::string log_level = "info";
    // Keep the work directory (logs, the coordinator's database) after the cluster is gone.
    bool keep_work_dir = false;
    // How long each stage of Start() may take (a daemon's port and health, the members READY).
    absl::Duration start_timeout = absl::Seconds(60);
    // Polled while Start() waits; when it returns true Start() gives up with CANCELLED.
    std::function<bool()> interrupted;
    // Extra flags for each kind of daemon.
    std::vector<std::string> coordinator_args;
    std::vector<std::string> server_args;
    std::vector<std::string> worker_args;
    // Per shard index, when there is an entry: the --listen address (default "127.0.0.1:0") and
    // extra flags (after server_args). A benchmark puts an emulated link in front of a shard
    // with them: a fixed port behind a proxy, and the proxy's address as --advertise_address.
    std::vector<std::string> shard_listen;
    std::vector<std::vector<std::string>> shard_args;
    // Extra environment of worker i (worker_env[i], when there is one): a failpoint
    // (common/failpoint.h) in a test, say.
    std::vector<std::map<std::string, std::string>> worker_env;
  };

  // One child process: how it is started, and the process while it runs.
  struct Child {
    std::string name;  // "coordinator", "shard-0", "worker-1"
    std::vector<std::string> argv;
    std::string log_path;
    std::string port_file;  // empty for workers
    // A shard's address before RestartOnNewPort.
    std::string previous_address;
    // Set in its environment (on top of this process's).
    std::map<std::string, std::string> env;
    ChildProcess process;
    // -1 once reaped.
    pid_t pid() const { return process.pid(); }
  };

  // Starts the cluster as described above. INVALID_ARGUMENT for counts < 1 or a missing binary
  // (naming it); DEADLINE_EXCEEDED or INTERNAL (with the failing child's log tail) when a daemon
  // exits or does not come up in time; CANCELLED when `interrupted` said so. On error every child
  // started so far has been stopped and reaped.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const Options& options);

  // Stop(absl::Seconds(10)), then removes the work directory unless keep_work_dir.
  ~LocalCluster();

  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // "127.0.0.1:<port>".
  const std::string& coordinator_address() const { return coordinator_address_; }
  const std::vector<std::string>& shard_addresses() const { return shard_addresses_; }
  const std::string& work_dir() const { return work_dir_; }
  const std::vector<Child>& children() const { return children_; }
  // Pids of the children not yet reaped.
  std::vector<pid_t> live_pids() const;

  // OK while every child runs; otherwise INTERNAL naming the first one that exited, how, and the
  // tail of its log. Reaps what has exited. Does not block.
  absl::Status CheckChildren();

  // SIGTERM to the workers, then the shards, then the coordinator; each group gets `grace` to exit
  // before SIGKILL. Reaps all. OK only when every child exited with status 0; otherwise INTERNAL
  // naming the first that did not and the tail of its log. Idempotent.
  absl::Status Stop(absl::Duration grace);

  // SIGKILL to the child named `name` ("coordinator", "shard-1", "worker-0"), then reaps it (for
  // recovery tests). NOT_FOUND for an unknown name, FAILED_PRECONDITION when it is not running.
  absl::Status Kill(const std::string& name);
  // Starts that child again with its first arguments: the same --data_dir and, for the
  // coordinator and the shards, the same port, as systemd's Restart=on-failure would. Waits for
  // its port and health (daemons that serve). FAILED_PRECONDITION while it still runs.
  absl::Status Restart(const std::string& name);
  // Restart() of a shard listening on a new port ("127.0.0.1:0"; its --data_dir, and so its
  // identity, kept), which later restarts keep. NOT_FOUND for a name that is no shard.
  absl::Status RestartOnNewPort(const std::string& name);
  // Kill("coordinator") and Restart("coordinator").
  absl::Status KillCoordinator();
  absl::Status RestartCoordinator();

  // The last `max_bytes` of a child's log.
  static std::string LogTail(const Child& child, size_t max_bytes = 3000);

 private:
  explicit LocalCluster(Options options) : options_(std::move(options)) {}

  Child* FindChild(const std::string& name);
  absl::Status Spawn(Child* child);
  // Waits for the child's port file and gRPC health; returns "127.0.0.1:<port>".
  absl::StatusOr<std::string> WaitServing(Child* child);
  absl::Status WaitMembersReady();
  void StopGroup(const std::string& prefix, absl::Duration grace);

  Options options_;
  std::string work_dir_;
  bool owns_work_dir_ = false;
  std::string coordinator_address_;
  std::vector<std::string> shard_addresses_;
  std::vector<Child> children_;  // coordinator first, then shards, then workers
};

// The folder holding the running executable (from /proc/self/exe).
absl::StatusOr<std::string> SelfBinaryDir();

}  // namespace tessera::cli

#endif  // TESSERA_CLI_LOCAL_CLUSTER_H_
