#include "server/shard_server.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_server.h"
#include "common/status_macros.h"
#include "server/checkpoint_file.h"
#include "spdlog/spdlog.h"

namespace tessera::server {
namespace {

constexpr size_t kMinMessageBytes = size_t{64} << 10;
constexpr size_t kMaxMessageBytes = (size_t{2} << 30) - 1;

}  // namespace

ShardServer::ShardServer(const ShardServerOptions& options) : options_(options) {
  int threads = options.threads;
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  pool_ = std::make_unique<ThreadPool>(threads);
  ParameterStoreOptions store_options;
  ThreadPool* pool = pool_.get();
  store_options.executor = [pool](std::function<void()> task) { pool->Schedule(std::move(task)); };
  store_options.max_memory_bytes = options.max_memory_bytes;
  store_options.max_message_bytes = options.max_message_bytes;
  if (!options.data_dir.empty()) store_options.checkpoint_dir = options.data_dir + "/checkpoints";
  store_options.shard_index = static_cast<uint32_t>(options.shard_index);
  store_ = std::make_unique<ParameterStore>(std::move(store_options));
  service_ =
      std::make_unique<GrpcParameterService>(store_.get(), pool_.get(), options.max_message_bytes);
}

absl::Status ShardServer::Validate(const ShardServerOptions& options) {
  if (options.listen.empty() || options.listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: want host:port, got '", options.listen, "'"));
  }
  if (options.max_message_bytes < kMinMessageBytes ||
      options.max_message_bytes > kMaxMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes: must be in [",
                                                   kMinMessageBytes, ", ", kMaxMessageBytes,
                                                   "], got ", options.max_message_bytes));
  }
  if (options.threads < 0 || options.threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads: must be in [0, 1024], got ", options.threads));
  }
  if (options.max_memory_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_memory_bytes: must be >= 0, got ", options.max_memory_bytes));
  }
  if (options.shard_index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard_index: must be >= 0, got ", options.shard_index));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Create(
    const ShardServerOptions& options) {
  TESSERA_RETURN_IF_ERROR(Validate(options));
  std::unique_ptr<DataDirClaim> claim;
  if (!options.data_dir.empty()) {
    TESSERA_RETURN_IF_ERROR(MakeDirs(options.data_dir, "--data_dir"));
    TESSERA_ASSIGN_OR_RETURN(claim, DataDirClaim::Claim(options.data_dir));
    const std::string checkpoints = options.data_dir + "/checkpoints";
    absl::Status made = MakeDurableDirs(checkpoints);
    if (!made.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("--data_dir: ", made.message()));
    }
    // Writes a crash interrupted left <file>.tmp behind; they are never loaded.
    absl::StatusOr<int> removed = RemoveTemporaryCheckpointFiles(checkpoints, options.shard_index);
    if (!removed.ok()) {
      spdlog::warn("tessera-server: {}", removed.status().ToString());
    } else if (*removed > 0) {
      spdlog::info("tessera-server: removed {} unfinished checkpoint files in {}", *removed,
                   checkpoints);
    }
  }
  std::unique_ptr<ShardServer> server(new ShardServer(options));
  server->claim_ = std::move(claim);
  return server;
}

ShardServer::~ShardServer() { Stop(absl::ZeroDuration()); }

absl::Status ShardServer::Start() {
  GrpcServerOptions grpc_options;
  grpc_options.listen = options_.listen;
  grpc_options.credentials = options_.credentials;
  grpc_options.max_message_bytes = options_.max_message_bytes;
  grpc_options.services = {service_.get()};
  grpc_options.configure = options_.configure;
  TESSERA_ASSIGN_OR_RETURN(StartedGrpcServer started, StartGrpcServer(grpc_options));
  server_ = std::move(started.server);
  port_ = started.port;
  spdlog::info("tessera-server shard {} serving on {} ({} threads, max message {} bytes)",
               options_.shard_index, address(), pool_->size(), options_.max_message_bytes);
  return absl::OkStatus();
}

std::string ShardServer::address() const {
  const size_t colon = options_.listen.rfind(':');
  return absl::StrCat(options_.listen.substr(0, colon), ":", port_);
}

void ShardServer::SetNotServing() { SetGrpcServing(server_.get(), false); }

void ShardServer::Stop(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  if (server_ != nullptr) {
    SetGrpcServing(server_.get(), false);
    store_->CloseAll(absl::CancelledError("the shard is shutting down"));
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
  store_->CloseAll(absl::CancelledError("the shard is shutting down"));
  pool_->Stop();
}

}  // namespace tessera::server
