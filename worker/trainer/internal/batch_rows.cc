#include "worker/trainer/internal/batch_rows.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/internal/splits.h"

namespace tessera::trainer::internal {

absl::Status RowMapper::MapIds(absl::Span<const int64_t> ids, int64_t begin, int64_t end,
                               const engine::SparseTableInfo& table, const char* what,
                               BatchRows* out, std::vector<int64_t>* positions) {
  if (begin < 0 || end < begin || end > static_cast<int64_t>(ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " offsets: [", begin, ", ", end, ") is not inside the batch's ", ids.size(), " ids"));
  }
  positions->assign(ids.size(), 0);
  for (int64_t j = begin; j < end; ++j) {
    const int64_t id = ids[j];
    if (table.num_rows > 0 && (id < 0 || id >= table.num_rows)) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", j, "]: id ", id, " is outside [0, ",
                                                     table.num_rows, ") of ", table.name));
    }
    auto [it, inserted] = index_.try_emplace(id, static_cast<int64_t>(out->rows.size()));
    if (inserted) out->rows.push_back(id);
    (*positions)[j] = it->second;
  }
  return absl::OkStatus();
}

absl::Status RowMapper::Map(const data::Batch& batch, const engine::SparseTableInfo& table,
                            BatchRows* out) {
  out->rows.clear();
  index_.clear();
  if (table.fields.empty()) {
    out->field_positions.clear();
    if (batch.sparse_offsets.empty()) {
      out->positions.assign(batch.sparse_ids.size(), 0);
      return absl::OkStatus();
    }
    return MapIds(batch.sparse_ids, batch.sparse_offsets.front(), batch.sparse_offsets.back(),
                  table, "batch.sparse_ids", out, &out->positions);
  }
  out->positions.clear();
  out->field_positions.resize(table.fields.size());
  for (size_t k = 0; k < table.fields.size(); ++k) {
    const int f = table.fields[k];
    if (f >= static_cast<int>(batch.fields.size())) {
      return absl::InvalidArgumentError(absl::StrCat("batch.fields: ", table.name, " reads field ",
                                                     f, ", the batch has ", batch.fields.size()));
    }
    const data::FieldBatch& field = batch.fields[f];
    if (field.offsets.empty()) {
      out->field_positions[k].clear();
      continue;
    }
    const std::string what = absl::StrCat("batch.fields[", f, "].ids");
    TESSERA_RETURN_IF_ERROR(MapIds(field.ids, field.offsets.front(), field.offsets.back(), table,
                                   what.c_str(), out, &out->field_positions[k]));
  }
  return absl::OkStatus();
}

engine::BatchView ViewWithRows(const data::Batch& batch, const engine::Model& model,
                               absl::Span<const BatchRows> rows,
                               std::vector<engine::SparseFieldView>* uses) {
  engine::BatchView v = ViewOf(batch);
  if (!model.multi_input()) {
    if (!rows.empty()) v.sparse_ids = rows[0].positions;
    return v;
  }
  uses->clear();
  const std::vector<engine::SparseTableInfo>& tables = model.sparse_tables();
  for (size_t t = 0; t < tables.size() && t < rows.size(); ++t) {
    for (size_t k = 0; k < tables[t].fields.size() && k < rows[t].field_positions.size(); ++k) {
      const int f = tables[t].fields[k];
      uses->push_back({batch.fields[f].offsets, rows[t].field_positions[k], {}});
    }
  }
  v.fields = *uses;
  return v;
}

}  // namespace tessera::trainer::internal
