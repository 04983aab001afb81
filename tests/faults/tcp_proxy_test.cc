// TcpProxy against a plain echo server on loopback: forwarding, latency, cuts, blackhole, refusal,
// an absent target and Stop() with open connections. Every socket read has a timeout, so no case
// can hang.
#include "tests/faults/tcp_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace faults {
namespace {

int ListenLoopback(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 16) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

// Echoes every byte back on each accepted connection, one thread per connection.
class EchoServer {
 public:
  EchoServer() {
    listen_fd_ = ListenLoopback(&port_);
    accept_thread_ = std::thread([this] {
      for (;;) {
        const int fd = accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) return;  // shutdown() of the listener
        absl::MutexLock lock(&mu_);
        fds_.push_back(fd);
        threads_.emplace_back([fd] {
          char buf[16384];
          for (;;) {
            const ssize_t n = recv(fd, buf, sizeof(buf), 0);
            if (n <= 0) return;
            for (ssize_t off = 0; off < n;) {
              const ssize_t w = send(fd, buf + off, n - off, MSG_NOSIGNAL);
              if (w <= 0) return;
              off += w;
            }
          }
        });
      }
    });
  }
  ~EchoServer() {
    shutdown(listen_fd_, SHUT_RDWR);
    accept_thread_.join();
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    for (std::thread& t : threads_) t.join();
    for (int fd : fds_) close(fd);
    close(listen_fd_);
  }
  int port() const { return port_; }

 private:
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread accept_thread_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// A blocking client socket with a receive timeout; -1 on failure.
int Connect(int port, absl::Duration recv_timeout = absl::Seconds(5)) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  timeval tv = absl::ToTimeval(recv_timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  for (size_t off = 0; off < data.size();) {
    const ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += n;
  }
  return true;
}

// Reads exactly n bytes; what was read before an error, EOF or the receive timeout otherwise.
// `error` gets errno (0 on EOF or success).
std::string RecvN(int fd, size_t n, int* error = nullptr) {
  std::string out;
  char buf[16384];
  if (error != nullptr) *error = 0;
  while (out.size() < n) {
    const ssize_t r = recv(fd, buf, std::min(sizeof(buf), n - out.size()), 0);
    if (r < 0 && error != nullptr) *error = errno;
    if (r <= 0) break;
    out.append(buf, r);
  }
  return out;
}

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + i / 977) & 0xff);
  return s;
}

std::unique_ptr<TcpProxy> StartProxy(int target_port, uint64_t seed = 1) {
  TcpProxy::Options o;
  o.target_port = target_port;
  o.seed = seed;
  o.max_buffered_bytes = 256 << 10;  // smaller than the transfer below: the bound is exercised
  auto proxy = TcpProxy::Start(o);
  EXPECT_TRUE(proxy.ok()) << proxy.status();
  return proxy.ok() ? *std::move(proxy) : nullptr;
}

TEST(TcpProxyTest, ForwardsBothWaysAndCounts) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  const std::string data = Pattern(3 << 20);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);
  // Writer and reader at once: the echo would otherwise stall on full buffers.
  std::thread writer([&] { EXPECT_TRUE(SendAll(fd, data)); });
  const std::string back = RecvN(fd, data.size());
  writer.join();
  EXPECT_TRUE(back == data) << "echoed " << back.size() << " of " << data.size() << " bytes";
  close(fd);
  const TcpProxy::Counters c = proxy->counters();
  EXPECT_EQ(c.bytes_to_target, static_cast<int64_t>(data.size()));
  EXPECT_EQ(c.bytes_to_client, static_cast<int64_t>(data.size()));
  EXPECT_EQ(c.connections, 1);
  EXPECT_EQ(c.cuts, 0);
  EXPECT_GT(c.chunks, 1);
}

TEST(TcpProxyTest, LatencyHoldsEveryChunk) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "warm"));
  ASSERT_EQ(RecvN(fd, 4), "warm");
  proxy->SetLatency(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  ASSERT_TRUE(SendAll(fd, "ping"));
  EXPECT_EQ(RecvN(fd, 4), "ping");
  // Held once on the way there and once on the way back.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  proxy->SetLatency(absl::ZeroDuration());
  const absl::Time again = absl::Now();
  ASSERT_TRUE(SendAll(fd, "pong"));
  EXPECT_EQ(RecvN(fd, 4), "pong");
  EXPECT_LT(absl::Now() - again, absl::Milliseconds(100));
  close(fd);
}

