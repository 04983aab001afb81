#include "cli/coordinator_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace tessera::cli {

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(
    const Options& options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("coordinator: the address is empty");
  }
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc_timeout: must be > 0, got ", absl::FormatDuration(options.rpc_timeout)));
  }
  return std::unique_ptr<CoordinatorClient>(new CoordinatorClient(options));
}

CoordinatorClient::CoordinatorClient(const Options& options)
    : options_(options),
      channel_(options.credentials.CreateChannel(options.address)),
      jobs_(v1::JobService::NewStub(channel_)),
      cluster_(v1::ClusterService::NewStub(channel_)) {}

std::unique_ptr<grpc::ClientContext> CoordinatorClient::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  return context;
}

absl::Status CoordinatorClient::Error(const grpc::Status& status) const {
  return FromGrpcStatus(status, options_.address);
}

absl::StatusOr<v1::Job> CoordinatorClient::CreateJob(const v1::JobSpec& spec) const {
  v1::CreateJobRequest request;
  *request.mutable_spec() = spec;
  v1::Job job;
  auto context = NewContext();
  grpc::Status status = jobs_->CreateJob(context.get(), request, &job);
  if (!status.ok()) return Error(status);
  return job;
}

absl::StatusOr<v1::Job> CoordinatorClient::GetJob(const std::string& job_id) const {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  auto context = NewContext();
  grpc::Status status = jobs_->GetJob(context.get(), request, &job);
  if (!status.ok()) return Error(status);
  return job;
}

absl::StatusOr<std::vector<v1::Job>> CoordinatorClient::ListJobs() const {
  v1::ListJobsRequest request;
  v1::ListJobsResponse response;
  auto context = NewContext();
  grpc::Status status = jobs_->ListJobs(context.get(), request, &response);
  if (!status.ok()) return Error(status);
  return std::vector<v1::Job>(response.jobs().begin(), response.jobs().end());
}

absl::StatusOr<v1::Job> CoordinatorClient::CancelJob(const std::string& job_id) const {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  auto context = NewContext();
  grpc::Status status = jobs_->CancelJob(context.get(), request, &job);
  if (!status.ok()) return Error(status);
  return job;
}

absl::StatusOr<v1::CheckpointRecord> CoordinatorClient::CheckpointJob(
    const std::string& job_id) const {
  v1::CheckpointJobRequest request;
  request.set_job_id(job_id);
  v1::CheckpointRecord record;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.checkpoint_timeout));
  grpc::Status status = jobs_->CheckpointJob(&context, request, &record);
  if (!status.ok()) return Error(status);
  return record;
}

absl::StatusOr<std::vector<v1::Member>> CoordinatorClient::ListMembers() const {
  v1::ListMembersRequest request;
  v1::ListMembersResponse response;
  auto context = NewContext();
  grpc::Status status = cluster_->ListMembers(context.get(), request, &response);
  if (!status.ok()) return Error(status);
  return std::vector<v1::Member>(response.members().begin(), response.members().end());
}

void CoordinatorClient::CancelWatches() {
  absl::MutexLock lock(&mu_);
  watches_cancelled_ = true;
  for (grpc::ClientContext* context : watches_) context->TryCancel();
}

absl::Status CoordinatorClient::WatchJob(
    const std::string& job_id, const std::function<void(const v1::WatchJobResponse&)>& on_update,
    absl::Duration stream_lifetime, int reconnect_attempts) {
  int64_t last_seq = 0;
  int failures = 0;
  absl::Status last_error;
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + stream_lifetime));
    {
      absl::MutexLock lock(&mu_);
      if (watches_cancelled_) return absl::CancelledError("watch cancelled");
      watches_.push_back(&context);
    }
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_after_seq(last_seq);
    std::unique_ptr<grpc::ClientReader<v1::WatchJobResponse>> reader =
        jobs_->WatchJob(&context, request);
    v1::WatchJobResponse response;
    bool terminal = false;
    bool progressed = false;
    while (reader->Read(&response)) {
      progressed = true;
      if (response.has_event()) last_seq = std::max(last_seq, response.event().seq());
      on_update(response);
      if (IsTerminal(response.job().state())) terminal = true;
    }
    grpc::Status status = reader->Finish();
    bool cancelled = false;
    {
      absl::MutexLock lock(&mu_);
      watches_.erase(std::find(watches_.begin(), watches_.end(), &context));
      cancelled = watches_cancelled_;
    }
    if (cancelled) return absl::CancelledError("watch cancelled");
    if (terminal) return absl::OkStatus();
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      // The stream's lifetime ran out: reopen after the last event seen.
      failures = 0;
      continue;
    }
    if (!status.ok() && status.error_code() != grpc::StatusCode::UNAVAILABLE) {
      return Error(status);
    }
    // Broken, or ended before the job did: reopen, a bounded number of times in a row.
    if (progressed) failures = 0;
    last_error =
        status.ok() ? absl::UnavailableError("the stream ended before the job did") : Error(status);
    if (++failures > reconnect_attempts) {
      return absl::UnavailableError(
          absl::StrCat("lost the watch stream to ", options_.address, ": ", last_error.message()));
    }
    // Sleeps the backoff, or less when CancelWatches() is called meanwhile.
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&watches_cancelled_),
                         absl::Milliseconds(200) * (1 << std::min(failures, 4)));
  }
}

}  // namespace tessera::cli
