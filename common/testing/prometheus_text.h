// Test helpers for the Prometheus text exposition the daemons serve (common/metrics.h): a sample's
// value, a family's presence, a scrape of /metrics over plain HTTP, and `promtool check metrics`.
// Header-only, for the unit tests of every folder and the end-to-end tests; not for production.
#ifndef TESSERA_COMMON_TESTING_PROMETHEUS_TEXT_H_
#define TESSERA_COMMON_TESTING_PROMETHEUS_TEXT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace tessera::prometheus_text {

// The value of the sample line `series` (the name with its labels exactly as exposed:
// "tessera_rpc_calls_total{method=\"/tessera.v1.ParameterService/Push\"}") in `text`, or -1 when
// there is no such line.
inline double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, series)) continue;
    absl::string_view rest = line.substr(series.size());
    if (rest.empty() || rest[0] != ' ') continue;
    double value = 0;
    if (absl::SimpleAtod(rest.substr(1), &value)) return value;
  }
  return -1;
}

// Whether `text` declares the family `family` (a "# TYPE <family> <type>" line).
inline bool HasFamily(const std::string& text, const std::string& family) {
  return absl::StrContains(text, absl::StrCat("# TYPE ", family, " "));
}

// GET `path` from 127.0.0.1:`port` with a plain socket (HTTP/1.1, Connection: close, 5 s
// timeouts): the whole response, status line and headers included; "" when nothing answers.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if (::send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
      char buffer[8192];
      for (int i = 0; i < 10000; ++i) {
        const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
        if (n <= 0) break;
        response.append(buffer, static_cast<size_t>(n));
      }
    }
  }
  ::close(fd);
  return response;
}

// The body of GET /metrics from 127.0.0.1:`port`, or "" when the answer is not 200.
inline std::string Scrape(int port) {
  const std::string response = HttpGet(port, "/metrics");
  const size_t body = response.find("\r\n\r\n");
  if (!absl::StartsWith(response, "HTTP/1.1 200") || body == std::string::npos) return "";
  return response.substr(body + 4);
}

// `promtool check metrics` over `text` (Debian `prometheus`): its exit status, with what it
// printed appended to *output; -1 when /usr/bin/promtool is not installed, -2 when it could not
// be run.
inline int Promtool(const std::string& text, std::string* output) {
  if (::access("/usr/bin/promtool", X_OK) != 0) return -1;
  char path[] = "/tmp/tessera-promtool-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) return -2;
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  int status = -1;
  if (written) {
    FILE* pipe =
        ::popen(absl::StrCat("/usr/bin/promtool check metrics < ", path, " 2>&1").c_str(), "r");
    if (pipe != nullptr) {
      char buffer[4096];
      size_t n;
      while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, n);
      status = ::pclose(pipe);
    }
  }
  ::unlink(path);
  return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -2;
}

}  // namespace tessera::prometheus_text

#endif  // TESSERA_COMMON_TESTING_PROMETHEUS_TEXT_H_
