// The metrics endpoint of every daemon, end to end (issue #5): the real tessera-coordinator,
// tessera-server and tessera-worker run as child processes with --metrics_listen 127.0.0.1:0 and
// --metrics_port_file; after a small PushPull straight to the shard, each endpoint is scraped
// over HTTP (a plain socket), passed through `promtool check metrics`, and checked for its
// families and for values the traffic must have moved.
//
// Every wait is bounded in time. The promtool part skips (with a message) when /usr/bin/promtool
// is missing; nothing else skips.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/child_process.h"
#include "common/testing/prometheus_text.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "tessera/v1/parameter.grpc.pb.h"
#include "tests/testlib/child_process.h"

#ifndef TESSERA_BIN_DIR
#error "TESSERA_BIN_DIR must name the folder of the daemons"
#endif

namespace tessera {
namespace {

using prometheus_text::HasFamily;
using prometheus_text::Promtool;
using prometheus_text::Sample;
using prometheus_text::Scrape;
using testlib::ReadWholeFile;
using testlib::ScratchDirectory;
using testlib::SpawnChild;
using testlib::StopChild;

std::string Bin(const std::string& name) { return absl::StrCat(TESSERA_BIN_DIR, "/", name); }

// Scrapes `port` until `ready(text)` holds, for at most `timeout`; the last scrape.
std::string ScrapeUntil(int port, const std::function<bool(const std::string&)>& ready,
                        absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string text;
  while (absl::Now() < deadline) {
    text = Scrape(port);
    if (!text.empty() && ready(text)) return text;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return text;
}

std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(10);
}

v1::Slice Floats(const std::string& tensor, const std::vector<float>& values, bool want_weights) {
  v1::Slice s;
  s.mutable_key()->set_tensor(tensor);
  s.mutable_key()->set_index(0);
  s.set_encoding(v1::ENCODING_FP32);
  s.mutable_data()->assign(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  s.set_want_weights(want_weights);
  return s;
}

class MetricsE2eTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (ChildProcess* p : {&worker_, &server_, &coordinator_}) {
      if (p->running()) {
        const int code = StopChild(p, absl::Seconds(15));
        if (code != 0) {
          ADD_FAILURE() << p->name() << " exited with " << code << ":\n"
                        << ReadWholeFile(p->stderr_path());
        }
      }
    }
  }

  // `p`'s stderr, and how it ended when it has.
  std::string Dump(const ChildProcess& p) {
    const std::string ended = p.ended() ? absl::StrCat(" (", p.DescribeExit(), ")") : "";
    return absl::StrCat(p.name(), ended, " stderr:\n", ReadWholeFile(p.stderr_path()));
  }

