#include "common/grpc_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(StartGrpcServerTest, BindsPortZeroAndRunsTheConfigureHook) {
  GrpcServerOptions options;
  options.listen = "127.0.0.1:0";
  int configured = 0;
  options.configure = [&configured](grpc::ServerBuilder&) { ++configured; };
  absl::StatusOr<StartedGrpcServer> started = StartGrpcServer(options);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_GT(started->port, 0);
  EXPECT_EQ(configured, 1);
  ASSERT_NE(started->server->GetHealthCheckService(), nullptr);

  // A second server on the same port: UNAVAILABLE naming the flag and the address.
  GrpcServerOptions again;
  again.listen = absl::StrCat("127.0.0.1:", started->port);
  again.listen_flag = "--listen";
  absl::StatusOr<StartedGrpcServer> clash = StartGrpcServer(again);
  ASSERT_FALSE(clash.ok());
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(clash.status().message(), "--listen: cannot bind " + again.listen))
      << clash.status();
  SetGrpcServing(started->server.get(), false);
  started->server->Shutdown();
}

TEST(MakeDirsTest, CreatesParentsAndNamesTheFlagOnError) {
  char tmpl[] = "/tmp/tessera-makedirs-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  const std::string deep = root + "/a/b/c";
  ASSERT_TRUE(MakeDirs(deep).ok());
  struct stat st;
  ASSERT_EQ(stat(deep.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_TRUE(MakeDirs(deep).ok());  // already there

  const std::string file = root + "/file";
  std::ofstream(file) << "x";
  absl::Status not_dir = MakeDirs(file, "--data_dir");
  EXPECT_EQ(not_dir.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(not_dir.message(), "--data_dir: " + file + " is not a directory"))
      << not_dir;
  absl::Status under_file = MakeDirs(file + "/sub", "--state_dir");
  EXPECT_EQ(under_file.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(under_file.message(), "--state_dir: cannot create")) << under_file;
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace tessera
