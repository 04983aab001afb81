// The daemon kit end to end (issue #5), with the real tessera-server, tessera-coordinator and
// tessera-worker binaries as child processes on 127.0.0.1 and ports picked at run time:
//
//  - sd_notify: with NOTIFY_SOCKET bound by the test, READY=1 arrives only once the port file
//    exists and health Check answers SERVING; WATCHDOG_USEC=200000 brings WATCHDOG=1 every
//    100 ms; SIGTERM brings STOPPING=1 and exit 0 within the grace. The metrics endpoint is up.
//  - A plaintext listener (gRPC or metrics) on a non-loopback address exits 78 naming the flag,
//    unless --insecure.
//  - --check-config prints each option with its source (flag, env, config FILE:LINE, default)
//    and binds nothing; unknown keys exit 78 naming FILE:LINE and the key.
//  - SIGHUP re-reads log_level from the config file and the new level takes effect.
//
// Every wait is bounded in time.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/child_process.h"
#include "common/health_probe.h"
#include "common/security.h"
#include "common/testing/notify_socket.h"
#include "common/testing/prometheus_text.h"
#include "gtest/gtest.h"
#include "tests/testlib/child_process.h"

#ifndef TESSERA_BIN_DIR
#error "TESSERA_BIN_DIR must name the folder of the daemons"
#endif

namespace tessera {
namespace {

using prometheus_text::HttpGet;
using testlib::CommandResult;
using testlib::ReadWholeFile;
using testlib::RunToEnd;
using testlib::ScratchDirectory;
using testlib::SpawnChild;
using testlib::WaitChild;

std::string Bin(const std::string& name) { return absl::StrCat(TESSERA_BIN_DIR, "/", name); }

// Options that add `env` to the child's scrubbed environment.
testlib::SpawnOptions WithEnv(std::map<std::string, std::string> env) {
  testlib::SpawnOptions options;
  options.env = std::move(env);
  return options;
}

bool WaitForText(const std::string& path, const std::string& text, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (absl::StrContains(ReadWholeFile(path), text)) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Waits up to `timeout` for `p` to exit while reading `notify` (a full datagram queue would block
// the daemon's sd_notify calls); sets *stopping when STOPPING=1 arrives. Returns as WaitChild().
int WaitReading(ChildProcess* p, NotifySocket* notify, absl::Duration timeout, bool* stopping) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (p->HasExited()) {
      while (true) {
        const std::string rest = notify->Receive(absl::Milliseconds(60));
        if (rest.empty()) break;
        if (absl::StartsWith(rest, "STOPPING=1")) *stopping = true;
      }
      return p->exit_code();
    }
    if (absl::StartsWith(notify->Receive(absl::Milliseconds(60)), "STOPPING=1")) *stopping = true;
  }
  return WaitChild(p, absl::ZeroDuration());
}

struct Daemon {
  std::string binary;
  std::string daemon_label;  // tessera_build_info's daemon label
  bool grpc;                 // serves gRPC (port file, health)
};

// The command line of `daemon` on loopback with port files in `dir`.
std::vector<std::string> BaseArgs(const Daemon& daemon, const ScratchDirectory& dir) {
  std::vector<std::string> args = {Bin(daemon.binary), "--metrics_listen", "127.0.0.1:0",
                                   "--metrics_port_file", dir.File("metrics.port")};
  if (daemon.binary == "tessera-worker") {
    // An unreachable coordinator: the worker retries in the background and serves on.
    // Its listener serves only health and reflection.
    args.insert(args.end(), {"--coordinator", "127.0.0.1:1", "--device", "cpu", "--listen",
                             "127.0.0.1:0", "--port_file", dir.File("grpc.port")});
  } else {
    args.insert(args.end(), {"--listen", "127.0.0.1:0", "--port_file", dir.File("grpc.port"),
                             "--shutdown_grace_seconds", "1"});
  }
  if (daemon.binary == "tessera-coordinator") {
    args.insert(args.end(), {"--data_dir", dir.File("coord")});
  }
  return args;
}

// `args` with `flag`'s value replaced (or the flag added).
std::vector<std::string> WithFlag(std::vector<std::string> args, const std::string& flag,
                                  const std::string& value) {
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == flag) {
      args[i + 1] = value;
      return args;
    }
  }
  args.push_back(flag);
  args.push_back(value);
  return args;
}

