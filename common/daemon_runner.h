// RunDaemon: the one run sequence of tessera-server, tessera-coordinator and tessera-worker. Each
// main() parses its flags (common/config.h: LayeredConfig::Parse runs the daemon's checks and
// sets up logging), then hands RunDaemon its Daemon, which RunDaemon drives through these steps:
//
//   1. the metrics endpoint starts (StartMetrics: --metrics_listen, --metrics_port_file);
//   2. Create(metrics): the daemon builds its service, with the per-RPC interceptors of
//      `metrics` and the collectors that read it at scrape time;
//   3. Start(): the listener serves, health SERVING;
//   4. the bound port() goes to --port_file (atomically), when one is asked for;
//   5. Announce(): the daemon tells the world (the shard registers with the coordinator);
//   6. sd_notify READY=1 with ReadyStatus(), and the systemd watchdog pings while CheckLive()
//      passes;
//   7. it waits for SIGTERM or SIGINT; each SIGHUP meanwhile re-reads log_level and the TLS and
//      token files (ReloadDaemonConfig);
//   8. the drain: StopServing() (health NOT_SERVING), sd_notify STOPPING=1, Deregister(),
//      "<program>: signal N received, <drain_log>", Stop(grace), the metrics endpoint stopped
//      (before the daemon it reads goes), the watchdog stopped, "<program>: stopped"; exit 0.
//
// A step that fails ends the run with its status reported ("<program>: <status>") and an exit
// code: 1 for the metrics endpoint, create_failure_exit_code for Create(), 1 for Start() and for
// the port file (after Stop(zero): nothing is left serving). The metrics endpoint always stops
// before RunDaemon returns, so the Daemon (the caller's, which outlives the call) is never read
// by a scrape after it.
#ifndef TESSERA_COMMON_DAEMON_RUNNER_H_
#define TESSERA_COMMON_DAEMON_RUNNER_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/daemon_metrics.h"

namespace tessera {

class LayeredConfig;
class Metrics;
class Security;

// What one daemon does at each step of RunDaemon (above). RunDaemon calls every method on the
// thread that called it, in the order above, each at most once (CheckLive() on the watchdog's
// thread, repeatedly).
class Daemon {
 public:
  virtual ~Daemon() = default;

  // Builds the service. `metrics` outlives every later call; install its RPC hook
  // (RpcMetricsHook) and register what it reads at scrape time here.
  virtual absl::Status Create(Metrics* metrics) = 0;
  // Starts serving. On an error nothing may be left running.
  virtual absl::Status Start() = 0;
  // The bound port, written to the port file; called only when one is asked for.
  virtual int port() const = 0;
  // After the port file: registration and what else says the daemon is up. Default: nothing.
  virtual void Announce() {}
  // sd_notify STATUS= with READY=1.
  virtual std::string ReadyStatus() const = 0;
  // The watchdog's liveness probe (SystemdWatchdog::Start): OK while the daemon's work goes on.
  // Called from the watchdog's thread; must return within its interval / 2.
  virtual absl::Status CheckLive() = 0;
  // The drain's first step: health NOT_SERVING.
  virtual void StopServing() = 0;
  // After STOPPING=1, before the drain log line: leave the cluster. Default: nothing.
  virtual void Deregister() {}
  // Stops serving, letting running calls finish within `grace`; joins the daemon's threads.
  // Also called with a zero grace when the port file cannot be written.
  virtual void Stop(absl::Duration grace) = 0;
};

struct DaemonRunOptions {
  // "tessera-server": starts every log line and failure report.
  std::string program;
  // tessera_build_info{daemon} and the metrics endpoint's flags.
  std::string metrics_daemon;
  MetricsFlags metrics;
  // --port_file; empty: none.
  std::string port_file;
  // Passed to Daemon::Stop() on SIGTERM/SIGINT.
  absl::Duration shutdown_grace = absl::Seconds(5);
  // What the drain log line says after "signal N received, ".
  std::string drain_log = "stopping";
  // sd_notify STATUS= with STOPPING=1.
  std::string stopping_status = "draining";
  // The exit code when Create() fails.
  int create_failure_exit_code = 1;
  // Reports a failed step; null: spdlog::error("<program>: <status>").
  std::function<void(const absl::Status&)> report_failure;
  // Re-read on SIGHUP (ReloadDaemonConfig); not owned, must outlive the call.
  const LayeredConfig* config = nullptr;
  Security* security = nullptr;
};

// Runs `daemon` through the sequence above and returns the process's exit code. Blocks until
// SIGTERM or SIGINT (or a failed step).
// REQUIRES: BlockDaemonSignals() before any thread was started; logging set up (InitLogging);
// options.config not null.
int RunDaemon(const DaemonRunOptions& options, Daemon& daemon);

}  // namespace tessera

#endif  // TESSERA_COMMON_DAEMON_RUNNER_H_
