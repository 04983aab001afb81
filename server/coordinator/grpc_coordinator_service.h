// The coordinator's gRPC adapters (callback API): JobService and ClusterService over one
// Coordinator. Handlers validate nothing themselves and hold no state beyond their streams; the
// Coordinator does the work and the errors cross to gRPC through ToGrpcStatus.
//
// A gRPC thread never waits on SQLite or on a shard: the calls that commit to SQLite (CreateJob,
// CancelJob, Register, Deregister, ReportProgress) and WatchJob (a flush and a read of the stored
// events) run on a bounded pool of their own, `store_pool`, and CheckpointJob, which waits for the
// shards to reach a step and write it, on another, `checkpoint_pool`, so that a flood of
// checkpoints never holds up a progress report; each finishes its reactor from the pool. The calls
// that only take the coordinator's mutex briefly (GetJob, ListJobs, Heartbeat, ListMembers,
// WatchTasks) run inline. Streams (WatchTasks, WatchJob) are write reactors fed by bounded
// queues, so a slow client never blocks the coordinator.
#ifndef TESSERA_SERVER_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
#define TESSERA_SERVER_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_

#include "common/thread_pool.h"
#include "server/coordinator/coordinator.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera::coordinator {

// `coordinator` and the pools must outlive the service, and the pools must run until the server
// has shut down (its Shutdown waits for the reactors the pools finish). Thread-safe.
class GrpcJobService final : public v1::JobService::CallbackService {
 public:
  GrpcJobService(Coordinator* coordinator, ThreadPool* store_pool, ThreadPool* checkpoint_pool)
      : coordinator_(coordinator), store_pool_(store_pool), checkpoint_pool_(checkpoint_pool) {}

  grpc::ServerUnaryReactor* CreateJob(grpc::CallbackServerContext* context,
                                      const v1::CreateJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* context,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerWriteReactor<v1::WatchJobResponse>* WatchJob(
      grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* CheckpointJob(grpc::CallbackServerContext* context,
                                          const v1::CheckpointJobRequest* request,
                                          v1::CheckpointRecord* response) override;

 private:
  Coordinator* const coordinator_;
  ThreadPool* const store_pool_;
  ThreadPool* const checkpoint_pool_;
};

// As GrpcJobService: `coordinator` and `store_pool` must outlive the service. Thread-safe.
class GrpcClusterService final : public v1::ClusterService::CallbackService {
 public:
  GrpcClusterService(Coordinator* coordinator, ThreadPool* store_pool)
      : coordinator_(coordinator), store_pool_(store_pool) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Deregister(grpc::CallbackServerContext* context,
                                       const v1::DeregisterRequest* request,
                                       v1::DeregisterResponse* response) override;
  grpc::ServerUnaryReactor* ListMembers(grpc::CallbackServerContext* context,
                                        const v1::ListMembersRequest* request,
                                        v1::ListMembersResponse* response) override;
  grpc::ServerWriteReactor<v1::TaskEvent>* WatchTasks(
      grpc::CallbackServerContext* context, const v1::WatchTasksRequest* request) override;
  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* context,
                                           const v1::ProgressReport* request,
                                           v1::ProgressAck* response) override;

 private:
  Coordinator* const coordinator_;
  ThreadPool* const store_pool_;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
