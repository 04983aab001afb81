// tessera-bench: whole-system benchmarks against real shards on loopback.
//
//   tessera-bench pushpull --shards S --clients C --bytes B --seconds T --output json|text
//                          [--rounds R] [--partition_bytes P] [--server PATH]
//                          [--reference tcp,zmq]
//
// starts S tessera-server processes (port 0), declares one B-byte fp32 tensor (ASP, SGD), and
// runs C client threads, each with its own ParameterClient, that PushPull the whole tensor in a
// loop for T seconds. Goodput is (bytes pushed + bytes pulled) / elapsed. In the same run it moves
// the same number of bytes over plain TCP on loopback, as C connections that each send B bytes
// and read B bytes back per round (the push/pull pattern without gRPC, protobuf or the shard),
// and prints goodput / TCP as the ratio. The two alternate in --rounds rounds (T / rounds of gRPC,
// then TCP with the bytes that round moved), and the ratio is the median of the rounds' ratios,
// because machines are shared: compare ratios, not absolutes. With --reference zmq (the default
// runs both) each round also moves the same iterations through a parameter server over plain
// ZeroMQ (bench/zmq_reference.h: S server processes, C DEALER clients, the same SGD update), and
// goodput / ZeroMQ's is `zmq_ratio`, again the median of the rounds'.
#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/zmq_reference.h"
#include "worker/client/local_shards.h"
#include "worker/client/parameter_client.h"

namespace tessera {
namespace bench {
namespace {

struct PushPullFlags {
  int shards = 1;
  int clients = 1;
  std::string bytes = "4M";
  double seconds = 5.0;
  std::string output = "text";
  std::string server;
  std::string partition_bytes = "4M";
  int64_t max_iterations = 1000000;
  int rounds = 3;
  int streams = 1;
  bool copy_push = false;
  int replicas = 1;
  std::string reference = "tcp,zmq";
};

// "64K", "4M", "1G" or a plain number of bytes.
absl::StatusOr<int64_t> ParseBytes(const std::string& flag, std::string text) {
  int64_t unit = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k':
        unit = int64_t{1} << 10;
        break;
      case 'M':
      case 'm':
        unit = int64_t{1} << 20;
        break;
      case 'G':
      case 'g':
        unit = int64_t{1} << 30;
        break;
      default:
        break;
    }
    if (unit != 1) text.pop_back();
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(text, &n) || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": expected a positive size such as 4M, got '", text, "'"));
  }
  return n * unit;
}

std::string DefaultServerPath() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "tessera-server";
  std::string self(buf, static_cast<size_t>(n));
  return self.substr(0, self.rfind('/') + 1) + "tessera-server";
}

// C client threads, each with its own ParameterClient, over one declared tensor.
class PushPullLoop {
 public:
  static absl::StatusOr<std::unique_ptr<PushPullLoop>> Create(
      int clients, int64_t bytes, int64_t partition_bytes, int streams, bool copy_push,
      int replicas, const std::vector<std::string>& addresses) {
    auto loop = std::unique_ptr<PushPullLoop>(new PushPullLoop());
    const int64_t n = bytes / 4;
    loop->n_ = n;
    client::ParameterClient::Options base;
    base.shard_addresses = addresses;
    base.job_id = "bench";
    base.partition_bytes = partition_bytes;
    base.call_timeout = absl::Seconds(60);
    base.streams_per_shard = streams;
    base.zero_copy_push = !copy_push;
    base.replicas = replicas;
    {
      auto declarer = client::ParameterClient::Create(base);
      if (!declarer.ok()) return declarer.status();
      v1::JobConfig config;
      config.set_consistency(v1::CONSISTENCY_ASP);
      config.set_num_workers(static_cast<uint32_t>(clients));
      config.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
      config.mutable_optimizer()->set_learning_rate(1e-6f);
      absl::Status s = (*declarer)->DeclareJob(config, {{"w", {n}, {}}}, {});
      if (!s.ok()) return s;
    }
    for (int c = 0; c < clients; ++c) {
      client::ParameterClient::Options o = base;
      o.worker_id = static_cast<uint32_t>(c);
      auto pc = client::ParameterClient::Create(o);
      if (!pc.ok()) return pc.status();
      absl::Status s = (*pc)->AttachJob({{"w", {n}, {}}}, {});
      if (!s.ok()) return s;
      loop->clients_.push_back(*std::move(pc));
      loop->grads_.emplace_back(n, 1e-3f);
      loop->weights_.emplace_back(n, 0.0f);
      loop->steps_.push_back(0);
    }
    // Warm-up: connect every stream and touch every buffer once.
    absl::StatusOr<RoundResult> warm = loop->Run(absl::ZeroDuration(), 1);
    if (!warm.ok()) return warm.status();
    return loop;
  }

