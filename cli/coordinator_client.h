// CoordinatorClient: the `tessera` CLI's view of a coordinator (proto/tessera/v1/job.proto):
// JobService and ClusterService.ListMembers over one channel, with a deadline on every call.
//
// Errors come back as absl::Status with the coordinator's address in front of the message
// ("127.0.0.1:7070: ..."), so UNAVAILABLE says which address could not be reached.
//
// Thread-safety: all methods may be called from any thread.
#ifndef TESSERA_CLI_COORDINATOR_CLIENT_H_
#define TESSERA_CLI_COORDINATOR_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera::cli {

class CoordinatorClient {
 public:
  struct Options {
    std::string address;  // host:port
    // Deadline of every unary call.
    absl::Duration rpc_timeout = absl::Seconds(10);
    // How the channel is made: TLS, the bearer token (default: plaintext, no token).
    ClientCredentials credentials;
    // Deadline of CheckpointJob, which waits for the job to reach the step and the shards to
    // write it.
    absl::Duration checkpoint_timeout = absl::Minutes(10);
  };

  // Creates the channel (no RPC is made). INVALID_ARGUMENT for an empty address.
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(const Options& options);

  // Each blocks for at most rpc_timeout. Errors are the coordinator's (INVALID_ARGUMENT naming
  // the spec's field, NOT_FOUND for an unknown job, FAILED_PRECONDITION) or the transport's
  // (UNAVAILABLE, DEADLINE_EXCEEDED), prefixed with the address.
  absl::StatusOr<v1::Job> CreateJob(const v1::JobSpec& spec) const;
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) const;
  absl::StatusOr<std::vector<v1::Job>> ListJobs() const;
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id) const;
  absl::StatusOr<std::vector<v1::Member>> ListMembers() const;
  // Takes a checkpoint of a RUNNING job now; blocks until it is committed (at most
  // checkpoint_timeout). FAILED_PRECONDITION for a job that is not RUNNING or is recovering.
  absl::StatusOr<v1::CheckpointRecord> CheckpointJob(const std::string& job_id) const;

  // Follows a job until it ends. Calls `on_update` (on this thread) with every WatchJobResponse:
  // first the current record, then each event in order with the record after it. Returns OK once
  // the record is SUCCEEDED, FAILED or CANCELLED (whatever that state; the caller reads it from
  // the last update).
  //
  // Each stream lives at most `stream_lifetime` and is then reopened after the last event seen,
  // so no event is lost or repeated and a silent connection is noticed. A stream that breaks is
  // reopened `reconnect_attempts` times (with a short backoff); after that it returns UNAVAILABLE
  // ("lost the watch stream to 127.0.0.1:7070: ..."). CANCELLED when Cancel() was called.
  absl::Status WatchJob(const std::string& job_id,
                        const std::function<void(const v1::WatchJobResponse&)>& on_update,
                        absl::Duration stream_lifetime = absl::Seconds(60),
                        int reconnect_attempts = 5);
  // Ends every WatchJob in progress (and any later one) with CANCELLED. Safe from any thread
  // (not from a signal handler).
  void CancelWatches();

  const std::string& address() const { return options_.address; }

 private:
  explicit CoordinatorClient(const Options& options);
  std::unique_ptr<grpc::ClientContext> NewContext() const;
  absl::Status Error(const grpc::Status& status) const;

  const Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;

  absl::Mutex mu_;
  std::vector<grpc::ClientContext*> watches_ ABSL_GUARDED_BY(mu_);
  bool watches_cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// True for a terminal state: SUCCEEDED, FAILED or CANCELLED.
bool IsTerminal(v1::JobState state);

}  // namespace tessera::cli

#endif  // TESSERA_CLI_COORDINATOR_CLIENT_H_