// `args` without `flag` and its value.
std::vector<std::string> WithoutFlag(const std::vector<std::string>& args,
                                     const std::string& flag) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag) {
      ++i;
      continue;
    }
    out.push_back(args[i]);
  }
  return out;
}

void PrintTo(const Daemon& daemon, std::ostream* os) { *os << daemon.binary; }

class DaemonE2eTest : public ::testing::TestWithParam<Daemon> {};

TEST_P(DaemonE2eTest, ReadyOnlyWhenServingWatchdogAndStoppingOnSigterm) {
  const Daemon& daemon = GetParam();
  ScratchDirectory dir("tessera-daemon-e2e");
  NotifySocket notify(dir.File("notify.sock"));
  ASSERT_TRUE(notify.bound());
  ChildProcess p =
      SpawnChild(BaseArgs(daemon, dir), dir.path(), daemon.binary,
                 WithEnv({{"NOTIFY_SOCKET", notify.path()}, {"WATCHDOG_USEC", "200000"}}));

  // READY=1 comes first, and by then the daemon serves.
  const std::string ready = notify.Receive(absl::Seconds(20));
  ASSERT_TRUE(absl::StartsWith(ready, "READY=1")) << "got '" << ready << "'\n"
                                                  << ReadWholeFile(p.stderr_path());
  if (daemon.grpc) {
    int port = 0;
    ASSERT_TRUE(
        absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadWholeFile(dir.File("grpc.port"))), &port))
        << "no port file when READY=1 arrived";
    EXPECT_TRUE(IsServing(absl::StrCat("127.0.0.1:", port), absl::Seconds(5)))
        << "READY=1 before health answered SERVING";
  }

  // WATCHDOG_USEC=200000: a ping every 100 ms.
  const absl::Time start = absl::Now();
  int watchdogs = 0;
  while (watchdogs < 5 && absl::Now() - start < absl::Seconds(5)) {
    if (notify.Receive(absl::Seconds(1)) == "WATCHDOG=1") ++watchdogs;
  }
  EXPECT_EQ(watchdogs, 5);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));

  // The metrics endpoint serves this daemon's families.
  const int metrics_port = p.WaitForPortFile(dir.File("metrics.port"), absl::Seconds(1));
  ASSERT_GT(metrics_port, 0);
  const std::string metrics = HttpGet(metrics_port, "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "200 OK")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "tessera_build_info")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, absl::StrCat("daemon=\"", daemon.daemon_label, "\"")));
  EXPECT_TRUE(absl::StrContains(metrics, "process_resident_memory_bytes"));
  if (daemon.grpc) {
    // The health checks above went through the metrics interceptor.
    EXPECT_TRUE(absl::StrContains(HttpGet(metrics_port, "/metrics"), "tessera_rpc_calls_total{"));
  }

  // SIGTERM: STOPPING=1, then exit 0 within the grace (1 s).
  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  bool stopping = false;
  const absl::Time term = absl::Now();
  EXPECT_EQ(WaitReading(&p, &notify, absl::Seconds(10), &stopping), 0)
      << ReadWholeFile(p.stderr_path());
  EXPECT_LT(absl::Now() - term, absl::Seconds(5));
  EXPECT_TRUE(stopping);
}

