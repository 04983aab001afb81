// tessera-server: one parameter shard (DESIGN.md §1). Flags live here only.
#include <malloc.h>
#include <unistd.h>

#include <csignal>
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
#include "common/membership.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "common/systemd.h"
#include "server/shard_metrics.h"
#include "server/shard_server.h"
#include "spdlog/spdlog.h"

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

int Run(Flags flags, const tessera::LayeredConfig& config, tessera::Security* security) {
  absl::Status logging = tessera::InitLogging(flags.log_level);
  if (!logging.ok()) {
    std::fprintf(stderr, "tessera-server: %s\n", std::string(logging.message()).c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<tessera::Metrics>> metrics =
      tessera::StartMetrics("server", flags.metrics);
  if (!metrics.ok()) {
    spdlog::error("tessera-server: {}", metrics.status().ToString());
    return 1;
  }
  tessera::Metrics* registry = metrics->get();
  flags.server.credentials = security->ServerCredentials();
  flags.server.configure = tessera::RpcMetricsHook(registry);
  auto server = tessera::server::ShardServer::Create(flags.server);
  if (!server.ok()) {
    spdlog::error("tessera-server: {}", server.status().ToString());
    return 2;
  }
  // From here until the end the endpoint reads the store at scrape time: every return destroys
  // `metrics` (stopping the endpoint) before `server`, which owns the store. `metrics` must still
  // outlive the server's calls (the interceptors): stop the server first when it was started.
  tessera::server::RegisterShardMetrics(registry, (*server)->store());
  absl::Status started = (*server)->Start();
  if (!started.ok()) {
    spdlog::error("tessera-server: {}", started.ToString());
    metrics->reset();
    return 1;
  }
  if (!flags.port_file.empty()) {
    absl::Status written = tessera::WritePortFile(flags.port_file, (*server)->port());
    if (!written.ok()) {
      spdlog::error("tessera-server: {}", written.ToString());
      (*server)->Stop(absl::ZeroDuration());
      metrics->reset();
      return 1;
    }
  }
  std::unique_ptr<tessera::MemberAgent> agent;
  if (!flags.coordinator.empty()) {
    tessera::MemberAgent::Options options;
    options.coordinator = flags.coordinator;
    options.credentials = security->Client();
    options.registration.set_role(tessera::v1::MEMBER_ROLE_SERVER);
    options.registration.set_address(AdvertisedAddress(flags, (*server)->port()));
    options.registration.set_shard_index(flags.server.shard_index);
    options.registration.set_hostname(Hostname());
    options.registration.set_pid(::getpid());
    agent = std::make_unique<tessera::MemberAgent>(std::move(options));
    agent->Start();
  }
  // The port answers health checks (SERVING) from here on, and READY means serving. The shard
  // loads no checkpoint by itself: only the coordinator knows which checkpoint of a job is
  // committed, so it sends Restore(job, step) once this shard has registered (docs/checkpoints.md).
  tessera::systemd::NotifyReady(absl::StrCat("serving on ", (*server)->address()));
  tessera::systemd::SystemdWatchdog watchdog;
  tessera::server::ParameterStore* store = (*server)->store();
  watchdog.Start([store] { return store->CheckLive(); });
  const int signal = tessera::WaitForShutdownSignal(
      [&] { tessera::ReloadDaemonConfig(config, security, "tessera-server"); });
  // Health NOT_SERVING for the whole drain, before the agent deregisters from the coordinator.
  (*server)->SetNotServing();
  tessera::systemd::NotifyStopping("draining");
  if (agent != nullptr) agent->Stop(/*deregister=*/true);
  spdlog::info("tessera-server: signal {} received, shutting down (grace {} s)", signal,
               flags.shutdown_grace_seconds);
  (*server)->Stop(absl::Seconds(flags.shutdown_grace_seconds));
  // The metrics read the store at scrape time: stop serving them before the store goes.
  metrics->reset();
  watchdog.Stop();
  spdlog::info("tessera-server: stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::ExecWithPassiveOpenMpWait(argv);
  tessera::ConfigureDaemonAllocator();
  tessera::BlockDaemonSignals();
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
                 "directory for checkpoints, created when missing; empty: none")
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
  return Run(flags, config, security.get());
}