// Two connections echo 1 MiB each through a link of 8 MiB/s per direction: 2 MiB cross each
// direction, so the whole takes at least 0.25 s (0.125 s if each connection had a link of its
// own), and everything arrives intact.
TEST(TcpProxyTest, RateLimitIsOneLinkSharedByEveryConnection) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  constexpr int64_t kRate = 8 << 20;
  proxy->SetRateLimit(kRate);
  const std::string data = Pattern(1 << 20);
  const absl::Time start = absl::Now();
  std::vector<std::thread> clients;
  std::atomic<int> intact{0};
  for (int k = 0; k < 2; ++k) {
    clients.emplace_back([&] {
      const int fd = Connect(proxy->port());
      if (fd < 0) return;
      std::thread writer([&] { SendAll(fd, data); });
      const std::string back = RecvN(fd, data.size());
      writer.join();
      close(fd);
      if (back == data) intact.fetch_add(1);
    });
  }
  for (std::thread& t : clients) t.join();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(intact.load(), 2);
  EXPECT_GE(took, absl::Seconds(2.0 * data.size() / kRate)) << took;
  EXPECT_LT(took, absl::Seconds(5)) << took;
  EXPECT_EQ(proxy->counters().bytes_to_target, 2 * static_cast<int64_t>(data.size()));

  // Lifted: the same transfer on one connection is no longer held to the link's pace.
  proxy->SetRateLimit(0);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);
  const absl::Time again = absl::Now();
  std::thread writer([&] { EXPECT_TRUE(SendAll(fd, data)); });
  EXPECT_TRUE(RecvN(fd, data.size()) == data);
  writer.join();
  close(fd);
  EXPECT_LT(absl::Now() - again, absl::Seconds(1.0 * data.size() / kRate));
}

TEST(TcpProxyTest, CutAllResetsOpenConnectionsAndNewOnesWork) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  const int a = Connect(proxy->port());
  const int b = Connect(proxy->port());
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  for (int fd : {a, b}) {
    ASSERT_TRUE(SendAll(fd, "x"));
    ASSERT_EQ(RecvN(fd, 1), "x");
  }
  EXPECT_EQ(proxy->CutAll(), 2);
  for (int fd : {a, b}) {
    int error = 0;
    EXPECT_EQ(RecvN(fd, 1, &error), "");
    EXPECT_EQ(error, ECONNRESET) << "an RST, not a FIN";
    close(fd);
  }
  const int c = Connect(proxy->port());
  ASSERT_GE(c, 0);
  ASSERT_TRUE(SendAll(c, "after"));
  EXPECT_EQ(RecvN(c, 5), "after");
  close(c);
  EXPECT_EQ(proxy->counters().cuts, 2);
  EXPECT_EQ(proxy->counters().connections, 3);
}

// With no connection open and no traffic coming, a cut has nothing to wait for: it returns 0 at
// once. A setting changed just before it (one wake-up of the proxy's loop for both) made the loop
// take the cut on its next pass and then wait for traffic that never came.
TEST(TcpProxyTest, CutAllWithNoConnectionReturnsAtOnce) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  constexpr int kCuts = 200;
  auto cut_sum = std::make_shared<std::atomic<int>>(0);
  auto cuts_done = std::make_shared<std::atomic<int>>(0);
  auto done = std::make_shared<absl::Notification>();
  std::thread([p = proxy.get(), cut_sum, cuts_done, done] {
    for (int i = 0; i < kCuts; ++i) {
      p->SetRefuseNewConnections(i % 2 == 0);
      cut_sum->fetch_add(p->CutAll());
      cuts_done->fetch_add(1);
    }
    done->Notify();
  }).detach();
  const bool returned = done->WaitForNotificationWithTimeout(absl::Seconds(10));
  const int returned_before_stop = cuts_done->load();
  // Stop() wakes a CutAll() that is stuck, so that the thread ends before the proxy goes; the
  // later calls then return 0 at once.
  if (!returned) proxy->Stop();
  done->WaitForNotification();
  EXPECT_TRUE(returned) << "a CutAll() with no connection waited for traffic, after "
                        << returned_before_stop << " of " << kCuts << " returned";
  EXPECT_EQ(cut_sum->load(), 0);
  EXPECT_EQ(proxy->counters().cuts, 0);
}

TEST(TcpProxyTest, CutProbabilityOneCutsAfterTheFirstChunk) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  proxy->SetCutProbability(1.0);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "hello"));
  int error = 0;
  EXPECT_EQ(RecvN(fd, 5, &error), "");
  EXPECT_EQ(error, ECONNRESET);
  close(fd);
  const TcpProxy::Counters c = proxy->counters();
  EXPECT_EQ(c.random_cuts, 1);
  EXPECT_EQ(c.cuts, 1);
  EXPECT_EQ(c.chunks, 1);
}

