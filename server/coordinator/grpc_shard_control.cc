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

absl::Status GrpcShardControl::OpenFill(const std::string& target, const v1::FillRequest& shape) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::FillRequest request;
  request.set_job_id(shape.job_id());
  request.set_step(shape.step());
  request.set_open(true);
  v1::FillResponse response;
  TESSERA_RETURN_IF_ERROR(Begin(&context));
  const grpc::Status status = StubFor(target)->Fill(&context, request, &response);
  End(&context);
  return FromGrpcStatus(status, target);
}

absl::StatusOr<v1::FillResponse> GrpcShardControl::CopyFill(const std::vector<std::string>& sources,
                                                            const std::string& target,
                                                            const v1::FillRequest& shape,
                                                            absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::FillResponse answer;
  for (size_t s = 0; s < sources.size(); ++s) {
    uint64_t offset = 0;
    uint64_t file_bytes = 0;
    do {
      v1::ReadCheckpointRequest read;
      read.set_job_id(shape.job_id());
      read.set_step(shape.step());
      read.set_offset(offset);
      read.set_max_bytes(kFillPageBytes);
      v1::ReadCheckpointResponse page;
      {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(deadline));
        TESSERA_RETURN_IF_ERROR(Begin(&context));
        const grpc::Status status = StubFor(sources[s])->ReadCheckpoint(&context, read, &page);
        End(&context);
        TESSERA_RETURN_IF_ERROR(FromGrpcStatus(status, sources[s]));
      }
      file_bytes = page.file_bytes();
      if (page.data().empty() && offset < file_bytes) {
        return absl::InternalError(absl::StrCat(sources[s], ": ReadCheckpoint at offset ", offset,
                                                " of ", file_bytes, " bytes answered nothing"));
      }
      v1::FillRequest fill = shape;
      fill.set_source(static_cast<uint32_t>(s));
      fill.set_num_sources(static_cast<uint32_t>(sources.size()));
      fill.set_offset(offset);
      fill.set_file_bytes(file_bytes);
      offset += page.data().size();
      fill.set_allocated_data(page.release_data());
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      TESSERA_RETURN_IF_ERROR(Begin(&context));
      const grpc::Status status = StubFor(target)->Fill(&context, fill, &answer);
      End(&context);
      TESSERA_RETURN_IF_ERROR(FromGrpcStatus(status, target));
    } while (offset < file_bytes);
  }
  if (!answer.installed()) {
    return absl::InternalError(
        absl::StrCat(target, ": the fill's last page was taken but nothing was installed"));
  }
  return answer;
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
