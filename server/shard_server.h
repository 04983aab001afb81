// ShardServer: one parameter shard process's gRPC server, its ParameterStore and its thread pool.
//
// Life cycle: Create() -> kNew; Start() binds and serves -> kRunning; Stop() -> kStopped.
// Besides the ParameterService it serves grpc.health.v1 (SERVING once started) and server
// reflection.
#ifndef TESSERA_SERVER_SHARD_SERVER_H_
#define TESSERA_SERVER_SHARD_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/data_dir_claim.h"
#include "server/grpc_parameter_service.h"
#include "server/parameter_store.h"

namespace tessera::server {

struct ShardServerOptions {
  // host:port to bind; port 0 picks a free one (see ShardServer::port()).
  std::string listen = "127.0.0.1:0";
  // Checkpoint files go to <data_dir>/checkpoints (issue #6, docs/checkpoints.md). Created when
  // missing; empty means none (Checkpoint and Restore answer FAILED_PRECONDITION). The directory
  // is also the shard's identity, and locked while the server lives (server/data_dir_claim.h).
  std::string data_dir;
  int shard_index = 0;
  // Largest message received or sent, in bytes.
  size_t max_message_bytes = size_t{64} << 20;
  // Threads that apply pushes and answer pulls; 0 means one per hardware thread.
  int threads = 0;
  // Cap on the bytes of parameter state (ParameterStoreOptions::max_memory_bytes); 0 means three
  // quarters of the physical memory.
  int64_t max_memory_bytes = 0;
  // Listener credentials (common/security.h Security::ServerCredentials()); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Called on the builder before the server starts (the metrics interceptor); may be empty.
  std::function<void(grpc::ServerBuilder&)> configure;
};

class ShardServer {
 public:
  // Validates `options`. INVALID_ARGUMENT names the bad field; FAILED_PRECONDITION when data_dir
  // cannot be created.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Create(const ShardServerOptions& options);

  // The checks of Create() that touch nothing (no directory, no socket), for --check-config:
  // INVALID_ARGUMENT naming the bad field.
  static absl::Status Validate(const ShardServerOptions& options);

  ~ShardServer();  // Stop(absl::ZeroDuration()) when still running

  // Binds and starts serving; health is SERVING when this returns OK. UNAVAILABLE when the address
  // cannot be bound. REQUIRES: not started yet.
  absl::Status Start();

  // Turns health NOT_SERVING while calls are still served: the start of a drain, so health
  // probes see it for the whole drain. Stop() does it too. No effect before Start(). Call from
  // the thread that calls Start() and Stop().
  void SetNotServing();

  // Turns health NOT_SERVING, stops accepting calls, fails parked pulls with CANCELLED, lets
  // running calls finish until `grace` has passed and cancels the rest, then joins the threads.
  // Idempotent; blocks.
  void Stop(absl::Duration grace);

  // The bound port (after Start()).
  int port() const { return port_; }
  // host:port actually bound.
  std::string address() const;
  ParameterStore* store() { return store_.get(); }
  // The data directory's identity (DataDirClaim), which the shard registers with; empty without
  // a data_dir.
  std::string identity() const { return claim_ != nullptr ? claim_->identity() : std::string(); }

 private:
  explicit ShardServer(const ShardServerOptions& options);

  const ShardServerOptions options_;
  std::unique_ptr<DataDirClaim> claim_;  // held for the server's life
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<GrpcParameterService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_SHARD_SERVER_H_
