// slow_link_benchmark: `tessera local` with an emulated network link in front of every shard
// (issue #17), to measure what a wire encoding buys where bytes, not round trips, cost the time.
//
// Each shard listens on a loopback port behind its own TcpProxy (tests/faults/tcp_proxy.h) and
// advertises the proxy's address, so every connection to the shard, the workers' and the other
// shards', goes through the proxy: one link per direction of --rate_mbit, shared by every
// connection, plus --latency_us each way: the shard's network port. The coordinator's traffic
// is direct. Everything else is `tessera local` (cli/commands.h): the same output, the same JSON
// lines with --output json, the same exit status. At the end the bytes each proxy forwarded are
// printed to stderr, and as one JSON line {"link": ...} on stdout with --output json.
//
//   build/bin/slow_link_benchmark --job examples/fashion_mlp.textproto --rate_mbit 1000
//       --shards 2 --workers 2 --threads 1 --output json      (one command line)
//
// The shard's port is picked by binding port 0 and closing it before the shard binds it, so
// another process could take it in between (the shard then fails to start, and the run says so).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "cli/local_cluster.h"
#include "tests/faults/tcp_proxy.h"

namespace {

// A loopback port free at the time of the call.
absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket() for a free port failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  if (!ok) return absl::InternalError("bind() of 127.0.0.1:0 for a free port failed");
  return static_cast<int>(ntohs(addr.sin_port));
}

}  // namespace

int main(int argc, char** argv) {
  tessera::cli::LocalOptions local;
  std::string output = "text";
  double rate_mbit = 1000;
  int64_t latency_us = 0;
  CLI::App app{
      "Run one job on a local cluster whose shards sit behind an emulated link of --rate_mbit "
      "per direction each (tessera local plus a rate-limited proxy per shard)"};
  app.add_option("--job", local.spec_file, "Job spec: textproto, or JSON")->required();
  app.add_option("--shards", local.shards, "Parameter shards (default 2)")
      ->check(CLI::Range(1, 64));
  app.add_option("--workers", local.workers, "Workers (default: the spec's, else 2)")
      ->check(CLI::Range(1, 64));
  app.add_option("--threads", local.threads, "CPU threads per worker (default: cores / workers)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--rate_mbit", rate_mbit,
                 "Each shard link's rate per direction in Mbit/s (default 1000); 0: no limit")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--latency_us", latency_us, "Added one-way latency per chunk (default 0)")
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}));
  app.add_option("--output", output, "text, or json (the lines of tessera local --output json)")
      ->check(CLI::IsMember({"text", "json"}));
  CLI11_PARSE(app, argc, argv);

  const int64_t bytes_per_second = static_cast<int64_t>(rate_mbit * 1e6 / 8);
  std::vector<std::unique_ptr<tessera::faults::TcpProxy>> proxies;
  local.adjust_cluster = [&](tessera::cli::LocalCluster::Options* cluster) -> absl::Status {
    for (int i = 0; i < cluster->num_shards; ++i) {
      absl::StatusOr<int> port = FreeLoopbackPort();
      if (!port.ok()) return port.status();
      tessera::faults::TcpProxy::Options o;
      o.target_port = *port;
      absl::StatusOr<std::unique_ptr<tessera::faults::TcpProxy>> proxy =
          tessera::faults::TcpProxy::Start(o);
      if (!proxy.ok()) return proxy.status();
      (*proxy)->SetRateLimit(bytes_per_second);
      (*proxy)->SetLatency(absl::Microseconds(latency_us));
      cluster->shard_listen.push_back(absl::StrCat("127.0.0.1:", *port));
      cluster->shard_args.push_back({"--advertise_address", (*proxy)->address()});
      std::fprintf(stderr, "slow_link_benchmark: shard-%d on 127.0.0.1:%d behind %s (%.0f Mbit/s",
                   i, *port, (*proxy)->address().c_str(), rate_mbit);
      std::fprintf(stderr, ", +%lld us)\n", static_cast<long long>(latency_us));
      proxies.push_back(*std::move(proxy));
    }
    return absl::OkStatus();
  };
  tessera::cli::GlobalOptions global;
  global.json = output == "json";
  const int code = tessera::cli::RunLocal(global, local);

  int64_t to_shards = 0, from_shards = 0, connections = 0;
  for (size_t i = 0; i < proxies.size(); ++i) {
    const tessera::faults::TcpProxy::Counters c = proxies[i]->counters();
    std::fprintf(stderr,
                 "slow_link_benchmark: shard-%zu link: %lld bytes in, %lld out, %lld "
                 "connections\n",
                 i, static_cast<long long>(c.bytes_to_target),
                 static_cast<long long>(c.bytes_to_client), static_cast<long long>(c.connections));
    to_shards += c.bytes_to_target;
    from_shards += c.bytes_to_client;
    connections += c.connections;
  }
  if (global.json) {
    std::printf(
        "{\"link\":{\"rate_mbit\":%g,\"latency_us\":%lld,\"bytes_to_shards\":%lld,"
        "\"bytes_from_shards\":%lld,\"connections\":%lld}}\n",
        rate_mbit, static_cast<long long>(latency_us), static_cast<long long>(to_shards),
        static_cast<long long>(from_shards), static_cast<long long>(connections));
  }
  return code;
}
