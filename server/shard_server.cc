#include "server/shard_server.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "spdlog/spdlog.h"

namespace tessera::server {
namespace {

constexpr size_t kMinMessageBytes = size_t{64} << 10;
constexpr size_t kMaxMessageBytes = (size_t{2} << 30) - 1;

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

ShardServer::ShardServer(const ShardServerOptions& options) : options_(options) {
  int threads = options.threads;
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  pool_ = std::make_unique<internal::ThreadPool>(threads);
  ParameterStoreOptions store_options;
  internal::ThreadPool* pool = pool_.get();
  store_options.executor = [pool](std::function<void()> task) { pool->Schedule(std::move(task)); };
  store_options.max_memory_bytes = options.max_memory_bytes;
  store_options.max_message_bytes = options.max_message_bytes;
  store_ = std::make_unique<ParameterStore>(std::move(store_options));
  service_ =
      std::make_unique<GrpcParameterService>(store_.get(), pool_.get(), options.max_message_bytes);
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Create(
    const ShardServerOptions& options) {
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
  if (!options.data_dir.empty()) {
    absl::Status dirs = MakeDirs(options.data_dir);
    if (!dirs.ok()) return dirs;
  }
  return std::unique_ptr<ShardServer>(new ShardServer(options));
}

ShardServer::~ShardServer() { Stop(absl::ZeroDuration()); }

absl::Status ShardServer::Start() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("--listen: cannot bind ", options_.listen,
                                               " (in use or not a local address?)"));
  }
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
  }
  spdlog::info("tessera-server shard {} serving on {} ({} threads, max message {} bytes)",
               options_.shard_index, address(), pool_->size(), options_.max_message_bytes);
  return absl::OkStatus();
}

std::string ShardServer::address() const {
  const size_t colon = options_.listen.rfind(':');
  return absl::StrCat(options_.listen.substr(0, colon), ":", port_);
}

void ShardServer::Stop(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
    store_->CloseAll(absl::CancelledError("the shard is shutting down"));
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
  store_->CloseAll(absl::CancelledError("the shard is shutting down"));
  pool_->Stop();
}

}  // namespace tessera::server
