// Tests through the real gRPC service on 127.0.0.1:0: every validation error with its code and a
// message that names the key or field, the shard still serving afterwards, PushPull streams with
// parked pulls, Pull splitting, health, and Checkpoint/Restore.
#include "server/grpc_parameter_service.h"

#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/push_pull_requests.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/shard_server.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;  // NOLINT: request builders

constexpr size_t kLimit = size_t{1} << 20;

class GrpcParameterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ShardServerOptions options;
    options.listen = "127.0.0.1:0";
    options.max_message_bytes = kLimit;
    options.threads = 2;
    auto server = ShardServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_GT(server_->port(), 0);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);  // so that the client can send what the shard must refuse
    args.SetMaxReceiveMessageSize(-1);
    channel_ =
        grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args);
    stub_ = v1::ParameterService::NewStub(channel_);

    v1::CreateJobStateRequest job;
    job.set_job_id("job");
    *job.mutable_config() = Config(v1::CONSISTENCY_BSP, 2, 0.5f);
    *job.add_partitions() = Dense("w", 0, 4);
    *job.add_partitions() = Dense("big", 0, 100000);
    *job.add_partitions() = Dense("big", 1, 100000);
    *job.add_partitions() = Dense("big", 2, 100000);
    auto* table = job.add_tables();
    table->set_name("emb");
    table->set_dim(2);
    ASSERT_TRUE(CreateJobState(job).ok());

    v1::CreateJobStateRequest asp;
    asp.set_job_id("asp");
    *asp.mutable_config() = Config(v1::CONSISTENCY_ASP, 2, 0.5f);
    *asp.add_partitions() = Dense("w", 0, 4);
    ASSERT_TRUE(CreateJobState(asp).ok());
  }

  void TearDown() override {
    if (server_) server_->Stop(absl::Seconds(1));
  }

#define TESSERA_UNARY_CALL(Name)                                                       \
  grpc::Status Name(const v1::Name##Request& request) {                                \
    grpc::ClientContext context;                                                       \
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10)); \
    v1::Name##Response response;                                                       \
    return stub_->Name(&context, request, &response);                                  \
  }
  TESSERA_UNARY_CALL(CreateJobState)
  TESSERA_UNARY_CALL(UpdateMembership)
  TESSERA_UNARY_CALL(DropJob)
  TESSERA_UNARY_CALL(Checkpoint)
  TESSERA_UNARY_CALL(Restore)
#undef TESSERA_UNARY_CALL

  grpc::Status Push(const v1::PushPullRequest& r, v1::PushResponse* response = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PushResponse local;
    return stub_->Push(&context, r, response ? response : &local);
  }

  // The shard still serves: an ASP push and a pull on the job "asp" succeed.
  void ExpectStillServing() {
    EXPECT_TRUE(Push(Request("asp", 0, 1, 0, ++asp_seq_, {GradSlice("w", 0, {1, 1, 1, 1})})).ok());
    grpc::ClientContext context;
    v1::PullRequest pull;
    pull.set_job_id("asp");
    pull.set_step(-1);
    *pull.add_keys() = PullKey("w", 0);
    auto reader = stub_->Pull(&context, pull);
    v1::PullResponse response;
    EXPECT_TRUE(reader->Read(&response));
    while (reader->Read(&response)) {
    }
    EXPECT_TRUE(reader->Finish().ok());
  }

  std::unique_ptr<ShardServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ParameterService::Stub> stub_;
  uint64_t asp_seq_ = 0;
};

struct ErrorCase {
  std::string name;
  v1::PushPullRequest request;
  grpc::StatusCode code;
  std::vector<std::string> mentions;
};

std::vector<ErrorCase> ErrorCases() {
  v1::PushPullRequest bad_encoding = Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})});
  bad_encoding.mutable_push(0)->set_encoding(static_cast<v1::Encoding>(99));
  v1::PushPullRequest nan = Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {1, NAN, 1, 1})});
  v1::PushPullRequest sparse_no_rows = Request("job", 0, 1, 0, 1, {GradSlice("emb", 0, {1, 2})});
  v1::PushPullRequest dense_rows = Request("job", 0, 1, 0, 1, {RowsSlice("w", {3}, {1, 1, 1, 1})});
  v1::PushPullRequest bf16_short =
      Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1}, false, v1::ENCODING_BF16)});
  return {
      {"unknown job",
       Request("nope", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})}),
       grpc::StatusCode::NOT_FOUND,
       {"nope"}},
      {"unknown key",
       Request("job", 0, 1, 0, 1, {GradSlice("missing", 3, {1})}),
       grpc::StatusCode::NOT_FOUND,
       {"missing/3"}},
      {"byte count",
       Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1})}),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"w/0", "16 bytes", "12 bytes"}},
      {"bf16 byte count", bf16_short, grpc::StatusCode::INVALID_ARGUMENT, {"w/0", "8 bytes", "6"}},
      {"bad encoding", bad_encoding, grpc::StatusCode::INVALID_ARGUMENT, {"w/0", "encoding 99"}},
      {"row ids on dense", dense_rows, grpc::StatusCode::INVALID_ARGUMENT, {"w/0", "row_ids"}},
      {"sparse without rows",
       sparse_no_rows,
       grpc::StatusCode::INVALID_ARGUMENT,
       {"emb/0", "row_ids"}},
      {"worker out of range",
       Request("job", 7, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})}),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"worker_id", "7", "num_workers 2"}},
      {"step from the future",
       Request("job", 0, 1, 5, 1, {GradSlice("w", 0, {1, 1, 1, 1})}),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"w/0", "step 5", "version 0"}},
      {"negative step",
       Request("job", 0, 1, -2, 1, {GradSlice("w", 0, {1, 1, 1, 1})}),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"step", "-2"}},
      {"NaN", nan, grpc::StatusCode::INVALID_ARGUMENT, {"w/0", "NaN"}},
  };
}

