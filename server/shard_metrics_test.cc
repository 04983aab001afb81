// The shard's metrics end to end in one process: the real GrpcParameterService behind the metrics
// interceptor, driven through its raw PushPull stream, the unary Push and the streaming Pull, then
// the exposition read back (method labels of raw and streaming methods, shard counters and
// histograms) and checked by `promtool check metrics` when it is installed.
#include "server/shard_metrics.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/testing/prometheus_text.h"
#include "common/testing/push_pull_requests.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/grpc_parameter_service.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::server {
namespace {

using namespace ::tessera::push_pull_requests;  // NOLINT: request builders
using prometheus_text::Promtool;
using prometheus_text::Sample;

std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(10);
}

TEST(ShardMetricsTest, RpcAndStoreFamiliesThroughTheRealService) {
  auto metrics = Metrics::Create("server", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  ParameterStore store;
  ThreadPool pool(2);
  GrpcParameterService service(&store, &pool, size_t{4} << 20);
  RegisterShardMetrics(metrics->get(), &store);

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  factories.push_back((*metrics)->NewServerInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(factories));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::ParameterService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));

  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::CreateJobStateRequest job;
    job.set_job_id("j");
    *job.mutable_config() = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
    *job.add_partitions() = Dense("w", 0, 4);
    v1::CreateJobStateResponse response;
    ASSERT_TRUE(stub->CreateJobState(&context, job, &response).ok());
  }
  {
    // Two pushes with weights back on the raw stream; the second repeats the first's seq.
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    auto stream = stub->PushPull(&context);
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(stream->Write(Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, 2, 3, 4}, true)})));
      v1::PushPullResponse response;
      ASSERT_TRUE(stream->Read(&response));
      EXPECT_EQ(response.status().code(), 0) << response.status().message();
      EXPECT_EQ(response.duplicates(), i == 0 ? 0u : 1u);
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  {
    // A unary push to an unknown job: NOT_FOUND.
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::PushResponse response;
    EXPECT_EQ(stub->Push(&context, Request("nope", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})}),
                         &response)
                  .error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::PullRequest pull;
    pull.set_job_id("j");
    pull.set_step(-1);
    *pull.add_keys() = PullKey("w", 0);
    auto reader = stub->Pull(&context, pull);
    v1::PullResponse response;
    int n = 0;
    while (n < 100 && reader->Read(&response)) ++n;
    EXPECT_EQ(n, 1);
    EXPECT_TRUE(reader->Finish().ok());
  }

  // A job being filled here keeps its pushes in a journal (server/fill_journal.h).
  v1::FillRequest open;
  open.set_job_id("filled");
  open.set_step(3);
  open.set_open(true);
  ASSERT_TRUE(store.Fill(open).ok());
  ASSERT_TRUE(store.Push(Request("filled", 0, 1, 3, 9, {GradSlice("w", 0, {1, 2, 3, 4})})).ok());

  const std::string text = (*metrics)->Serialize();
  const std::string m = "/tessera.v1.ParameterService/";
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_calls_total{method=\"", m, "PushPull\"}")), 1)
      << text;
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_calls_total{method=\"", m, "Push\"}")), 1);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_calls_total{method=\"", m, "Pull\"}")), 1);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_errors_total{code=\"NOT_FOUND\",method=\"", m,
                                      "Push\"}")),
            1);
  // Latency is for unary calls (Push); the PushPull and Pull streams are not timed.
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_latency_seconds_count{method=\"", m, "Push\"}")),
            1);
  EXPECT_EQ(
      Sample(text, absl::StrCat("tessera_rpc_latency_seconds_count{method=\"", m, "PushPull\"}")),
      0);
  EXPECT_EQ(Sample(text, "tessera_shard_jobs"), 1);
  EXPECT_EQ(Sample(text, "tessera_shard_fill_journals"), 1);
  EXPECT_GE(Sample(text, "tessera_shard_fill_journal_bytes"), 16);  // the gradient and the rest
  EXPECT_EQ(Sample(text, "tessera_shard_pushed_bytes_total"), 16);
  EXPECT_EQ(Sample(text, "tessera_shard_duplicate_pushes_total"), 1);
  EXPECT_EQ(Sample(text, "tessera_shard_updates_applied_total"), 1);
  // Weights answered: the two PushPull answers and the Pull.
  EXPECT_EQ(Sample(text, "tessera_shard_pulled_bytes_total"), 3 * 16);
  // The one update came before any answer held the weights: written in place.
  EXPECT_EQ(Sample(text, "tessera_shard_weight_copies_on_write_total"), 0);
  EXPECT_EQ(Sample(text, "tessera_shard_gate_wait_seconds_count{consistency=\"bsp\"}"), 0);
  EXPECT_EQ(Sample(text, "tessera_shard_ssp_staleness_steps_count"), 0);
  EXPECT_EQ(Sample(text, "tessera_shard_ssp_staleness_steps_bucket{le=\"+Inf\"}"), 0);

  std::string output;
  const int status = Promtool(text, &output);
  server->Shutdown();
  if (status == -1) GTEST_SKIP() << "/usr/bin/promtool is not installed (Debian `prometheus`)";
  EXPECT_EQ(status, 0) << output << "\n" << text;
}

}  // namespace
}  // namespace tessera::server
