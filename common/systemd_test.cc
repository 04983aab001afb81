#include "common/systemd.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/process.h"
#include "gtest/gtest.h"

namespace tessera::systemd {
namespace {

// A datagram socket standing in for the service manager's NOTIFY_SOCKET.
class NotifySocket {
 public:
  NotifySocket() {
    path_ = "/tmp/tessera-notify-" + std::to_string(::getpid());
    ::unlink(path_.c_str());
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    path_.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  }
  ~NotifySocket() {
    ::unsetenv("NOTIFY_SOCKET");
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  // The next message, or "" after a second without one.
  std::string Receive() {
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, n) : "";
  }

 private:
  std::string path_;
  int fd_ = -1;
};

TEST(SystemdTest, NoSocketIsANoOp) {
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_FALSE(NotifyReady("serving"));
  EXPECT_FALSE(NotifyStopping());
  SystemdWatchdog watchdog;
  EXPECT_FALSE(watchdog.Start());
}

TEST(SystemdTest, ReadyStoppingAndStatusArrive) {
  NotifySocket socket;
  ASSERT_TRUE(NotifyReady("serving on 127.0.0.1:1"));
  EXPECT_EQ(socket.Receive(), "READY=1\nSTATUS=serving on 127.0.0.1:1");
  ASSERT_TRUE(NotifyStatus("busy"));
  EXPECT_EQ(socket.Receive(), "STATUS=busy");
  ASSERT_TRUE(NotifyStopping());
  EXPECT_EQ(socket.Receive(), "STOPPING=1");
}

TEST(SystemdTest, WatchdogPingsEveryHalfInterval) {
  NotifySocket socket;
  ::setenv("WATCHDOG_USEC", "100000", 1);
  SystemdWatchdog watchdog;
  ASSERT_TRUE(watchdog.Start());
  EXPECT_EQ(watchdog.interval(), absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  int pings = 0;
  while (pings < 5 && absl::Now() - start < absl::Seconds(5)) {
    if (socket.Receive() == "WATCHDOG=1") ++pings;
  }
  const absl::Duration took = absl::Now() - start;
  watchdog.Stop();
  ::unsetenv("WATCHDOG_USEC");
  EXPECT_EQ(pings, 5);
  // The first ping goes at once, the next four 50 ms apart.
  EXPECT_GE(took, absl::Milliseconds(150));
  EXPECT_LT(took, absl::Seconds(2));
}

// While the probe fails nothing is sent; once it passes the pings come back.
TEST(SystemdTest, WatchdogPingsOnlyWhileTheProbePasses) {
  NotifySocket socket;
  ::setenv("WATCHDOG_USEC", "100000", 1);
  std::atomic<bool> live{false};
  std::atomic<int> probes{0};
  SystemdWatchdog watchdog;
  ASSERT_TRUE(watchdog.Start([&]() -> absl::Status {
    ++probes;
    return live ? absl::OkStatus() : absl::DeadlineExceededError("the loop has stopped");
  }));
  // A second without a message (Receive() gives up after one) while the probe ran ~20 times.
  EXPECT_EQ(socket.Receive(), "");
  EXPECT_GE(probes.load(), 5);
  live = true;
  int pings = 0;
  const absl::Time start = absl::Now();
  while (pings < 3 && absl::Now() - start < absl::Seconds(5)) {
    if (socket.Receive() == "WATCHDOG=1") ++pings;
  }
  live = false;
  watchdog.Stop();
  ::unsetenv("WATCHDOG_USEC");
  EXPECT_EQ(pings, 3);
}

TEST(SystemdTest, MutexRespondsUnlessHeld) {
  // Lives as long as the process, as MutexResponds requires (its helper may outlast a timeout).
  static absl::Mutex* const mu = new absl::Mutex;
  EXPECT_TRUE(tessera::MutexResponds(mu, absl::Seconds(2), "the store lock").ok());
  {
    absl::ReaderMutexLock shared(mu);  // readers do not block the probe
    EXPECT_TRUE(tessera::MutexResponds(mu, absl::Seconds(2), "the store lock").ok());
  }
  // A thread waiting on a condition (as daemon loops do) does not block it either.
  absl::Notification stop;
  std::thread waiter([&] {
    absl::MutexLock lock(mu);
    mu->AwaitWithTimeout(absl::Condition(&stop, &absl::Notification::HasBeenNotified),
                         absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(tessera::MutexResponds(mu, absl::Seconds(2), "the store lock").ok());
  stop.Notify();
  waiter.join();
  mu->Lock();
  const absl::Time start = absl::Now();
  const absl::Status held = tessera::MutexResponds(mu, absl::Milliseconds(100), "the store lock");
  const absl::Duration took = absl::Now() - start;
  // Its helper still waits on the lock, and is done soon after the lock is free.
  EXPECT_FALSE(tessera::WaitForMutexProbes(absl::Milliseconds(50)));
  mu->Unlock();
  EXPECT_TRUE(tessera::WaitForMutexProbes(absl::Seconds(5)));
  EXPECT_EQ(held.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(held.message(), "the store lock has been held for more than"))
      << held;
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_TRUE(tessera::MutexResponds(mu, absl::Seconds(2), "the store lock").ok());
}

TEST(SystemdTest, WatchdogOffWithoutWatchdogUsec) {
  NotifySocket socket;
  ::unsetenv("WATCHDOG_USEC");
  SystemdWatchdog watchdog;
  EXPECT_FALSE(watchdog.Start());
}

}  // namespace
}  // namespace tessera::systemd