TEST_F(GrpcParameterServiceTest, EveryValidationErrorThroughUnaryPush) {
  for (const ErrorCase& c : ErrorCases()) {
    SCOPED_TRACE(c.name);
    grpc::Status status = Push(c.request);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    for (const std::string& m : c.mentions) EXPECT_THAT(status.error_message(), HasSubstr(m));
    ExpectStillServing();
  }
}

// The same errors on one PushPull stream: each comes back in PushPullResponse.status with the
// request's seq, and the stream stays open for the next request.
TEST_F(GrpcParameterServiceTest, EveryValidationErrorOnOneStream) {
  grpc::ClientContext context;
  auto stream = stub_->PushPull(&context);
  uint64_t seq = 100;
  for (ErrorCase c : ErrorCases()) {
    SCOPED_TRACE(c.name);
    c.request.set_seq(++seq);
    ASSERT_TRUE(stream->Write(c.request));
    v1::PushPullResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.seq(), seq);
    EXPECT_EQ(response.status().code(), static_cast<int>(c.code)) << response.status().message();
    for (const std::string& m : c.mentions) EXPECT_THAT(response.status().message(), HasSubstr(m));
  }
  // Still open: a good ASP request on the same stream succeeds.
  ASSERT_TRUE(
      stream->Write(Request("asp", 1, 1, 0, ++seq, {GradSlice("w", 0, {2, 2, 2, 2}, true)})));
  v1::PushPullResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.status().code(), 0) << response.status().message();
  ASSERT_EQ(response.weights_size(), 1);
  EXPECT_EQ(Floats(response.weights(0)), (std::vector<float>{-1, -1, -1, -1}));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  ExpectStillServing();
}

TEST_F(GrpcParameterServiceTest, NonFiniteSkipPolicyIsCountedNotApplied) {
  v1::CreateJobStateRequest job;
  job.set_job_id("skip");
  *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  job.mutable_config()->set_non_finite_policy(v1::NON_FINITE_POLICY_SKIP);
  *job.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(CreateJobState(job).ok());
  v1::PushResponse response;
  ASSERT_TRUE(
      Push(Request("skip", 0, 1, 0, 1, {GradSlice("w", 0, {INFINITY, 1})}), &response).ok());
  EXPECT_EQ(response.skipped_non_finite(), 1u);
}

TEST_F(GrpcParameterServiceTest, MessageOverTheLimitIsResourceExhausted) {
  // 2 MiB of gradient against a 1 MiB limit; the job need not even exist.
  grpc::Status status =
      Push(Request("asp", 0, 1, 0, 1, {GradSlice("w", 0, std::vector<float>(512 * 1024, 1.0f))}));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  ExpectStillServing();

  // On a stream the library ends the stream with RESOURCE_EXHAUSTED; the shard serves on.
  grpc::ClientContext context;
  auto stream = stub_->PushPull(&context);
  stream->Write(
      Request("asp", 0, 1, 0, 1, {GradSlice("w", 0, std::vector<float>(512 * 1024, 1.0f))}));
  v1::PushPullResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ExpectStillServing();
}

// Stopping the shard while a pull is parked answers it with CANCELLED and ends cleanly.
TEST_F(GrpcParameterServiceTest, StopWithAParkedPullEndsCleanly) {
  grpc::ClientContext context;
  auto stream = stub_->PushPull(&context);
  ASSERT_TRUE(stream->Write(Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1}, true)})));
  // The pull parks until worker 1 pushes step 0, which never happens.
  ASSERT_TRUE(stream->Write(Request("job", 0, 1, 0, 2, {}, {PullKey("w", 0)})));
  v1::PushPullResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.seq(), 2u);
  server_->Stop(absl::Milliseconds(200));
  if (stream->Read(&response)) {
    EXPECT_EQ(response.seq(), 1u);
    EXPECT_EQ(response.status().code(), static_cast<int>(grpc::StatusCode::CANCELLED));
  }
  stream->Finish();
  server_.reset();
}

TEST_F(GrpcParameterServiceTest, ControlCallsValidate) {
  v1::CreateJobStateRequest bad;
  bad.set_job_id("bad");
  *bad.mutable_config() = Config(v1::CONSISTENCY_BSP, 0, 0.5f);
  grpc::Status status = CreateJobState(bad);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("num_workers"));

  v1::CreateJobStateRequest resized;
  resized.set_job_id("job");
  *resized.mutable_config() = Config(v1::CONSISTENCY_BSP, 2, 0.5f);
  *resized.add_partitions() = Dense("w", 0, 5);
  status = CreateJobState(resized);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("w/0"));

  v1::UpdateMembershipRequest membership;
  membership.set_job_id("job");
  membership.add_live_workers(9);
  status = UpdateMembership(membership);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("live_workers"));

  v1::DropJobRequest drop;
  drop.set_job_id("nope");
  status = DropJob(drop);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("nope"));

  // This shard has no --data_dir.
  v1::CheckpointRequest checkpoint;
  checkpoint.set_job_id("job");
  checkpoint.set_step(5);
  status = Checkpoint(checkpoint);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--data_dir not set"));
  status = Restore(v1::RestoreRequest());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ExpectStillServing();
}

