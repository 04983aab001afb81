#include "server/coordinator/coordinator_server.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator {
namespace {

absl::Status MakeDirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    const std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat("--data_dir: cannot create ", prefix, ": ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("--data_dir: ", path, " is not a directory"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Create(
    const CoordinatorServerOptions& options) {
  if (options.listen.empty() || options.listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: want host:port, got '", options.listen, "'"));
  }
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data_dir: must be set");
  if (options.shard_rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shard_rpc_timeout: must be > 0");
  }
  TESSERA_RETURN_IF_ERROR(MakeDirs(options.data_dir));
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer(options));
  TESSERA_ASSIGN_OR_RETURN(server->store_,
                           JobStore::Open(absl::StrCat(options.data_dir, "/coordinator.db")));
  server->shards_ = std::make_unique<GrpcShardControl>(options.shard_rpc_timeout);
  absl::StatusOr<std::unique_ptr<Coordinator>> coordinator =
      Coordinator::Create(options.coordinator, server->store_.get(), server->shards_.get());
  if (!coordinator.ok()) {
    // Option names are the flags' names without the dashes.
    const absl::Status& status = coordinator.status();
    return absl::Status(status.code(), status.code() == absl::StatusCode::kInvalidArgument
                                           ? absl::StrCat("--", status.message())
                                           : std::string(status.message()));
  }
  server->coordinator_ = std::move(*coordinator);
  server->job_service_ = std::make_unique<GrpcJobService>(server->coordinator_.get());
  server->cluster_service_ = std::make_unique<GrpcClusterService>(server->coordinator_.get());
  return server;
}

CoordinatorServer::~CoordinatorServer() { Stop(absl::ZeroDuration()); }

absl::Status CoordinatorServer::Start() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(job_service_.get());
  builder.RegisterService(cluster_service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("--listen: cannot bind ", options_.listen,
                                               " (in use or not a local address?)"));
  }
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
  }
  coordinator_->Start();
  const size_t colon = options_.listen.rfind(':');
  spdlog::info("tessera-coordinator serving on {}:{} (data in {})",
               options_.listen.substr(0, colon), port_, options_.data_dir);
  return absl::OkStatus();
}

void CoordinatorServer::Stop(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
  }
  // Ends the streams first, so Shutdown does not wait for them.
  if (coordinator_ != nullptr) coordinator_->Stop();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
}

}  // namespace tessera::coordinator
