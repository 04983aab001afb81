// ShardControl: the coordinator's calls to the shards (tessera.v1.ParameterService). An interface
// so that tests can fake it; GrpcShardControl (grpc_shard_control.h) is the real one.
#ifndef TESSERA_SERVER_COORDINATOR_SHARD_CONTROL_H_
#define TESSERA_SERVER_COORDINATOR_SHARD_CONTROL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::coordinator {

// Implementations put a deadline on every call and are thread-safe. The coordinator never calls
// them while holding its lock.
class ShardControl {
 public:
  virtual ~ShardControl() = default;
  // CreateJobState(job_id, config, no partitions) on the shard at `address`. Blocks.
  virtual absl::Status CreateJobState(const std::string& address, const std::string& job_id,
                                      const v1::JobConfig& config) = 0;
  // DropJob(job_id) on the shard at `address`. Blocks.
  virtual absl::Status DropJob(const std::string& address, const std::string& job_id) = 0;
  // Checkpoint (see parameter.proto): answers once the shard's file of `request.step` is durable,
  // or with the shard's error (FAILED_PRECONDITION: the step boundary passed without a snapshot).
  // Blocks for at most `timeout`.
  virtual absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& address,
                                                            const v1::CheckpointRequest& request,
                                                            absl::Duration timeout) = 0;
  // Restore (see parameter.proto): DATA_LOSS for a torn or corrupt file, NOT_FOUND for a missing
  // one. Blocks (the implementation's deadline).
  virtual absl::StatusOr<v1::RestoreResponse> Restore(const std::string& address,
                                                      const v1::RestoreRequest& request) = 0;
  // UpdateMembership (see parameter.proto). Blocks (the implementation's deadline).
  virtual absl::StatusOr<v1::UpdateMembershipResponse> UpdateMembership(
      const std::string& address, const v1::UpdateMembershipRequest& request) = 0;
  // Filling a new copy (server/shard_fill.h): copies the checkpoint files of `shape.step` of the
  // shards at `sources` (in this order) page by page to the shard at `target` (ReadCheckpoint,
  // then Fill with `shape`'s job, step, num_shards and replicas), and returns the target's answer
  // to the last page (installed). Blocks for at most `timeout` in all. The default is
  // UNIMPLEMENTED.
  virtual absl::StatusOr<v1::FillResponse> CopyFill(const std::vector<std::string>& sources,
                                                    const std::string& target,
                                                    const v1::FillRequest& shape,
                                                    absl::Duration timeout) {
    return absl::UnimplementedError("this shard control cannot fill a shard");
  }
  // Opens the journal of the fill `shape` (its job and step) on the shard at `target`: from then
  // until the fill is installed, the shard keeps and acknowledges the ranks' pushes of the step
  // and later, so that they train on while the files are copied (Fill with open, see
  // parameter.proto). Blocks (the implementation's deadline). The default is UNIMPLEMENTED (the
  // fill then pauses the ranks at the step until it is installed).
  virtual absl::Status OpenFill(const std::string& target, const v1::FillRequest& shape) {
    return absl::UnimplementedError("this shard control cannot open a fill's journal");
  }
  // Ends the calls in flight (they return CANCELLED) so that a stopping coordinator does not wait
  // out their deadlines; the coordinator calls it from Stop() before it joins its threads. May
  // make later calls fail at once too. Never blocks. The default does nothing.
  virtual void CancelAll() {}
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_SHARD_CONTROL_H_