  struct RoundResult {
    int64_t iterations = 0;
    double seconds = 0;
    int64_t retries = 0;
  };

  // Every client loops until `duration` has passed (at least one iteration each, at most
  // max_iterations).
  absl::StatusOr<RoundResult> Run(absl::Duration duration, int64_t max_iterations) {
    const int clients = static_cast<int>(clients_.size());
    std::vector<int64_t> iterations(clients, 0), retries(clients, 0);
    std::vector<absl::Status> errors(clients);
    const absl::Time start = absl::Now();
    const absl::Time end = start + duration;
    std::vector<std::thread> threads;
    for (int c = 0; c < clients; ++c) {
      threads.emplace_back([&, c] {
        do {
          auto r =
              clients_[c]->PushPull("w", steps_[c]++, grads_[c], absl::MakeSpan(weights_[c])).get();
          if (!r.ok()) {
            errors[c] = r.status();
            return;
          }
          ++iterations[c];
          retries[c] += r->retries;
        } while (iterations[c] < max_iterations && absl::Now() < end);
      });
    }
    for (auto& t : threads) t.join();
    RoundResult result;
    result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    for (int c = 0; c < clients; ++c) {
      if (!errors[c].ok()) return errors[c];
      result.iterations += iterations[c];
      result.retries += retries[c];
    }
    return result;
  }

 private:
  PushPullLoop() = default;
  int64_t n_ = 0;
  std::vector<std::unique_ptr<client::ParameterClient>> clients_;
  std::vector<std::vector<float>> grads_, weights_;
  std::vector<int64_t> steps_;
};

constexpr int64_t kTcpChunk = 1 << 20;

// Sends n bytes from a kTcpChunk buffer in 1 MiB writes (iperf3 -l 1M style).
absl::Status WriteAll(int fd, const char* buf, int64_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, buf, static_cast<size_t>(std::min<int64_t>(n, kTcpChunk)));
    if (w <= 0) return absl::InternalError(absl::StrCat("write: ", std::strerror(errno)));
    n -= w;
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* buf, int64_t n) {
  while (n > 0) {
    const ssize_t r = read(fd, buf, static_cast<size_t>(std::min<int64_t>(n, kTcpChunk)));
    if (r <= 0) return absl::InternalError(absl::StrCat("read: ", std::strerror(errno)));
    n -= r;
  }
  return absl::OkStatus();
}

