// GrpcShardControl: ShardControl over gRPC (tessera.v1.ParameterService on each shard), one
// channel per shard address, reused.
#ifndef TESSERA_SERVER_COORDINATOR_GRPC_SHARD_CONTROL_H_
#define TESSERA_SERVER_COORDINATOR_GRPC_SHARD_CONTROL_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "grpcpp/client_context.h"
#include "server/coordinator/shard_control.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::coordinator {

// Thread-safe. Every call has a deadline of `timeout`; errors carry the shard's address. Channels
// are made with `credentials` (default: plaintext, no token).
class GrpcShardControl : public ShardControl {
 public:
  explicit GrpcShardControl(absl::Duration timeout, ClientCredentials credentials = {})
      : timeout_(timeout), credentials_(std::move(credentials)) {}

  absl::Status CreateJobState(const std::string& address, const std::string& job_id,
                              const v1::JobConfig& config) override;
  absl::Status DropJob(const std::string& address, const std::string& job_id) override;
  // Deadline `timeout` (not the constructor's): the call waits for the step and the write.
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& address,
                                                    const v1::CheckpointRequest& request,
                                                    absl::Duration timeout) override;
  absl::StatusOr<v1::RestoreResponse> Restore(const std::string& address,
                                              const v1::RestoreRequest& request) override;
  absl::StatusOr<v1::UpdateMembershipResponse> UpdateMembership(
      const std::string& address, const v1::UpdateMembershipRequest& request) override;

  absl::Status OpenFill(const std::string& target, const v1::FillRequest& shape) override;
  // Pages of kFillPageBytes; every call's deadline is the whole copy's.
  absl::StatusOr<v1::FillResponse> CopyFill(const std::vector<std::string>& sources,
                                            const std::string& target, const v1::FillRequest& shape,
                                            absl::Duration timeout) override;
  // Under gRPC's default 4 MiB receive limit with room for the message around it.
  static constexpr uint32_t kFillPageBytes = 1u << 20;

  // Cancels the calls in flight and makes every later call fail at once with CANCELLED, so a
  // stopping coordinator does not wait out a Checkpoint deadline. Irreversible; thread-safe.
  void CancelAll() override;

 private:
  v1::ParameterService::Stub* StubFor(const std::string& address);
  // Registers `context` as in flight; CANCELLED after CancelAll().
  absl::Status Begin(grpc::ClientContext* context);
  void End(grpc::ClientContext* context);

  const absl::Duration timeout_;
  const ClientCredentials credentials_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<v1::ParameterService::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_GRPC_SHARD_CONTROL_H_
