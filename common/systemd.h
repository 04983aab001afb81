// systemd service notification (sd_notify, Type=notify units; issue #5).
//
// Every function is a no-op when NOTIFY_SOCKET is unset (the daemon was not started by systemd
// or a test acting like it), so daemons call them unconditionally.
//   READY=1      once the gRPC port answers RPCs (health SERVING) and state is loaded;
//   STOPPING=1   when draining starts (SIGTERM/SIGINT);
//   WATCHDOG=1   every WATCHDOG_USEC/2 while the unit sets WatchdogSec and the daemon's liveness
//                probe passes (SystemdWatchdog).
#ifndef TESSERA_COMMON_SYSTEMD_H_
#define TESSERA_COMMON_SYSTEMD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace tessera::systemd {

// Sends "READY=1" with "STATUS=<status>" (when not empty). Returns whether a message was sent
// (false without NOTIFY_SOCKET or when sending failed). Thread-safe; does not block for long.
bool NotifyReady(absl::string_view status);
// Sends "STOPPING=1" with an optional status. Same contract as NotifyReady.
bool NotifyStopping(absl::string_view status = "");
// Sends "STATUS=<text>". Same contract as NotifyReady.
bool NotifyStatus(absl::string_view text);

// Sends WATCHDOG=1 every WATCHDOG_USEC/2 from its own thread when sd_watchdog_enabled() says the
// service manager expects it (WATCHDOG_USEC set, and WATCHDOG_PID unset or this process). With a
// probe, each ping goes only when the probe answers OK: a daemon whose work has stopped (a
// deadlock, a loop that no longer turns) then misses its pings and systemd restarts it, where a
// ping from this thread alone would keep a hung daemon alive. A failing probe is logged once per
// failing streak, with its message.
// Life cycle: constructed idle -> Start() (kRunning when enabled) -> Stop() or destructor joins.
// Not thread-safe: call Start() and Stop() from one thread.
class SystemdWatchdog {
 public:
  SystemdWatchdog() = default;
  ~SystemdWatchdog();  // Stop()
  SystemdWatchdog(const SystemdWatchdog&) = delete;
  SystemdWatchdog& operator=(const SystemdWatchdog&) = delete;

  // Starts the thread when the watchdog is enabled; returns whether it did. Call once. `probe`
  // (may be empty) runs on the watchdog's thread before each ping and should return within
  // interval() / 2.
  bool Start(std::function<absl::Status()> probe = nullptr);
  // Joins the thread; idempotent.
  void Stop();
  // The interval between pings (zero when not running).
  absl::Duration interval() const { return interval_; }

 private:
  absl::Duration interval_ = absl::ZeroDuration();
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace tessera::systemd

#endif  // TESSERA_COMMON_SYSTEMD_H_
