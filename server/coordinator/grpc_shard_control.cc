#include "server/coordinator/grpc_shard_control.h"

#include "common/grpc_status.h"
#include "common/status_macros.h"
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

absl::Status GrpcShardControl::Begin(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return absl::CancelledError("the coordinator is shutting down");
  in_flight_.insert(context);
  return absl::OkStatus();
}

void GrpcShardControl::End(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  in_flight_.erase(context);
}

void GrpcShardControl::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* context : in_flight_) context->TryCancel();
}

absl::Status GrpcShardControl::CreateJobState(const std::string& address, const std::string& job_id,
                                              const v1::JobConfig& config) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::CreateJobStateRequest request;
  request.set_job_id(job_id);
  *request.mutable_config() = config;
  v1::CreateJobStateResponse response;
  TESSERA_RETURN_IF_ERROR(Begin(&context));
  const grpc::Status status = StubFor(address)->CreateJobState(&context, request, &response);
  End(&context);
  return FromGrpcStatus(status);
}

absl::Status GrpcShardControl::DropJob(const std::string& address, const std::string& job_id) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::DropJobRequest request;
  request.set_job_id(job_id);
  v1::DropJobResponse response;
  TESSERA_RETURN_IF_ERROR(Begin(&context));
  const grpc::Status status = StubFor(address)->DropJob(&context, request, &response);
  End(&context);
  return FromGrpcStatus(status, address);
}

absl::StatusOr<v1::CheckpointResponse> GrpcShardControl::Checkpoint(
    const std::string& address, const v1::CheckpointRequest& request, absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::CheckpointResponse response;
  TESSERA_RETURN_IF_ERROR(Begin(&context));
  const grpc::Status status = StubFor(address)->Checkpoint(&context, request, &response);
  End(&context);
  TESSERA_RETURN_IF_ERROR(FromGrpcStatus(status, address));
  return response;
}

absl::StatusOr<v1::RestoreResponse> GrpcShardControl::Restore(const std::string& address,
                                                              const v1::RestoreRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::RestoreResponse response;
  TESSERA_RETURN_IF_ERROR(Begin(&context));
  const grpc::Status status = StubFor(address)->Restore(&context, request, &response);
  End(&context);
  TESSERA_RETURN_IF_ERROR(FromGrpcStatus(status, address));
  return response;
}

absl::StatusOr<v1::UpdateMembershipResponse> GrpcShardControl::UpdateMembership(
    const std::string& address, const v1::UpdateMembershipRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::UpdateMembershipResponse response;
  TESSERA_RETURN_IF_ERROR(Begin(&context));
  const grpc::Status status = StubFor(address)->UpdateMembership(&context, request, &response);
  End(&context);
  TESSERA_RETURN_IF_ERROR(FromGrpcStatus(status, address));
  return response;
}

}  // namespace tessera::coordinator
