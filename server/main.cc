// tessera-server: one parameter shard (DESIGN.md §1). Flags live here only.
#include <malloc.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/membership.h"
#include "common/process.h"
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
};

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

int Run(const Flags& flags) {
  absl::Status logging = tessera::InitLogging(flags.log_level);
  if (!logging.ok()) {
    std::fprintf(stderr, "tessera-server: %s\n", std::string(logging.message()).c_str());
    return 2;
  }
  auto server = tessera::server::ShardServer::Create(flags.server);
  if (!server.ok()) {
    spdlog::error("tessera-server: {}", server.status().ToString());
    return 2;
  }
  absl::Status started = (*server)->Start();
  if (!started.ok()) {
    spdlog::error("tessera-server: {}", started.ToString());
    return 1;
  }
  if (!flags.port_file.empty()) {
    absl::Status written = tessera::WritePortFile(flags.port_file, (*server)->port());
    if (!written.ok()) {
      spdlog::error("tessera-server: {}", written.ToString());
      (*server)->Stop(absl::ZeroDuration());
      return 1;
    }
  }
  std::unique_ptr<tessera::MemberAgent> agent;
  if (!flags.coordinator.empty()) {
    tessera::MemberAgent::Options options;
    options.coordinator = flags.coordinator;
    options.registration.set_role(tessera::v1::MEMBER_ROLE_SERVER);
    options.registration.set_address(AdvertisedAddress(flags, (*server)->port()));
    options.registration.set_shard_index(flags.server.shard_index);
    options.registration.set_hostname(Hostname());
    options.registration.set_pid(::getpid());
    agent = std::make_unique<tessera::MemberAgent>(std::move(options));
    agent->Start();
  }
  const int signal = tessera::WaitForShutdownSignal();
  if (agent != nullptr) agent->Stop(/*deregister=*/true);
  spdlog::info("tessera-server: signal {} received, shutting down (grace {} s)", signal,
               flags.shutdown_grace_seconds);
  (*server)->Stop(absl::Seconds(flags.shutdown_grace_seconds));
  spdlog::info("tessera-server: stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::ExecWithPassiveOpenMpWait(argv);
  tessera::BlockShutdownSignals();
  // Partitions are 4 MiB: keep freed message buffers in the heap for reuse instead of returning
  // them to the kernel (mmap/munmap and page faults on every message).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  Flags flags;
  CLI::App app{
      "tessera-server: a Tessera parameter shard. It holds the partitions of each job that hash\n"
      "to it, enforces the job's consistency model (BSP, SSP, ASP), applies the optimizer and\n"
      "answers pulls over gRPC (tessera.v1.ParameterService, plus grpc.health.v1 and server\n"
      "reflection). SIGTERM or SIGINT shuts it down cleanly.",
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return Run(flags);
}