TEST(GrpcCheckpointTest, CheckpointAndRestoreThroughGrpc) {
  std::string dir = ::testing::TempDir() + "/grpcckptXXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  ShardServerOptions options;
  options.listen = "127.0.0.1:0";
  options.threads = 2;
  options.data_dir = dir;
  options.shard_index = 1;
  auto server = ShardServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::ParameterService::NewStub(channel);
  auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(10); };

  v1::CreateJobStateRequest job;
  job.set_job_id("job-7");
  *job.mutable_config() = Config(v1::CONSISTENCY_BSP, 1, 0.5f);
  *job.add_partitions() = Dense("w", 0, 4, {1, 2, 3, 4});
  {
    grpc::ClientContext context;
    context.set_deadline(deadline());
    v1::CreateJobStateResponse response;
    ASSERT_TRUE(stub->CreateJobState(&context, job, &response).ok());
  }
  auto push = [&](int64_t step, uint64_t incarnation) {
    grpc::ClientContext context;
    context.set_deadline(deadline());
    v1::PushResponse response;
    return stub->Push(&context,
                      Request("job-7", 0, incarnation, step, static_cast<uint64_t>(step + 1),
                              {GradSlice("w", 0, {2, 2, 2, 2})}),
                      &response);
  };
  ASSERT_TRUE(push(0, 1).ok());
  {
    // Step 2 is registered ahead; the call answers once the job reaches it and the file is
    // durable, while the push below runs on the same shard.
    grpc::ClientContext context;
    context.set_deadline(deadline());
    v1::CheckpointRequest request;
    request.set_job_id("job-7");
    request.set_step(2);
    v1::CheckpointResponse response;
    std::thread pusher([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      EXPECT_TRUE(push(1, 1).ok());
    });
    grpc::Status status = stub->Checkpoint(&context, request, &response);
    pusher.join();
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.path(), dir + "/checkpoints/job-7/ckpt-2/shard-1");
    EXPECT_EQ(response.step(), 2);
    EXPECT_GT(response.bytes(), 16u);
  }
  ASSERT_TRUE(push(2, 1).ok());
  {
    grpc::ClientContext context;
    context.set_deadline(deadline());
    v1::UpdateMembershipRequest request;
    request.set_job_id("job-7");
    request.add_live_workers(0);
    request.set_effective_step(3);
    v1::UpdateMembershipResponse response;
    ASSERT_TRUE(stub->UpdateMembership(&context, request, &response).ok());
    EXPECT_EQ(response.completed_steps(), 3);
  }
  struct Case {
    std::string job;
    int64_t step;
    grpc::StatusCode code;
  };
  for (const Case& c : std::vector<Case>{{"job-7", 2, grpc::StatusCode::OK},
                                         {"job-7", 9, grpc::StatusCode::NOT_FOUND},
                                         {"../job-7", 2, grpc::StatusCode::INVALID_ARGUMENT},
                                         {"job-7", 0, grpc::StatusCode::INVALID_ARGUMENT}}) {
    grpc::ClientContext context;
    context.set_deadline(deadline());
    v1::RestoreRequest request;
    request.set_job_id(c.job);
    request.set_step(c.step);
    request.set_min_incarnation(5);
    v1::RestoreResponse response;
    grpc::Status status = stub->Restore(&context, request, &response);
    EXPECT_EQ(status.error_code(), c.code)
        << c.job << " " << c.step << ": " << status.error_message();
    if (status.ok()) {
      EXPECT_EQ(response.step(), 2);
      EXPECT_EQ(response.partitions(), 1u);
    }
  }
  // Restored to step 2: the old incarnation is refused, the new one pushes step 2 again.
  EXPECT_EQ(push(2, 1).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(push(2, 5).ok());
  (*server)->Stop(absl::Seconds(1));
}

// Checkpoint calls whose deadline passes are finished at once and stop holding the job's slots
// for waiting steps, so the coordinator's later calls are not refused with RESOURCE_EXHAUSTED.
TEST(GrpcCheckpointTest, CancelledCheckpointCallsFreeTheirSlots) {
  std::string dir = ::testing::TempDir() + "/grpcckptXXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  ShardServerOptions options;
  options.listen = "127.0.0.1:0";
  options.threads = 2;
  options.data_dir = dir;
  auto server = ShardServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::ParameterService::NewStub(channel);
  v1::CreateJobStateRequest job;
  job.set_job_id("job-c");
  *job.mutable_config() = Config(v1::CONSISTENCY_BSP, 1, 0.5f);
  *job.add_partitions() = Dense("w", 0, 4, {1, 2, 3, 4});
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::CreateJobStateResponse response;
    ASSERT_TRUE(stub->CreateJobState(&context, job, &response).ok());
  }
  auto checkpoint = [&](int64_t step, std::chrono::milliseconds timeout) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::CheckpointRequest request;
    request.set_job_id("job-c");
    request.set_step(step);
    v1::CheckpointResponse response;
    grpc::Status status = stub->Checkpoint(&context, request, &response);
    return std::make_pair(status, response);
  };
  // 16 far steps whose callers give up; each call ends with its deadline, not later.
  std::vector<std::thread> callers;
  std::atomic<int> expired{0};
  for (int i = 0; i < 16; ++i) {
    callers.emplace_back([&, i] {
      auto [status, response] = checkpoint(1000 + i, std::chrono::milliseconds(300));
      if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) ++expired;
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(expired.load(), 16);
  // Step 1 is registered, then reached by a push: before the fix the 16 dead calls kept every
  // slot and this was RESOURCE_EXHAUSTED.
  std::thread pusher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PushResponse response;
    EXPECT_TRUE(stub->Push(&context,
                           Request("job-c", 0, 1, 0, 1, {GradSlice("w", 0, {2, 2, 2, 2})}),
                           &response)
                    .ok());
  });
  auto [status, response] = checkpoint(1, std::chrono::seconds(10));
  pusher.join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.step(), 1);
  EXPECT_EQ(response.path(), dir + "/checkpoints/job-c/ckpt-1/shard-0");
  (*server)->Stop(absl::Seconds(1));
}

