#include "tests/faults/tcp_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera {
namespace faults {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Closes with an RST instead of a FIN.
void Reset(int fd) {
  if (fd < 0) return;
  linger l{};
  l.l_onoff = 1;
  l.l_linger = 0;
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

}  // namespace

struct TcpProxy::Connection {
  struct Chunk {
    std::string data;
    size_t offset = 0;
    absl::Time due;
  };
  // One direction: what was read from `from` and waits to be written to `to`.
  struct Direction {
    std::deque<Chunk> queue;
    int64_t queued_bytes = 0;
    bool eof = false;        // `from` sent FIN
    bool shut_down = false;  // FIN passed on to `to`
    bool Due(absl::Time now) const { return !queue.empty() && queue.front().due <= now; }
    bool Done() const { return eof && queue.empty() && shut_down; }
  };
  int client_fd = -1;
  int target_fd = -1;
  bool connecting = true;
  Direction up;    // client -> target
  Direction down;  // target -> client
  bool dead = false;
  bool cut = false;  // reset (both sides) at the end of this pass
};

absl::StatusOr<std::unique_ptr<TcpProxy>> TcpProxy::Start(const Options& options) {
  in_addr target{};
  if (inet_pton(AF_INET, options.target_host.c_str(), &target) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_host: '", options.target_host, "' is not an IPv4 address"));
  }
  if (options.target_port <= 0 || options.target_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_port: ", options.target_port, " is not in [1, 65535]"));
  }
  if (options.max_buffered_bytes <= 0 || options.chunk_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_buffered_bytes and chunk_bytes must be positive, got ",
                     options.max_buffered_bytes, " and ", options.chunk_bytes));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 128) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    absl::Status s = Errno("bind/listen on 127.0.0.1:0");
    close(fd);
    return s;
  }
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC) != 0) {
    absl::Status s = Errno("pipe2");
    close(fd);
    return s;
  }
  std::unique_ptr<TcpProxy> proxy(
      new TcpProxy(options, fd, pipe_fds[0], pipe_fds[1], ntohs(addr.sin_port)));
  proxy->thread_ = std::thread([p = proxy.get()] { p->Run(); });
  return proxy;
}

TcpProxy::TcpProxy(const Options& options, int listen_fd, int wake_read_fd, int wake_write_fd,
                   int port)
    : options_(options),
      listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port) {}

TcpProxy::~TcpProxy() {
  Stop();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

std::string TcpProxy::address() const { return absl::StrCat("127.0.0.1:", port_); }

void TcpProxy::Wake() const {
  const char byte = 1;
  // A full pipe already holds a wake-up.
  [[maybe_unused]] ssize_t n = write(wake_write_fd_, &byte, 1);
}

void TcpProxy::SetRateLimit(int64_t bytes_per_second) {
  {
    absl::MutexLock lock(&mu_);
    rate_bytes_per_second_ = std::max<int64_t>(bytes_per_second, 0);
  }
  Wake();
}

void TcpProxy::SetLatency(absl::Duration latency) {
  {
    absl::MutexLock lock(&mu_);
    latency_ = std::max(latency, absl::ZeroDuration());
  }
  Wake();
}

void TcpProxy::SetCutProbability(double p) {
  {
    absl::MutexLock lock(&mu_);
    cut_probability_ = std::clamp(p, 0.0, 1.0);
  }
  Wake();
}

void TcpProxy::SetBlackhole(bool on) {
  {
    absl::MutexLock lock(&mu_);
    blackhole_ = on;
  }
  Wake();
}

void TcpProxy::SetRefuseNewConnections(bool on) {
  {
    absl::MutexLock lock(&mu_);
    refuse_ = on;
  }
  Wake();
}

int TcpProxy::CutAll() {
  uint64_t mine;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_ || stopping_) return 0;
    mine = ++cut_requests_;
  }
  Wake();
  struct Wait {
    const TcpProxy* proxy;
    uint64_t mine;
  } wait{this, mine};
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return w->proxy->cut_done_ >= w->mine || w->proxy->stopped_;
      },
      &wait));
  return cut_done_ >= mine ? last_cut_count_ : 0;
}

TcpProxy::Counters TcpProxy::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

