// GrpcParameterService: the ParameterService of proto/tessera/v1/parameter.proto over gRPC's
// callback API, adapting a ParameterStore (DESIGN.md §3).
//
// Reactors only move requests onto a bounded thread pool; the store's work (decoding, the
// optimizer, encoding the answer) runs there. PushPull keeps one stream per worker-shard pair:
// requests of a stream are applied in the order they arrive (so a worker's sequence numbers reach
// each partition in order), one at a time on the pool; a pull that waits on the consistency gate
// parks without holding the stream, and later requests go on. Responses carry the request's seq
// and can leave out of order; a failed request is answered in PushPullResponse.status and the
// stream stays open. Writes are queued so that at most one is outstanding.
#ifndef TESSERA_SERVER_GRPC_PARAMETER_SERVICE_H_
#define TESSERA_SERVER_GRPC_PARAMETER_SERVICE_H_

#include <cstddef>

#include "server/internal/thread_pool.h"
#include "server/parameter_store.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::server {

class GrpcParameterService final : public v1::ParameterService::CallbackService {
 public:
  // `store` and `pool` must outlive the service and every call it serves. Answers larger than
  // max_message_bytes are split (Pull) or refused with RESOURCE_EXHAUSTED (PushPull).
  GrpcParameterService(ParameterStore* store, internal::ThreadPool* pool, size_t max_message_bytes);

  grpc::ServerBidiReactor<v1::PushPullRequest, v1::PushPullResponse>* PushPull(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<v1::PullResponse>* Pull(grpc::CallbackServerContext* context,
                                                   const v1::PullRequest* request) override;
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context,
                                 const v1::PushPullRequest* request,
                                 v1::PushResponse* response) override;
  grpc::ServerUnaryReactor* CreateJobState(grpc::CallbackServerContext* context,
                                           const v1::CreateJobStateRequest* request,
                                           v1::CreateJobStateResponse* response) override;
  grpc::ServerUnaryReactor* UpdateMembership(grpc::CallbackServerContext* context,
                                             const v1::UpdateMembershipRequest* request,
                                             v1::UpdateMembershipResponse* response) override;
  grpc::ServerUnaryReactor* DropJob(grpc::CallbackServerContext* context,
                                    const v1::DropJobRequest* request,
                                    v1::DropJobResponse* response) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const v1::CheckpointRequest* request,
                                       v1::CheckpointResponse* response) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* context,
                                    const v1::RestoreRequest* request,
                                    v1::RestoreResponse* response) override;

 private:
  ParameterStore* const store_;
  internal::ThreadPool* const pool_;
  const size_t max_message_bytes_;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_GRPC_PARAMETER_SERVICE_H_
