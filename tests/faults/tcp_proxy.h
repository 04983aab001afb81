// TcpProxy: a userspace TCP proxy on loopback that injects network faults between a client and
// one target (issue #6; `tc netem` does not work in this sandbox, see FACTS.md).
//
// It listens on 127.0.0.1:<port picked at run time> and forwards every accepted connection to
// target_host:target_port over a connection of its own. Faults, set at run time from any thread:
//   - latency: every chunk read from one side is held for that long before it is written to the
//     other side (order within a connection is kept, as TCP keeps it);
//   - CutAll(): every open connection is reset now (SO_LINGER 0, so both peers see RST);
//   - cut probability p: after each chunk is forwarded, its connection is reset with probability p
//     (a seeded generator, so a run is reproducible up to thread timing);
//   - blackhole: nothing is read, written or accepted until healed, while the sockets stay open
//     (a partition; TCP's buffers hold what was sent, as retransmission would, and it flows on
//     once healed);
//   - refuse: new connections are accepted and reset at once;
//   - rate limit: each direction is a link of that many bytes per second, shared by every
//     connection: a chunk goes out after the chunks read before it (on any connection) and
//     arrives `latency` after its last byte (a 1 or 10 Gbit/s link emulated on loopback).
// One thread runs a poll() loop over every socket; buffers are bounded (a side is not read while
// the other side's queue holds max_buffered_bytes). Connections to the target are non-blocking.
//
// Life cycle: kRunning after Start(); Stop() (or the destructor) closes every socket and joins the
// thread (kStopped). Thread-safety: every method may be called from any thread at any time.
#ifndef TESSERA_TESTS_FAULTS_TCP_PROXY_H_
#define TESSERA_TESTS_FAULTS_TCP_PROXY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera {
namespace faults {

class TcpProxy {
 public:
  struct Options {
    std::string target_host = "127.0.0.1";  // an IPv4 address
    int target_port = 0;
    // Bytes queued per direction of one connection before that direction's reader pauses.
    int64_t max_buffered_bytes = 1 << 20;
    // Largest chunk read at once (one chunk = one latency hold and one cut draw).
    int64_t chunk_bytes = 64 << 10;
    uint64_t seed = 1;  // for the random cuts
  };

  // Totals since Start().
  struct Counters {
    int64_t bytes_to_target = 0;  // forwarded client -> target
    int64_t bytes_to_client = 0;  // forwarded target -> client
    int64_t chunks = 0;           // chunks forwarded, both directions
    int64_t connections = 0;      // accepted and forwarded
    int64_t refused = 0;          // accepted and reset while refusing
    int64_t target_failures = 0;  // connections to the target that failed (client reset)
    int64_t cuts = 0;             // connections reset by CutAll() or a random cut
    int64_t random_cuts = 0;      // of which by the cut probability
    int64_t open = 0;             // connections open now
  };

  // Binds 127.0.0.1:0, listens and starts the forwarding thread. INVALID_ARGUMENT for a bad
  // target address or port, or non-positive sizes; INTERNAL (with errno text) when a socket call
  // fails.
  static absl::StatusOr<std::unique_ptr<TcpProxy>> Start(const Options& options);

  ~TcpProxy();  // Stop()

  int port() const { return port_; }
  // "127.0.0.1:<port>", for a gRPC channel.
  std::string address() const;

  // Fault settings; each takes effect for what the loop does next (non-blocking).
  void SetLatency(absl::Duration latency);
  // Bytes per second per direction; 0 (the default) is no limit.
  void SetRateLimit(int64_t bytes_per_second);
  // p in [0, 1]; values outside are clamped.
  void SetCutProbability(double p);
  void SetBlackhole(bool on);
  void SetRefuseNewConnections(bool on);
  // Resets every open connection and returns how many it reset (callers at the same moment may
  // share one pass and its count). Blocks until the loop did it; returns 0 once stopped.
  int CutAll();

  Counters counters() const;

  // Closes every socket and joins the thread. Idempotent; blocks for at most one loop pass.
  void Stop();

 private:
  struct Connection;

  TcpProxy(const Options& options, int listen_fd, int wake_read_fd, int wake_write_fd, int port);
  void Wake() const;
  void Run();

  const Options options_;
  const int listen_fd_;
  const int wake_read_fd_;
  const int wake_write_fd_;
  const int port_;

  // Settings and requests from other threads, read by the loop under mu_.
  mutable absl::Mutex mu_;
  absl::Duration latency_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int64_t rate_bytes_per_second_ ABSL_GUARDED_BY(mu_) = 0;
  double cut_probability_ ABSL_GUARDED_BY(mu_) = 0.0;
  bool blackhole_ ABSL_GUARDED_BY(mu_) = false;
  bool refuse_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t cut_requests_ ABSL_GUARDED_BY(mu_) = 0;  // CutAll() calls so far
  uint64_t cut_done_ ABSL_GUARDED_BY(mu_) = 0;      // of which the loop has carried out
  int last_cut_count_ ABSL_GUARDED_BY(mu_) = 0;
  Counters counters_ ABSL_GUARDED_BY(mu_);

  absl::Mutex join_mu_;  // serialises Stop()
  std::thread thread_;
};

}  // namespace faults
}  // namespace tessera

#endif  // TESSERA_TESTS_FAULTS_TCP_PROXY_H_
