// tessera-coordinator: the control plane, one per cluster (DESIGN.md §1, §6). Flags live here only.
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"
#include "common/process.h"
#include "server/coordinator/coordinator_server.h"
#include "spdlog/spdlog.h"

namespace {

struct Flags {
  tessera::coordinator::CoordinatorServerOptions server;
  std::string port_file;
  std::string log_level = "info";
  double lease_seconds = 10.0;
  double heartbeat_seconds = 2.0;
  double shutdown_grace_seconds = 5.0;
};

int Run(Flags flags) {
  absl::Status logging = tessera::InitLogging(flags.log_level);
  if (!logging.ok()) {
    std::fprintf(stderr, "tessera-coordinator: %s\n", std::string(logging.message()).c_str());
    return 2;
  }
  flags.server.coordinator.lease = absl::Seconds(flags.lease_seconds);
  flags.server.coordinator.heartbeat_interval = absl::Seconds(flags.heartbeat_seconds);
  auto server = tessera::coordinator::CoordinatorServer::Create(flags.server);
  if (!server.ok()) {
    spdlog::error("tessera-coordinator: {}", server.status().ToString());
    return 2;
  }
  absl::Status started = (*server)->Start();
  if (!started.ok()) {
    spdlog::error("tessera-coordinator: {}", started.ToString());
    return 1;
  }
  if (!flags.port_file.empty()) {
    absl::Status written = tessera::WritePortFile(flags.port_file, (*server)->port());
    if (!written.ok()) {
      spdlog::error("tessera-coordinator: {}", written.ToString());
      (*server)->Stop(absl::ZeroDuration());
      return 1;
    }
  }
  const int signal = tessera::WaitForShutdownSignal();
  spdlog::info("tessera-coordinator: signal {} received, shutting down (grace {} s)", signal,
               flags.shutdown_grace_seconds);
  (*server)->Stop(absl::Seconds(flags.shutdown_grace_seconds));
  spdlog::info("tessera-coordinator: stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::BlockShutdownSignals();
  Flags flags;
  CLI::App app{
      "tessera-coordinator: the Tessera control plane, one per cluster. It queues jobs, tracks\n"
      "the shards and workers that register with it (leases kept alive by heartbeats),\n"
      "gang-schedules each job's workers, and streams progress (tessera.v1.JobService and\n"
      "tessera.v1.ClusterService, plus grpc.health.v1 and server reflection). Jobs, events and\n"
      "members persist in SQLite under --data_dir. SIGTERM or SIGINT shuts it down cleanly.\n\n"
      "Examples:\n"
      "  tessera-coordinator --data_dir /var/lib/tessera/coordinator\n"
      "  tessera-coordinator --listen 127.0.0.1:0 --port_file /tmp/coord.port --data_dir /tmp/c "
      "--num_shards 2",
      "tessera-coordinator"};
  app.add_option("--listen", flags.server.listen,
                 "host:port to serve on; port 0 picks a free port (see --port_file)")
      ->capture_default_str();
  app.add_option("--port_file", flags.port_file,
                 "write the bound port here (atomically) once serving; empty: don't")
      ->capture_default_str();
  app.add_option("--data_dir", flags.server.data_dir,
                 "directory of coordinator.db (jobs, events, members); created when missing")
      ->required();
  app.add_option("--num_shards", flags.server.coordinator.num_shards,
                 "shards every job uses; 0: the live registered shards (indices 0..S-1, S >= 1)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lease_seconds", flags.lease_seconds,
                 "a member without a heartbeat for this long is LOST")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--heartbeat_seconds", flags.heartbeat_seconds,
                 "heartbeat interval asked of members; below --lease_seconds")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--retain_models", flags.server.coordinator.retain_models,
                 "succeeded jobs whose weights stay on the shards for export; older ones are "
                 "dropped")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--check_dataset_files", flags.server.coordinator.check_files,
                 "refuse a job whose dataset files are missing here (true), or leave that to the "
                 "workers, which fail the job naming the file (false: the coordinator's host does "
                 "not hold the datasets)")
      ->capture_default_str();
  app.add_option("--log_level", flags.log_level, "trace, debug, info, warn, error, critical or off")
      ->capture_default_str();
  app.add_option("--shutdown_grace_seconds", flags.shutdown_grace_seconds,
                 "on SIGTERM/SIGINT, how long running calls may finish before they are cancelled")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return Run(flags);
}
