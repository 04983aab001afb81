// Partition: one dense partition or one sparse table of a job on this shard, and its apply
// (DESIGN.md §2).
//
// A partition holds its weights (dense: SharedWeights, copy-on-write; sparse: the table's rows,
// kernels/sparse_rows.h, created on first touch or on admission and evicted as the table's
// lifecycle says), its optimizer slots, its version, each worker's clock on it
// and last applied (incarnation, seq), and the consistency gate's BSP staging. One lock, `mu`,
// guards all of that: independent partitions never share a lock, so pushes to different
// partitions run in parallel. The version and the clocks are atomics besides, written under `mu`
// and read without it by parked pulls. The rules for when a push is applied (BSP, SSP, ASP) are
// the consistency gate's (server/consistency_gate.h); a partition only stores and applies.
#ifndef TESSERA_SERVER_PARTITION_H_
#define TESSERA_SERVER_PARTITION_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/fixed_array.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/push_pull_view.h"
#include "kernels/optimizer.h"
#include "kernels/sparse_rows.h"
#include "server/gradient_payload.h"
#include "server/memory_budget.h"
#include "server/published_weights.h"
#include "server/shard_counters.h"
#include "server/shared_weights.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// "tensor/index", the name of a key in messages.
std::string KeyName(const v1::PartitionKey& key);
std::string KeyName(const SliceView& slice);

// Per-worker clocks of one partition: clocks[w] = steps worker w has completed on it. Written
// under the partition's lock, read by the consistency gate without it.
using WorkerClocks = std::vector<std::atomic<int64_t>>;

// The last push a worker had applied to a partition (exactly-once, DESIGN.md §3).
struct AppliedSeq {
  bool seen = false;
  uint64_t incarnation = 0;
  uint64_t seq = 0;
};

// The consistency gate's BSP state of one partition: what is staged for the step in progress
// (step == version). It lives here so that the partition's lock guards it; only ConsistencyGate
// reads and writes it.
struct BspStaging {
  std::vector<uint8_t> contributed;  // per worker: pushed the step
  std::vector<uint8_t> skipped;      // per worker: that push was skipped for NaN/Inf
  uint32_t contributors = 0;
  std::vector<std::vector<float>> dense;  // per worker, dense partitions; kept for later steps
  std::vector<SparseGrad> rows;           // per worker, sparse tables
  std::vector<int64_t> rows_bytes;        // per worker: reserved in the budget for `rows`
  // The exactly-once table as it was at the step boundary (copied when the step's first push is
  // staged, so that a capture registered mid-step still gets the boundary's table).
  std::vector<AppliedSeq> boundary_seqs;
  // Steady-clock nanoseconds (SteadyNowNs) when the step's first push was staged: how long the
  // step has waited, for the stall inspector (ConsistencyGate::FindStall).
  int64_t first_push_ns = 0;
};

// Nanoseconds of the steady clock (monotonic; for durations only).
int64_t SteadyNowNs();

// What a new partition shares with its job and store.
struct PartitionSetup {
  std::shared_ptr<MemoryBudget> budget;
  std::shared_ptr<ShardCounters> counters;
  v1::LearningRateSchedule schedule;
  uint32_t workers = 0;
  int64_t next_capture = std::numeric_limits<int64_t>::max();
};

// Owned by its job (JobState) by std::shared_ptr; parked pulls and checkpoints hold references
// too. The fields above `mu` are set at creation and then only read. Thread-safe as annotated.
struct Partition {
  // A dense partition declared by `decl` (zeros or its initial values; slots at their initial
  // values), owning `charged` bytes already reserved in setup.budget.
  static std::shared_ptr<Partition> Dense(const v1::DensePartitionDecl& decl,
                                          const kernels::OptimizerParams& params,
                                          const PartitionSetup& setup, int64_t charged);
  // An empty sparse table declared by `decl`, owning `charged` bytes as for Dense.
  static std::shared_ptr<Partition> Table(const v1::SparseTableDecl& decl,
                                          const kernels::OptimizerParams& params,
                                          const PartitionSetup& setup, int64_t charged);

  // Gives back what it holds of the budget.
  ~Partition();

  // Bytes of bookkeeping that do not depend on the values: this struct, the name and the
  // per-worker vectors.
  static int64_t FixedBytes(uint32_t workers, size_t name_size);
  // Bytes of one sparse row: weights, slots and the hash map entry (kernels::SparseRows).
  int64_t RowBytes() const;
  // Bytes the rows of a push slice to a table may add (at most one row per row id; 0 for a dense
  // partition), to be checked against the budget before they are created.
  int64_t NewRowsBound(const SliceView& slice) const;
  // Gives `bytes` of this partition's charge back to the budget.
  void ReleaseCharge(int64_t bytes);

