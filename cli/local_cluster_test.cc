// LocalCluster's process handling with stand-in daemons (shell scripts): what it starts, how it
// reports a daemon that fails, and that nothing it started outlives a failed Start(). The real
// daemons are covered by tests/e2e/.
#include "cli/local_cluster.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace tessera::cli {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool ProcessExists(pid_t pid) {
  // A zombie still has /proc/<pid>; a reaped process has none.
  return std::filesystem::exists(absl::StrCat("/proc/", pid));
}

class LocalClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-local-cluster-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    // The work directories go under our own TMPDIR, so the test can look at them.
    setenv("TMPDIR", dir_.c_str(), 1);
    for (const char* name : {"tessera-coordinator", "tessera-server", "tessera-worker"}) {
      WriteScript(name, "exec sleep 30\n");
    }
  }
  void TearDown() override {
    unsetenv("TMPDIR");
    std::filesystem::remove_all(dir_);
  }

  void WriteScript(const std::string& name, const std::string& body) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << "#!/bin/sh\n" << body;
    chmod(path.c_str(), 0755);
  }

  LocalCluster::Options Options() {
    LocalCluster::Options o;
    o.bin_dir = dir_;
    o.num_shards = 2;
    o.num_workers = 2;
    o.start_timeout = absl::Milliseconds(800);
    return o;
  }

  pid_t RecordedPid() {
    int pid = 0;
    EXPECT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(dir_ + "/pid")), &pid));
    return pid;
  }

  std::string dir_;
};

TEST_F(LocalClusterTest, RefusesBadCountsAndMissingBinaries) {
  LocalCluster::Options o = Options();
  o.num_shards = 0;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("shards: must be in [1, 64], got 0"), absl::string_view::npos)
      << c.status();
  o = Options();
  o.num_workers = 65;
  c = LocalCluster::Start(o);
  EXPECT_NE(c.status().message().find("workers: must be in [1, 64], got 65"),
            absl::string_view::npos)
      << c.status();

  std::filesystem::remove(dir_ + "/tessera-worker");
  c = LocalCluster::Start(Options());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("tessera-worker not found next to tessera: " + dir_ +
                                      "/tessera-worker"),
            absl::string_view::npos)
      << c.status();
}

TEST_F(LocalClusterTest, ReportsADaemonThatExitsWithItsLog) {
  WriteScript("tessera-coordinator",
              "echo \"$@\" > " + dir_ + "/args\necho 'listen: address in use' >&2\nexit 3\n");
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(Options());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(c.status().message().find("coordinator exited with status 3"), absl::string_view::npos)
      << c.status();
  EXPECT_NE(c.status().message().find("listen: address in use"), absl::string_view::npos)
      << c.status();
  const std::string args = ReadFile(dir_ + "/args");
  EXPECT_EQ(args.rfind("--listen 127.0.0.1:0 --port_file " + dir_ + "/tessera-local-", 0), 0u)
      << args;
  EXPECT_NE(args.find("/coordinator --num_shards 2 --log_level info"), std::string::npos) << args;
  // The work directory is gone with the failed cluster.
  int left = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    if (entry.path().filename().string().rfind("tessera-local-", 0) == 0) ++left;
  }
  EXPECT_EQ(left, 0);
}

TEST_F(LocalClusterTest, TimesOutOnADaemonThatNeverServesAndKillsIt) {
  WriteScript("tessera-coordinator", "echo $$ > " + dir_ + "/pid\nexec sleep 30\n");
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(Options());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(c.status().message().find("coordinator is not serving after 800ms (no port in "),
            absl::string_view::npos)
      << c.status();
  const pid_t pid = RecordedPid();
  ASSERT_GT(pid, 0);
  EXPECT_FALSE(ProcessExists(pid)) << "the stand-in coordinator " << pid << " was left running";
}

TEST_F(LocalClusterTest, GivesUpWhenInterrupted) {
  WriteScript("tessera-coordinator", "echo $$ > " + dir_ + "/pid\nexec sleep 30\n");
  LocalCluster::Options o = Options();
  o.start_timeout = absl::Seconds(30);
  std::atomic<int> polls{0};
  o.interrupted = [&polls] { return ++polls > 5; };
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
  const pid_t pid = RecordedPid();
  ASSERT_GT(pid, 0);
  EXPECT_FALSE(ProcessExists(pid));
}

TEST(SelfBinaryDirTest, IsTheTestsOwnFolder) {
  absl::StatusOr<std::string> dir = SelfBinaryDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  char path[4096] = {0};
  ASSERT_GT(readlink("/proc/self/exe", path, sizeof(path) - 1), 0);
  EXPECT_EQ(*dir + "/tessera_cli_test", std::string(path));
}

}  // namespace
}  // namespace tessera::cli
