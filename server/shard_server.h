// ShardServer: one parameter shard process's gRPC server, its ParameterStore and its thread pool.
//
// Life cycle: Create() -> kNew; Start() binds and serves -> kRunning; Stop() -> kStopped.
// Besides the ParameterService it serves grpc.health.v1 (SERVING once started) and server
// reflection.
#ifndef TESSERA_SERVER_SHARD_SERVER_H_
#define TESSERA_SERVER_SHARD_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/grpc_parameter_service.h"
#include "server/internal/thread_pool.h"
#include "server/parameter_store.h"

namespace tessera::server {

struct ShardServerOptions {
  // host:port to bind; port 0 picks a free one (see ShardServer::port()).
  std::string listen = "127.0.0.1:0";
  // Where checkpoints go (issue #6). Created when missing; empty means none.
  std::string data_dir;
  int shard_index = 0;
  // Largest message received or sent, in bytes.
  size_t max_message_bytes = size_t{64} << 20;
  // Threads that apply pushes and answer pulls; 0 means one per hardware thread.
  int threads = 0;
  // Cap on the bytes of parameter state (ParameterStoreOptions::max_memory_bytes); 0 means three
  // quarters of the physical memory.
  int64_t max_memory_bytes = 0;
};

class ShardServer {
 public:
  // Validates `options`. INVALID_ARGUMENT names the bad field; FAILED_PRECONDITION when data_dir
  // cannot be created.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Create(const ShardServerOptions& options);

  ~ShardServer();  // Stop(absl::ZeroDuration()) when still running

  // Binds and starts serving. UNAVAILABLE when the address cannot be bound.
  // REQUIRES: not started yet.
  absl::Status Start();

  // Stops accepting calls, fails parked pulls with CANCELLED, lets running calls finish until
  // `grace` has passed and cancels the rest, then joins the threads. Idempotent; blocks.
  void Stop(absl::Duration grace);

  // The bound port (after Start()).
  int port() const { return port_; }
  // host:port actually bound.
  std::string address() const;
  ParameterStore* store() { return store_.get(); }

 private:
  explicit ShardServer(const ShardServerOptions& options);

  const ShardServerOptions options_;
  std::unique_ptr<internal::ThreadPool> pool_;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<GrpcParameterService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_SHARD_SERVER_H_
