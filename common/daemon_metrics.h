// The metrics endpoint of a daemon's main(): its flags, their start-time checks, starting the
// endpoint, and the server hook that installs the per-RPC interceptors (common/metrics.h).
// Shared by tessera-coordinator, tessera-server and tessera-worker.
#ifndef TESSERA_COMMON_DAEMON_METRICS_H_
#define TESSERA_COMMON_DAEMON_METRICS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/metrics.h"
#include "grpcpp/server_builder.h"

namespace CLI {
class App;
}  // namespace CLI

namespace tessera {

struct MetricsFlags {
  std::string listen;     // --metrics_listen; empty: no endpoint
  std::string port_file;  // --metrics_port_file
  // --metrics_insecure: a non-loopback plain-HTTP endpoint is allowed (not the gRPC listener).
  bool insecure = false;
};

// Adds --metrics_listen, --metrics_port_file and --metrics_insecure to `app`, writing into `flags`;
// `help_prefix` starts each help text (the worker's "Daemon: ").
void AddMetricsFlags(CLI::App& app, MetricsFlags* flags, absl::string_view help_prefix = "");

// OK, or why the daemon must not start (exit 78): a non-loopback --metrics_listen without
// --metrics_insecure or `insecure` (the process-wide --insecure; the endpoint is plain HTTP), a
// malformed address, --metrics_port_file without
// --metrics_listen. Binds nothing.
absl::Status ValidateMetricsFlags(const MetricsFlags& flags, bool insecure);

// Metrics::Create(daemon, flags.listen) with tessera_auth_failures_total{reason="missing_token"|
// "bad_token"} (AuthFailures() of common/security.h, read at scrape time) added, then the bound
// port written to flags.port_file when set.
// The errors of Metrics::Create; the port file's error naming --metrics_port_file.
absl::StatusOr<std::unique_ptr<Metrics>> StartMetrics(const std::string& daemon,
                                                      const MetricsFlags& flags);

// A ServerBuilder hook (ShardServerOptions::configure, CoordinatorServerOptions::configure) that
// installs the reflection guard (common/reflection_guard.h) and the per-RPC interceptors of
// `metrics`, which must outlive the server.
std::function<void(grpc::ServerBuilder&)> RpcMetricsHook(Metrics* metrics);

}  // namespace tessera

#endif  // TESSERA_COMMON_DAEMON_METRICS_H_