TEST(TcpProxyTest, RandomCutsFollowTheProbability) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port(), /*seed=*/42);
  ASSERT_NE(proxy, nullptr);
  proxy->SetCutProbability(0.25);
  // Each connection sends one byte at a time until it is cut: about 1/0.25 chunks (both ways)
  // per connection, bounded.
  int connections = 0;
  for (; connections < 40; ++connections) {
    const int fd = Connect(proxy->port());
    ASSERT_GE(fd, 0);
    for (int i = 0; i < 100; ++i) {
      if (!SendAll(fd, "z") || RecvN(fd, 1) != "z") break;
    }
    close(fd);
  }
  const TcpProxy::Counters c = proxy->counters();
  EXPECT_EQ(c.random_cuts, connections);
  // Expected chunks per cut: 4; anything in [2, 8] on average is fine for 40 draws.
  EXPECT_GE(c.chunks, 2 * connections);
  EXPECT_LE(c.chunks, 8 * connections);
}

TEST(TcpProxyTest, BlackholeHoldsEverythingUntilHealed) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  const int fd = Connect(proxy->port(), absl::Milliseconds(300));
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "a"));
  ASSERT_EQ(RecvN(fd, 1), "a");
  proxy->SetBlackhole(true);
  ASSERT_TRUE(SendAll(fd, "partitioned"));
  int error = 0;
  EXPECT_EQ(RecvN(fd, 11, &error), "");
  EXPECT_EQ(error, EAGAIN) << "a timeout, the socket stays open";
  const int64_t forwarded = proxy->counters().bytes_to_target;
  EXPECT_EQ(forwarded, 1);
  proxy->SetBlackhole(false);
  EXPECT_EQ(RecvN(fd, 11), "partitioned") << "held bytes flow once healed";
  close(fd);
  EXPECT_EQ(proxy->counters().cuts, 0);
}

TEST(TcpProxyTest, RefusedConnectionsAreResetAndLaterOnesServed) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  proxy->SetRefuseNewConnections(true);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);  // the kernel completes the handshake; the proxy then resets it
  // Only read: a send that meets the reset would take the socket's pending ECONNRESET itself,
  // and the read after it would see a plain EOF.
  int error = 0;
  EXPECT_EQ(RecvN(fd, 1, &error), "");
  EXPECT_EQ(error, ECONNRESET);
  close(fd);
  EXPECT_EQ(proxy->counters().refused, 1);
  proxy->SetRefuseNewConnections(false);
  const int ok = Connect(proxy->port());
  ASSERT_GE(ok, 0);
  ASSERT_TRUE(SendAll(ok, "y"));
  EXPECT_EQ(RecvN(ok, 1), "y");
  close(ok);
}

TEST(TcpProxyTest, AbsentTargetResetsTheClient) {
  int port = 0;
  const int l = ListenLoopback(&port);
  ASSERT_GE(l, 0);
  close(l);  // nothing listens on `port` now
  auto proxy = StartProxy(port);
  ASSERT_NE(proxy, nullptr);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);
  int error = 0;
  EXPECT_EQ(RecvN(fd, 1, &error), "");
  EXPECT_EQ(error, ECONNRESET);
  close(fd);
  EXPECT_EQ(proxy->counters().target_failures, 1);
}

TEST(TcpProxyTest, StopClosesOpenConnectionsAndIsIdempotent) {
  EchoServer echo;
  auto proxy = StartProxy(echo.port());
  ASSERT_NE(proxy, nullptr);
  const int fd = Connect(proxy->port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "q"));
  ASSERT_EQ(RecvN(fd, 1), "q");
  EXPECT_EQ(proxy->counters().open, 1);
  proxy->Stop();
  proxy->Stop();
  EXPECT_EQ(proxy->CutAll(), 0);
  int error = 0;
  EXPECT_EQ(RecvN(fd, 1, &error), "");
  EXPECT_EQ(error, ECONNRESET);
  close(fd);
  EXPECT_EQ(proxy->counters().open, 0);
}

TEST(TcpProxyTest, RejectsBadOptions) {
  TcpProxy::Options o;
  o.target_port = 0;
  EXPECT_EQ(TcpProxy::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.target_port = 1;
  o.target_host = "localhost";
  EXPECT_EQ(TcpProxy::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.target_host = "127.0.0.1";
  o.max_buffered_bytes = 0;
  EXPECT_EQ(TcpProxy::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace faults
}  // namespace tessera
