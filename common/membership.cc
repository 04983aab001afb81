#include "common/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "spdlog/spdlog.h"

namespace tessera {
namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const MemberAgent::Options& options) {
  return options.credentials.CreateChannel(options.coordinator);
}

const char* RoleName(v1::MemberRole role) {
  switch (role) {
    case v1::MEMBER_ROLE_SERVER:
      return "shard";
    case v1::MEMBER_ROLE_WORKER:
      return "worker";
    default:
      return "member";
  }
}

std::string Seconds(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), " s"); }

}  // namespace

MemberAgent::MemberAgent(Options options)
    : options_(std::move(options)),
      channel_(MakeChannel(options_)),
      stub_(v1::ClusterService::NewStub(channel_)) {}

MemberAgent::~MemberAgent() { Stop(/*deregister=*/false); }

void MemberAgent::Start() {
  absl::MutexLock lock(&mu_);
  if (started_ || stopping_) return;
  started_ = true;
  thread_ = std::thread([this] { Run(); });
}

void MemberAgent::Stop(bool deregister) {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    if (!deregister) return;
    id.swap(member_id_);
  }
  if (id.empty()) return;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  v1::DeregisterRequest request;
  request.set_member_id(id);
  v1::DeregisterResponse response;
  const grpc::Status status = stub_->Deregister(&context, request, &response);
  if (status.ok()) {
    spdlog::info("{} {} deregistered from coordinator {}", RoleName(options_.registration.role()),
                 id, options_.coordinator);
  } else {
    spdlog::warn("{} {}: deregistering from coordinator {} failed: {}",
                 RoleName(options_.registration.role()), id, options_.coordinator,
                 FromGrpcStatus(status).ToString());
  }
}

std::string MemberAgent::member_id() const {
  absl::MutexLock lock(&mu_);
  return member_id_;
}

absl::Status MemberAgent::WaitRegistered(absl::Duration timeout) const {
  struct Watched {
    const std::string* id;
    const bool* stopping;
  } watched{&member_id_, &stopping_};
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(
                           +[](Watched* w) { return !w->id->empty() || *w->stopping; }, &watched),
                       timeout);
  if (!member_id_.empty()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "not registered with coordinator ", options_.coordinator, " after ", Seconds(timeout),
      last_error_.ok() ? std::string() : absl::StrCat(": ", last_error_.ToString())));
}

void MemberAgent::Run() {
  const char* role = RoleName(options_.registration.role());
  absl::Duration backoff = options_.initial_backoff;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  bool registered = false;
  bool in_outage = false;
  // Sleeps for `d` unless Stop() is called; returns false when stopping.
  auto sleep = [this](absl::Duration d) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), d);
    return !stopping_;
  };
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    if (!registered) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
      v1::RegisterResponse response;
      const grpc::Status status = stub_->Register(&context, options_.registration, &response);
      if (status.ok() && !response.member_id().empty()) {
        heartbeat_interval = response.heartbeat_interval_ms() > 0
                                 ? absl::Milliseconds(response.heartbeat_interval_ms())
                                 : absl::Seconds(1);
        {
          absl::MutexLock lock(&mu_);
          member_id_ = response.member_id();
          last_error_ = absl::OkStatus();
        }
        spdlog::info("{} registered with coordinator {} as {} (lease {} ms, heartbeat every {} ms)",
                     role, options_.coordinator, response.member_id(), response.lease_ms(),
                     absl::ToInt64Milliseconds(heartbeat_interval));
        registered = true;
        in_outage = false;
        backoff = options_.initial_backoff;
        if (options_.on_registered) options_.on_registered(response.member_id());
        continue;
      }
      absl::Status error = status.ok()
                               ? absl::InternalError("the coordinator returned an empty member id")
                               : FromGrpcStatus(status);
      {
        absl::MutexLock lock(&mu_);
        last_error_ = error;
      }
      spdlog::warn("{}: coordinator {} {}: {}; retrying in {}", role, options_.coordinator,
                   error.code() == absl::StatusCode::kUnavailable ? "unavailable"
                                                                  : "refused the registration",
                   std::string(error.message()), Seconds(backoff));
      if (!sleep(backoff)) return;
      backoff = std::min(backoff * 2, options_.max_backoff);
      continue;
    }

    if (!sleep(heartbeat_interval)) return;
    const std::string id = member_id();
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    v1::HeartbeatRequest request;
    request.set_member_id(id);
    if (options_.fill_heartbeat) options_.fill_heartbeat(&request);
    v1::HeartbeatResponse response;
    const grpc::Status status = stub_->Heartbeat(&context, request, &response);
    if (status.ok()) {
      if (in_outage) {
        spdlog::info("{} {}: coordinator {} reachable again", role, id, options_.coordinator);
      }
      in_outage = false;
      continue;
    }
    const absl::Status error = FromGrpcStatus(status);
    {
      absl::MutexLock lock(&mu_);
      last_error_ = error;
    }
    if (error.code() == absl::StatusCode::kNotFound) {
      spdlog::warn("{} {}: coordinator {} does not know this member ({}); registering again", role,
                   id, options_.coordinator, std::string(error.message()));
      {
        absl::MutexLock lock(&mu_);
        member_id_.clear();
      }
      registered = false;
      backoff = options_.initial_backoff;
      continue;
    }
    if (!in_outage) {
      spdlog::warn("{} {}: heartbeat to coordinator {} failed: {}; retrying every {}", role, id,
                   options_.coordinator, error.ToString(), Seconds(heartbeat_interval));
      in_outage = true;
    }
  }
}

}  // namespace tessera
