#include "common/grpc_server.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/reflection_guard.h"
#include "grpc/impl/codegen/grpc_types.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace tessera {

absl::StatusOr<StartedGrpcServer> StartGrpcServer(const GrpcServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  StartedGrpcServer started;
  builder.AddListeningPort(
      options.listen,
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &started.port);
  // gRPC sets SO_REUSEPORT by default, so a second daemon on a taken port would share it
  // silently; turned off, the bind fails and the error names the flag.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // The shards' clients ping every 5 s to notice a dead connection (grpc_shard_client.cc), also
  // while a stream waits on a BSP barrier with no data moving; by default a server answers pings
  // that come more often than every 5 minutes without data with GOAWAY ("too_many_pings").
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  if (options.max_message_bytes > 0) {
    builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  }
  // Built now so that its memory is there from the start, not at the first reflection call.
  ReflectionNames::Get();
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(NewReflectionGuardFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  if (options.configure) options.configure(builder);
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || started.port == 0) {
    return absl::UnavailableError(absl::StrCat(options.listen_flag, ": cannot bind ",
                                               options.listen,
                                               " (in use or not a local address?)"));
  }
  SetGrpcServing(started.server.get(), true);
  return started;
}

void SetGrpcServing(grpc::Server* server, bool serving) {
  if (server == nullptr) return;
  if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
    health->SetServingStatus(serving);
  }
}

absl::Status MakeDirs(const std::string& path, absl::string_view flag) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    const std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat(flag, ": cannot create ", prefix, ": ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", path, " is not a directory"));
  }
  return absl::OkStatus();
}

}  // namespace tessera