TEST_P(DaemonE2eTest, NoNotifySocketStartsAndStopsAsBefore) {
  const Daemon& daemon = GetParam();
  ScratchDirectory dir("tessera-daemon-e2e");
  ChildProcess p = SpawnChild(BaseArgs(daemon, dir), dir.path(), daemon.binary);
  if (daemon.grpc) {
    const int port = p.WaitForPortFile(dir.File("grpc.port"), absl::Seconds(20));
    ASSERT_GT(port, 0) << ReadWholeFile(p.stderr_path());
    EXPECT_TRUE(IsServing(absl::StrCat("127.0.0.1:", port), absl::Seconds(5)));
  }
  const int metrics_port = p.WaitForPortFile(dir.File("metrics.port"), absl::Seconds(20));
  ASSERT_GT(metrics_port, 0) << ReadWholeFile(p.stderr_path());
  EXPECT_TRUE(absl::StrContains(HttpGet(metrics_port, "/metrics"), "tessera_build_info"));
  ASSERT_EQ(kill(p.pid(), SIGINT), 0);
  EXPECT_EQ(WaitChild(&p, absl::Seconds(10)), 0) << ReadWholeFile(p.stderr_path());
  EXPECT_FALSE(absl::StrContains(ReadWholeFile(p.stderr_path()), "systemd watchdog"));
}

TEST_P(DaemonE2eTest, RefusesPlaintextOnNonLoopbackWithoutInsecure) {
  const Daemon& daemon = GetParam();
  ScratchDirectory dir("tessera-daemon-e2e");
  if (daemon.grpc) {
    std::vector<std::string> args = WithFlag(BaseArgs(daemon, dir), "--listen", "0.0.0.0:0");
    const CommandResult refused = RunToEnd(args, dir.path(), "refused");
    EXPECT_EQ(refused.code, 78) << refused.err;
    EXPECT_TRUE(absl::StrContains(refused.err, "--listen 0.0.0.0:0")) << refused.err;
    EXPECT_TRUE(absl::StrContains(refused.err, "--tls_cert")) << refused.err;
    EXPECT_TRUE(absl::StrContains(refused.err, "--insecure")) << refused.err;
    EXPECT_FALSE(std::filesystem::exists(dir.File("grpc.port")));

    // The same from the environment (no --listen on the command line).
    const CommandResult from_env =
        RunToEnd(WithoutFlag(args, "--listen"), dir.path(), "refused-env2",
                 WithEnv({{"TESSERA_LISTEN", "0.0.0.0:0"}}));
    EXPECT_EQ(from_env.code, 78) << from_env.err;
    EXPECT_TRUE(absl::StrContains(from_env.err, "--listen 0.0.0.0:0")) << from_env.err;

    // With --insecure it starts.
    args.push_back("--insecure");
    ChildProcess p = SpawnChild(args, dir.path(), "insecure");
    const int port = p.WaitForPortFile(dir.File("grpc.port"), absl::Seconds(20));
    ASSERT_GT(port, 0) << ReadWholeFile(p.stderr_path());
    EXPECT_TRUE(IsServing(absl::StrCat("127.0.0.1:", port), absl::Seconds(5)));
    kill(p.pid(), SIGTERM);
    EXPECT_EQ(WaitChild(&p, absl::Seconds(10)), 0);
  }
  // The metrics endpoint is plain HTTP: non-loopback needs --metrics_insecure, which allows only
  // that endpoint (a plaintext gRPC listener off loopback is still refused).
  std::vector<std::string> args = WithFlag(BaseArgs(daemon, dir), "--metrics_listen", "0.0.0.0:0");
  const CommandResult refused = RunToEnd(args, dir.path(), "refused-metrics");
  EXPECT_EQ(refused.code, 78) << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "--metrics_listen 0.0.0.0:0")) << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "--metrics_insecure")) << refused.err;
  args.push_back("--metrics_insecure");
  const CommandResult grpc_refused = RunToEnd(WithFlag(args, "--listen", "0.0.0.0:0"), dir.path(),
                                              "refused-grpc-with-metrics-insecure");
  EXPECT_EQ(grpc_refused.code, 78) << grpc_refused.err;
  EXPECT_TRUE(absl::StrContains(grpc_refused.err, "--listen 0.0.0.0:0")) << grpc_refused.err;
  const CommandResult checked = RunToEnd(
      [&] {
        std::vector<std::string> a = args;
        a.push_back("--check-config");
        return a;
      }(),
      dir.path(), "metrics-insecure-check");
  EXPECT_EQ(checked.code, 0) << checked.err;
}

