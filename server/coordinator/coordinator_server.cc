#include "server/coordinator/coordinator_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_server.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace tessera::coordinator {
absl::Status CoordinatorServer::Validate(const CoordinatorServerOptions& options) {
  if (options.listen.empty() || options.listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: want host:port, got '", options.listen, "'"));
  }
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data_dir: must be set");
  if (options.shard_rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shard_rpc_timeout: must be > 0");
  }
  if (options.store_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("store_threads: must be >= 1, got ", options.store_threads));
  }
  if (options.checkpoint_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_threads: must be >= 1, got ", options.checkpoint_threads));
  }
  if (options.coordinator.recovery_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--recovery_timeout: must be > 0 seconds, got ",
                     absl::ToDoubleSeconds(options.coordinator.recovery_timeout)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Create(
    const CoordinatorServerOptions& options) {
  TESSERA_RETURN_IF_ERROR(Validate(options));
  TESSERA_RETURN_IF_ERROR(MakeDirs(options.data_dir, "--data_dir"));
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer(options));
  TESSERA_ASSIGN_OR_RETURN(server->store_,
                           JobStore::Open(absl::StrCat(options.data_dir, "/coordinator.db")));
  server->shards_ =
      std::make_unique<GrpcShardControl>(options.shard_rpc_timeout, options.client_credentials);
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
  server->store_pool_ = std::make_unique<ThreadPool>(options.store_threads);
  server->checkpoint_pool_ = std::make_unique<ThreadPool>(options.checkpoint_threads);
  server->job_service_ = std::make_unique<GrpcJobService>(
      server->coordinator_.get(), server->store_pool_.get(), server->checkpoint_pool_.get());
  server->cluster_service_ =
      std::make_unique<GrpcClusterService>(server->coordinator_.get(), server->store_pool_.get());
  return server;
}

CoordinatorServer::~CoordinatorServer() { Stop(absl::ZeroDuration()); }

absl::Status CoordinatorServer::Start() {
  GrpcServerOptions grpc_options;
  grpc_options.listen = options_.listen;
  grpc_options.credentials = options_.credentials;
  grpc_options.services = {job_service_.get(), cluster_service_.get()};
  grpc_options.configure = options_.configure;
  TESSERA_ASSIGN_OR_RETURN(StartedGrpcServer started, StartGrpcServer(grpc_options));
  server_ = std::move(started.server);
  port_ = started.port;
  coordinator_->Start();
  const size_t colon = options_.listen.rfind(':');
  spdlog::info("tessera-coordinator serving on {}:{} (data in {})",
               options_.listen.substr(0, colon), port_, options_.data_dir);
  return absl::OkStatus();
}

void CoordinatorServer::SetNotServing() { SetGrpcServing(server_.get(), false); }

void CoordinatorServer::Stop(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  SetGrpcServing(server_.get(), false);
  // Shard calls in flight (a Checkpoint may wait minutes) end at once, then the streams, so
  // neither Stop nor Shutdown waits for them.
  if (shards_ != nullptr) shards_->CancelAll();
  if (coordinator_ != nullptr) coordinator_->Stop();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
  // Every call is finished: the pools have nothing left to run.
  if (store_pool_ != nullptr) store_pool_->Stop();
  if (checkpoint_pool_ != nullptr) checkpoint_pool_->Stop();
}

}  // namespace tessera::coordinator
