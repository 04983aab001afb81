// JobState: one job on this shard (DESIGN.md §2-4): its config, its consistency gate, its dense
// partitions and sparse tables, its counters, the membership changes applied to its gate, and the
// bookkeeping of its checkpoints.
#ifndef TESSERA_SERVER_JOB_STATE_H_
#define TESSERA_SERVER_JOB_STATE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/push_pull_view.h"
#include "kernels/optimizer.h"
#include "server/checkpoint_capture.h"
#include "server/consistency_gate.h"
#include "server/memory_budget.h"
#include "server/partition.h"
#include "server/shard_counters.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// Owned by the store's job table by std::shared_ptr (the checkpoint writer and the calls in
// flight hold references too). The const fields are set at creation. Thread-safe as annotated.
// Lock order: membership_mu > the gate's lock; mu is a leaf (nothing is locked under it);
// Partition::mu > checkpoints.mu > log_mu.
class JobState : public std::enable_shared_from_this<JobState> {
 public:
  // `charged`: bytes already reserved in `budget` for the job itself (FixedBytes), given back on
  // destruction.
  JobState(std::string job_id, const v1::JobConfig& config,
           absl::StatusOr<kernels::OptimizerParams> dense_params,
           std::shared_ptr<MemoryBudget> budget, int64_t charged,
           std::shared_ptr<ShardCounters> counters);
  ~JobState();

  JobState(const JobState&) = delete;
  JobState& operator=(const JobState&) = delete;

  // Bytes of a job without partitions: this struct, its id and the gate's per-worker state.
  static int64_t FixedBytes(uint32_t workers, size_t id_size);

  // The partition or table named by `key`, or NOT_FOUND naming the job and the key.
  absl::StatusOr<std::shared_ptr<Partition>> Find(const SliceView& key) const;
  // Every partition and table, dense first.
  std::vector<std::shared_ptr<Partition>> AllPartitions() const;
  // How many dense partitions and sparse tables the job holds now.
  uint32_t NumDense() const;
  uint32_t NumTables() const;

  // Adds the partitions and tables `request` declares that do not exist yet (all or nothing;
  // additive and idempotent), their bytes reserved in the budget, each new one due for a capture
  // at `next_capture`. REQUIRES: `request` passed ValidateJobRequest, which gave `table_params`.
  // FAILED_PRECONDITION when a key exists with another size or declaration, or as the other kind;
  // RESOURCE_EXHAUSTED when the new state does not fit max_memory_bytes. Allocates and fills the
  // new partitions without holding mu, so the job's pushes and pulls go on meanwhile.
  absl::StatusOr<v1::CreateJobStateResponse> AddDeclared(
      const v1::CreateJobStateRequest& request,
      const std::vector<kernels::OptimizerParams>& table_params, int64_t next_capture);

  // Changes the gate's live set (ConsistencyGate::UpdateMembership, same errors) and records the
  // change in the membership log, in the same order as the gate sees them.
  absl::Status UpdateMembership(const std::vector<uint32_t>& live, int64_t effective_step);
  // The membership changes applied to the gate, with the gate's own truncation (an entry replaces
  // those at or after its step), so replaying them on a fresh gate gives the same history.
  std::vector<v1::CheckpointMembership> MembershipLog() const;

  bool bsp() const { return gate.mode() == v1::CONSISTENCY_BSP; }

  const std::string id;
  const v1::JobConfig config;
  // The job's optimizer for dense partitions, or why it cannot update them (FTRL).
  const absl::StatusOr<kernels::OptimizerParams> dense_params;
  ConsistencyGate gate;
  const std::shared_ptr<MemoryBudget> budget;
  const int64_t charged;
  // The store's shard-wide counters.
  const std::shared_ptr<ShardCounters> counters;

  std::atomic<int64_t> duplicates{0};
  std::atomic<int64_t> skipped_non_finite{0};
  std::atomic<int64_t> updates_applied{0};
  // Pushes of an incarnation below this are refused (set by Restore).
  std::atomic<uint64_t> min_incarnation{0};
  // Partitions and tables held (dense.size() + tables.size()), read without mu by captures.
  std::atomic<size_t> num_partitions{0};

  // Captures, waiting Checkpoint calls, written files (CheckpointWriter).
  JobCheckpoints checkpoints;

 private:
  // FAILED_PRECONDITION when `request` redeclares an existing key differently.
  absl::Status CheckRedeclarationsLocked(const v1::CreateJobStateRequest& request) const
      ABSL_SHARED_LOCKS_REQUIRED(mu);

  mutable absl::Mutex mu;
  absl::flat_hash_map<std::pair<std::string, uint32_t>, std::shared_ptr<Partition>> dense
      ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::shared_ptr<Partition>> tables ABSL_GUARDED_BY(mu);

  // Serializes UpdateMembership so that the gate and membership_log change in the same order.
  absl::Mutex membership_mu;
  mutable absl::Mutex log_mu;
  std::vector<v1::CheckpointMembership> membership_log ABSL_GUARDED_BY(log_mu);
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_JOB_STATE_H_