// C connections over loopback; each does `rounds` rounds of: send `bytes`, read `bytes` back.
// Returns the elapsed seconds.
absl::StatusOr<double> RunTcp(int clients, int64_t bytes, int64_t rounds_total) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, clients) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(listener);
    return absl::InternalError(absl::StrCat("bind/listen: ", std::strerror(errno)));
  }
  std::vector<int64_t> rounds(clients, rounds_total / clients);
  for (int64_t i = 0; i < rounds_total % clients; ++i) ++rounds[i];
  std::vector<int> client_fds(clients, -1), server_fds(clients, -1);
  for (int c = 0; c < clients; ++c) {
    client_fds[c] = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(client_fds[c], reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return absl::InternalError(absl::StrCat("connect: ", std::strerror(errno)));
    }
    server_fds[c] = accept(listener, nullptr, nullptr);
    if (server_fds[c] < 0) return absl::InternalError("accept");
    int one = 1;
    setsockopt(client_fds[c], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(server_fds[c], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  close(listener);
  std::vector<absl::Status> errors(2 * clients);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {  // the "shard": read a push, send a pull back
      std::vector<char> buf(kTcpChunk);
      for (int64_t i = 0; i < rounds[c] && errors[2 * c].ok(); ++i) {
        errors[2 * c] = ReadAll(server_fds[c], buf.data(), bytes);
        if (errors[2 * c].ok()) errors[2 * c] = WriteAll(server_fds[c], buf.data(), bytes);
      }
    });
    threads.emplace_back([&, c] {  // the worker
      std::vector<char> out(kTcpChunk, 1), in(kTcpChunk);
      for (int64_t i = 0; i < rounds[c] && errors[2 * c + 1].ok(); ++i) {
        errors[2 * c + 1] = WriteAll(client_fds[c], out.data(), bytes);
        if (errors[2 * c + 1].ok()) errors[2 * c + 1] = ReadAll(client_fds[c], in.data(), bytes);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (int c = 0; c < clients; ++c) {
    close(client_fds[c]);
    close(server_fds[c]);
  }
  for (const absl::Status& s : errors) {
    if (!s.ok()) return s;
  }
  return seconds;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int PushPullMain(const PushPullFlags& flags) {
  auto bytes = ParseBytes("bytes", flags.bytes);
  auto partition_bytes = ParseBytes("partition_bytes", flags.partition_bytes);
  for (const auto* s : {&bytes, &partition_bytes}) {
    if (!s->ok()) {
      std::fprintf(stderr, "tessera-bench: %s\n", s->status().ToString().c_str());
      return 2;
    }
  }
  if (*bytes % 4 != 0) {
    std::fprintf(stderr, "tessera-bench: --bytes must be a multiple of 4, got %lld\n",
                 static_cast<long long>(*bytes));
    return 2;
  }
  bool with_tcp = false, with_zmq = false;
  for (absl::string_view r : absl::StrSplit(flags.reference, ',')) {
    if (r == "tcp") {
      with_tcp = true;
    } else if (r == "zmq") {
      with_zmq = true;
    } else {
      std::fprintf(stderr, "tessera-bench: --reference: want tcp, zmq or tcp,zmq, got '%s'\n",
                   flags.reference.c_str());
      return 2;
    }
  }
  // The ZeroMQ servers fork first, while this process has one thread.
  std::unique_ptr<ZmqReference> zmq;
  if (with_zmq) {
    auto started = ZmqReference::Start(flags.shards, *bytes, 1e-6f);
    if (!started.ok()) {
      std::fprintf(stderr, "tessera-bench: %s\n", started.status().ToString().c_str());
      return 1;
    }
    zmq = *std::move(started);
  }
  client::LocalShards::Options so;
  so.server_path = flags.server.empty() ? DefaultServerPath() : flags.server;
  so.num_shards = flags.shards;
  so.max_message_bytes = std::max<int64_t>(64 << 20, *partition_bytes + (1 << 20));
  so.extra_args = {"--log_level", "warn"};
  auto shards = client::LocalShards::Start(so);
  if (!shards.ok()) {
    std::fprintf(stderr, "tessera-bench: %s\n", shards.status().ToString().c_str());
    return 1;
  }
  // gRPC, TCP and ZeroMQ alternate in rounds so that all see the same machine load; the reported
  // ratios are the medians of the rounds' ratios, and the goodputs are totals over all rounds.
  struct Round {
    double goodput;
    double tcp = 0, ratio = 0;
    double zmq = 0, zmq_ratio = 0;
  };
  std::vector<Round> rounds;
  int64_t iterations = 0, retries = 0;
  double grpc_bytes = 0, grpc_seconds = 0, tcp_seconds = 0, zmq_seconds = 0;
  {
    auto loop = PushPullLoop::Create(flags.clients, *bytes, *partition_bytes, flags.streams,
                                     flags.copy_push, flags.replicas, (*shards)->addresses());
    if (!loop.ok()) {
      std::fprintf(stderr, "tessera-bench: pushpull: %s\n", loop.status().ToString().c_str());
      return 1;
    }
    const absl::Duration per_round = absl::Seconds(flags.seconds / flags.rounds);
    for (int r = 0; r < flags.rounds; ++r) {
      auto run = (*loop)->Run(per_round, flags.max_iterations);
      if (!run.ok()) {
        std::fprintf(stderr, "tessera-bench: pushpull: %s\n", run.status().ToString().c_str());
        return 1;
      }
      const double moved = static_cast<double>(run->iterations) * 2.0 * static_cast<double>(*bytes);
      Round round{moved / run->seconds};
      if (with_tcp) {
        auto tcp = RunTcp(flags.clients, *bytes, run->iterations);
        if (!tcp.ok()) {
          std::fprintf(stderr, "tessera-bench: tcp: %s\n", tcp.status().ToString().c_str());
          return 1;
        }
        round.tcp = moved / *tcp;
        round.ratio = round.goodput / round.tcp;
        tcp_seconds += *tcp;
      }
      if (with_zmq) {
        auto z = zmq->Run(flags.clients, run->iterations);
        if (!z.ok()) {
          std::fprintf(stderr, "tessera-bench: %s\n", z.status().ToString().c_str());
          return 1;
        }
        round.zmq = moved / *z;
        round.zmq_ratio = round.goodput / round.zmq;
        zmq_seconds += *z;
      }
      rounds.push_back(round);
      iterations += run->iterations;
      retries += run->retries;
      grpc_bytes += moved;
      grpc_seconds += run->seconds;
    }
  }
  absl::Status stopped = (*shards)->Stop(absl::Seconds(15));
  if (!stopped.ok()) {
    std::fprintf(stderr, "tessera-bench: %s\n", stopped.ToString().c_str());
    return 1;
  }
  std::vector<double> ratios, zmq_ratios;
  for (const Round& r : rounds) {
    ratios.push_back(r.ratio);
    zmq_ratios.push_back(r.zmq_ratio);
  }
  const double median = Median(ratios), zmq_median = Median(zmq_ratios);
  const double goodput = grpc_bytes / grpc_seconds;
  const double tcp = with_tcp ? grpc_bytes / tcp_seconds : 0;
  const double zmq_goodput = with_zmq ? grpc_bytes / zmq_seconds : 0;
  if (flags.output == "json") {
    std::string per_round;
    for (const Round& r : rounds) {
      std::string one = absl::StrFormat("{\"goodput\": %.0f", r.goodput);
      if (with_tcp) absl::StrAppendFormat(&one, ", \"tcp\": %.0f, \"ratio\": %.3f", r.tcp, r.ratio);
      if (with_zmq) {
        absl::StrAppendFormat(&one, ", \"zmq\": %.0f, \"zmq_ratio\": %.3f", r.zmq, r.zmq_ratio);
      }
      absl::StrAppend(&per_round, per_round.empty() ? "" : ", ", one, "}");
    }
    std::string references;
    if (with_tcp) {
      absl::StrAppendFormat(&references, "\"tcp_bytes_per_second\": %.0f, \"ratio\": %.3f, ", tcp,
                            median);
    }
    if (with_zmq) {
      absl::StrAppendFormat(&references, "\"zmq_bytes_per_second\": %.0f, \"zmq_ratio\": %.3f, ",
                            zmq_goodput, zmq_median);
    }
    std::printf(
        "{\"benchmark\": \"pushpull\", \"shards\": %d, \"clients\": %d, \"bytes\": %lld, "
        "\"partition_bytes\": %lld, \"streams\": %d, \"replicas\": %d, \"seconds\": %.3f, "
        "\"iterations\": %lld, \"retries\": %lld, \"goodput_bytes_per_second\": %.0f, "
        "%s\"rounds\": [%s]}\n",
        flags.shards, flags.clients, static_cast<long long>(*bytes),
        static_cast<long long>(*partition_bytes), flags.streams, flags.replicas, grpc_seconds,
        static_cast<long long>(iterations), static_cast<long long>(retries), goodput,
        references.c_str(), per_round.c_str());
  } else {
    std::printf(
        "pushpull: %d shard(s), %d client(s), %lld bytes per tensor, partitions of %lld bytes, "
        "%d stream(s) per shard, %d cop%s of each partition\n"
        "  gRPC push+pull: %lld iterations in %.2f s, goodput %.3f GB/s (%lld retries)\n",
        flags.shards, flags.clients, static_cast<long long>(*bytes),
        static_cast<long long>(*partition_bytes), flags.streams, flags.replicas,
        flags.replicas == 1 ? "y" : "ies", static_cast<long long>(iterations), grpc_seconds,
        goodput / 1e9, static_cast<long long>(retries));
    if (with_tcp) {
      std::printf("  plain TCP:      same bytes in %.2f s, %.3f GB/s; ratio %.3f\n", tcp_seconds,
                  tcp / 1e9, median);
    }
    if (with_zmq) {
      std::printf("  ZeroMQ PS:      same bytes in %.2f s, %.3f GB/s; zmq_ratio %.3f\n",
                  zmq_seconds, zmq_goodput / 1e9, zmq_median);
    }
    std::printf("  (ratios: medians of %d interleaved rounds)\n", flags.rounds);
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace tessera

int main(int argc, char** argv) {
  // As in tessera-server: keep freed 4 MiB message buffers (requests, decoded weights) in the heap
  // for the next step instead of returning them to the kernel (page faults on every message).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"tessera-bench: whole-system benchmarks against real shards on loopback",
               "tessera-bench"};
  app.require_subcommand(1);
  tessera::bench::PushPullFlags pp;
  CLI::App* pushpull = app.add_subcommand(
      "pushpull",
      "push and pull one tensor in a loop (ASP, SGD) against real shards, and compare the "
      "goodput with plain TCP over loopback");
  pushpull->add_option("--shards", pp.shards, "shard processes")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  pushpull->add_option("--clients", pp.clients, "client threads, one ParameterClient each")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  pushpull->add_option("--bytes", pp.bytes, "tensor size in bytes (suffix K, M or G)")
      ->capture_default_str();
  pushpull->add_option("--seconds", pp.seconds, "length of the timed loop")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 600.0));
  pushpull->add_option("--output", pp.output, "json or text")
      ->capture_default_str()
      ->check(CLI::IsMember({"json", "text"}));
  pushpull->add_option("--server", pp.server,
                       "tessera-server binary (default: next to tessera-bench)");
  pushpull->add_option("--partition_bytes", pp.partition_bytes, "partition size (suffix K, M)")
      ->capture_default_str();
  pushpull->add_flag("--copy_push", pp.copy_push,
                     "serialise pushes as plain protobuf (one more copy) instead of zero-copy");
  pushpull->add_option("--streams", pp.streams, "PushPull streams per client and shard")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  pushpull
      ->add_option("--replicas", pp.replicas,
                   "copies of every partition (a job's replication; 2 needs --shards >= 2): each "
                   "push goes to every copy, the goodput counts the tensor's bytes once")
      ->capture_default_str()
      ->check(CLI::Range(1, 2));
  pushpull
      ->add_option("--reference", pp.reference,
                   "what the goodput is compared with, in the same run: tcp (plain sockets), "
                   "zmq (a parameter server over ZeroMQ, as ps-lite), or tcp,zmq")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            return v == "tcp" || v == "zmq" || v == "tcp,zmq" || v == "zmq,tcp"
                       ? std::string()
                       : "want tcp, zmq or tcp,zmq, got '" + v + "'";
          },
          "tcp|zmq|tcp,zmq"));
  pushpull
      ->add_option("--rounds", pp.rounds,
                   "gRPC and the references alternate this many times; a ratio is the median")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  pushpull
      ->add_option("--max_iterations", pp.max_iterations, "iterations per client and round at most")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return tessera::bench::PushPullMain(pp);
}