  ScratchDirectory dir_{"tessera-metrics-e2e"};
  ChildProcess coordinator_;
  ChildProcess server_;
  ChildProcess worker_;
};

TEST_F(MetricsE2eTest, EveryDaemonServesValidMetrics) {
  const std::string d = dir_.path();
  ASSERT_FALSE(d.empty());
  coordinator_ =
      SpawnChild({Bin("tessera-coordinator"), "--listen", "127.0.0.1:0", "--port_file",
                  d + "/coordinator.port", "--data_dir", d + "/coordinator", "--metrics_listen",
                  "127.0.0.1:0", "--metrics_port_file", d + "/coordinator.metrics"},
                 d, "coordinator");
  const int coordinator_port =
      coordinator_.WaitForPortFile(d + "/coordinator.port", absl::Seconds(30));
  ASSERT_GT(coordinator_port, 0) << Dump(coordinator_);
  const int coordinator_metrics =
      coordinator_.WaitForPortFile(d + "/coordinator.metrics", absl::Seconds(10));
  ASSERT_GT(coordinator_metrics, 0) << Dump(coordinator_);
  const std::string coordinator_address = absl::StrCat("127.0.0.1:", coordinator_port);

  server_ = SpawnChild(
      {Bin("tessera-server"), "--listen", "127.0.0.1:0", "--port_file", d + "/server.port",
       "--coordinator", coordinator_address, "--shard_index", "0", "--threads", "2",
       "--metrics_listen", "127.0.0.1:0", "--metrics_port_file", d + "/server.metrics"},
      d, "server");
  worker_ =
      SpawnChild({Bin("tessera-worker"), "--coordinator", coordinator_address, "--metrics_listen",
                  "127.0.0.1:0", "--metrics_port_file", d + "/worker.metrics"},
                 d, "worker");
  const int server_port = server_.WaitForPortFile(d + "/server.port", absl::Seconds(30));
  ASSERT_GT(server_port, 0) << Dump(server_);
  const int server_metrics = server_.WaitForPortFile(d + "/server.metrics", absl::Seconds(10));
  ASSERT_GT(server_metrics, 0) << Dump(server_);
  const int worker_metrics = worker_.WaitForPortFile(d + "/worker.metrics", absl::Seconds(30));
  ASSERT_GT(worker_metrics, 0) << Dump(worker_);

  // A small PushPull straight to the shard: 16 bytes of gradient, weights back.
  auto stub = v1::ParameterService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server_port), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::CreateJobStateRequest job;
    job.set_job_id("metrics-e2e");
    job.mutable_config()->set_consistency(v1::CONSISTENCY_ASP);
    job.mutable_config()->set_num_workers(1);
    job.mutable_config()->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
    job.mutable_config()->mutable_optimizer()->set_learning_rate(0.5f);
    v1::DensePartitionDecl* w = job.add_partitions();
    w->mutable_key()->set_tensor("w");
    w->set_num_elements(4);
    v1::CreateJobStateResponse response;
    const grpc::Status status = stub->CreateJobState(&context, job, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    auto stream = stub->PushPull(&context);
    v1::PushPullRequest request;
    request.set_job_id("metrics-e2e");
    request.set_incarnation(1);
    request.set_seq(1);
    *request.add_push() = Floats("w", {1, 2, 3, 4}, /*want_weights=*/true);
    ASSERT_TRUE(stream->Write(request));
    v1::PushPullResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.status().code(), 0) << response.status().message();
    EXPECT_EQ(response.weights_size(), 1);
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }

  {
    // A push to a job the shard does not hold: NOT_FOUND, counted as an error.
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::PushPullRequest request;
    request.set_job_id("no-such-job");
    request.set_incarnation(1);
    request.set_seq(1);
    *request.add_push() = Floats("w", {1, 2, 3, 4}, /*want_weights=*/false);
    v1::PushResponse response;
    EXPECT_EQ(stub->Push(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  const std::string push_pull =
      "tessera_rpc_calls_total{method=\"/tessera.v1.ParameterService/PushPull\"}";
  const std::string server_text = ScrapeUntil(
      server_metrics,
      [&](const std::string& t) {
        return Sample(t, push_pull) >= 1 && Sample(t, "tessera_shard_pushed_bytes_total") >= 16;
      },
      absl::Seconds(10));
  EXPECT_GE(Sample(server_text, push_pull), 1) << server_text;
  EXPECT_GE(Sample(server_text, "tessera_shard_pushed_bytes_total"), 16);
  EXPECT_GE(Sample(server_text, "tessera_shard_pulled_bytes_total"), 16);
  EXPECT_GE(Sample(server_text, "tessera_shard_updates_applied_total"), 1);
  EXPECT_EQ(Sample(server_text, "tessera_shard_jobs"), 1);
  EXPECT_EQ(Sample(server_text,
                   "tessera_rpc_errors_total{code=\"NOT_FOUND\",method=\"/tessera.v1."
                   "ParameterService/Push\"}"),
            1);
  // Latency is for unary calls (Push); the PushPull stream is counted in calls/errors only.
  EXPECT_GE(Sample(server_text,
                   "tessera_rpc_latency_seconds_count{method=\"/tessera.v1."
                   "ParameterService/Push\"}"),
            1);
  EXPECT_EQ(Sample(server_text,
                   "tessera_rpc_latency_seconds_count{method=\"/tessera.v1."
                   "ParameterService/PushPull\"}"),
            0);
  for (const char* family :
       {"tessera_shard_duplicate_pushes_total", "tessera_shard_gate_wait_seconds",
        "tessera_shard_ssp_staleness_steps", "tessera_rpc_latency_seconds"}) {
    EXPECT_TRUE(HasFamily(server_text, family)) << family;
  }

  // The coordinator sees the shard and the worker register.
  const std::string shards_ready = "tessera_members{role=\"server\",state=\"ready\"}";
  const std::string workers_ready = "tessera_members{role=\"worker\",state=\"ready\"}";
  const std::string coordinator_text = ScrapeUntil(
      coordinator_metrics,
      [&](const std::string& t) {
        return Sample(t, shards_ready) == 1 && Sample(t, workers_ready) == 1;
      },
      absl::Seconds(20));
  EXPECT_EQ(Sample(coordinator_text, shards_ready), 1) << coordinator_text;
  EXPECT_EQ(Sample(coordinator_text, workers_ready), 1);
  EXPECT_EQ(Sample(coordinator_text, "tessera_jobs{state=\"running\"}"), 0);
  EXPECT_GE(Sample(coordinator_text,
                   "tessera_rpc_calls_total{method=\"/tessera.v1.ClusterService/Register\"}"),
            2);

  const std::string worker_text = Scrape(worker_metrics);
  ASSERT_FALSE(worker_text.empty()) << Dump(worker_);

  const struct {
    const char* daemon;
    const std::string* text;
  } scrapes[] = {
      {"coordinator", &coordinator_text}, {"server", &server_text}, {"worker", &worker_text}};
  bool have_promtool = true;
  for (const auto& s : scrapes) {
    SCOPED_TRACE(s.daemon);
    const std::string& text = *s.text;
    EXPECT_EQ(Sample(text, absl::StrCat("tessera_build_info{daemon=\"", s.daemon,
                                        "\",version=\"0.1.0\"}")),
              1)
        << text;
    EXPECT_GT(Sample(text, "process_resident_memory_bytes"), 0);
    EXPECT_GT(Sample(text, "process_open_fds"), 0);
    EXPECT_GT(Sample(text, "process_threads"), 0);
    EXPECT_GE(Sample(text, "process_cpu_seconds_total"), 0);
    EXPECT_GT(Sample(text, "process_start_time_seconds"), 0);
    std::string output;
    const int status = Promtool(text, &output);
    if (status == -1) {
      have_promtool = false;
      continue;
    }
    EXPECT_EQ(status, 0) << output << "\n" << text;
  }
  if (!have_promtool) GTEST_SKIP() << "/usr/bin/promtool is not installed (Debian `prometheus`)";
}

}  // namespace
}  // namespace tessera
