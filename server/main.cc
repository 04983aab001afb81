// tessera-server: one parameter shard (DESIGN.md §1). Flags live here only.
#include <malloc.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/crash_reporter.h"
#include "common/daemon_metrics.h"
#include "common/daemon_runner.h"
#include "common/membership.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "server/shard_metrics.h"
#include "server/shard_server.h"
#include "spdlog/fmt/fmt.h"

namespace {

struct Flags {
  tessera::server::ShardServerOptions server;
  std::string port_file;
  std::string log_level = "info";
  double shutdown_grace_seconds = 5.0;
  std::string coordinator;
  std::string advertise_address;
  tessera::SecurityOptions security;
  tessera::MetricsFlags metrics;
};

// The checks --check-config runs and every start runs first (exit 78 on failure); binds nothing.
absl::Status Validate(const Flags& flags, std::unique_ptr<tessera::Security>* security) {
  TESSERA_RETURN_IF_ERROR(tessera::ValidateLogLevel(flags.log_level));
  // Before Security::Create, which may log warnings.
  TESSERA_RETURN_IF_ERROR(tessera::InitLogging(flags.log_level));
  TESSERA_RETURN_IF_ERROR(tessera::server::ShardServer::Validate(flags.server));
  TESSERA_ASSIGN_OR_RETURN(*security, tessera::Security::Create(flags.security));
  TESSERA_RETURN_IF_ERROR((*security)->CheckListenAddress("--listen", flags.server.listen));
  TESSERA_RETURN_IF_ERROR(tessera::ValidateMetricsFlags(flags.metrics, flags.security.insecure));
  return absl::OkStatus();
}

std::string Hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// The address workers dial: --advertise_address, else the --listen host with the bound port (a
// wildcard host becomes this machine's hostname).
std::string AdvertisedAddress(const Flags& flags, int port) {
  if (!flags.advertise_address.empty()) return flags.advertise_address;
  std::string host = flags.server.listen.substr(0, flags.server.listen.rfind(':'));
  if (host == "0.0.0.0" || host == "::" || host == "[::]" || host.empty()) host = Hostname();
  return absl::StrCat(host, ":", port);
}

// The shard in RunDaemon's steps (common/daemon_runner.h).
class ShardDaemon final : public tessera::Daemon {
 public:
  ShardDaemon(const Flags& flags, tessera::Security* security)
      : flags_(flags), security_(security) {}

  absl::Status Create(tessera::Metrics* metrics) override {
    tessera::server::ShardServerOptions options = flags_.server;
    options.credentials = security_->ServerCredentials();
    options.configure = tessera::RpcMetricsHook(metrics);
    TESSERA_ASSIGN_OR_RETURN(server_, tessera::server::ShardServer::Create(options));
    tessera::server::RegisterShardMetrics(metrics, server_->store());
    return absl::OkStatus();
  }
  absl::Status Start() override { return server_->Start(); }
  int port() const override { return server_->port(); }
  void Announce() override {
    if (flags_.coordinator.empty()) return;
    tessera::MemberAgent::Options options;
    options.coordinator = flags_.coordinator;
    options.credentials = security_->Client();
    options.registration.set_role(tessera::v1::MEMBER_ROLE_SERVER);
    options.registration.set_address(AdvertisedAddress(flags_, server_->port()));
    options.registration.set_shard_index(flags_.server.shard_index);
    options.registration.set_hostname(Hostname());
    options.registration.set_pid(::getpid());
    options.registration.set_identity(server_->identity());
    // The stall inspector: what each job has waited for over a second goes with every heartbeat.
    options.fill_heartbeat = [store = server_->store()](tessera::v1::HeartbeatRequest* request) {
      for (tessera::v1::ShardStall& stall :
           store->FindStalls(tessera::server::ParameterStore::kStallReportAfter)) {
        *request->add_stalls() = std::move(stall);
      }
    };
    agent_ = std::make_unique<tessera::MemberAgent>(std::move(options));
    agent_->Start();
  }
  // The port answers health checks (SERVING) from here on, and READY means serving. The shard
  // loads no checkpoint by itself: only the coordinator knows which checkpoint of a job is
  // committed, so it sends Restore(job, step) once this shard has registered (docs/checkpoints.md).
  std::string ReadyStatus() const override {
    return absl::StrCat("serving on ", server_->address());
  }
  absl::Status CheckLive() override { return server_->store()->CheckLive(); }
  // Health NOT_SERVING for the whole drain, before the agent deregisters from the coordinator.
  void StopServing() override { server_->SetNotServing(); }
  void Deregister() override {
    if (agent_ != nullptr) agent_->Stop(/*deregister=*/true);
  }
  void Stop(absl::Duration grace) override { server_->Stop(grace); }

