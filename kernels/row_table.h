// Sparse-table rows on the host (DESIGN.md §2): how a row is initialised on first touch, and a
// table of rows with their optimizer slots.
//
// InitializeRow is the one rule for a row's first values: every shard and the standalone trainer
// draw row r of a table from (initializer, r) alike, so where a row lives changes nothing.
// RowTable is the standalone trainer's table: it holds only the rows that were touched, and
// applies the sparse optimizers (SGD, Adagrad, Adam, FTRL) row by row, each row with its own
// update count, exactly as a shard applies a merged sparse gradient (server/partition.h).
#ifndef TESSERA_KERNELS_ROW_TABLE_H_
#define TESSERA_KERNELS_ROW_TABLE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "kernels/optimizer.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::kernels {

// Writes row `row`'s initial `dim` values to `out`: zeros, a constant, U(-scale, scale) or
// N(0, scale^2), from a SplitMix64 stream seeded by (init.seed, row). Pure; the same values on
// every machine.
void InitializeRow(const v1::Initializer& init, int64_t row, float* out, uint32_t dim);

// Not thread-safe.
class RowTable {
 public:
  // REQUIRES: dim >= 1; params came from MakeOptimizerParams of a sparse-capable config.
  RowTable(uint32_t dim, v1::Initializer initializer, OptimizerParams params);

  uint32_t dim() const { return dim_; }
  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  // Bytes per row: its weights and slots.
  int64_t RowBytes() const;

  // Copies the weights of rows `ids` to out[i * dim ...]; a row never touched reads as its
  // initializer makes it (and is not created). REQUIRES: out.size() == ids.size() * dim.
  void Gather(absl::Span<const int64_t> ids, absl::Span<float> out) const;
  // One optimizer update of rows `ids` (distinct) with gradients grads[i * dim ...] scaled by
  // `grad_scale`, at learning rate `lr`; absent rows are created first.
  // REQUIRES: grads.size() == ids.size() * dim; the ids are distinct.
  void Apply(float lr, float grad_scale, absl::Span<const int64_t> ids,
             absl::Span<const float> grads);
  // Every row's id and weights, in no particular order.
  void ForEach(const std::function<void(int64_t id, absl::Span<const float> weights)>& f) const;

 private:
  struct Row {
    std::vector<float> values;  // dim weights, then NumSlots * dim slot values
    int64_t updates = 0;
  };
  Row& RowOf(int64_t id);

  uint32_t dim_;
  v1::Initializer initializer_;
  OptimizerParams params_;
  int num_slots_;
  absl::flat_hash_map<int64_t, Row> rows_;
};

}  // namespace tessera::kernels

#endif  // TESSERA_KERNELS_ROW_TABLE_H_