TEST_P(DaemonE2eTest, CheckConfigListsEverySourceAndBindsNothing) {
  const Daemon& daemon = GetParam();
  ScratchDirectory dir("tessera-daemon-e2e");
  const std::string config = dir.File("daemon.conf");
  std::ofstream(config) << "# test configuration\n"
                        << "\n"
                        << "log_level = debug   # chatty\n"
                        << "metrics_port_file = " << dir.File("from-file.port") << "\n";
  // Without --metrics_port_file on the command line, so the file's value is used.
  std::vector<std::string> trimmed = WithoutFlag(BaseArgs(daemon, dir), "--metrics_port_file");
  trimmed.insert(trimmed.end(), {"--config", config, "--check-config"});
  const CommandResult r = RunToEnd(trimmed, dir.path(), "check",
                                   WithEnv({{"TESSERA_TLS_SERVER_NAME", "tessera.test"}}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "metrics_listen = 127.0.0.1:0  # flag\n")) << r.out;
  EXPECT_TRUE(
      absl::StrContains(r.out, "tls_server_name = tessera.test  # env TESSERA_TLS_SERVER_NAME\n"))
      << r.out;
  EXPECT_TRUE(
      absl::StrContains(r.out, absl::StrCat("log_level = debug  # config ", config, ":3\n")))
      << r.out;
  EXPECT_TRUE(
      absl::StrContains(r.out, absl::StrCat("metrics_port_file = ", dir.File("from-file.port"),
                                            "  # config ", config, ":4\n")))
      << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "insecure = false  # default\n")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "auth_token_file =   # default\n")) << r.out;
  // Nothing was bound or written.
  EXPECT_FALSE(std::filesystem::exists(dir.File("from-file.port")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("grpc.port")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("coord")));

  // An unknown key: 78 naming FILE:LINE and the key.
  std::ofstream(config, std::ios::trunc) << "log_level = info\nlisen = 127.0.0.1:0\n";
  const CommandResult unknown = RunToEnd(trimmed, dir.path(), "unknown");
  EXPECT_EQ(unknown.code, 78);
  EXPECT_TRUE(absl::StrContains(unknown.err, absl::StrCat(config, ":2: unknown key 'lisen'")))
      << unknown.err;

  // A value the option rejects, from the environment: 78 naming the variable.
  std::ofstream(config, std::ios::trunc) << "";
  const CommandResult bad_env =
      RunToEnd(trimmed, dir.path(), "bad-env", WithEnv({{"TESSERA_LOG_LEVEL", "loud"}}));
  EXPECT_EQ(bad_env.code, 78);
  EXPECT_TRUE(absl::StrContains(bad_env.err, "loud")) << bad_env.err;

  // A validation failure (an unreadable certificate) under --check-config: 78 naming the flag.
  std::vector<std::string> tls = trimmed;
  tls.insert(tls.end(),
             {"--tls_cert", dir.File("missing.pem"), "--tls_key", dir.File("missing.key")});
  const CommandResult bad_tls = RunToEnd(tls, dir.path(), "bad-tls");
  EXPECT_EQ(bad_tls.code, 78);
  EXPECT_TRUE(absl::StrContains(bad_tls.err, "--tls_")) << bad_tls.err;
}