 private:
  const Flags& flags_;
  tessera::Security* const security_;
  // Owns the store, which the metrics read at scrape time: RunDaemon stops them before it returns.
  std::unique_ptr<tessera::server::ShardServer> server_;
  std::unique_ptr<tessera::MemberAgent> agent_;
};

}  // namespace

int main(int argc, char** argv) {
  tessera::ExecWithPassiveOpenMpWait(argv);
  tessera::ConfigureDaemonAllocator();
  tessera::ConfigureReleaseMutexes();
  tessera::BlockDaemonSignals();
  tessera::InstallCrashReporter(argv[0]);
  // Partitions are 4 MiB: keep freed message buffers in the heap for reuse instead of returning
  // them to the kernel (mmap/munmap and page faults on every message).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  // WaitForShutdownSignal gives what stays free back to the kernel once a second.
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  Flags flags;
  CLI::App app{
      "tessera-server: a Tessera parameter shard. It holds the partitions of each job that hash\n"
      "to it, enforces the job's consistency model (BSP, SSP, ASP), applies the optimizer and\n"
      "answers pulls over gRPC (tessera.v1.ParameterService, plus grpc.health.v1 and server\n"
      "reflection). SIGTERM or SIGINT drains it (health NOT_SERVING, running calls finish within\n"
      "--shutdown_grace_seconds) and exits 0; SIGHUP re-reads log_level and the TLS and token\n"
      "files. Under systemd (Type=notify) it sends READY=1 once serving, STOPPING=1 on drain and\n"
      "WATCHDOG=1 when the unit sets WatchdogSec.",
      "tessera-server"};
  app.add_option("--listen", flags.server.listen,
                 "host:port to serve on; port 0 picks a free port (see --port_file)")
      ->capture_default_str();
  app.add_option("--port_file", flags.port_file,
                 "write the bound port here (atomically) once serving; empty: don't")
      ->capture_default_str();
  app.add_option("--data_dir", flags.server.data_dir,
                 "directory for checkpoints, created when missing; empty: none. It is also the "
                 "shard's identity (kept in DIR/identity, locked while the shard runs): restarted "
                 "on any port with it, the shard replaces its dead instance at once")
      ->capture_default_str();
  app.add_option("--shard_index", flags.server.shard_index,
                 "index of this shard among the job's shards (logs, checkpoint names)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max_message_bytes", flags.server.max_message_bytes,
                 "largest gRPC message received or sent, in bytes; larger requests get "
                 "RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max_memory_bytes", flags.server.max_memory_bytes,
                 "cap on the bytes of parameter state over all jobs; declarations and pushes "
                 "beyond it get RESOURCE_EXHAUSTED; 0: three quarters of the physical memory")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", flags.server.threads,
                 "threads that apply pushes and answer pulls; 0: one per hardware thread")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app.add_option("--coordinator", flags.coordinator,
                 "host:port of tessera-coordinator to register with (heartbeats keep the lease); "
                 "empty: a standalone shard")
      ->capture_default_str();
  app.add_option("--advertise_address", flags.advertise_address,
                 "host:port workers dial, sent to the coordinator; empty: the --listen host with "
                 "the bound port (0.0.0.0 or :: becomes the hostname)")
      ->capture_default_str();
  app.add_option("--log_level", flags.log_level, "trace, debug, info, warn, error, critical or off")
      ->capture_default_str();
  app.add_option("--shutdown_grace_seconds", flags.shutdown_grace_seconds,
                 "on SIGTERM/SIGINT, how long running calls may finish before they are cancelled")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  tessera::AddSecurityFlags(app, &flags.security);
  tessera::AddMetricsFlags(app, &flags.metrics);
  tessera::LayeredConfig config("tessera-server");
  config.AddFlags(app);
  std::unique_ptr<tessera::Security> security;
  const int code = config.Parse(app, argc, argv, [&] { return Validate(flags, &security); });
  if (code >= 0) return code;
  tessera::DaemonRunOptions run;
  run.program = "tessera-server";
  run.metrics_daemon = "server";
  run.metrics = flags.metrics;
  run.port_file = flags.port_file;
  run.shutdown_grace = absl::Seconds(flags.shutdown_grace_seconds);
  run.drain_log = fmt::format("shutting down (grace {} s)", flags.shutdown_grace_seconds);
  run.create_failure_exit_code = 2;
  run.config = &config;
  run.security = security.get();
  ShardDaemon daemon(flags, security.get());
  return tessera::RunDaemon(run, daemon);
}
