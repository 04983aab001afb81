// CoordinatorServer: the tessera-coordinator process's pieces together: the JobStore in
// <data_dir>/coordinator.db, the Coordinator, its gRPC services (JobService, ClusterService,
// grpc.health.v1 and server reflection), the two bounded pools the services run their blocking
// calls on (grpc_coordinator_service.h), and the shard control channels.
//
// Life cycle: Create() (opens the database and loads it) -> kNew; Start() binds and serves ->
// kRunning; Stop() -> kStopped.
#ifndef TESSERA_SERVER_COORDINATOR_COORDINATOR_SERVER_H_
#define TESSERA_SERVER_COORDINATOR_COORDINATOR_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "common/thread_pool.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/grpc_coordinator_service.h"
#include "server/coordinator/grpc_shard_control.h"
#include "server/coordinator/job_store.h"

namespace tessera::coordinator {

struct CoordinatorServerOptions {
  // host:port to bind; port 0 picks a free one (see port()).
  std::string listen = "127.0.0.1:7070";
  // Required. Holds coordinator.db; created when missing.
  std::string data_dir;
  CoordinatorOptions coordinator;
  // Deadline of each CreateJobState / DropJob call to a shard.
  absl::Duration shard_rpc_timeout = absl::Seconds(10);
  // Threads that run the calls committing to SQLite (CreateJob, CancelJob, WatchJob, Register,
  // Deregister, ReportProgress) off gRPC's threads; the writes are serialized anyway. >= 1.
  int store_threads = 4;
  // Threads that run CheckpointJob calls (each waits for the shards to reach a step and write
  // it); more calls wait for one. >= 1.
  int checkpoint_threads = 4;
  // Listener credentials (common/security.h Security::ServerCredentials()); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // What the shard control channels dial with (Security::Client()); default: plaintext.
  ClientCredentials client_credentials;
  // Called on the builder before the server starts (the metrics interceptor); may be empty.
  std::function<void(grpc::ServerBuilder&)> configure;
};

class CoordinatorServer {
 public:
  // Validates `options`, creates data_dir, opens and loads the database. INVALID_ARGUMENT naming
  // the flag; FAILED_PRECONDITION when data_dir cannot be created; the store's errors.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Create(
      const CoordinatorServerOptions& options);
  // The checks of Create() that touch nothing (no directory, database or socket), for
  // --check-config: INVALID_ARGUMENT naming the flag.
  static absl::Status Validate(const CoordinatorServerOptions& options);
  ~CoordinatorServer();  // Stop(absl::ZeroDuration())

  // Binds and serves (health SERVING when this returns OK), and starts the coordinator's tick
  // thread. UNAVAILABLE when the address cannot be bound. REQUIRES: not started yet.
  absl::Status Start();
  // Turns health NOT_SERVING while calls are still served: the start of a drain, so health
  // probes see it for the whole drain. Stop() does it too. No effect before Start(). Call from
  // the thread that calls Start() and Stop().
  void SetNotServing();

  // Turns health NOT_SERVING, ends every watch and task stream, lets running calls finish for
  // `grace`, then cancels them and joins. Idempotent; blocks.
  void Stop(absl::Duration grace);

  int port() const { return port_; }
  Coordinator* coordinator() { return coordinator_.get(); }

 private:
  explicit CoordinatorServer(const CoordinatorServerOptions& options) : options_(options) {}

  const CoordinatorServerOptions options_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<GrpcShardControl> shards_;
  std::unique_ptr<Coordinator> coordinator_;
  // Run until the server has shut down (its Shutdown waits for the reactors they finish).
  std::unique_ptr<ThreadPool> store_pool_;
  std::unique_ptr<ThreadPool> checkpoint_pool_;
  std::unique_ptr<GrpcJobService> job_service_;
  std::unique_ptr<GrpcClusterService> cluster_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_COORDINATOR_SERVER_H_
