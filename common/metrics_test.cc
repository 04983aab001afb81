// Tests of Metrics through its public contract: the listen address, the process metrics, the
// per-RPC interceptor on an in-process callback server (unary and streaming methods, errors by
// code, unknown methods), the HTTP endpoint on a port-0 exposer read with a plain socket, and the
// exposition checked by `promtool check metrics` when it is installed.
#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/testing/prometheus_text.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera {
namespace {

using prometheus_text::HttpGet;
using prometheus_text::Promtool;
using prometheus_text::Sample;
using ::testing::HasSubstr;

TEST(MetricsTest, RejectsBadListenAddresses) {
  for (const char* bad : {"nocolon", ":9100", "127.0.0.1:", "127.0.0.1:abc", "127.0.0.1:70000",
                          "127.0.0.1:-1", "::1:0"}) {
    auto metrics = Metrics::Create("server", bad);
    ASSERT_FALSE(metrics.ok()) << bad;
    EXPECT_EQ(metrics.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(metrics.status().message(), HasSubstr("--metrics_listen")) << bad;
  }
  EXPECT_EQ(Metrics::Create("", "").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MetricsTest, PortInUseIsUnavailable) {
  auto first = Metrics::Create("server", "127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT((*first)->port(), 0);
  auto second = Metrics::Create("server", absl::StrCat("127.0.0.1:", (*first)->port()));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("--metrics_listen"));
}

TEST(MetricsTest, NoEndpointWithoutListen) {
  auto metrics = Metrics::Create("worker", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ((*metrics)->port(), 0);
  EXPECT_EQ(Sample((*metrics)->Serialize(),
                   "tessera_build_info{daemon=\"worker\",version=\"" TESSERA_VERSION "\"}"),
            1);
}

TEST(MetricsTest, ProcessMetricsReadProcSelf) {
  auto metrics = Metrics::Create("server", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  // Burn a little CPU so that the CPU counter is above zero.
  volatile double sink = 0;
  const std::clock_t until = std::clock() + CLOCKS_PER_SEC / 20;
  while (std::clock() < until) sink = sink + 1;
  const std::string text = (*metrics)->Serialize();
  EXPECT_GT(Sample(text, "process_resident_memory_bytes"), 1 << 20) << text;
  EXPECT_GT(Sample(text, "process_virtual_memory_bytes"), 1 << 20);
  EXPECT_GE(Sample(text, "process_threads"), 1);
  EXPECT_GT(Sample(text, "process_cpu_seconds_total"), 0);
  // Three descriptors at least (stdin, stdout, stderr); one more open file is seen.
  const double fds = Sample(text, "process_open_fds");
  EXPECT_GE(fds, 3);
  FILE* extra = std::fopen("/proc/self/stat", "r");
  ASSERT_NE(extra, nullptr);
  EXPECT_EQ(Sample((*metrics)->Serialize(), "process_open_fds"), fds + 1);
  std::fclose(extra);
  const double start = Sample(text, "process_start_time_seconds");
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_GT(start, now - 3600);
  EXPECT_LE(start, now + 2);
  // The same instant as boot time (btime of /proc/stat, which the metrics code may not read under
  // ProcSubset=pid) plus starttime, within clock-tick and NTP-slew error.
  std::ifstream proc_stat("/proc/stat");
  std::string line;
  double btime = -1;
  while (std::getline(proc_stat, line)) {
    if (absl::StartsWith(line, "btime ")) {
      ASSERT_TRUE(absl::SimpleAtod(line.substr(6), &btime));
    }
  }
  ASSERT_GT(btime, 0);
  std::ifstream self_stat("/proc/self/stat");
  ASSERT_TRUE(std::getline(self_stat, line));
  const std::vector<std::string> fields =
      absl::StrSplit(line.substr(line.rfind(')') + 1), ' ', absl::SkipEmpty());
  ASSERT_GE(fields.size(), 20u);
  double start_ticks = 0;
  ASSERT_TRUE(absl::SimpleAtod(fields[19], &start_ticks));
  EXPECT_NEAR(start, btime + start_ticks / static_cast<double>(sysconf(_SC_CLK_TCK)), 2.0);
}

// ParameterService with DropJob (unary: NOT_FOUND for "missing", INVALID_ARGUMENT for "", OK
// otherwise) and Pull (server streaming: one message per key, then OK).
class FakeParameterService final
    : public v1::ParameterService::WithCallbackMethod_Pull<
          v1::ParameterService::WithCallbackMethod_DropJob<v1::ParameterService::Service>> {
 public:
  grpc::ServerUnaryReactor* DropJob(grpc::CallbackServerContext* context,
                                    const v1::DropJobRequest* request,
                                    v1::DropJobResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (request->job_id().empty()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: empty"));
    } else if (request->job_id() == "missing") {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "job_id: unknown"));
    } else {
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

  grpc::ServerWriteReactor<v1::PullResponse>* Pull(grpc::CallbackServerContext*,
                                                   const v1::PullRequest* request) override {
    class Writer final : public grpc::ServerWriteReactor<v1::PullResponse> {
     public:
      explicit Writer(int n) : left_(n) { Next(); }
      void OnWriteDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::CANCELLED);
          return;
        }
        Next();
      }
      void OnDone() override { delete this; }

     private:
      void Next() {
        if (left_-- <= 0) {
          Finish(grpc::Status::OK);
          return;
        }
        StartWrite(&response_);
      }
      int left_;
      v1::PullResponse response_;
    };
    return new Writer(request->keys_size());
  }
};

class MetricsRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto metrics = Metrics::Create("server", "127.0.0.1:0");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = *std::move(metrics);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
    factories.push_back(metrics_->NewServerInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(factories));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = v1::ParameterService::NewStub(channel_);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  grpc::StatusCode DropJob(const std::string& job_id) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::DropJobRequest request;
    request.set_job_id(job_id);
    v1::DropJobResponse response;
    return stub_->DropJob(&context, request, &response).error_code();
  }

