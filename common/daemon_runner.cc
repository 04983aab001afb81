#include "common/daemon_runner.h"

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/systemd.h"
#include "spdlog/spdlog.h"

namespace tessera {

int RunDaemon(const DaemonRunOptions& options, Daemon& daemon) {
  auto fail = [&options](const absl::Status& status, int exit_code) {
    if (options.report_failure) {
      options.report_failure(status);
    } else {
      spdlog::error("{}: {}", options.program, status.ToString());
    }
    return exit_code;
  };
  absl::StatusOr<std::unique_ptr<Metrics>> metrics =
      StartMetrics(options.metrics_daemon, options.metrics);
  if (!metrics.ok()) return fail(metrics.status(), 1);
  // From here the endpoint may read the daemon at scrape time. `metrics` goes when this function
  // returns, before the daemon (the caller's); it must also outlive the daemon's calls (the
  // interceptors), so a started daemon is stopped before every return.
  if (absl::Status created = daemon.Create(metrics->get()); !created.ok()) {
    return fail(created, options.create_failure_exit_code);
  }
  if (absl::Status started = daemon.Start(); !started.ok()) return fail(started, 1);
  if (!options.port_file.empty()) {
    if (absl::Status written = WritePortFile(options.port_file, daemon.port()); !written.ok()) {
      const int code = fail(written, 1);
      daemon.Stop(absl::ZeroDuration());
      return code;
    }
  }
  daemon.Announce();
  systemd::NotifyReady(daemon.ReadyStatus());
  systemd::SystemdWatchdog watchdog;
  watchdog.Start([&daemon] { return daemon.CheckLive(); });
  const int signal = WaitForShutdownSignal(
      [&options] { ReloadDaemonConfig(*options.config, options.security, options.program); });
  daemon.StopServing();
  systemd::NotifyStopping(options.stopping_status);
  daemon.Deregister();
  spdlog::info("{}: signal {} received, {}", options.program, signal, options.drain_log);
  daemon.Stop(options.shutdown_grace);
  // The metrics read the daemon at scrape time: stop serving them before it goes.
  metrics->reset();
  watchdog.Stop();
  spdlog::info("{}: stopped", options.program);
  return 0;
}

}  // namespace tessera
