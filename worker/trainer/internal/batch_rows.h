// The rows of a sparse table that one batch touches (DESIGN.md §2: a step moves only those).
// Private to worker/trainer.
//
// RowMapper deduplicates a batch's sparse ids into the rows to fetch, in first-use order, and
// rewrites the ids as positions among those rows, which is what the engine reads once the rows
// are installed (engine::Model::SetRows). The rows' gradients then come back one per row, each
// the sum of every use of that row in the batch: the push is deduplicated and summed per row.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_BATCH_ROWS_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_BATCH_ROWS_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "worker/data/batch.h"
#include "worker/engine/model.h"

namespace tessera::trainer::internal {

struct BatchRows {
  std::vector<int64_t> rows;       // distinct row ids, in first-use order
  std::vector<int64_t> positions;  // per sparse id of the batch: its index into `rows`
};

// Not thread-safe; reuses its buffers from batch to batch.
class RowMapper {
 public:
  // Maps the ids of `batch` (those its offsets cover) for `table`. INVALID_ARGUMENT
  // "batch.sparse_ids[j]: id X is outside [0, num_rows) of <table>" when the table bounds its ids.
  absl::Status Map(const data::Batch& batch, const engine::SparseTableInfo& table, BatchRows* out);

 private:
  absl::flat_hash_map<int64_t, int64_t> index_;
};

// The engine's view of `batch` with `rows.positions` as its sparse ids (valid while both live).
engine::BatchView ViewWithRows(const data::Batch& batch, const BatchRows& rows);

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_BATCH_ROWS_H_
