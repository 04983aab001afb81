// The push-then-pull loop of `tessera-bench pushpull` over plain ZeroMQ: the transport that
// ps-lite and BytePS are built on, as the reference Tessera's goodput is compared with (issue #17).
//
// S server processes (forked before any other thread exists) each hold a 1/S slice of one fp32
// tensor behind a ROUTER socket on 127.0.0.1 (a port picked at run time). C client threads each
// have a DEALER socket to every server; an iteration sends each server its slice of the gradient
// (a zero-copy message over the client's buffer), and each server applies SGD to its slice
// (w -= lr * g, the shards' update) and answers with its weights, which the client copies into its
// own weight buffer, as Tessera's client writes the pulled weights into the caller's span.
#ifndef TESSERA_BENCH_ZMQ_REFERENCE_H_
#define TESSERA_BENCH_ZMQ_REFERENCE_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera::bench {

class ZmqReference {
 public:
  // Forks `servers` server processes for a tensor of `bytes` bytes (a multiple of 4). Call it
  // while the process has one thread: the children run only ZeroMQ code.
  static absl::StatusOr<std::unique_ptr<ZmqReference>> Start(int servers, int64_t bytes,
                                                             float learning_rate);
  ~ZmqReference();  // stops and reaps the servers

  ZmqReference(const ZmqReference&) = delete;
  ZmqReference& operator=(const ZmqReference&) = delete;

  // `clients` threads run `iterations` push-then-pull iterations in all (spread evenly); returns
  // the elapsed seconds. The connections are made (and one iteration each run) before the clock
  // starts. Each client's weights end as the servers' after its last iteration.
  absl::StatusOr<double> Run(int clients, int64_t iterations);

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // Client 0's weights after its last iteration of the last Run: the servers' weights then.
  const std::vector<float>& last_weights() const { return last_weights_; }

 private:
  ZmqReference() = default;

  int64_t bytes_ = 0;
  std::vector<pid_t> pids_;
  std::vector<std::string> endpoints_;  // tcp://127.0.0.1:PORT, one per server
  std::vector<int64_t> slice_floats_;   // per server
  void* context_ = nullptr;             // the clients' ZeroMQ context
  std::vector<float> last_weights_;
};

}  // namespace tessera::bench

#endif  // TESSERA_BENCH_ZMQ_REFERENCE_H_
