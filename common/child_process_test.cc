// ChildProcess through its contract, with /bin/sh stand-ins for the daemons: where the output
// goes, the environment, the signal state the child starts with, exits and signals, the port
// file, the serving wait against an in-process health service, and no child left behind.
#include "common/child_process.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/health_probe.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Whether the kernel still knows `pid` (a zombie counts; a reaped process does not).
bool ProcessExists(pid_t pid) { return std::filesystem::exists(absl::StrCat("/proc/", pid)); }

class ChildProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-child-process-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // `script` under /bin/sh, named "sh", its output in <dir>/out.log.
  ChildProcess::Options Shell(const std::string& script) {
    ChildProcess::Options options;
    options.name = "sh";
    options.argv = {"/bin/sh", "-c", script};
    options.log_path = dir_ + "/out.log";
    return options;
  }

  ChildProcess Start(ChildProcess::Options options) {
    absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(std::move(options));
    EXPECT_TRUE(child.ok()) << child.status();
    return child.ok() ? *std::move(child) : ChildProcess();
  }

  std::string dir_;
};

TEST_F(ChildProcessTest, ExitCodesAndHowTheyAreDescribed) {
  struct Case {
    std::string script;
    int exit_code;
    std::string described;
  };
  const std::vector<Case> cases = {
      {"exit 0", 0, "exited with status 0"},
      {"exit 3", 3, "exited with status 3"},
      {"kill -KILL $$", 128 + SIGKILL, "was killed by signal 9 (Killed)"},
      {"kill -TERM $$", 128 + SIGTERM, "was killed by signal 15 (Terminated)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.script);
    ChildProcess child = Start(Shell(c.script));
    EXPECT_TRUE(child.running());
    EXPECT_EQ(child.exit_code(), -1);
    EXPECT_EQ(child.DescribeExit(), "is running");
    ASSERT_TRUE(child.Wait(absl::Seconds(10)));
    EXPECT_FALSE(child.running());
    EXPECT_EQ(child.pid(), -1);
    EXPECT_TRUE(child.ended());
    EXPECT_EQ(child.exit_code(), c.exit_code);
    EXPECT_EQ(child.DescribeExit(), c.described);
    EXPECT_EQ(DescribeWaitStatus(child.wait_status()), c.described);
  }
  ChildProcess never;
  EXPECT_FALSE(never.running());
  EXPECT_FALSE(never.ended());
  EXPECT_TRUE(never.HasExited());
  EXPECT_FALSE(never.Signal(SIGTERM));
  EXPECT_FALSE(never.Terminate(absl::Seconds(1)));
  EXPECT_EQ(never.DescribeExit(), "was not started");
}

TEST_F(ChildProcessTest, OutputGoesToTheLogFilesTruncatedOrAppended) {
  ChildProcess::Options together = Shell("echo out; echo err >&2");
  ChildProcess child = Start(together);
  ASSERT_TRUE(child.Wait(absl::Seconds(10)));
  EXPECT_EQ(ReadAll(dir_ + "/out.log"), "out\nerr\n");
  EXPECT_EQ(child.stdout_path(), dir_ + "/out.log");
  EXPECT_EQ(child.stderr_path(), dir_ + "/out.log");

  together.append_log = true;
  child = Start(together);
  ASSERT_TRUE(child.Wait(absl::Seconds(10)));
  EXPECT_EQ(ReadAll(dir_ + "/out.log"), "out\nerr\nout\nerr\n");

  ChildProcess::Options apart = Shell("echo out; echo err >&2; exit 4");
  apart.name = "apart";
  apart.err_path = dir_ + "/err.log";
  child = Start(apart);
  ASSERT_TRUE(child.Wait(absl::Seconds(10)));
  EXPECT_EQ(ReadAll(dir_ + "/out.log"), "out\n");
  EXPECT_EQ(ReadAll(dir_ + "/err.log"), "err\n");
  EXPECT_EQ(child.LogTail(), "err\n");
  EXPECT_EQ(child.LogTail(2), "...r\n");
  const absl::Status exited = child.ExitedError();
  EXPECT_EQ(exited.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(exited.message(),
            absl::StrCat("apart exited with status 4; the end of ", dir_, "/err.log:\nerr\n"));
}

TEST_F(ChildProcessTest, EnvironmentDropsPrefixesAndSetsVariables) {
  ::setenv("TESSERA_CHILD_TEST", "dropped", 1);
  ::setenv("CHILD_TEST_KEPT", "kept", 1);
  ::setenv("CHILD_TEST_REPLACED", "old", 1);
  ChildProcess::Options options =
      Shell("echo \"[$TESSERA_CHILD_TEST][$CHILD_TEST_KEPT][$CHILD_TEST_REPLACED][$CHILD_NEW]\"");
  options.drop_env = {"TESSERA_"};
  options.set_env = {{"CHILD_TEST_REPLACED", "new"}, {"CHILD_NEW", "added"}};
  ChildProcess child = Start(options);
  ASSERT_TRUE(child.Wait(absl::Seconds(10)));
  EXPECT_EQ(ReadAll(dir_ + "/out.log"), "[][kept][new][added]\n");
  ::unsetenv("TESSERA_CHILD_TEST");
  ::unsetenv("CHILD_TEST_KEPT");
  ::unsetenv("CHILD_TEST_REPLACED");
}

TEST_F(ChildProcessTest, StartsWithNoBlockedSignalsDefaultsAndStdinOnDevNull) {
  // The parent blocks and ignores what a daemon's main() blocks; the child gets neither.
  sigset_t blocked, old;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGTERM);
  sigaddset(&blocked, SIGHUP);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &blocked, &old), 0);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  struct sigaction old_pipe {};
  sigaction(SIGPIPE, &ignore, &old_pipe);
  ChildProcess child = Start(
      Shell("grep -E '^Sig(Blk|Ign):' /proc/self/status; readlink /proc/self/fd/0; sleep 30"));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  sigaction(SIGPIPE, &old_pipe, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!absl::StrContains(ReadAll(dir_ + "/out.log"), "/dev/null") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ReadAll(dir_ + "/out.log"),
            "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n/dev/null\n");
  EXPECT_TRUE(child.Terminate(absl::Seconds(10)));  // SIGTERM reaches it
  EXPECT_EQ(child.exit_code(), 128 + SIGTERM);
}