TEST_P(DaemonE2eTest, SighupReloadsLogLevelFromTheConfigFile) {
  const Daemon& daemon = GetParam();
  ScratchDirectory dir("tessera-daemon-e2e");
  const std::string config = dir.File("daemon.conf");
  std::ofstream(config) << "log_level = info\n";
  std::vector<std::string> args = BaseArgs(daemon, dir);
  args.insert(args.end(), {"--config", config});
  NotifySocket notify(dir.File("notify.sock"));
  ASSERT_TRUE(notify.bound());
  ChildProcess p =
      SpawnChild(args, dir.path(), daemon.binary, WithEnv({{"NOTIFY_SOCKET", notify.path()}}));
  ASSERT_TRUE(notify.ReceiveUntil("READY=1", absl::Seconds(20))) << ReadWholeFile(p.stderr_path());
  EXPECT_FALSE(absl::StrContains(ReadWholeFile(p.stderr_path()), "debug logging is on"));

  // An unchanged file: the level stays and the daemon serves on.
  ASSERT_EQ(kill(p.pid(), SIGHUP), 0);
  EXPECT_TRUE(WaitForText(p.stderr_path(), "log level unchanged (info)", absl::Seconds(5)))
      << ReadWholeFile(p.stderr_path());

  std::ofstream(config, std::ios::trunc) << "# louder\nlog_level = debug\n";
  ASSERT_EQ(kill(p.pid(), SIGHUP), 0);
  // The debug line shows only when the new level is in force.
  EXPECT_TRUE(WaitForText(p.stderr_path(), "debug logging is on", absl::Seconds(5)))
      << ReadWholeFile(p.stderr_path());
  EXPECT_TRUE(absl::StrContains(ReadWholeFile(p.stderr_path()), "log level now debug"));
  EXPECT_TRUE(absl::StrContains(ReadWholeFile(p.stderr_path()), absl::StrCat(config, ":2")));

  // A bad value keeps the old level.
  std::ofstream(config, std::ios::trunc) << "log_level = loud\n";
  ASSERT_EQ(kill(p.pid(), SIGHUP), 0);
  EXPECT_TRUE(WaitForText(p.stderr_path(), "keeping the log level", absl::Seconds(5)))
      << ReadWholeFile(p.stderr_path());

  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  EXPECT_EQ(WaitChild(&p, absl::Seconds(10)), 0) << ReadWholeFile(p.stderr_path());
}

// Makes a CA and a certificate for 127.0.0.1 signed by it (ca.pem, srv.pem, srv.key) and a token
// file (mode 600) in `dir` with openssl. False when openssl fails.
bool MakePki(const ScratchDirectory& dir) {
  const std::string d = dir.path();
  const std::string script = absl::StrCat(
      "cd ", d, " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2",
      " -subj /CN=tessera-test-ca >/dev/null 2>&1",
      " && openssl req -newkey rsa:2048 -nodes -keyout srv.key -out srv.csr -subj /CN=localhost",
      " >/dev/null 2>&1 && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > ext",
      " && openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem",
      " -days 2 -extfile ext >/dev/null 2>&1 && echo right-token > token && chmod 600 token");
  return std::system(script.c_str()) == 0;
}

