// A datagram socket standing in for systemd's NOTIFY_SOCKET in tests (common/systemd.h): bind it,
// hand its path to the daemon as NOTIFY_SOCKET, and read the READY=1, STOPPING=1 and WATCHDOG=1
// messages it sends. Header-only, for tests; not thread-safe.
#ifndef TESSERA_COMMON_TESTING_NOTIFY_SOCKET_H_
#define TESSERA_COMMON_TESTING_NOTIFY_SOCKET_H_

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera {

class NotifySocket {
 public:
  // Binds a socket at `path` (which must not exist); see bound().
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    path_.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    bound_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    timeval tv{0, 50 * 1000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~NotifySocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  NotifySocket(const NotifySocket&) = delete;
  NotifySocket& operator=(const NotifySocket&) = delete;

  bool bound() const { return bound_; }
  const std::string& path() const { return path_; }

  // The next message; "" when none arrives before `timeout`.
  std::string Receive(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n > 0) return std::string(buf, n);
    }
    return "";
  }

  // Receives until a message starting with `prefix` arrives; counts the WATCHDOG=1 messages
  // seen on the way. False after `timeout`.
  bool ReceiveUntil(const std::string& prefix, absl::Duration timeout, int* watchdogs = nullptr) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const std::string message = Receive(deadline - absl::Now());
      if (absl::StartsWith(message, prefix)) return true;
      if (message == "WATCHDOG=1" && watchdogs != nullptr) ++*watchdogs;
    }
    return false;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_TESTING_NOTIFY_SOCKET_H_
