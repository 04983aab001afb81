#include "common/membership.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// A ClusterService that refuses the first Register with UNAVAILABLE, answers the
// `not_found_at`-th heartbeat NOT_FOUND, and records every call.
class FakeCluster final : public v1::ClusterService::Service {
 public:
  explicit FakeCluster(int not_found_at) : not_found_at_(not_found_at) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++register_calls_;
    if (register_calls_ == 1) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "warming up");
    last_registration_ = *request;
    const std::string id = absl::StrCat("s-", ++next_id_);
    ids_.push_back(id);
    response->set_member_id(id);
    response->set_lease_ms(1000);
    response->set_heartbeat_interval_ms(50);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu_);
    ++heartbeat_calls_;
    heartbeat_ids_.push_back(request->member_id());
    if (heartbeat_calls_ == not_found_at_) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown member");
    }
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const v1::DeregisterRequest* request,
                          v1::DeregisterResponse*) override {
    absl::MutexLock lock(&mu_);
    deregistered_.push_back(request->member_id());
    return grpc::Status::OK;
  }

  mutable absl::Mutex mu_;
  const int not_found_at_;
  int register_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeat_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> ids_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> heartbeat_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> deregistered_ ABSL_GUARDED_BY(mu_);
  v1::RegisterRequest last_registration_ ABSL_GUARDED_BY(mu_);
};

struct Fixture {
  explicit Fixture(int not_found_at) : service(not_found_at) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~Fixture() { server->Shutdown(); }
  FakeCluster service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

MemberAgent::Options AgentOptions(int port) {
  MemberAgent::Options options;
  options.coordinator = absl::StrCat("127.0.0.1:", port);
  options.registration.set_role(v1::MEMBER_ROLE_SERVER);
  options.registration.set_address("127.0.0.1:4000");
  options.registration.set_shard_index(1);
  options.registration.set_hostname("host-a");
  options.registration.set_pid(42);
  options.initial_backoff = absl::Milliseconds(20);
  options.max_backoff = absl::Milliseconds(100);
  options.rpc_timeout = absl::Seconds(2);
  return options;
}

TEST(MemberAgentTest, DialsWithTheGivenCredentials) {
  Fixture fixture(/*not_found_at=*/0);
  ASSERT_NE(fixture.server, nullptr);
  MemberAgent::Options options = AgentOptions(fixture.port);
  // TLS against this plaintext coordinator: every attempt fails the handshake.
  options.credentials.channel = grpc::SslCredentials(grpc::SslCredentialsOptions());
  MemberAgent agent(options);
  agent.Start();
  const absl::Status status = agent.WaitRegistered(absl::Milliseconds(600));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("UNAVAILABLE"), absl::string_view::npos) << status;
  EXPECT_EQ(agent.member_id(), "");
  agent.Stop(/*deregister=*/false);
  absl::MutexLock lock(&fixture.service.mu_);
  EXPECT_EQ(fixture.service.register_calls_, 0);  // no call got through the handshake
}

TEST(MemberAgentTest, RetriesRegistersAgainOnNotFoundAndDeregisters) {
  Fixture fixture(/*not_found_at=*/3);
  ASSERT_NE(fixture.server, nullptr);
  std::atomic<int> callbacks{0};
  MemberAgent::Options options = AgentOptions(fixture.port);
  options.on_registered = [&](const std::string&) { ++callbacks; };
  MemberAgent agent(options);
  EXPECT_EQ(agent.member_id(), "");
  agent.Start();
  ASSERT_TRUE(agent.WaitRegistered(absl::Seconds(10)).ok());
  // The first attempt was refused; the second one registered as s-1.
  EXPECT_EQ(agent.member_id(), "s-1");

  // Heartbeat 3 is NOT_FOUND: the agent registers again with a new id.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  // on_registered runs on the agent's thread just after the id changes: wait for both.
  while ((agent.member_id() != "s-2" || callbacks.load() < 2) && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(agent.member_id(), "s-2");
  EXPECT_EQ(callbacks.load(), 2);

  // Cadence: 50 ms asked for, so about 10 heartbeats in 500 ms (at least 2 on a loaded machine).
  int before;
  {
    absl::MutexLock lock(&fixture.service.mu_);
    before = fixture.service.heartbeat_calls_;
  }
  absl::SleepFor(absl::Milliseconds(500));
  int after;
  {
    absl::MutexLock lock(&fixture.service.mu_);
    after = fixture.service.heartbeat_calls_;
  }
  EXPECT_GE(after - before, 2);
  EXPECT_LE(after - before, 12);

  agent.Stop(/*deregister=*/true);
  agent.Stop(/*deregister=*/true);  // idempotent: one Deregister only
  absl::MutexLock lock(&fixture.service.mu_);
  EXPECT_EQ(fixture.service.register_calls_, 3);
  EXPECT_EQ(fixture.service.ids_, (std::vector<std::string>{"s-1", "s-2"}));
  ASSERT_GE(fixture.service.heartbeat_ids_.size(), 3u);
  EXPECT_EQ(fixture.service.heartbeat_ids_[0], "s-1");
  EXPECT_EQ(fixture.service.heartbeat_ids_[2], "s-1");
  EXPECT_EQ(fixture.service.heartbeat_ids_.back(), "s-2");
  EXPECT_EQ(fixture.service.deregistered_, (std::vector<std::string>{"s-2"}));
  EXPECT_EQ(fixture.service.last_registration_.address(), "127.0.0.1:4000");
  EXPECT_EQ(fixture.service.last_registration_.shard_index(), 1);
  EXPECT_EQ(fixture.service.last_registration_.pid(), 42);
}

TEST(MemberAgentTest, WaitRegisteredTimesOutWithTheLastError) {
  // Nothing listens on this port (a server bound then shut down).
  int port = 0;
  {
    Fixture fixture(0);
    port = fixture.port;
  }
  MemberAgent agent(AgentOptions(port));
  agent.Start();
  const absl::Status status = agent.WaitRegistered(absl::Milliseconds(300));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find(absl::StrCat("127.0.0.1:", port)), absl::string_view::npos)
      << status;
  agent.Stop(/*deregister=*/true);  // never registered: nothing to deregister, returns promptly
  EXPECT_EQ(agent.member_id(), "");
}

}  // namespace
}  // namespace tessera
