// The coordinator's gRPC adapters (callback API): JobService and ClusterService over one
// Coordinator. Handlers validate nothing themselves and hold no state beyond their streams; the
// Coordinator does the work and the errors cross to gRPC through ToGrpcStatus.
//
// Unary handlers call the Coordinator inline on gRPC's callback threads: each call takes the
// coordinator's mutex briefly and may wait for one small SQLite transaction. CheckpointJob, which
// waits for the shards to reach a step and write it, runs on a thread of its own. Streams
// (WatchTasks, WatchJob) are write reactors fed by bounded queues, so a slow client never blocks
// the coordinator.
#ifndef TESSERA_SERVER_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
#define TESSERA_SERVER_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/coordinator/coordinator.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera::coordinator {

// `coordinator` must outlive the service. Thread-safe. The destructor joins the CheckpointJob
// threads (each ends within the coordinator's shard deadlines).
class GrpcJobService final : public v1::JobService::CallbackService {
 public:
  explicit GrpcJobService(Coordinator* coordinator) : coordinator_(coordinator) {}
  ~GrpcJobService() override;

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
  struct Blocking {
    std::thread thread;
    std::shared_ptr<bool> done;  // guarded by mu_
  };
  Coordinator* const coordinator_;
  absl::Mutex mu_;
  std::vector<Blocking> blocking_ ABSL_GUARDED_BY(mu_);
};

// `coordinator` must outlive the service. Thread-safe.
class GrpcClusterService final : public v1::ClusterService::CallbackService {
 public:
  explicit GrpcClusterService(Coordinator* coordinator) : coordinator_(coordinator) {}

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
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
