// WatchJob over gRPC when the watcher gives up before the store pool opens its watch: the pool's
// task must not read the request, which gRPC frees with the finished call (the coordinator's
// crash in the hostile test of 2026-12-02: a general protection fault in JobStore::ReadEvents on
// a WatchJob whose deadline had passed). The old code, which handed the pool the request itself,
// died in this test of std::bad_alloc, copying a job id out of freed memory.
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/thread_pool.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/coordinator/grpc_coordinator_service.h"
#include "server/coordinator/testing/coordinator_fixture.h"
#include "spec/testing/example_jobs.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera::coordinator {
namespace {

class WatchJobCancelTest : public testing::CoordinatorTest {
 protected:
  void StartService() {
    service_ =
        std::make_unique<GrpcJobService>(coordinator_.get(), &store_pool_, &checkpoint_pool_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::JobService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    store_pool_.Stop();
    checkpoint_pool_.Stop();
    server_.reset();
    service_.reset();
    testing::CoordinatorTest::TearDown();
  }

  ThreadPool store_pool_{1};
  ThreadPool checkpoint_pool_{1};
  std::unique_ptr<GrpcJobService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

TEST_F(WatchJobCancelTest, AWatchThatEndsBeforeThePoolOpensItLeavesTheServiceWorking) {
  // A long id, so that the request's string lives on the heap (in the call's arena).
  const std::string name(100, 'w');
  auto job = coordinator_->CreateJob(spec::examples::FashionMlpJob(name, 1, "/data"));
  ASSERT_TRUE(job.ok()) << job.status();
  StartService();

  // The pool's only thread is busy: the watch below is queued behind this.
  absl::Notification release;
  store_pool_.Schedule([&release] { release.WaitForNotification(); });
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    v1::WatchJobRequest request;
    request.set_job_id(job->id());
    auto reader = stub_->WatchJob(&context, request);
    v1::WatchJobResponse response;
    EXPECT_FALSE(reader->Read(&response));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // The server ends its side of the call at the same deadline and frees the request; give it
  // that, then let the pool open the stale watch.
  absl::SleepFor(absl::Milliseconds(300));
  release.Notify();

  // The service goes on: a new watch gets the job as it stands.
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WatchJobRequest request;
  request.set_job_id(job->id());
  auto reader = stub_->WatchJob(&context, request);
  v1::WatchJobResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.job().id(), job->id());
  EXPECT_EQ(response.job().state(), v1::JOB_STATE_PENDING);
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

}  // namespace
}  // namespace tessera::coordinator
