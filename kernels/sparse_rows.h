// The rows of one sparse table (DESIGN.md §2) with their optimizer slots and their lifecycle: the
// one implementation of a table's rows for the shards (server/partition.h) and the standalone
// trainer (worker/trainer/standalone_trainer.h), so that a table behaves the same wherever it
// lives.
//
// Rows are created from the table's initializer (InitializeRow) by the update that admits them
// and updated by the sparse optimizers (SGD, Adagrad, Adam, FTRL), each row with its own update
// count. The table's clock counts its updates (`clock` below: the shard's version after the
// update, the standalone trainer's step). With a v1::RowLifecycle:
// - Admission (admit_after = N > 1, Monolith's and DeepRec's frequency filter): an id's first N - 1
//   updates only count it. Meanwhile it is pending: its gradients are dropped and it reads as
//   zeros. The N-th creates the row and applies that update's gradient.
// - Eviction (evict_after = T > 0): at the first update whose clock reaches a multiple of T past
//   the last check, every row and pending id whose last update is at least T ticks old is dropped.
//   An id idle for T ticks is thus gone within T more. A dropped id starts over.
// Every count is exact and is kept in checkpoints (counts(), Restore*).
#ifndef TESSERA_KERNELS_SPARSE_ROWS_H_
#define TESSERA_KERNELS_SPARSE_ROWS_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/optimizer.h"
#include "tessera/v1/checkpoint.pb.h"  // RowCounts
#include "tessera/v1/optimizer.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::kernels {

// Writes row `row`'s initial `dim` values to `out`: zeros, a constant, U(-scale, scale) or
// N(0, scale^2), from a SplitMix64 stream seeded by (init.seed, row). Pure; the same values on
// every machine.
void InitializeRow(const v1::Initializer& init, int64_t row, float* out, uint32_t dim);

// Not thread-safe: the owner locks (a shard's partition lock).
class SparseRows {
 public:
  struct Row {
    std::vector<float> values;  // dim weights, then NumSlots * dim slot values
    int64_t updates = 0;        // optimizer applications (Adam's bias correction)
    int64_t last_clock = 0;     // the table's clock at the row's last update
  };
  struct Pending {
    uint32_t sightings = 0;  // updates that carried the id so far (< admit_after)
    int64_t last_clock = 0;
  };

  // REQUIRES: dim >= 1; params came from MakeOptimizerParams of a sparse-capable config.
  SparseRows(uint32_t dim, v1::Initializer initializer, OptimizerParams params,
             v1::RowLifecycle lifecycle);

  uint32_t dim() const { return dim_; }
  int num_slots() const { return num_slots_; }
  const v1::Initializer& initializer() const { return initializer_; }
  const v1::RowLifecycle& lifecycle() const { return lifecycle_; }
  bool admission() const { return lifecycle_.admit_after() > 1; }

  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  int64_t pending_size() const { return static_cast<int64_t>(pending_.size()); }
  const v1::RowCounts& counts() const { return counts_; }
  // Bytes one row holds (weights, slots, its map entry), and one pending id. RowBytes() is the
  // larger, so that ids * RowBytes() bounds what an update adds.
  int64_t RowBytes() const { return RowBytes(dim_, num_slots_); }
  static int64_t RowBytes(uint32_t dim, int num_slots);
  static int64_t PendingBytes();
  // Bytes held now: rows and pending ids.
  int64_t BytesHeld() const { return size() * RowBytes() + pending_size() * PendingBytes(); }

  // Writes the weights of rows `ids` to out[i * dim ...]: a row's weights; an id without a row
  // reads as its initializer makes it, or as zeros while admission keeps it out (nothing is
  // created). REQUIRES: out holds ids.size() * dim floats.
  void Gather(absl::Span<const int64_t> ids, float* out) const;

  // One update of the table at clock `clock` (> the previous update's): the optimizer step of
  // rows `ids` (distinct) with gradients grads[i * dim ...] scaled by `grad_scale` at learning
  // rate `lr`, admitting and evicting as the lifecycle says. Returns the change in BytesHeld().
  int64_t Apply(int64_t clock, float lr, float grad_scale, absl::Span<const int64_t> ids,
                const float* grads);

  const absl::flat_hash_map<int64_t, Row>& rows() const { return rows_; }
  const absl::flat_hash_map<int64_t, Pending>& pending() const { return pending_; }
  const Row* Find(int64_t id) const;

  // Restoring a checkpoint into an empty table: a row (values: weights then slots, dim *
  // (1 + num_slots) floats), a pending id, the counts. INVALID_ARGUMENT for an id given twice, a
  // wrong width or a pending count that admission would have admitted.
  absl::Status RestoreRow(int64_t id, int64_t updates, int64_t last_clock,
                          absl::Span<const float> values);
  absl::Status RestorePending(int64_t id, uint32_t sightings, int64_t last_clock);
  void RestoreCounts(const v1::RowCounts& counts) { counts_ = counts; }

 private:
  // The new row `id` from the initializer, slots at their initial values.
  Row& CreateRow(int64_t id);
  // The eviction check at `clock`; returns the bytes dropped.
  int64_t Evict(int64_t clock);

  uint32_t dim_;
  v1::Initializer initializer_;
  OptimizerParams params_;
  v1::RowLifecycle lifecycle_;
  int num_slots_;
  absl::flat_hash_map<int64_t, Row> rows_;
  absl::flat_hash_map<int64_t, Pending> pending_;
  v1::RowCounts counts_;
};

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_SPARSE_ROWS_H_
