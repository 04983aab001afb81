// Prometheus metrics for every Tessera daemon (DESIGN.md §9; issue #5), through prometheus-cpp.
//
// One Metrics per process. It owns the registry and, when asked to listen, an HTTP exposer that
// serves GET /metrics. Every daemon gets, from Create():
//   - process metrics, read at scrape time (prometheus-cpp has no process collector):
//     process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
//     process_threads, process_start_time_seconds, process_cpu_seconds_total (/proc/self);
//   - tessera_build_info{daemon="server|coordinator|worker",version} 1 (version: the project
//     VERSION of the top CMakeLists.txt).
// process_start_time_seconds is the wall clock minus the process's age (CLOCK_BOOTTIME against
// starttime of /proc/self/stat): /proc/stat, hidden by the units' ProcSubset=pid, is not read.
// The endpoint is plaintext HTTP: Debian's civetweb 1.15 (under prometheus-cpp) accepts a TLS
// certificate but its worker thread crashes on the first TLS connection under OpenSSL 3, so a
// non-loopback --metrics_listen needs --insecure (or a TLS-terminating proxy).
// Servers add the per-RPC metrics with NewServerInterceptorFactory():
//   tessera_rpc_calls_total{method}, tessera_rpc_errors_total{method,code},
//   tessera_rpc_latency_seconds{method} (histogram, unary calls only: a streaming call's duration
//   is the stream's lifetime, so streams are counted in calls/errors only).
// Destroying a Metrics with an endpoint takes up to 2 s (civetweb's accept loop polls with a 2 s
// timeout before it sees the stop).
// Daemons add their own families to registry() or AddCollectable() (shard: bytes pushed and
// pulled, updates applied, duplicate pushes dropped, BSP wait time, SSP staleness; coordinator:
// jobs by state, workers by state, step rate, loss and accuracy per job), see
// server/shard_metrics.h and server/coordinator/coordinator_metrics.h.
//
// Thread-safety: every method may be called from any thread.
#ifndef TESSERA_COMMON_METRICS_H_
#define TESSERA_COMMON_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace tessera {

class Metrics {
 public:
  // `daemon`: "server", "coordinator" or "worker" (a label of tessera_build_info). `listen`:
  // "host:port" for the HTTP endpoint (port 0 picks a free one, see port()); empty: no endpoint
  // (the registry still works, for tests). UNAVAILABLE naming --metrics_listen when the address
  // cannot be bound; INVALID_ARGUMENT naming it when it is not host:port.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const std::string& daemon,
                                                         const std::string& listen);
  ~Metrics();

  // The registry to add families to. Lives as long as this object.
  prometheus::Registry& registry();
  // The bound HTTP port; 0 without an endpoint.
  int port() const;

  // Adds a collectable read at every scrape (and by Serialize()), for state read at scrape time
  // (see RegisterShardMetrics). It is kept until this object is destroyed; whatever it reads must
  // outlive that.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);

  // A factory for grpc::ServerBuilder::experimental().SetInterceptorCreators(); its interceptors
  // record the tessera_rpc_* families above. This object must outlive the server. Method labels
  // are bounded: a method declared by a service linked into the binary (generated descriptor
  // pool) or gRPC's health service keeps its full name ("/tessera.v1.ParameterService/PushPull",
  // raw and streaming methods included); any other name is counted as "other". A call counts in
  // tessera_rpc_calls_total when it starts; unless OK, its code is recorded when its status is
  // sent (a call that ends without a status counts as CANCELLED), and so is its latency when the
  // method is unary (ServerRpcInfo::Type::UNARY; streaming calls get no latency sample).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  NewServerInterceptorFactory();

  // The text exposition of everything registered (what GET /metrics returns), for tests and
  // `--check-config`-style dumps.
  std::string Serialize() const;

  class Impl;

 private:
  explicit Metrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Building blocks for the collectables that read a daemon's state at scrape time
// (server/shard_metrics.cc, server/coordinator/coordinator_metrics.cc,
// worker/daemon/worker_metrics.cc). A family with no samples yet.
prometheus::MetricFamily MetricFamilyOf(const std::string& name, const std::string& help,
                                        prometheus::MetricType type);
// Appends a sample with `labels` to `family`: a counter's value for a Counter family, a gauge's
// otherwise (not for histograms).
void AddSample(prometheus::MetricFamily* family, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {});

}  // namespace tessera

#endif  // TESSERA_COMMON_METRICS_H_
