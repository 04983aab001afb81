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
#include "absl/types/span.h"
#include "worker/data/batch.h"
#include "worker/engine/model.h"

namespace tessera::trainer::internal {

struct BatchRows {
  std::vector<int64_t> rows;  // distinct row ids, in first-use order
  // An embedding_bag first layer's table: per sparse id of the batch, its index into `rows`.
  std::vector<int64_t> positions;
  // A multi-input model's table: per field it reads (SparseTableInfo::fields order), per id of
  // that field, its index into `rows`.
  std::vector<std::vector<int64_t>> field_positions;
};

// Not thread-safe; reuses its buffers from batch to batch.
class RowMapper {
 public:
  // Maps the ids of `batch` (those its offsets cover) that `table` reads: the batch's sparse ids,
  // or those of the table's fields. INVALID_ARGUMENT "batch.sparse_ids[j]: id X is outside
  // [0, num_rows) of <table>" when the table bounds its ids, or "batch.fields: ..." when the
  // batch lacks a field the table reads.
  absl::Status Map(const data::Batch& batch, const engine::SparseTableInfo& table, BatchRows* out);

 private:
  // Adds the ids [begin, end) of `ids` to out->rows, writing their indices to `positions`.
  absl::Status MapIds(absl::Span<const int64_t> ids, int64_t begin, int64_t end,
                      const engine::SparseTableInfo& table, const char* what, BatchRows* out,
                      std::vector<int64_t>* positions);

  absl::flat_hash_map<int64_t, int64_t> index_;
};

// The engine's view of `batch` with the mapped positions as its ids: `rows` holds one BatchRows
// per table of `model` (sparse_tables() order). A multi-input model's field views are written
// to `uses`. Valid while `batch`, `rows` and `uses` live and are not changed.
engine::BatchView ViewWithRows(const data::Batch& batch, const engine::Model& model,
                               absl::Span<const BatchRows> rows,
                               std::vector<engine::SparseFieldView>* uses);

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_BATCH_ROWS_H_