  // Reads the whole Pull stream of `keys` messages; the number read.
  int Pull(int keys, grpc::StatusCode* code) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PullRequest request;
    for (int i = 0; i < keys; ++i) request.add_keys();
    auto reader = stub_->Pull(&context, request);
    v1::PullResponse response;
    int n = 0;
    while (n < 1000 && reader->Read(&response)) ++n;
    *code = reader->Finish().error_code();
    return n;
  }

  // Calls `method` with an empty body through the generic stub; its status code.
  grpc::StatusCode CallGeneric(const std::string& method) {
    grpc::GenericStub generic(channel_);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status result;
    generic.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status status) {
                        std::lock_guard<std::mutex> lock(mu);
                        result = status;
                        done = true;
                        cv.notify_all();
                      });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(15), [&] { return done; });
    return done ? result.error_code() : grpc::StatusCode::DEADLINE_EXCEEDED;
  }

  FakeParameterService service_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ParameterService::Stub> stub_;
};

constexpr char kDrop[] = "/tessera.v1.ParameterService/DropJob";
constexpr char kPull[] = "/tessera.v1.ParameterService/Pull";

TEST_F(MetricsRpcTest, CountsCallsErrorsByCodeAndLatency) {
  EXPECT_EQ(DropJob("a"), grpc::StatusCode::OK);
  EXPECT_EQ(DropJob("b"), grpc::StatusCode::OK);
  EXPECT_EQ(DropJob("missing"), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(DropJob("missing"), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(DropJob("missing"), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(DropJob(""), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::StatusCode code;
  EXPECT_EQ(Pull(3, &code), 3);
  EXPECT_EQ(code, grpc::StatusCode::OK);
  EXPECT_EQ(Pull(0, &code), 0);
  EXPECT_EQ(code, grpc::StatusCode::OK);

  const std::string text = metrics_->Serialize();
  const std::string drop = absl::StrCat("{method=\"", kDrop, "\"}");
  const std::string pull = absl::StrCat("{method=\"", kPull, "\"}");
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_calls_total", drop)), 6) << text;
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_calls_total", pull)), 2);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_errors_total{code=\"NOT_FOUND\",method=\"",
                                      kDrop, "\"}")),
            3);
  EXPECT_EQ(
      Sample(text, absl::StrCat("tessera_rpc_errors_total{code=\"INVALID_ARGUMENT\",method=\"",
                                kDrop, "\"}")),
      1);
  EXPECT_EQ(
      Sample(text, absl::StrCat("tessera_rpc_errors_total{code=\"OK\",method=\"", kDrop, "\"}")),
      -1);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_latency_seconds_count", drop)), 6);
  // Streams are counted in calls/errors only: their latency would be the stream's lifetime.
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_latency_seconds_count", pull)), 0);
  EXPECT_EQ(Sample(text, absl::StrCat("tessera_rpc_latency_seconds_bucket{method=\"", kDrop,
                                      "\",le=\"+Inf\"}")),
            6);
  EXPECT_GT(Sample(text, absl::StrCat("tessera_rpc_latency_seconds_sum", drop)), 0);
  EXPECT_LT(Sample(text, absl::StrCat("tessera_rpc_latency_seconds_sum", drop)), 60);
}

TEST_F(MetricsRpcTest, UnknownMethodsShareOneLabel) {
  EXPECT_EQ(CallGeneric("/tessera.v1.Nope/One"), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CallGeneric("/random.Service/Two"), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CallGeneric("/x"), grpc::StatusCode::UNIMPLEMENTED);
  const std::string text = metrics_->Serialize();
  EXPECT_THAT(text, ::testing::Not(HasSubstr("Nope")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("random.Service")));
  // gRPC 1.51 runs the interceptors for methods no service registered, with the caller's path:
  // they are counted under "other".
  EXPECT_EQ(Sample(text, "tessera_rpc_calls_total{method=\"other\"}"), 3) << text;
  EXPECT_EQ(Sample(text, "tessera_rpc_errors_total{code=\"UNIMPLEMENTED\",method=\"other\"}"), 3);
}

TEST_F(MetricsRpcTest, EndpointServesTheExpositionThatPromtoolAccepts) {
  EXPECT_EQ(DropJob("missing"), grpc::StatusCode::NOT_FOUND);
  grpc::StatusCode code;
  EXPECT_EQ(Pull(2, &code), 2);
  const std::string response = HttpGet(metrics_->port(), "/metrics");
  ASSERT_THAT(response, HasSubstr("200 OK"));
  const size_t body_at = response.find("\r\n\r\n");
  ASSERT_NE(body_at, std::string::npos);
  const std::string body = response.substr(body_at + 4);
  EXPECT_EQ(Sample(body, "tessera_build_info{daemon=\"server\",version=\"" TESSERA_VERSION "\"}"),
            1)
      << body;
  EXPECT_EQ(Sample(body, absl::StrCat("tessera_rpc_calls_total{method=\"", kDrop, "\"}")), 1);
  EXPECT_GT(Sample(body, "process_resident_memory_bytes"), 0);
  EXPECT_THAT(body, HasSubstr("# TYPE tessera_rpc_latency_seconds histogram"));

  // A collectable added later is served too.
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("tessera_test_things_total")
      .Help("Things.")
      .Register(*registry)
      .Add({})
      .Increment(7);
  metrics_->AddCollectable(registry);
  EXPECT_EQ(Sample(HttpGet(metrics_->port(), "/metrics"), "tessera_test_things_total"), 7);

  std::string output;
  const int status = Promtool(body, &output);
  if (status == -1) GTEST_SKIP() << "/usr/bin/promtool is not installed (Debian `prometheus`)";
  EXPECT_EQ(status, 0) << output << "\n" << body;
}

TEST(MetricsPromtoolTest, PromtoolRejectsABadName) {
  // The check above can fail: promtool refuses a counter without _total.
  std::string output;
  const int status = Promtool(
      "# HELP bad_counter A counter.\n# TYPE bad_counter counter\nbad_counter 1\n", &output);
  if (status == -1) GTEST_SKIP() << "/usr/bin/promtool is not installed (Debian `prometheus`)";
  EXPECT_NE(status, 0) << output;
}

}  // namespace
}  // namespace tessera
