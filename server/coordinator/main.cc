// tessera-coordinator: the control plane, one per cluster (DESIGN.md §1, §6). Flags live here only.
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/crash_reporter.h"
#include "common/daemon_metrics.h"
#include "common/daemon_runner.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/coordinator_server.h"
#include "spdlog/fmt/fmt.h"
#include "spec/dataset_spec.h"

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

// The coordinator in RunDaemon's steps (common/daemon_runner.h).
class CoordinatorDaemon final : public tessera::Daemon {
 public:
  CoordinatorDaemon(const Flags& flags, tessera::Security* security)
      : flags_(flags), security_(security) {}

  absl::Status Create(tessera::Metrics* metrics) override {
    tessera::coordinator::CoordinatorServerOptions options = flags_.server;
    options.coordinator.lease = absl::Seconds(flags_.lease_seconds);
    options.coordinator.heartbeat_interval = absl::Seconds(flags_.heartbeat_seconds);
    options.coordinator.recovery_timeout = absl::Seconds(flags_.recovery_timeout_seconds);
    if (options.coordinator.dataset_roots.empty()) {
      options.coordinator.dataset_roots = {tessera::spec::kDebianDatasetsFolder, options.data_dir};
    }
    options.credentials = security_->ServerCredentials();
    options.client_credentials = security_->Client();
    options.configure = tessera::RpcMetricsHook(metrics);
    TESSERA_ASSIGN_OR_RETURN(server_, tessera::coordinator::CoordinatorServer::Create(options));
    tessera::coordinator::RegisterCoordinatorMetrics(metrics, server_->coordinator());
    return absl::OkStatus();
  }
  absl::Status Start() override { return server_->Start(); }
  int port() const override { return server_->port(); }
  // The port answers health checks (SERVING) and the database is loaded (Create()).
  std::string ReadyStatus() const override {
    return absl::StrCat("serving on port ", server_->port());
  }
  // A tick that waits on hung shards takes up to a few shard deadlines (10 s each); two minutes
  // without one means the loop is stuck.
  absl::Status CheckLive() override { return server_->coordinator()->CheckLive(absl::Minutes(2)); }
  // Health NOT_SERVING for the whole drain (Stop() would set it too, but only after the log and
  // the STOPPING notification).
  void StopServing() override { server_->SetNotServing(); }
  void Stop(absl::Duration grace) override { server_->Stop(grace); }

 private:
  const Flags& flags_;
  tessera::Security* const security_;
  // Owns the coordinator, which the metrics read at scrape time: RunDaemon stops them before it
  // returns.
  std::unique_ptr<tessera::coordinator::CoordinatorServer> server_;
};

}  // namespace

int main(int argc, char** argv) {
  tessera::ConfigureDaemonAllocator();
  tessera::ConfigureReleaseMutexes();
  tessera::BlockDaemonSignals();
  tessera::InstallCrashReporter(argv[0]);
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
  app.add_option("--dataset_root", flags.server.coordinator.dataset_roots,
                 "a folder a job's dataset files may lie in (repeat it, or separate folders with "
                 "commas, for several); a spec naming a file elsewhere is refused. Default: "
                 "/usr/share/datasets and --data_dir")
      ->delimiter(',');
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
  tessera::DaemonRunOptions run;
  run.program = "tessera-coordinator";
  run.metrics_daemon = "coordinator";
  run.metrics = flags.metrics;
  run.port_file = flags.port_file;
  run.shutdown_grace = absl::Seconds(flags.shutdown_grace_seconds);
  run.drain_log = fmt::format("shutting down (grace {} s)", flags.shutdown_grace_seconds);
  run.create_failure_exit_code = 2;
  run.config = &config;
  run.security = security.get();
  CoordinatorDaemon daemon(flags, security.get());
  return tessera::RunDaemon(run, daemon);
}
