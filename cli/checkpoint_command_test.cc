// `tessera checkpoint JOB_ID` against an in-process JobService on 127.0.0.1:0: what it prints and
// its exit status.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cli/commands.h"
#include "cli/job_format.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera::cli {
namespace {

class FakeJobService final : public v1::JobService::Service {
 public:
  grpc::Status CheckpointJob(grpc::ServerContext*, const v1::CheckpointJobRequest* request,
                             v1::CheckpointRecord* record) override {
    {
      absl::MutexLock lock(&mu);
      asked.push_back(request->job_id());
    }
    if (request->job_id() == "done-2") {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "job done-2 is SUCCEEDED; only a RUNNING job takes checkpoints");
    }
    record->set_job_id(request->job_id());
    record->set_step(150);
    record->set_manual(true);
    for (int i = 0; i < 2; ++i) {
      v1::ShardCheckpoint* shard = record->add_shards();
      shard->set_shard_index(i);
      shard->set_bytes(768 * 1024);
    }
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::vector<std::string> asked;
};

TEST(CheckpointCommandTest, PrintsTheCommittedCheckpointAndExitsLikeTheOthers) {
  FakeJobService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  GlobalOptions global;
  global.coordinator = absl::StrCat("127.0.0.1:", port);

  ::testing::internal::CaptureStdout();
  EXPECT_EQ(RunCheckpoint(global, "mlp-1"), kExitOk);
  EXPECT_EQ(::testing::internal::GetCapturedStdout(),
            "checkpoint 150 of mlp-1 committed (2 shards, 1.5 MiB)\n");

  global.json = true;
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(RunCheckpoint(global, "mlp-1"), kExitOk);
  const std::string json = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(json.rfind("{\"checkpoint\":{", 0), 0u) << json;
  EXPECT_NE(json.find("\"step\":\"150\""), std::string::npos) << json;

  global.json = false;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(RunCheckpoint(global, "done-2"), kExitJobFailed);
  EXPECT_NE(
      ::testing::internal::GetCapturedStderr().find("checkpoint done-2: FAILED_PRECONDITION: "),
      std::string::npos);
  {
    absl::MutexLock lock(&service.mu);
    EXPECT_EQ(service.asked, (std::vector<std::string>{"mlp-1", "mlp-1", "done-2"}));
  }
  server->Shutdown();
  server.reset();
  // Nobody listens there any more.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(RunCheckpoint(global, "mlp-1"), kExitUnavailable);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find(global.coordinator), std::string::npos);
}

TEST(CheckpointCommandTest, SizesAreHumanReadable) {
  EXPECT_EQ(HumanBytes(812), "812 bytes");
  EXPECT_EQ(HumanBytes(4096), "4.0 KiB");
  EXPECT_EQ(HumanBytes(1536 * 1024), "1.5 MiB");
  EXPECT_EQ(HumanBytes(uint64_t{2} << 30), "2.0 GiB");
  v1::CheckpointRecord record;
  record.set_job_id("a-1");
  record.set_step(10);
  record.add_shards()->set_bytes(100);
  EXPECT_EQ(CheckpointLine(record), "checkpoint 10 of a-1 committed (1 shard, 100 bytes)");
}

}  // namespace
}  // namespace tessera::cli