// A parked BSP pull does not hold the stream: a later request on it is answered first, and the
// parked one comes back with its own seq once the other worker pushes.
TEST_F(GrpcParameterServiceTest, ParkedPullDoesNotBlockLaterRequestsOnTheStream) {
  grpc::ClientContext context;
  auto stream = stub_->PushPull(&context);
  ASSERT_TRUE(stream->Write(Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {2, 4, 6, 8}, true)})));
  ASSERT_TRUE(stream->Write(Request("job", 0, 1, 0, 2, {}, {PullKey("w", 0)})));
  v1::PushPullResponse first;
  ASSERT_TRUE(stream->Read(&first));
  EXPECT_EQ(first.seq(), 2u);  // the pull for step 0 is open at version 0
  EXPECT_EQ(first.status().code(), 0) << first.status().message();
  ASSERT_EQ(first.weights_size(), 1);
  EXPECT_EQ(first.weights(0).version(), 0);

  ASSERT_TRUE(Push(Request("job", 1, 1, 0, 1, {GradSlice("w", 0, {2, 0, 2, 0})})).ok());
  v1::PushPullResponse second;
  ASSERT_TRUE(stream->Read(&second));
  EXPECT_EQ(second.seq(), 1u);
  ASSERT_EQ(second.weights_size(), 1);
  EXPECT_EQ(second.weights(0).version(), 1);
  EXPECT_EQ(Floats(second.weights(0)), (std::vector<float>{-1, -1, -2, -2}));

  // A retry of seq 1 is a duplicate, answered with the current weights.
  ASSERT_TRUE(stream->Write(Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {2, 4, 6, 8}, true)})));
  v1::PushPullResponse retry;
  ASSERT_TRUE(stream->Read(&retry));
  EXPECT_EQ(retry.duplicates(), 1u);
  EXPECT_EQ(Floats(retry.weights(0)), (std::vector<float>{-1, -1, -2, -2}));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// Pull splits its answer: three 400 KB partitions against a 1 MiB limit take two messages or
// more, none over the limit, and all weights arrive.
TEST_F(GrpcParameterServiceTest, PullSplitsAnswersUnderTheMessageLimit) {
  grpc::ClientContext context;
  v1::PullRequest pull;
  pull.set_job_id("job");
  pull.set_step(0);
  for (uint32_t i = 0; i < 3; ++i) *pull.add_keys() = PullKey("big", i);
  *pull.add_keys() = PullKey("emb", 0, {4, 5});
  auto reader = stub_->Pull(&context, pull);
  v1::PullResponse response;
  int messages = 0;
  int slices = 0;
  while (reader->Read(&response)) {
    ++messages;
    EXPECT_LE(response.ByteSizeLong(), kLimit);
    slices += response.weights_size();
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_GE(messages, 2);
  EXPECT_EQ(slices, 4);

  // A Pull of one slice larger than the limit is refused, naming the key.
  v1::PullRequest fp32;
  fp32.set_job_id("job");
  fp32.set_step(-1);
  std::vector<int64_t> rows(200000);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>(i);
  *fp32.add_keys() = PullKey("emb", 0, rows);
  grpc::ClientContext context2;
  auto reader2 = stub_->Pull(&context2, fp32);
  while (reader2->Read(&response)) {
  }
  grpc::Status status = reader2->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("emb/0"));
}

TEST_F(GrpcParameterServiceTest, PullValidatesKeysEncodingWorkerAndStep) {
  struct Case {
    std::string name;
    v1::PullRequest request;
    grpc::StatusCode code;
    std::vector<std::string> mentions;
  };
  auto pull = [](const std::string& job, uint32_t worker, int64_t step, v1::Slice key,
                 int encoding = 0) {
    v1::PullRequest r;
    r.set_job_id(job);
    r.set_worker_id(worker);
    r.set_step(step);
    r.set_encoding(static_cast<v1::Encoding>(encoding));
    *r.add_keys() = std::move(key);
    return r;
  };
  const std::vector<Case> cases = {
      {"unknown job", pull("nope", 0, -1, PullKey("w", 0)), grpc::StatusCode::NOT_FOUND, {"nope"}},
      {"unknown key", pull("job", 0, -1, PullKey("w", 9)), grpc::StatusCode::NOT_FOUND, {"w/9"}},
      {"bad encoding",
       pull("job", 0, -1, PullKey("w", 0), 42),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"encoding", "42"}},
      {"worker out of range",
       pull("job", 5, -1, PullKey("w", 0)),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"worker_id", "5"}},
      {"rows on dense",
       pull("job", 0, -1, PullKey("w", 0, {1})),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"w/0", "row_ids"}},
      {"sparse without rows",
       pull("job", 0, -1, PullKey("emb", 0)),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"emb/0", "row_ids"}},
      {"step from the future",
       pull("job", 0, 7, PullKey("w", 0)),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"w/0", "step 7", "version 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    grpc::ClientContext context;
    auto reader = stub_->Pull(&context, c.request);
    v1::PullResponse response;
    EXPECT_FALSE(reader->Read(&response));
    grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    for (const std::string& m : c.mentions) EXPECT_THAT(status.error_message(), HasSubstr(m));
    ExpectStillServing();
  }
}

// Declarations far beyond the shard's memory (terabytes, by the default budget of 3/4 of the
// physical memory) and answers beyond the message limit fail alone, and the shard keeps serving.
TEST_F(GrpcParameterServiceTest, HostileSizesAreRefusedAndTheShardKeepsServing) {
  v1::CreateJobStateRequest huge;
  huge.set_job_id("huge");
  *huge.mutable_config() = Config(v1::CONSISTENCY_BSP, 65536, 0.5f, v1::OPTIMIZER_KIND_ADAM);
  for (uint32_t i = 0; i < 4096; ++i) *huge.add_partitions() = Dense("w", i, int64_t{1} << 28);
  grpc::Status status = CreateJobState(huge);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("max_memory_bytes"));
  ExpectStillServing();

  // 500000 rows of table emb (dim 2, fp32) would answer 4 MB, over the 1 MiB message limit: refused
  // before any of it is built.
  grpc::ClientContext context;
  auto stream = stub_->PushPull(&context);
  v1::PushPullRequest pull = Request("job", 0, 1, 0, 1, {}, {PullKey("emb", 0)});
  for (int64_t r = 0; r < 500000; ++r) pull.mutable_pull(0)->add_row_ids(r % 7);
  ASSERT_TRUE(stream->Write(pull));
  v1::PushPullResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.status().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED))
      << response.status().message();
  EXPECT_THAT(response.status().message(), HasSubstr("emb/0"));
  // 200000 rows of a table of width 2^20 would be 800 GiB (std::bad_alloc, or the OOM killer).
  v1::CreateJobStateRequest wide;
  wide.set_job_id("wide");
  *wide.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  wide.add_tables()->set_name("t");
  wide.mutable_tables(0)->set_dim(1 << 20);
  ASSERT_TRUE(CreateJobState(wide).ok());
  v1::PushPullRequest wide_pull = Request("wide", 0, 1, 0, 1, {}, {PullKey("t", 0)});
  for (int64_t r = 0; r < 200000; ++r) wide_pull.mutable_pull(0)->add_row_ids(r % 3);
  ASSERT_TRUE(stream->Write(wide_pull));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.status().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED))
      << response.status().message();
  EXPECT_THAT(response.status().message(), HasSubstr("t/0"));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  ExpectStillServing();
}

