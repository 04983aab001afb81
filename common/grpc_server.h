// What ShardServer and CoordinatorServer share to build and start their grpc::Server: the
// listening port with its credentials, message size limits, grpc.health.v1 and server
// reflection, and the daemon's `configure` hook (interceptors); plus MakeDirs for --data_dir.
#ifndef TESSERA_COMMON_GRPC_SERVER_H_
#define TESSERA_COMMON_GRPC_SERVER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace tessera {

struct GrpcServerOptions {
  // host:port to bind; port 0 picks a free one.
  std::string listen;
  // The flag named in errors about `listen`.
  std::string listen_flag = "--listen";
  // Null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Largest message received and sent; 0 keeps gRPC's defaults.
  size_t max_message_bytes = 0;
  // Registered in order; not owned, must outlive the server.
  std::vector<grpc::Service*> services;
  // Called on the builder after everything above, before BuildAndStart (interceptors, options).
  // A hook that sets interceptor creators replaces the reflection guard that StartGrpcServer
  // installs (common/reflection_guard.h), so it must add NewReflectionGuardFactory() itself, as
  // RpcMetricsHook does.
  std::function<void(grpc::ServerBuilder&)> configure;
};

// A started server and the port it bound.
struct StartedGrpcServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

// Builds and starts the server with grpc.health.v1 (overall status SERVING once this returns)
// and server reflection, without SO_REUSEPORT. UNAVAILABLE naming `listen_flag` and the address
// when it cannot be bound (in use, not a local address).
absl::StatusOr<StartedGrpcServer> StartGrpcServer(const GrpcServerOptions& options);

// Sets the overall health status (SERVING or NOT_SERVING) of a server made by StartGrpcServer.
void SetGrpcServing(grpc::Server* server, bool serving);

// Creates `path` and its missing parents (mode 0755). FAILED_PRECONDITION naming `flag` when a
// component cannot be created or `path` is not a directory.
absl::Status MakeDirs(const std::string& path, absl::string_view flag = "--data_dir");

}  // namespace tessera

#endif  // TESSERA_COMMON_GRPC_SERVER_H_