TEST_F(ChildProcessTest, TerminateKillsWhatIgnoresSigtermAndKillReaps) {
  ChildProcess child = Start(Shell("trap '' TERM; echo trapped; sleep 30"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ReadAll(dir_ + "/out.log").empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const pid_t pid = child.pid();
  EXPECT_FALSE(child.Terminate(absl::Milliseconds(300)));
  EXPECT_EQ(child.exit_code(), 128 + SIGKILL);
  EXPECT_FALSE(ProcessExists(pid));

  child = Start(Shell("sleep 30"));
  const pid_t second = child.pid();
  EXPECT_FALSE(child.Wait(absl::Milliseconds(50)));
  child.Kill();
  EXPECT_EQ(child.exit_code(), 128 + SIGKILL);
  EXPECT_FALSE(ProcessExists(second));
  child.Kill();  // no-op
  EXPECT_EQ(child.exit_code(), 128 + SIGKILL);
}

TEST_F(ChildProcessTest, NoChildOutlivesItsObject) {
  pid_t pid = -1;
  {
    ChildProcess child = Start(Shell("sleep 30"));
    pid = child.pid();
    ASSERT_GT(pid, 0);
    ChildProcess moved = std::move(child);
    EXPECT_FALSE(child.running());
    EXPECT_EQ(moved.pid(), pid);
  }
  EXPECT_FALSE(ProcessExists(pid));

  ChildProcess first = Start(Shell("sleep 30"));
  const pid_t replaced = first.pid();
  first = Start(Shell("sleep 30"));
  EXPECT_FALSE(ProcessExists(replaced));
  EXPECT_TRUE(first.running());
}

TEST_F(ChildProcessTest, OwnProcessGroup) {
  ChildProcess::Options options = Shell("sleep 30");
  options.own_process_group = true;
  options.die_with_parent = true;
  ChildProcess child = Start(options);
  EXPECT_EQ(getpgid(child.pid()), child.pid());
  ChildProcess same = Start(Shell("sleep 30"));
  EXPECT_EQ(getpgid(same.pid()), getpgrp());
}

TEST_F(ChildProcessTest, SpawnErrorsNameTheFileOrTheBinary) {
  ChildProcess::Options missing;
  missing.name = "ghost";
  missing.argv = {dir_ + "/no-such-binary"};
  absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(missing);
  EXPECT_EQ(child.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(child.status().message(), absl::StrCat("cannot start ghost: ", dir_,
                                                   "/no-such-binary: No such file or directory"));

  ChildProcess::Options unwritable = Shell("exit 0");
  unwritable.log_path = dir_ + "/no-such-dir/out.log";
  child = ChildProcess::Spawn(unwritable);
  EXPECT_EQ(child.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(child.status().message(), dir_ + "/no-such-dir/out.log"))
      << child.status();

  child = ChildProcess::Spawn(ChildProcess::Options{});
  EXPECT_EQ(child.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ChildProcessTest, PortFiles) {
  struct Case {
    std::string text;
    int port;
  };
  for (const Case& c : std::vector<Case>{
           {"", 0}, {"4242\n", 4242}, {" 7 \n", 7}, {"0\n", 0}, {"65536\n", 0}, {"12ab", 0}}) {
    std::ofstream(dir_ + "/port") << c.text;
    EXPECT_EQ(ReadPortFile(dir_ + "/port"), c.port) << "'" << c.text << "'";
  }
  EXPECT_EQ(ReadPortFile(dir_ + "/missing"), 0);

  const std::string file = dir_ + "/child.port";
  ChildProcess child = Start(Shell(absl::StrCat("sleep 0.2; echo 4242 > ", file, ".tmp; mv ", file,
                                                ".tmp ", file, "; sleep 30")));
  EXPECT_EQ(child.WaitForPortFile(file, absl::Seconds(10)), 4242);
  EXPECT_TRUE(child.running());

  // A child that exits without writing one: 0 at once, not after the timeout.
  ChildProcess quitter = Start(Shell("exit 1"));
  const absl::Time start = absl::Now();
  EXPECT_EQ(quitter.WaitForPortFile(dir_ + "/never.port", absl::Seconds(30)), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(quitter.exit_code(), 1);
}

TEST_F(ChildProcessTest, WaitUntilServingReportsServingExitTimeoutAndInterruption) {
  // A health service in this process stands in for the daemon's listener.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  v1::ParameterService::Service service;  // every method UNIMPLEMENTED; a server needs one
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  EXPECT_TRUE(IsServing(absl::StrCat("127.0.0.1:", port), absl::Seconds(5)));

  const std::string file = dir_ + "/serving.port";
  ChildProcess serving = Start(Shell(absl::StrCat("echo ", port, " > ", file, "; sleep 30")));
  absl::StatusOr<int> served = WaitUntilServing(serving, file, absl::Seconds(10));
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(*served, port);

  server->GetHealthCheckService()->SetServingStatus(false);
  EXPECT_FALSE(IsServing(absl::StrCat("127.0.0.1:", port), absl::Seconds(5)));
  absl::StatusOr<int> not_serving = WaitUntilServing(serving, file, absl::Milliseconds(300));
  EXPECT_EQ(not_serving.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(
      not_serving.status().message(),
      absl::StrCat("sh is not serving after 300ms; the end of ", dir_, "/out.log:\n")))
      << not_serving.status();
  server->Shutdown();

  ChildProcess silent = Start(Shell("echo starting; sleep 30"));
  absl::StatusOr<int> no_port = WaitUntilServing(silent, dir_ + "/none.port", absl::Seconds(0.3));
  EXPECT_EQ(no_port.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(no_port.status().message(),
                               absl::StrCat("sh is not serving after 300ms (no port in ", dir_,
                                            "/none.port); the end of ", dir_, "/out.log:\n")))
      << no_port.status();

  int polls = 0;
  absl::StatusOr<int> interrupted = WaitUntilServing(silent, dir_ + "/none.port", absl::Seconds(30),
                                                     [&polls] { return ++polls > 3; });
  EXPECT_EQ(interrupted.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(polls, 4);

  ChildProcess failing = Start(Shell("echo 'address in use' >&2; exit 5"));
  absl::StatusOr<int> exited = WaitUntilServing(failing, dir_ + "/none.port", absl::Seconds(30));
  EXPECT_EQ(exited.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(exited.status().message(), absl::StrCat("sh exited with status 5; the end of ", dir_,
                                                    "/out.log:\naddress in use\n"));
}

}  // namespace
}  // namespace tessera
