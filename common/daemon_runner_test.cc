// RunDaemon through its contract with a recording Daemon: the order of the steps, the port file,
// READY=1 and STOPPING=1 on a stand-in NOTIFY_SOCKET, SIGHUP handled without stopping, the drain
// log lines, the metrics endpoint stopped after Stop() and before RunDaemon returns, and the exit
// code and report of each failing step.
//
// The signals go to the runner's own thread (pthread_kill), which blocks them as a daemon's
// main() does, so that other threads of this test binary never see them.
#include "common/daemon_runner.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/testing/notify_socket.h"
#include "gtest/gtest.h"
#include "prometheus/collectable.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"

namespace tessera {
namespace {

// The steps a RecordingDaemon was taken through, in order; thread-safe.
class StepLog {
 public:
  void Add(const std::string& step) {
    absl::MutexLock lock(&mu_);
    steps_.push_back(step);
  }
  std::string Joined() {
    absl::MutexLock lock(&mu_);
    return absl::StrJoin(steps_, ",");
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> steps_ ABSL_GUARDED_BY(mu_);
};

// Registered on the metrics in Create(); says when the metrics let it go.
class MetricsWitness : public prometheus::Collectable {
 public:
  explicit MetricsWitness(StepLog* log) : log_(log) {}
  ~MetricsWitness() override { log_->Add("metrics-gone"); }
  std::vector<prometheus::MetricFamily> Collect() const override { return {}; }

 private:
  StepLog* const log_;
};

class RecordingDaemon : public Daemon {
 public:
  // The step whose method fails ("create", "start"), or "" for none.
  explicit RecordingDaemon(std::string failing = "") : failing_(std::move(failing)) {}

  absl::Status Create(Metrics* metrics) override {
    log.Add("create");
    if (failing_ == "create") return absl::InvalidArgumentError("bad --data_dir");
    metrics->AddCollectable(std::make_shared<MetricsWitness>(&log));
    return absl::OkStatus();
  }
  absl::Status Start() override {
    log.Add("start");
    if (failing_ == "start") return absl::UnavailableError("--listen: cannot bind");
    return absl::OkStatus();
  }
  int port() const override {
    const_cast<RecordingDaemon*>(this)->log.Add("port");
    return 4242;
  }
  void Announce() override { log.Add("announce"); }
  std::string ReadyStatus() const override {
    const_cast<RecordingDaemon*>(this)->log.Add("ready");
    return "serving on 127.0.0.1:4242";
  }
  absl::Status CheckLive() override { return absl::OkStatus(); }
  void StopServing() override { log.Add("stop-serving"); }
  void Deregister() override { log.Add("deregister"); }
  void Stop(absl::Duration grace) override {
    log.Add(absl::StrCat("stop(", absl::FormatDuration(grace), ")"));
  }

  StepLog log;

 private:
  const std::string failing_;
};

class DaemonRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-daemon-runner-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    sink_ = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(100);
    sink_->set_pattern("%v");
    previous_logger_ = spdlog::default_logger();
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("runner-test", sink_));
    // A daemon-like configuration for SIGHUP.
    app_.add_option("--log_level", log_level_, "level")->capture_default_str();
    config_.AddFlags(app_);
    const char* argv[] = {"tessera-test"};
    ASSERT_EQ(config_.Parse(app_, 1, const_cast<char**>(argv)), -1);
  }
  void TearDown() override {
    spdlog::set_default_logger(previous_logger_);
    std::filesystem::remove_all(dir_);
  }

  DaemonRunOptions Options() {
    DaemonRunOptions options;
    options.program = "tessera-test";
    options.metrics_daemon = "server";
    options.port_file = dir_ + "/grpc.port";
    options.shutdown_grace = absl::Seconds(1);
    options.drain_log = "shutting down (grace 1 s)";
    options.create_failure_exit_code = 2;
    options.config = &config_;
    return options;
  }

  std::string Logged() { return absl::StrJoin(sink_->last_formatted(), ""); }

  std::string dir_;
  std::string log_level_ = "info";
  CLI::App app_{"test daemon", "tessera-test"};
  LayeredConfig config_{"tessera-test"};
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
  std::shared_ptr<spdlog::logger> previous_logger_;
};

