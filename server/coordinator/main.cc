// tessera-coordinator: the control plane, one per cluster (DESIGN.md §1, §6). Flags live here only.
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/daemon_metrics.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "common/systemd.h"
#include "server/coordinator/coordinator_metrics.h"
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
  double recovery_timeout_seconds = 300.0;
  tessera::SecurityOptions security;
  tessera::MetricsFlags metrics;
};

// The checks --check-config runs and every start runs first (exit 78 on failure); binds nothing.
absl::Status Validate(const Flags& flags, std::unique_ptr<tessera::Security>* security) {
  TESSERA_RETURN_IF_ERROR(tessera::ValidateLogLevel(flags.log_level));
  // Before Security::Create, which may log warnings.
  TESSERA_RETURN_IF_ERROR(tessera::InitLogging(flags.log_level));
  tessera::coordinator::CoordinatorServerOptions server = flags.server;
  server.coordinator.recovery_timeout = absl::Seconds(flags.recovery_timeout_seconds);
  TESSERA_RETURN_IF_ERROR(tessera::coordinator::CoordinatorServer::Validate(server));
  if (flags.heartbeat_seconds >= flags.lease_seconds) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_seconds: must be below --lease_seconds (", flags.lease_seconds,
                     "), got ", flags.heartbeat_seconds));
  }
  TESSERA_ASSIGN_OR_RETURN(*security, tessera::Security::Create(flags.security));
  TESSERA_RETURN_IF_ERROR((*security)->CheckListenAddress("--listen", flags.server.listen));
  TESSERA_RETURN_IF_ERROR(tessera::ValidateMetricsFlags(flags.metrics, flags.security.insecure));
  return absl::OkStatus();
}

int Run(Flags flags, const tessera::LayeredConfig& config, tessera::Security* security) {
  absl::Status logging = tessera::InitLogging(flags.log_level);
  if (!logging.ok()) {
    std::fprintf(stderr, "tessera-coordinator: %s\n", std::string(logging.message()).c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<tessera::Metrics>> metrics =
      tessera::StartMetrics("coordinator", flags.metrics);
  if (!metrics.ok()) {
    spdlog::error("tessera-coordinator: {}", metrics.status().ToString());
    return 1;
  }
  tessera::Metrics* registry = metrics->get();
  flags.server.coordinator.lease = absl::Seconds(flags.lease_seconds);
  flags.server.coordinator.heartbeat_interval = absl::Seconds(flags.heartbeat_seconds);
  flags.server.coordinator.recovery_timeout = absl::Seconds(flags.recovery_timeout_seconds);
  flags.server.credentials = security->ServerCredentials();
  flags.server.client_credentials = security->Client();
  flags.server.configure = tessera::RpcMetricsHook(registry);
  auto server = tessera::coordinator::CoordinatorServer::Create(flags.server);
  if (!server.ok()) {
    spdlog::error("tessera-coordinator: {}", server.status().ToString());
    return 2;
  }
  // From here until the end the endpoint reads the coordinator at scrape time: every return
  // destroys `metrics` (stopping the endpoint) before `server`, which owns the coordinator.
  // `metrics` must still outlive the server's calls (the interceptors): stop the server first
  // when it was started.
  tessera::coordinator::RegisterCoordinatorMetrics(registry, (*server)->coordinator());
  absl::Status started = (*server)->Start();
  if (!started.ok()) {
    spdlog::error("tessera-coordinator: {}", started.ToString());
    metrics->reset();
    return 1;
  }
  if (!flags.port_file.empty()) {
    absl::Status written = tessera::WritePortFile(flags.port_file, (*server)->port());
    if (!written.ok()) {
      spdlog::error("tessera-coordinator: {}", written.ToString());
      (*server)->Stop(absl::ZeroDuration());
      metrics->reset();
      return 1;
    }
  }
  // The port answers health checks (SERVING) and the database is loaded (Create()).
  tessera::systemd::NotifyReady(absl::StrCat("serving on port ", (*server)->port()));
  tessera::systemd::SystemdWatchdog watchdog;
  // A tick that waits on hung shards takes up to a few shard deadlines (10 s each); two minutes
  // without one means the loop is stuck.
  tessera::coordinator::Coordinator* coordinator = (*server)->coordinator();
  watchdog.Start([coordinator] { return coordinator->CheckLive(absl::Minutes(2)); });
  const int signal = tessera::WaitForShutdownSignal(
      [&] { tessera::ReloadDaemonConfig(config, security, "tessera-coordinator"); });
  // Health NOT_SERVING for the whole drain (Stop() would set it too, but only after the log
  // and the STOPPING notification).
  (*server)->SetNotServing();
  tessera::systemd::NotifyStopping("draining");
  spdlog::info("tessera-coordinator: signal {} received, shutting down (grace {} s)", signal,
               flags.shutdown_grace_seconds);
  (*server)->Stop(absl::Seconds(flags.shutdown_grace_seconds));
  // The metrics read the coordinator at scrape time: stop serving them before it goes.
  metrics->reset();
  watchdog.Stop();
  spdlog::info("tessera-coordinator: stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::ConfigureDaemonAllocator();
  tessera::BlockDaemonSignals();
  Flags flags;
  CLI::App app{
      "tessera-coordinator: the Tessera control plane, one per cluster. It queues jobs, tracks\n"
      "the shards and workers that register with it (leases kept alive by heartbeats),\n"
      "gang-schedules each job's workers, and streams progress (tessera.v1.JobService and\n"
      "tessera.v1.ClusterService, plus grpc.health.v1 and server reflection). Jobs, events and\n"
      "members persist in SQLite under --data_dir. SIGTERM or SIGINT drains it (health\n"
      "NOT_SERVING, running calls finish within --shutdown_grace_seconds) and exits 0; SIGHUP\n"
      "re-reads log_level and the TLS and token files. Under systemd (Type=notify) it sends\n"
      "READY=1 once serving, STOPPING=1 on drain and WATCHDOG=1 when the unit sets WatchdogSec.\n"
      "Fault tolerance: it commits the shards' checkpoints, rewinds a job to its newest "
      "checkpoint\n"
      "when a shard is lost (waiting --recovery_timeout for it), and carries on without a lost\n"
      "worker until an idle one takes its rank over.\n\n"
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
  app.add_option("--recovery_timeout", flags.recovery_timeout_seconds,
                 "seconds a job whose shard was lost waits for it to come back (and for its "
                 "checkpoint to be restored) before it fails")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  app.add_option("--log_level", flags.log_level, "trace, debug, info, warn, error, critical or off")
      ->capture_default_str();
  app.add_option("--shutdown_grace_seconds", flags.shutdown_grace_seconds,
                 "on SIGTERM/SIGINT, how long running calls may finish before they are cancelled")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  tessera::AddSecurityFlags(app, &flags.security);
  tessera::AddMetricsFlags(app, &flags.metrics);
  tessera::LayeredConfig config("tessera-coordinator");
  config.AddFlags(app);
  std::unique_ptr<tessera::Security> security;
  const int code = config.Parse(app, argc, argv, [&] { return Validate(flags, &security); });
  if (code >= 0) return code;
  return Run(std::move(flags), config, security.get());
}
