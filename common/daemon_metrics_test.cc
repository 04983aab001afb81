#include "common/daemon_metrics.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/security.h"
#include "common/testing/prometheus_text.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using prometheus_text::Sample;

TEST(DaemonMetricsTest, AuthFailuresAreExposedByReason) {
  absl::StatusOr<std::unique_ptr<Metrics>> metrics = StartMetrics("server", MetricsFlags{});
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const std::string text = (*metrics)->Serialize();
  const AuthFailureCounts counts = AuthFailures();
  EXPECT_NE(text.find("# TYPE tessera_auth_failures_total counter"), std::string::npos) << text;
  EXPECT_EQ(Sample(text, "tessera_auth_failures_total{reason=\"missing_token\"}"),
            static_cast<double>(counts.missing_token))
      << text;
  EXPECT_EQ(Sample(text, "tessera_auth_failures_total{reason=\"bad_token\"}"),
            static_cast<double>(counts.bad_token))
      << text;
}

}  // namespace
}  // namespace tessera