// Pulls that park for a step that never comes and are then cancelled (deadline) do not pile up
// in the shard: the gate drops them, so retries cannot exhaust it.
TEST_F(GrpcParameterServiceTest, CancelledParkedPullsDoNotPileUp) {
  constexpr int kCalls = 150;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(5));
    v1::PullRequest pull;
    pull.set_job_id("job");
    pull.set_step(1);  // BSP: waits for version 1, which needs both workers to push step 0
    *pull.add_keys() = PullKey("w", 0);
    auto reader = stub_->Pull(&context, pull);
    v1::PullResponse response;
    EXPECT_FALSE(reader->Read(&response));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  auto stats = server_->store()->GetJobStats("job");
  ASSERT_TRUE(stats.ok());
  // Without the sweep all 150 would still be parked; with it, about 64 at most (the sweep runs
  // when 64 are parked, and drops those whose cancellation the shard has seen).
  EXPECT_LE(stats->parked_pulls, 100u);
  // The step completes and the shard still answers a pull for it.
  ASSERT_TRUE(Push(Request("job", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})})).ok());
  ASSERT_TRUE(Push(Request("job", 1, 1, 0, 1, {GradSlice("w", 0, {3, 3, 3, 3})})).ok());
  stats = server_->store()->GetJobStats("job");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->parked_pulls, 0u);
  grpc::ClientContext context;
  v1::PullRequest pull;
  pull.set_job_id("job");
  pull.set_step(1);
  *pull.add_keys() = PullKey("w", 0);
  auto reader = stub_->Pull(&context, pull);
  v1::PullResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(Floats(response.weights(0)), (std::vector<float>{-1, -1, -1, -1}));
  EXPECT_TRUE(reader->Finish().ok());
}

// Calls are cancelled while the pushes that open their parked pulls arrive: whichever comes first,
// no write reaches a finished call (run under ASan/TSan), every step is applied once, and the shard
// keeps serving.
TEST_F(GrpcParameterServiceTest, CancellingCallsWhileTheirPullsOpenIsSafe) {
  constexpr int kSteps = 30;
  for (int step = 0; step < kSteps; ++step) {
    grpc::ClientContext stream_context;
    auto stream = stub_->PushPull(&stream_context);
    ASSERT_TRUE(stream->Write(Request("job", 0, 1, step + 1, 1, {}, {PullKey("w", 0)})));
    grpc::ClientContext pull_context;
    v1::PullRequest pull;
    pull.set_job_id("job");
    pull.set_step(step + 1);
    *pull.add_keys() = PullKey("w", 0);
    auto reader = stub_->Pull(&pull_context, pull);
    std::thread cancel([&] {
      stream_context.TryCancel();
      pull_context.TryCancel();
    });
    const uint64_t seq = static_cast<uint64_t>(step) + 1;
    EXPECT_TRUE(Push(Request("job", 0, 1, step, seq, {GradSlice("w", 0, {1, 1, 1, 1})})).ok());
    EXPECT_TRUE(Push(Request("job", 1, 1, step, seq, {GradSlice("w", 0, {3, 3, 3, 3})})).ok());
    cancel.join();
    v1::PushPullResponse response;
    while (stream->Read(&response)) {
    }
    stream->Finish();
    v1::PullResponse weights;
    while (reader->Read(&weights)) {
    }
    reader->Finish();
  }
  grpc::ClientContext context;
  v1::PullRequest pull;
  pull.set_job_id("job");
  pull.set_step(kSteps);
  *pull.add_keys() = PullKey("w", 0);
  auto reader = stub_->Pull(&context, pull);
  v1::PullResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(Floats(response.weights(0)), (std::vector<float>(4, -1.0f * kSteps)));
  EXPECT_EQ(response.weights(0).version(), kSteps);
  EXPECT_TRUE(reader->Finish().ok());
  auto stats = server_->store()->GetJobStats("job");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->parked_pulls, 0u);
  ExpectStillServing();
}

