#include "server/coordinator/grpc_shard_control.h"

#include "common/grpc_status.h"
#include "grpcpp/client_context.h"

namespace tessera::coordinator {

v1::ParameterService::Stub* GrpcShardControl::StubFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<v1::ParameterService::Stub>& stub = stubs_[address];
  if (stub == nullptr) {
    stub = v1::ParameterService::NewStub(credentials_.CreateChannel(address));
  }
  return stub.get();
}

absl::Status GrpcShardControl::CreateJobState(const std::string& address, const std::string& job_id,
                                              const v1::JobConfig& config) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::CreateJobStateRequest request;
  request.set_job_id(job_id);
  *request.mutable_config() = config;
  v1::CreateJobStateResponse response;
  return FromGrpcStatus(StubFor(address)->CreateJobState(&context, request, &response));
}

absl::Status GrpcShardControl::DropJob(const std::string& address, const std::string& job_id) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::DropJobRequest request;
  request.set_job_id(job_id);
  v1::DropJobResponse response;
  return FromGrpcStatus(StubFor(address)->DropJob(&context, request, &response), address);
}

}  // namespace tessera::coordinator
