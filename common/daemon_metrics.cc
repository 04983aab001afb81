#include "common/daemon_metrics.h"

#include <memory>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/process.h"
#include "common/reflection_guard.h"
#include "common/security.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace tessera {
namespace {

// tessera_auth_failures_total{reason}: calls refused for their bearer token (AuthFailures()).
class AuthFailuresCollectable final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    const AuthFailureCounts counts = AuthFailures();
    prometheus::MetricFamily family =
        MetricFamilyOf("tessera_auth_failures_total",
                       "Calls refused UNAUTHENTICATED for their bearer token, by reason",
                       prometheus::MetricType::Counter);
    AddSample(&family, static_cast<double>(counts.missing_token), {{"reason", "missing_token"}});
    AddSample(&family, static_cast<double>(counts.bad_token), {{"reason", "bad_token"}});
    return {std::move(family)};
  }
};

}  // namespace

void AddMetricsFlags(CLI::App& app, MetricsFlags* flags, absl::string_view help_prefix) {
  app.add_option("--metrics_listen", flags->listen,
                 absl::StrCat(help_prefix,
                              "host:port of the Prometheus endpoint (GET /metrics, plain HTTP: a "
                              "non-loopback address needs --metrics_insecure); port 0 picks one; "
                              "empty: none"))
      ->capture_default_str();
  app.add_flag("--metrics_insecure", flags->insecure,
               absl::StrCat(help_prefix,
                            "allow the plain-HTTP metrics endpoint on a non-loopback address "
                            "(the gRPC listener keeps its own rule, --insecure)"));
  app.add_option(
         "--metrics_port_file", flags->port_file,
         absl::StrCat(help_prefix, "write the bound metrics port here (atomically); empty: don't"))
      ->capture_default_str();
}

absl::Status ValidateMetricsFlags(const MetricsFlags& flags, bool insecure) {
  if (flags.listen.empty()) {
    if (!flags.port_file.empty()) {
      return absl::InvalidArgumentError("--metrics_port_file: needs --metrics_listen");
    }
    return absl::OkStatus();
  }
  return CheckMetricsListenAddress(flags.listen, insecure || flags.insecure);
}

absl::StatusOr<std::unique_ptr<Metrics>> StartMetrics(const std::string& daemon,
                                                      const MetricsFlags& flags) {
  absl::StatusOr<std::unique_ptr<Metrics>> metrics = Metrics::Create(daemon, flags.listen);
  if (!metrics.ok()) return metrics;
  (*metrics)->AddCollectable(std::make_shared<AuthFailuresCollectable>());
  if (flags.port_file.empty()) return metrics;
  absl::Status written = WritePortFile(flags.port_file, (*metrics)->port());
  if (!written.ok()) {
    return absl::Status(written.code(), absl::StrCat("--metrics_port_file: ", written.message()));
  }
  return metrics;
}

std::function<void(grpc::ServerBuilder&)> RpcMetricsHook(Metrics* metrics) {
  return [metrics](grpc::ServerBuilder& builder) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(NewReflectionGuardFactory());
    creators.push_back(metrics->NewServerInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  };
}

}  // namespace tessera