// Server reflection lists the ParameterService (grpc.reflection.v1alpha, as Debian ships it).
TEST_F(GrpcParameterServiceTest, ServesReflection) {
  grpc::GenericStub generic_stub(channel_);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = generic_stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  // ServerReflectionRequest{list_services: ""}: field 7, length 0.
  grpc::Slice request_slice(std::string("\x3a\x00", 2));
  grpc::ByteBuffer request(&request_slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_THAT(bytes, HasSubstr("tessera.v1.ParameterService"));
  EXPECT_THAT(bytes, HasSubstr("grpc.health.v1.Health"));
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

grpc::Status GenericUnary(grpc::Channel* channel, const std::string& method,
                          const std::string& request_bytes, std::string* response_bytes) {
  grpc::GenericStub generic_stub(channel->shared_from_this());
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  auto call = generic_stub.PrepareUnaryCall(&context, method, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  cq.Next(&tag, &ok);
  std::vector<grpc::Slice> slices;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      response_bytes->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

TEST_F(GrpcParameterServiceTest, ServesTheStandardHealthService) {
  std::string response;
  // HealthCheckRequest{} is empty; HealthCheckResponse{status: SERVING} is 08 01.
  grpc::Status status = GenericUnary(channel_.get(), "/grpc.health.v1.Health/Check", "", &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response, std::string("\x08\x01", 2));
}

// ---- The PushPull codec (common/push_pull_codec.h) over the store's shared weights. The codec's
// own cases are in common/push_pull_codec_test.cc.

// The bytes of `buffer`, joined.
std::string Flat(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string flat;
  for (const grpc::Slice& s : slices) {
    flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return flat;
}

SharedWeights Shared(size_t n, float first) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = first + static_cast<float>(i);
  return SharedWeights(std::move(values));
}

// Weight data held by reference is sent as if it were in the response: large data as its own
// slice that holds a reference until gRPC releases it, small data copied into the header. The size
// computed beforehand is the serialised size.
TEST(PushPullWireTest, SharedWeightsSerialiseAsTheWholeResponse) {
  auto pool = std::make_shared<BufferPool>(4, 64 << 20);
  const SharedWeights big = Shared(100000, 0.5f);  // its own slice
  const SharedWeights small = Shared(10, -3.0f);   // under kOwnSliceMinBytes: copied
  const SharedWeights huge = Shared(40000, 7.0f);  // 160000 bytes: a 3-byte length prefix
  v1::PushPullResponse response;
  response.set_seq(7);
  *response.add_weights() = PullKey("big", 0);
  response.mutable_weights(0)->set_encoding(v1::ENCODING_FP32);
  response.mutable_weights(0)->set_version(3);
  *response.add_weights() = GradSlice("pooled", 1, std::vector<float>(20000, 2.0f));
  *response.add_weights() = PullKey("small", 2);
  response.mutable_weights(2)->set_encoding(v1::ENCODING_FP32);
  *response.add_weights() = PullKey("huge", 3);
  std::vector<std::pair<int, SharedWeights>> shared = {{3, huge}, {0, big}, {2, small}};
  v1::PushPullResponse want = response;
  want.mutable_weights(0)->set_data(std::string(big.bytes()));
  want.mutable_weights(2)->set_data(std::string(small.bytes()));
  want.mutable_weights(3)->set_data(std::string(huge.bytes()));

  const SharedAnswerWeights external(shared);
  absl::StatusOr<size_t> size = PushPullResponseSize(response, &external);
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_EQ(*size, want.ByteSizeLong());
  {
    size_t bytes = 0;
    grpc::ByteBuffer buffer;
    const absl::Status encoded =
        EncodePushPullResponse(&response, &external, pool, &buffer, &bytes);
    ASSERT_TRUE(encoded.ok()) << encoded;
    shared.clear();
    EXPECT_EQ(bytes, want.ByteSizeLong());
    EXPECT_EQ(buffer.Length(), want.ByteSizeLong());
    // The data follows the other fields of its slice: compare what a parser reads.
    v1::PushPullResponse got;
    ASSERT_TRUE(got.ParseFromString(Flat(buffer)));
    EXPECT_TRUE(got.SerializeAsString() == want.SerializeAsString());
    // The large data is referenced by the buffer, the small data was copied.
    EXPECT_FALSE(big.unique());
    EXPECT_FALSE(huge.unique());
    EXPECT_TRUE(small.unique());
  }
  // gRPC released the slices (here: the buffer above): only this test holds the weights.
  EXPECT_TRUE(big.unique());
  EXPECT_TRUE(huge.unique());
  EXPECT_GE(pool->held_bytes(), size_t{20000} * 4);  // the pooled data went back
}

// Shared data that does not match the response (an index out of range or twice, or a slice that
// has data of its own) is INTERNAL, and nothing is serialised.
TEST(PushPullWireTest, SharedWeightsThatDoNotFitTheResponseAreInternal) {
  auto pool = std::make_shared<BufferPool>(4, 64 << 20);
  const SharedWeights w = Shared(4, 1.0f);
  v1::PushPullResponse response;
  *response.add_weights() = PullKey("a", 0);
  *response.add_weights() = GradSlice("b", 0, {1, 2});
  const std::vector<std::vector<std::pair<int, SharedWeights>>> cases = {
      {{2, w}}, {{-1, w}}, {{0, w}, {0, w}}, {{1, w}}};
  for (const std::vector<std::pair<int, SharedWeights>>& shared : cases) {
    SCOPED_TRACE(shared.back().first);
    const SharedAnswerWeights external(shared);
    EXPECT_EQ(PushPullResponseSize(response, &external).status().code(),
              absl::StatusCode::kInternal);
    v1::PushPullResponse copy = response;
    size_t bytes = 0;
    grpc::ByteBuffer buffer;
    EXPECT_EQ(EncodePushPullResponse(&copy, &external, pool, &buffer, &bytes).code(),
              absl::StatusCode::kInternal);
    EXPECT_EQ(copy.SerializeAsString(), response.SerializeAsString());
  }
}

// The store's answer by reference, serialised as the service does and held unsent (as gRPC holds
// a queued write), keeps the weights it answered bit for bit while later pushes update the
// partition, which copies them once; after the buffer is released, updates copy nothing.
TEST(PushPullWireTest, HeldSerialisedAnswerKeepsItsWeightsWhileTheStoreCopiesOnWrite) {
  constexpr int kN = 50000;
  auto pool = std::make_shared<BufferPool>(4, 64 << 20);
  ParameterStore store;
  v1::CreateJobStateRequest job;
  job.set_job_id("j");
  *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  std::vector<float> initial(kN);
  for (int i = 0; i < kN; ++i) initial[i] = 0.25f * static_cast<float>(i);
  *job.add_partitions() = Dense("w", 0, kN, initial);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  std::vector<float> grad(kN);
  for (int i = 0; i < kN; ++i) grad[i] = static_cast<float>(i % 7);
  uint64_t seq = 0;
  // PushPulls `grad` by reference and returns the serialised answer.
  auto push_pull = [&]() -> grpc::ByteBuffer {
    const v1::PushPullRequest request =
        Request("j", 0, 1, 0, ++seq, {GradSlice("w", 0, grad, true)});
    auto sink = std::make_shared<PushPullAnswerSink>();
    std::optional<absl::StatusOr<v1::PushPullResponse>> answer;
    store.PushPull(
        ViewOf(request), [&answer](absl::StatusOr<v1::PushPullResponse> r) { answer = r; }, nullptr,
        sink);
    EXPECT_TRUE(answer.has_value() && answer->ok());
    if (!answer.has_value() || !answer->ok()) return grpc::ByteBuffer();
    size_t bytes = 0;
    const SharedAnswerWeights external(sink->shared);
    grpc::ByteBuffer buffer;
    const absl::Status encoded =
        EncodePushPullResponse(&**answer, &external, pool, &buffer, &bytes);
    EXPECT_TRUE(encoded.ok()) << encoded;
    return encoded.ok() ? buffer : grpc::ByteBuffer();
  };
  auto weights_of = [](const grpc::ByteBuffer& buffer) {
    v1::PushPullResponse response;
    EXPECT_TRUE(response.ParseFromString(Flat(buffer)));
    EXPECT_EQ(response.weights_size(), 1);
    return response.weights_size() == 1 ? response.weights(0).data() : std::string();
  };
  std::vector<float> w1 = initial;
  for (int i = 0; i < kN; ++i) w1[i] -= 0.5f * grad[i];
  std::vector<float> w2 = w1;
  for (int i = 0; i < kN; ++i) w2[i] -= 0.5f * grad[i];

  auto held = std::make_unique<grpc::ByteBuffer>(push_pull());
  const std::string first = weights_of(*held);
  EXPECT_TRUE(first == Fp32Bytes(w1));
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 0);
  // The next update finds the answer held: copies, and the held buffer still has w1.
  grpc::ByteBuffer second = push_pull();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_TRUE(weights_of(*held) == first) << "the held answer changed under the update";
  EXPECT_TRUE(weights_of(second) == Fp32Bytes(w2));
  EXPECT_EQ(store.GetShardStats().bytes_pulled, 2 * kN * 4);
  // Released (the write done), the next update writes in place.
  held.reset();
  second.Clear();
  grpc::ByteBuffer third = push_pull();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  std::vector<float> w3 = w2;
  for (int i = 0; i < kN; ++i) w3[i] -= 0.5f * grad[i];
  EXPECT_TRUE(weights_of(third) == Fp32Bytes(w3));
}

// ---- The raw PushPull method over gRPC.

// A request whose push slice is corrupt (wrong wire type inside the slice) but whose seq is
// readable is answered alone with INVALID_ARGUMENT; the stream goes on.
TEST_F(GrpcParameterServiceTest, MalformedRequestIsAnsweredAloneWhenItsSeqIsReadable) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub_->PushPull(&context);
  v1::PushPullRequest bad = Request("asp", 0, 1, 0, 501, {});
  // push { key: varint 5 }: a known field with the wrong wire type.
  bad.GetReflection()->MutableUnknownFields(&bad)->AddLengthDelimited(6,
                                                                      std::string("\x08\x05", 2));
  ASSERT_TRUE(stream->Write(bad));
  v1::PushPullResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.seq(), 501u);
  EXPECT_EQ(response.status().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(response.status().message(), HasSubstr("key"));
  ASSERT_TRUE(stream->Write(Request("asp", 0, 1, 0, 502, {GradSlice("w", 0, {2, 2, 2, 2}, true)})));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.seq(), 502u);
  EXPECT_EQ(response.status().code(), 0) << response.status().message();
  ASSERT_EQ(response.weights_size(), 1);
  EXPECT_EQ(Floats(response.weights(0)), (std::vector<float>{-1, -1, -1, -1}));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  ExpectStillServing();
}

// A request whose seq cannot be read ends its stream with INVALID_ARGUMENT; the shard serves on.
TEST_F(GrpcParameterServiceTest, MalformedRequestWithoutReadableSeqEndsTheStream) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub_->PushPull(&context);
  v1::PushPullRequest bad;
  bad.set_job_id("asp");
  bad.GetReflection()->MutableUnknownFields(&bad)->AddFixed32(5, 7);  // seq as fixed32
  ASSERT_TRUE(stream->Write(bad));
  v1::PushPullResponse response;
  EXPECT_FALSE(stream->Read(&response));
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("seq"));
  ExpectStillServing();
}

