#include "worker/trainer/internal/batch_rows.h"

#include "absl/strings/str_cat.h"
#include "worker/trainer/internal/splits.h"

namespace tessera::trainer::internal {

absl::Status RowMapper::Map(const data::Batch& batch, const engine::SparseTableInfo& table,
                            BatchRows* out) {
  out->rows.clear();
  out->positions.assign(batch.sparse_ids.size(), 0);
  index_.clear();
  if (batch.sparse_offsets.empty()) return absl::OkStatus();
  const int64_t begin = batch.sparse_offsets.front();
  const int64_t end = batch.sparse_offsets.back();
  if (begin < 0 || end < begin || end > static_cast<int64_t>(batch.sparse_ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat("batch.sparse_offsets: [", begin, ", ", end,
                                                   ") is not inside the batch's ",
                                                   batch.sparse_ids.size(), " ids"));
  }
  for (int64_t j = begin; j < end; ++j) {
    const int64_t id = batch.sparse_ids[j];
    if (table.num_rows > 0 && (id < 0 || id >= table.num_rows)) {
      return absl::InvalidArgumentError(absl::StrCat("batch.sparse_ids[", j, "]: id ", id,
                                                     " is outside [0, ", table.num_rows, ") of ",
                                                     table.name));
    }
    auto [it, inserted] = index_.try_emplace(id, static_cast<int64_t>(out->rows.size()));
    if (inserted) out->rows.push_back(id);
    out->positions[j] = it->second;
  }
  return absl::OkStatus();
}

engine::BatchView ViewWithRows(const data::Batch& batch, const BatchRows& rows) {
  engine::BatchView v = ViewOf(batch);
  v.sparse_ids = rows.positions;
  return v;
}

}  // namespace tessera::trainer::internal
