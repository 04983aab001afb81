#include "common/process.h"

#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace tessera {
namespace {

// Formats the syslog priority of a message's level (debug 7 ... critical 2).
class SyslogPriorityFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    static constexpr char kPriority[] = {'7', '7', '6', '4', '3', '2', '6'};
    dest.push_back(kPriority[static_cast<int>(msg.level)]);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<SyslogPriorityFlag>();
  }
};

}  // namespace

absl::Status InitLogging(absl::string_view level) {
  const spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level: unknown level '", level,
                     "' (want trace, debug, info, warn, error, critical or off)"));
  }
  auto logger = spdlog::get("tessera");
  if (logger == nullptr) logger = spdlog::stderr_color_mt("tessera");
  if (std::getenv("JOURNAL_STREAM") != nullptr) {
    // journald reads a "<N>" syslog priority at the start of each line and stamps the time itself.
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<SyslogPriorityFlag>('*').set_pattern("<%*>%v");
    logger->set_formatter(std::move(formatter));
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ %t] %v");
  }
  logger->set_level(lvl);
  spdlog::set_default_logger(logger);
  return absl::OkStatus();
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--port_file: cannot create ", tmp, ": ", std::strerror(errno)));
  }
  const std::string text = absl::StrCat(port, "\n");
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--port_file: cannot write ", path, ": ", std::strerror(ok ? errno : err)));
  }
  return absl::OkStatus();
}

void ExecWithPassiveOpenMpWait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (::setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  ::execv("/proc/self/exe", argv);
}

void BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void BlockDaemonSignals() {
  BlockShutdownSignals();
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal(const std::function<void()>& on_reload) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  const timespec trim_interval{kTrimIntervalSeconds, 0};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &trim_interval);
    if (sig < 0) {
      if (errno == EAGAIN) ReleaseFreeMemory();
      continue;
    }
    if (sig != SIGHUP) return sig;
    if (on_reload) on_reload();
  }
}

void ReleaseFreeMemory() { malloc_trim(0); }

void ConfigureDaemonAllocator() {
  if (std::getenv("MALLOC_ARENA_MAX") != nullptr || std::getenv("GLIBC_TUNABLES") != nullptr) {
    return;
  }
  mallopt(M_ARENA_MAX, 1);
}

void ConfigureReleaseMutexes() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

namespace {

// MutexResponds helpers still running (WaitForMutexProbes).
absl::Mutex probes_mu(absl::kConstInit);
int probes_running ABSL_GUARDED_BY(probes_mu) = 0;

}  // namespace

absl::Status MutexResponds(absl::Mutex* mu, absl::Duration within, absl::string_view what) {
  // A blocking ReaderLock on a helper thread: absl's ReaderTryLock also fails while any thread
  // waits on the mutex (an Await), which daemons' loops do most of the time.
  auto taken = std::make_shared<absl::Notification>();
  {
    absl::MutexLock lock(&probes_mu);
    ++probes_running;
  }
  std::thread([mu, taken] {
    mu->ReaderLock();
    mu->ReaderUnlock();
    taken->Notify();
    absl::MutexLock lock(&probes_mu);
    --probes_running;
  }).detach();
  if (taken->WaitForNotificationWithTimeout(within)) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat(what, " has been held for more than ", absl::FormatDuration(within)));
}

bool WaitForMutexProbes(absl::Duration timeout) {
  absl::MutexLock lock(&probes_mu);
  return probes_mu.AwaitWithTimeout(
      absl::Condition(
          +[](int* running) { return *running == 0; }, &probes_running),
      timeout);
}

}  // namespace tessera