// Large gradients and weights through the raw method: the answer is exact (plain SGD on values
// that are exact in fp32), whatever slices gRPC delivered them in.
TEST_F(GrpcParameterServiceTest, LargeGradientsRoundTripExactly) {
  v1::CreateJobStateRequest job;
  job.set_job_id("large");
  *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  *job.add_partitions() = Dense("p", 0, 200000);
  ASSERT_TRUE(CreateJobState(job).ok());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub_->PushPull(&context);
  std::vector<float> grad(200000);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i % 1000);
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    ASSERT_TRUE(stream->Write(Request("large", 0, 1, 0, seq, {GradSlice("p", 0, grad, true)})));
  }
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    v1::PushPullResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.seq(), seq);
    ASSERT_EQ(response.status().code(), 0) << response.status().message();
    ASSERT_EQ(response.weights_size(), 1);
    EXPECT_EQ(response.weights(0).version(), static_cast<int64_t>(seq));
    const std::vector<float> w = Floats(response.weights(0));
    ASSERT_EQ(w.size(), grad.size());
    for (size_t i = 0; i < w.size(); i += 997) {
      ASSERT_EQ(w[i], -0.5f * static_cast<float>(seq) * grad[i]) << "i=" << i << " seq=" << seq;
    }
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// An answer whose values alone fit --max_message_bytes exactly (the store's own check passes) is
// still over it with its framing: the service counts the weights it sends by reference too and
// answers RESOURCE_EXHAUSTED in the response, and the stream goes on.
TEST_F(GrpcParameterServiceTest, SharedAnswerOverTheLimitWithItsFramingIsRefused) {
  v1::CreateJobStateRequest job;
  job.set_job_id("exact");
  *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  *job.add_partitions() = Dense("w", 0, kLimit / 4);
  *job.add_partitions() = Dense("w", 1, kLimit / 4 - 64);
  ASSERT_TRUE(CreateJobState(job).ok());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub_->PushPull(&context);
  v1::PushPullRequest over = Request("exact", 0, 1, 0, 1, {}, {PullKey("w", 0)});
  over.set_pull_encoding(v1::ENCODING_FP32);
  ASSERT_TRUE(stream->Write(over));
  v1::PushPullResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.seq(), 1u);
  EXPECT_EQ(response.status().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED))
      << response.status().message();
  EXPECT_THAT(response.status().message(), HasSubstr("--max_message_bytes"));
  EXPECT_EQ(response.weights_size(), 0);
  // 64 values less: it fits, framing included, and comes back whole.
  v1::PushPullRequest under = Request("exact", 0, 1, 0, 2, {}, {PullKey("w", 1)});
  under.set_pull_encoding(v1::ENCODING_FP32);
  ASSERT_TRUE(stream->Write(under));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.seq(), 2u);
  ASSERT_EQ(response.status().code(), 0) << response.status().message();
  ASSERT_EQ(response.weights_size(), 1);
  EXPECT_EQ(response.weights(0).data(), std::string((kLimit / 4 - 64) * 4, '\0'));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// Flow control: a client that sends many requests and never reads its responses makes the shard
