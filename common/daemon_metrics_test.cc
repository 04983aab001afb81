#include "common/daemon_metrics.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/security.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// The value of the sample line that starts with `series` ("name{labels}"), or -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  const std::string prefix = series + " ";
  size_t at = text.find("\n" + prefix);
  if (at == std::string::npos) return -1;
  at += 1 + prefix.size();
  return std::stod(text.substr(at, text.find('\n', at) - at));
}

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
