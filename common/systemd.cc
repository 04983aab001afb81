#include "common/systemd.h"

#include <systemd/sd-daemon.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/process.h"
#include "spdlog/spdlog.h"

namespace tessera::systemd {
namespace {

bool Notify(const std::string& state) {
  if (std::getenv("NOTIFY_SOCKET") == nullptr) return false;
  const int r = sd_notify(/*unset_environment=*/0, state.c_str());
  if (r < 0) spdlog::warn("sd_notify({}) failed: error {}", state, -r);
  return r > 0;
}

std::string WithStatus(std::string state, absl::string_view status) {
  if (!status.empty()) absl::StrAppend(&state, "\nSTATUS=", status);
  return state;
}

}  // namespace

bool NotifyReady(absl::string_view status) { return Notify(WithStatus("READY=1", status)); }

bool NotifyStopping(absl::string_view status) { return Notify(WithStatus("STOPPING=1", status)); }

bool NotifyStatus(absl::string_view text) { return Notify(absl::StrCat("STATUS=", text)); }

SystemdWatchdog::~SystemdWatchdog() { Stop(); }

bool SystemdWatchdog::Start(std::function<absl::Status()> probe) {
  if (std::getenv("NOTIFY_SOCKET") == nullptr) return false;
  uint64_t usec = 0;
  if (sd_watchdog_enabled(/*unset_environment=*/0, &usec) <= 0 || usec == 0) return false;
  interval_ = absl::Microseconds(usec / 2);
  const bool probed = probe != nullptr;
  thread_ = std::thread([this, probe = std::move(probe)] {
    bool failing = false;
    do {
      const absl::Status live = probe ? probe() : absl::OkStatus();
      if (live.ok()) {
        if (failing) spdlog::info("systemd watchdog: the liveness probe passes again");
        failing = false;
        Notify("WATCHDOG=1");
      } else if (!failing) {
        failing = true;
        spdlog::error("systemd watchdog: liveness probe failed, not pinging: {}", live.ToString());
      }
    } while (!stop_.WaitForNotificationWithTimeout(interval_));
  });
  spdlog::info("systemd watchdog: WATCHDOG=1 every {}{}", absl::FormatDuration(interval_),
               probed ? " while the liveness probe passes" : "");
  return true;
}

void SystemdWatchdog::Stop() {
  if (!thread_.joinable()) return;
  if (!stop_.HasBeenNotified()) stop_.Notify();
  thread_.join();
  // The probe's lock helpers must be done before the daemon destroys the locks.
  if (!WaitForMutexProbes(absl::Seconds(10))) {
    spdlog::error("systemd watchdog: a liveness probe still waits on a lock after 10 s");
  }
}

}  // namespace tessera::systemd