void TcpProxy::Stop() {
  absl::MutexLock join_lock(&join_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
}

void TcpProxy::Run() {
  std::list<Connection> conns;
  std::mt19937_64 rng(options_.seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<char> buffer(options_.chunk_bytes);
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_port = htons(static_cast<uint16_t>(options_.target_port));
  inet_pton(AF_INET, options_.target_host.c_str(), &target.sin_addr);

  // When each direction's emulated link is next free (SetRateLimit).
  absl::Time link_free_up = absl::InfinitePast();
  absl::Time link_free_down = absl::InfinitePast();
  for (;;) {
    absl::Duration latency;
    int64_t rate = 0;
    double cut_p;
    bool blackhole, refuse;
    Counters delta;
    uint64_t cut_request = 0;  // the CutAll() calls this pass carries out
    int cut_count = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      latency = latency_;
      cut_p = cut_probability_;
      blackhole = blackhole_;
      refuse = refuse_;
      if (cut_done_ < cut_requests_) {
        for (Connection& c : conns) {
          if (!c.dead) {
            c.cut = true;
            ++cut_count;
          }
        }
        cut_request = cut_requests_;
        counters_.cuts += cut_count;
      }
    }

    // Sockets to watch, and the soonest due chunk that is not due yet.
    const absl::Time now = absl::Now();
    std::vector<pollfd> fds;
    fds.push_back({wake_read_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, static_cast<int16_t>(blackhole ? 0 : POLLIN), 0});
    absl::Time next_due = absl::InfiniteFuture();
    for (Connection& c : conns) {
      int16_t client_events = 0, target_events = 0;
      if (c.connecting) {
        target_events = POLLOUT;
      } else if (!blackhole && !c.cut) {
        if (!c.up.eof && c.up.queued_bytes < options_.max_buffered_bytes) client_events |= POLLIN;
        if (!c.down.eof && c.down.queued_bytes < options_.max_buffered_bytes) {
          target_events |= POLLIN;
        }
        if (c.down.Due(now)) client_events |= POLLOUT;
        if (c.up.Due(now)) target_events |= POLLOUT;
        for (const Connection::Direction* d : {&c.up, &c.down}) {
          if (!d->queue.empty() && d->queue.front().due > now) {
            next_due = std::min(next_due, d->queue.front().due);
          }
        }
      }
      // A socket with nothing to wait for is left out (poll ignores negative fds), so that a
      // hung-up peer does not wake the loop over and over.
      fds.push_back({client_events != 0 ? c.client_fd : -1, client_events, 0});
      fds.push_back({target_events != 0 ? c.target_fd : -1, target_events, 0});
    }
    // To the microsecond (ppoll): with poll's whole milliseconds a chunk of 64 KiB, which takes
    // 0.5 ms on an emulated 1 Gbit/s link, would leave up to a millisecond late.
    timespec timeout{};
    timespec* timeout_or_none = nullptr;
    if (next_due != absl::InfiniteFuture()) {
      timeout = absl::ToTimespec(
          absl::Ceil(std::max(next_due - now, absl::ZeroDuration()), absl::Microseconds(1)));
      timeout_or_none = &timeout;
    }
    // A cut request is carried out right away, below. One that found no connection to cut must
    // not wait either: with no traffic left, poll would block and CutAll() would never return.
    bool any_cut = cut_request != 0;
    for (const Connection& c : conns) any_cut |= c.cut;
    if (any_cut) {
      timeout = timespec{};
      timeout_or_none = &timeout;
    }
    if (ppoll(fds.data(), fds.size(), timeout_or_none, nullptr) < 0 && errno != EINTR) break;

    if (fds[0].revents & POLLIN) {
      char drain[256];
      while (read(wake_read_fd_, drain, sizeof(drain)) > 0) {
      }
    }
    // Settings changed while the loop waited apply to what it reads and writes now.
    {
      absl::MutexLock lock(&mu_);
      latency = latency_;
      rate = rate_bytes_per_second_;
      cut_p = cut_probability_;
      blackhole = blackhole_;
      refuse = refuse_;
    }
    const absl::Time after = absl::Now();

    // Reads one chunk from `fd` into `d`; false when the connection must be reset.
    // Under a rate limit a chunk is sent over its direction's link after the chunks before it, of
    // every connection, and arrives `latency` after its last byte went out.
    auto read_into = [&](int fd, Connection::Direction& d, absl::Time* link_free) {
      const ssize_t n = recv(fd, buffer.data(), buffer.size(), 0);
      if (n > 0) {
        absl::Time sent = after;
        if (rate > 0) {
          *link_free = std::max(*link_free, after) +
                       absl::Seconds(static_cast<double>(n) / static_cast<double>(rate));
          sent = *link_free;
        }
        d.queue.push_back({std::string(buffer.data(), n), 0, sent + latency});
        d.queued_bytes += n;
        return true;
      }
      if (n == 0) {
        d.eof = true;
        return true;
      }
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    };
    // Writes the due chunks of `d` to `fd`; false when the connection must be reset.
    auto write_from = [&](int fd, Connection::Direction& d, Connection& c, bool to_target) {
      while (d.Due(after)) {
        Connection::Chunk& chunk = d.queue.front();
        const ssize_t n = send(fd, chunk.data.data() + chunk.offset,
                               chunk.data.size() - chunk.offset, MSG_NOSIGNAL);
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        chunk.offset += n;
        d.queued_bytes -= n;
        (to_target ? delta.bytes_to_target : delta.bytes_to_client) += n;
        if (chunk.offset < chunk.data.size()) return true;
        d.queue.pop_front();
        ++delta.chunks;
        if (cut_p > 0 && unit(rng) < cut_p) {
          c.cut = true;
          ++delta.cuts;
          ++delta.random_cuts;
          return true;
        }
      }
      return true;
    };

    size_t i = 2;
    for (Connection& c : conns) {
      const int16_t client_rev = fds[i++].revents;
      const int16_t target_rev = fds[i++].revents;
      if (c.cut) continue;
      if (blackhole && !c.connecting) continue;
      if (c.connecting) {
        if (target_rev == 0) continue;
        int err = 0;
        socklen_t len = sizeof(err);
        if (getsockopt(c.target_fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
          ++delta.target_failures;
          c.cut = true;
          continue;
        }
        c.connecting = false;
        continue;
      }
      bool ok = true;
      if (client_rev & (POLLIN | POLLHUP | POLLERR)) {
        ok = ok && read_into(c.client_fd, c.up, &link_free_up);
      }
      if (target_rev & (POLLIN | POLLHUP | POLLERR)) {
        ok = ok && read_into(c.target_fd, c.down, &link_free_down);
      }
      if (ok && (target_rev & (POLLOUT | POLLERR))) ok = write_from(c.target_fd, c.up, c, true);
      if (ok && !c.cut && (client_rev & (POLLOUT | POLLERR))) {
        ok = write_from(c.client_fd, c.down, c, false);
      }
      if (!ok) {
        c.cut = true;  // a peer reset: pass the reset on
        continue;
      }
      // Pass a FIN on once everything before it is written.
      if (c.up.eof && c.up.queue.empty() && !c.up.shut_down) {
        shutdown(c.target_fd, SHUT_WR);
        c.up.shut_down = true;
      }
      if (c.down.eof && c.down.queue.empty() && !c.down.shut_down) {
        shutdown(c.client_fd, SHUT_WR);
        c.down.shut_down = true;
      }
      if (c.up.Done() && c.down.Done()) {
        close(c.client_fd);
        close(c.target_fd);
        c.dead = true;
      }
    }
    // Sockets to reset once the counters say so (a peer that sees the RST may read them).
    std::vector<int> to_reset;
    for (Connection& c : conns) {
      if (c.cut && !c.dead) {
        to_reset.push_back(c.client_fd);
        to_reset.push_back(c.target_fd);
        c.dead = true;
      }
    }
    conns.remove_if([](const Connection& c) { return c.dead; });

    // New connections.
    if (!blackhole && (fds[1].revents & POLLIN)) {
      for (;;) {
        const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (client < 0) break;
        if (refuse) {
          to_reset.push_back(client);
          ++delta.refused;
          continue;
        }
        const int t = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        const int one = 1;
        setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        if (t >= 0) setsockopt(t, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        const int rc =
            t < 0 ? -1 : connect(t, reinterpret_cast<sockaddr*>(&target), sizeof(target));
        if (t < 0 || (rc != 0 && errno != EINPROGRESS)) {
          ++delta.target_failures;
          to_reset.push_back(client);
          if (t >= 0) close(t);
          continue;
        }
        Connection& c = conns.emplace_back();
        c.client_fd = client;
        c.target_fd = t;
        c.connecting = rc != 0;
        ++delta.connections;
      }
    }

    {
      absl::MutexLock lock(&mu_);
      counters_.bytes_to_target += delta.bytes_to_target;
      counters_.bytes_to_client += delta.bytes_to_client;
      counters_.chunks += delta.chunks;
      counters_.connections += delta.connections;
      counters_.refused += delta.refused;
      counters_.target_failures += delta.target_failures;
      counters_.cuts += delta.cuts;
      counters_.random_cuts += delta.random_cuts;
      counters_.open = static_cast<int64_t>(conns.size());
    }
    for (int fd : to_reset) Reset(fd);
    if (cut_request != 0) {
      absl::MutexLock lock(&mu_);
      cut_done_ = cut_request;
      last_cut_count_ = cut_count;
    }
  }

  for (Connection& c : conns) {
    Reset(c.client_fd);
    Reset(c.target_fd);
  }
  absl::MutexLock lock(&mu_);
  counters_.open = 0;
  stopped_ = true;
}

}  // namespace faults
}  // namespace tessera