TEST_F(DaemonRunnerTest, RunsTheStepsInOrderAndDrainsOnSigterm) {
  NotifySocket notify(dir_ + "/notify.sock");
  ASSERT_TRUE(notify.bound());
  ::setenv("NOTIFY_SOCKET", notify.path().c_str(), 1);
  RecordingDaemon daemon;
  const DaemonRunOptions options = Options();
  std::atomic<int> code{-1};
  absl::Notification returned;
  std::string steps_at_return;
  std::thread runner([&] {
    BlockDaemonSignals();  // this thread only: the signals below are sent to it
    code = RunDaemon(options, daemon);
    steps_at_return = daemon.log.Joined();
    returned.Notify();
  });
  // A failed assertion below still ends the run.
  absl::Cleanup stop_runner = [&runner] {
    if (!runner.joinable()) return;
    pthread_kill(runner.native_handle(), SIGTERM);
    runner.join();
  };

  EXPECT_EQ(notify.Receive(absl::Seconds(10)), "READY=1\nSTATUS=serving on 127.0.0.1:4242");
  EXPECT_EQ(daemon.log.Joined(), "create,start,port,announce,ready");
  std::ifstream port_file(dir_ + "/grpc.port");
  std::stringstream port;
  port << port_file.rdbuf();
  EXPECT_EQ(port.str(), "4242\n");

  // SIGHUP reloads and the daemon runs on.
  ASSERT_EQ(pthread_kill(runner.native_handle(), SIGHUP), 0);
  EXPECT_FALSE(returned.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  EXPECT_TRUE(absl::StrContains(Logged(), "tessera-test: SIGHUP: reloading log_level")) << Logged();

  ASSERT_EQ(pthread_kill(runner.native_handle(), SIGTERM), 0);
  EXPECT_EQ(notify.Receive(absl::Seconds(10)), "STOPPING=1\nSTATUS=draining");
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(20)));
  runner.join();
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(steps_at_return,
            "create,start,port,announce,ready,stop-serving,deregister,stop(1s),metrics-gone");
  const std::string logged = Logged();
  const size_t drain = logged.find("tessera-test: signal 15 received, shutting down (grace 1 s)");
  const size_t stopped = logged.find("tessera-test: stopped");
  ASSERT_NE(drain, std::string::npos) << logged;
  ASSERT_NE(stopped, std::string::npos) << logged;
  EXPECT_LT(drain, stopped);
}

TEST_F(DaemonRunnerTest, AFailingStepEndsTheRunWithItsExitCode) {
  struct Case {
    std::string name;
    std::string failing;       // the RecordingDaemon step that fails
    std::string port_file;     // "" keeps Options()'s
    std::string metrics_port;  // --metrics_port_file
    int code;
    std::string steps;
    std::string reported;
  };
  const std::vector<Case> cases = {
      {"metrics endpoint", "", "", "/no-such-dir/metrics.port", 1, "", "--metrics_port_file"},
      {"create", "create", "", "", 2, "create", "INVALID_ARGUMENT: bad --data_dir"},
      {"start", "start", "", "", 1, "create,start,metrics-gone",
       "UNAVAILABLE: --listen: cannot bind"},
      {"port file", "", "/no-such-dir/grpc.port", "", 1, "create,start,port,stop(0),metrics-gone",
       "--port_file: cannot create"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RecordingDaemon daemon(c.failing);
    DaemonRunOptions options = Options();
    if (!c.port_file.empty()) options.port_file = dir_ + c.port_file;
    if (!c.metrics_port.empty()) {
      options.metrics.listen = "127.0.0.1:0";
      options.metrics.port_file = dir_ + c.metrics_port;
    }
    std::vector<std::string> reports;
    options.report_failure = [&reports](const absl::Status& s) { reports.push_back(s.ToString()); };
    EXPECT_EQ(RunDaemon(options, daemon), c.code);
    EXPECT_EQ(daemon.log.Joined(), c.steps);
    ASSERT_EQ(reports.size(), 1u);
    EXPECT_TRUE(absl::StrContains(reports[0], c.reported)) << reports[0];
  }

  // Without report_failure: one error line naming the program.
  RecordingDaemon daemon("create");
  EXPECT_EQ(RunDaemon(Options(), daemon), 2);
  EXPECT_TRUE(absl::StrContains(Logged(), "tessera-test: INVALID_ARGUMENT: bad --data_dir"))
      << Logged();
}

}  // namespace
}  // namespace tessera