// stop reading, so its queued responses stay bounded in number and bytes.
TEST(PushPullFlowControlTest, ClientThatNeverReadsCannotMakeTheShardQueueWithoutBound) {
  constexpr size_t kMaxQueuedBytes = 4 << 20;
  constexpr int kElements = 100000;  // 400 KB of weights per response
  ParameterStore store;
  ThreadPool pool(2);
  GrpcParameterService service(&store, &pool, 16 << 20, kMaxQueuedBytes);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  v1::CreateJobStateRequest job;
  job.set_job_id("flood");
  *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  *job.add_partitions() = Dense("w", 0, kElements);
  ASSERT_TRUE(store.CreateJobState(job).ok());

  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = v1::ParameterService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->PushPull(&context);
  constexpr int kRequests = 400;
  std::atomic<int> written{0};
  std::thread writer([&] {
    for (int i = 0; i < kRequests; ++i) {
      v1::PushPullRequest r =
          Request("flood", 0, 1, 0, static_cast<uint64_t>(i + 1), {}, {PullKey("w", 0)});
      if (!stream->Write(r)) return;
      written.fetch_add(1);
    }
  });
  // Wait until the shard stops making progress (bounded: at most 10 s).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int64_t last = -1;
  int quiet = 0;
  while (std::chrono::steady_clock::now() < give_up && quiet < 5) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int64_t read = service.stream_stats().requests_read;
    quiet = read == last ? quiet + 1 : 0;
    last = read;
  }
  const PushPullStreamStats stats = service.stream_stats();
  context.TryCancel();
  writer.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));

  // The shard read more requests than fit in its queue, and then stopped.
  EXPECT_GT(stats.requests_read, 10);
  EXPECT_LT(stats.requests_read, kRequests);
  EXPECT_LE(stats.peak_queued, GrpcParameterService::kMaxQueuedPerStream);
  // Bytes: requests read while under the byte limit may each still add a response, so the bound
  // is the count limit times the largest response.
  EXPECT_LE(stats.peak_queued_bytes,
            int64_t{GrpcParameterService::kMaxQueuedPerStream} * (kElements * 4 + 1024));
}

// A request that reaches an idle stream is processed on the gRPC thread that read it when it is
// at most kInlineRequestBytes, and on the pool when larger; both answer the same way.
TEST(PushPullInlineTest, SmallRequestsRunOnTheReadingThreadAndLargeOnesOnThePool) {
  constexpr int kSmall = 1000;
  // One float more than kInlineRequestBytes holds: the request is over it with any framing.
  constexpr int kLarge = static_cast<int>(GrpcParameterService::kInlineRequestBytes / 4) + 1;
  ParameterStore store;
  ThreadPool pool(2);
  GrpcParameterService service(&store, &pool, 64 << 20);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  v1::CreateJobStateRequest job;
  job.set_job_id("inline");
  *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
  *job.add_partitions() = Dense("small", 0, kSmall);
  *job.add_partitions() = Dense("large", 0, kLarge);
  ASSERT_TRUE(store.CreateJobState(job).ok());

  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = v1::ParameterService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->PushPull(&context);

  // One at a time: each request finds the stream idle.
  uint64_t seq = 0;
  auto round_trip = [&](const std::string& name, int n, float g, int64_t version) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(stream->Write(
        Request("inline", 0, 1, 0, ++seq, {GradSlice(name, 0, std::vector<float>(n, g), true)})));
    v1::PushPullResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.seq(), seq);
    ASSERT_EQ(response.status().code(), 0) << response.status().message();
    ASSERT_EQ(response.weights_size(), 1);
    EXPECT_EQ(response.weights(0).version(), version);
    const std::vector<float> w = Floats(response.weights(0));
    ASSERT_EQ(w.size(), static_cast<size_t>(n));
    EXPECT_EQ(w.front(), -0.5f * g * static_cast<float>(version));
    EXPECT_EQ(w.back(), -0.5f * g * static_cast<float>(version));
  };
  for (int i = 1; i <= 3; ++i) round_trip("small", kSmall, 2.0f, i);
  PushPullStreamStats stats = service.stream_stats();
  EXPECT_EQ(stats.requests_read, 3);
  EXPECT_EQ(stats.requests_inline, 3);

  round_trip("large", kLarge, 4.0f, 1);
  stats = service.stream_stats();
  EXPECT_EQ(stats.requests_read, 4);
  EXPECT_EQ(stats.requests_inline, 3);  // the large one went to the pool

  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

}  // namespace
}  // namespace tessera::server