// With TLS a daemon may listen on any address; SIGHUP re-reads the token and certificate files
// (Security::Reload) and keeps the old ones when that fails; SIGTERM drains and exits 0.
TEST(DaemonTlsTest, TlsOnAnyAddressSighupReloadsSecurityFilesAndSigtermDrains) {
  for (const char* binary : {"tessera-server", "tessera-coordinator"}) {
    SCOPED_TRACE(binary);
    ScratchDirectory dir("tessera-daemon-e2e");
    ASSERT_TRUE(MakePki(dir)) << "openssl failed";
    std::vector<std::string> args = {Bin(binary),
                                     "--listen",
                                     "0.0.0.0:0",
                                     "--port_file",
                                     dir.File("grpc.port"),
                                     "--tls_cert",
                                     dir.File("srv.pem"),
                                     "--tls_key",
                                     dir.File("srv.key"),
                                     "--tls_ca",
                                     dir.File("ca.pem"),
                                     "--auth_token_file",
                                     dir.File("token"),
                                     "--shutdown_grace_seconds",
                                     "1"};
    if (std::string(binary) == "tessera-coordinator") {
      args.insert(args.end(), {"--data_dir", dir.File("coord")});
    }
    ChildProcess p = SpawnChild(args, dir.path(), binary);
    const int port = p.WaitForPortFile(dir.File("grpc.port"), absl::Seconds(20));
    ASSERT_GT(port, 0) << ReadWholeFile(p.stderr_path());
    const std::string address = absl::StrCat("127.0.0.1:", port);

    SecurityOptions client_options;
    client_options.serves_grpc = false;  // dials only, like the CLI
    client_options.tls_ca = dir.File("ca.pem");
    client_options.auth_token_file = dir.File("token");
    absl::StatusOr<std::unique_ptr<Security>> client = Security::Create(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_TRUE(IsServing(address, absl::Seconds(5), (*client)->Client()));
    EXPECT_FALSE(IsServing(address, absl::Seconds(2)));  // plaintext

    ASSERT_EQ(kill(p.pid(), SIGHUP), 0);
    EXPECT_TRUE(
        WaitForText(p.stderr_path(), "token and certificate files re-read", absl::Seconds(5)))
        << ReadWholeFile(p.stderr_path());
    // The token file gone: the reload fails and the old token stays in force.
    std::filesystem::remove(dir.File("token"));
    ASSERT_EQ(kill(p.pid(), SIGHUP), 0);
    EXPECT_TRUE(WaitForText(p.stderr_path(), "keeping the old token", absl::Seconds(5)))
        << ReadWholeFile(p.stderr_path());
    EXPECT_TRUE(IsServing(address, absl::Seconds(5), (*client)->Client()));

    ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
    EXPECT_EQ(WaitChild(&p, absl::Seconds(10)), 0) << ReadWholeFile(p.stderr_path());
  }
}

// Usage errors on the real command line keep their exit codes (CLI11's, 64 for the worker), and
// `tessera-worker --standalone` ignores a $TESSERA_COORDINATOR meant for the daemon as before.
TEST(DaemonUsageTest, UsageErrorsKeepTheirCodesAndStandaloneIgnoresTheDaemonLayers) {
  ScratchDirectory dir("tessera-daemon-e2e");
  const CommandResult server =
      RunToEnd({Bin("tessera-server"), "--threads", "5000"}, dir.path(), "s");
  EXPECT_NE(server.code, 0);
  EXPECT_NE(server.code, 78);
  EXPECT_TRUE(absl::StrContains(server.err, "--threads")) << server.err;
  const CommandResult coordinator = RunToEnd({Bin("tessera-coordinator")}, dir.path(), "c");
  EXPECT_EQ(coordinator.code, 106) << coordinator.err;  // CLI::RequiredError, as before
  EXPECT_TRUE(absl::StrContains(coordinator.err, "--data_dir")) << coordinator.err;
  const CommandResult worker = RunToEnd({Bin("tessera-worker"), "--bogus"}, dir.path(), "w");
  EXPECT_EQ(worker.code, 64) << worker.err;

  const CommandResult from_env = RunToEnd({Bin("tessera-worker"), "--standalone"}, dir.path(), "w1",
                                          WithEnv({{"TESSERA_COORDINATOR", "10.0.0.5:7070"}}));
  EXPECT_EQ(from_env.code, 64);
  EXPECT_TRUE(absl::StrContains(from_env.err, "--standalone needs --job FILE")) << from_env.err;
  const CommandResult from_flag = RunToEnd(
      {Bin("tessera-worker"), "--standalone", "--coordinator", "10.0.0.5:7070"}, dir.path(), "w2");
  EXPECT_EQ(from_flag.code, 64);
  EXPECT_TRUE(absl::StrContains(from_flag.err, "drop --coordinator")) << from_flag.err;
}

INSTANTIATE_TEST_SUITE_P(Daemons, DaemonE2eTest,
                         ::testing::Values(Daemon{"tessera-server", "server", true},
                                           Daemon{"tessera-coordinator", "coordinator", true},
                                           Daemon{"tessera-worker", "worker", true}),
                         [](const ::testing::TestParamInfo<Daemon>& info) {
                           std::string name = info.param.daemon_label;
                           return name;
                         });

}  // namespace
}  // namespace tessera