  // Exactly-once: true when (worker, incarnation, seq) is already applied here (a duplicate);
  // FAILED_PRECONDITION when incarnation is older than the one last applied.
  absl::StatusOr<bool> IsAppliedLocked(uint32_t worker, uint64_t incarnation, uint64_t seq) const
      ABSL_SHARED_LOCKS_REQUIRED(mu);
  void RecordAppliedLocked(uint32_t worker, uint64_t incarnation, uint64_t seq)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    last_applied[worker] = AppliedSeq{true, incarnation, seq};
  }

  // The dense weights to write in place. When an answer or a checkpoint still holds a reference
  // to them, they are copied first and the partition keeps the copy (the holders keep the old
  // values). unique() is an acquire load of the count that every holder decrements with release
  // once done reading, so seeing 1 orders the writes that follow after those reads; no reference
  // can appear meanwhile, since new ones are taken only under mu (held exclusively here) or from
  // the partition's own handle.
  float* MutableWeightsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Applies a dense gradient of `count` values to values [begin, begin + count) in place
  // (count < 0: all, from 0), one fused optimizer pass, learning rate
  // ScheduledLearningRate(schedule, lr, step); `g` holds the gradient of those values, as floats
  // or (ApplyDenseBytesLocked) as fp32 bytes at any alignment, read in place. The optimizers are
  // elementwise, so applying one gradient block by block gives the same weights. The caller
  // bumps the version once per update.
  // An averaging partition (`average`) takes `g` as values instead: w += scale * (g - w), so that
  // scale 1 sets w to g.
  void ApplyDenseLocked(int64_t step, float scale, const float* g, int64_t begin = 0,
                        int64_t count = -1) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void ApplyDenseBytesLocked(int64_t step, float scale, const char* g, int64_t begin, int64_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Applies a merged sparse gradient row by row (each row's own update count for Adam), as one
  // update of the table at clock version + 1, admitting and evicting rows as its lifecycle says;
  // rows created are charged to the budget (the push that carried them checked that they fit,
  // NewRowsBound) and rows dropped given back.
  void ApplySparseLocked(int64_t step, float scale, const SparseGrad& grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Applies a pushed slice at once, reading an fp32 gradient where it lies. False when there was
  // nothing to apply (a table's slice without rows). REQUIRES: the slice was validated.
  bool ApplySliceLocked(int64_t step, float scale, const SliceView& slice,
                        std::vector<float>* scratch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Copies the weights (dense) or rows `row_ids` (sparse; absent rows as SparseRows::Gather
  // reads them) into `slice` with its version; the data goes into slice->mutable_data(), reusing
  // its capacity.
  void ReadInto(const std::vector<int64_t>& row_ids, v1::Encoding encoding, v1::Slice* slice) const
      ABSL_SHARED_LOCKS_REQUIRED(mu);

  std::shared_ptr<MemoryBudget> budget;
  std::atomic<int64_t> charged{0};          // bytes reserved in `budget`, given back on destruction
  std::shared_ptr<ShardCounters> counters;  // the store's

  std::string name;    // "tensor/index", for messages
  std::string tensor;  // the key: tensor (or table) name and index (0 for a table)
  uint32_t index = 0;
  bool sparse = false;
  int64_t num_elements = 0;  // dense
  uint32_t dim = 0;          // sparse
  std::string table_decl;    // sparse: serialized SparseTableDecl, to check redeclarations
  // Dense: DENSE_UPDATE_AVERAGE, pushes are values to average in (no slots, no learning rate),
  // not gradients (v1::DenseUpdate).
  bool average = false;
  kernels::OptimizerParams params;
  int num_slots = 0;
  v1::LearningRateSchedule schedule;  // the job's

  // Dense: the weights its workers hold under weight-delta pulls (pull encoding TOPK), with a
  // lock of its own, taken without mu. Set at creation.
  std::unique_ptr<PublishedWeights> published;

  // Written under mu; read without it by parked pulls.
  std::atomic<int64_t> version{0};
  WorkerClocks clocks;  // sized at creation, steps completed per worker

  mutable absl::Mutex mu;
  std::vector<AppliedSeq> last_applied ABSL_GUARDED_BY(mu);  // per worker
  BspStaging staging ABSL_GUARDED_BY(mu);
  // Dense. Only mu guards the handle: answers and checkpoints take a reference under the reader
  // lock, and every write goes through MutableWeightsLocked (copy-on-write).
  SharedWeights weights ABSL_GUARDED_BY(mu);
  std::vector<std::vector<float>> slots ABSL_GUARDED_BY(mu);
  // Sparse: the table's rows and their lifecycle (empty for a dense partition).
  std::optional<kernels::SparseRows> rows ABSL_GUARDED_BY(mu);
  // The next step this partition must be captured at (kNoCapture, INT64_MAX: none); kept by the
  // CheckpointWriter.
  int64_t next_capture ABSL_GUARDED_BY(mu) = std::numeric_limits<int64_t>::max();
};

// Holds the locks of one request's partitions: taken in address order, so that two requests over
// overlapping partitions never deadlock, and all released when it goes out of scope. No
// allocation for up to 8 partitions.
class PartitionLocks {
 public:
  // REQUIRES: the partitions are distinct, and the caller holds none of their locks.
  explicit PartitionLocks(absl::InlinedVector<Partition*, 8> partitions);

  PartitionLocks(const PartitionLocks&) = delete;
  PartitionLocks& operator=(const PartitionLocks&) = delete;

 private:
  absl::FixedArray<std::optional<absl::MutexLock>, 8> locks_;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_PARTITION_H_
