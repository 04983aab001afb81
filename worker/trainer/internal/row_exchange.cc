#include "worker/trainer/internal/row_exchange.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "kernels/schedule.h"
#include "spec/model_spec.h"

namespace tessera::trainer::internal {

std::vector<v1::SparseTableDecl> SparseTableDecls(const engine::Model& model,
                                                  const v1::JobSpec& spec) {
  std::vector<v1::SparseTableDecl> out;
  for (const engine::SparseTableInfo& t : model.sparse_tables()) {
    v1::SparseTableDecl d;
    d.set_name(t.name);
    d.set_dim(static_cast<uint32_t>(t.dim));
    // Today's only table is the first layer's only parameter.
    *d.mutable_initializer() =
        spec::RowInitializer(model.layers()[0].parameters[0], spec.seed(), t.name);
    out.push_back(std::move(d));
  }
  return out;
}

RowExchange::RowExchange(client::ParameterClient* client, engine::Model* model)
    : client_(client),
      model_(model),
      table_(model->sparse_tables()[0]),
      dim_(static_cast<size_t>(table_.dim)) {
  const int shards = client_->num_shards();
  probes_.assign(static_cast<size_t>(shards), -1);
  int found = 0;
  for (int64_t id = 0; found < shards; ++id) {
    int64_t& probe = probes_[static_cast<size_t>(
        ShardOfSparseRow(client_->options().job_id, table_.name, id, shards))];
    if (probe < 0) {
      probe = id;
      ++found;
    }
  }
}

void RowExchange::AddProbes(Slot& slot) {
  const int shards = client_->num_shards();
  std::vector<bool> asked(static_cast<size_t>(shards), false);
  slot.asked = slot.rows.rows;
  for (int64_t id : slot.rows.rows) {
    asked[static_cast<size_t>(
        ShardOfSparseRow(client_->options().job_id, table_.name, id, shards))] = true;
  }
  for (int s = 0; s < shards; ++s) {
    if (!asked[static_cast<size_t>(s)]) slot.asked.push_back(probes_[static_cast<size_t>(s)]);
  }
  slot.values.resize(slot.asked.size() * dim_);
}

absl::Status RowExchange::Start(const data::Batch& batch, int64_t step) {
  Slot& slot = slots_[1 - current_];
  TESSERA_RETURN_IF_ERROR(mapper_.Map(batch, table_, &slot.rows));
  AddProbes(slot);
  {
    absl::MutexLock lock(&mu_);
    fetched_ = false;
    fetch_status_ = absl::OkStatus();
  }
  fetching_ = true;
  client_->PullSparseAsync(table_.name, step, slot.asked, absl::MakeSpan(slot.values),
                           [this](absl::StatusOr<client::PushPullResult> r) {
                             absl::MutexLock lock(&mu_);
                             fetch_status_ = r.status();
                             fetched_ = true;
                           });
  return absl::OkStatus();
}

absl::Status RowExchange::Install(const Slot& slot) {
  const int64_t count = static_cast<int64_t>(slot.rows.rows.size());
  return model_->SetRows(
      0, count, absl::MakeConstSpan(slot.values.data(), static_cast<size_t>(count) * dim_));
}

absl::StatusOr<engine::BatchView> RowExchange::Finish(const data::Batch& batch,
                                                      const std::function<bool()>& cancelled) {
  {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&fetched_), absl::Milliseconds(20))) {
      // The pull still in flight writes into the slot, which lives as long as the exchange; the
      // caller destroys the client (which waits for its calls) first.
      if (cancelled()) return absl::CancelledError("cancelled");
    }
    TESSERA_RETURN_IF_ERROR(fetch_status_);
  }
  fetching_ = false;
  current_ = 1 - current_;
  const Slot& slot = slots_[current_];
  TESSERA_RETURN_IF_ERROR(Install(slot));
  return ViewWithRows(batch, slot.rows);
}

absl::StatusOr<double> RowExchange::CopyGrads() {
  Slot& slot = slots_[current_];
  TESSERA_RETURN_IF_ERROR(model_->CopyGradToHost(table_.name, &slot.grads));
  return kernels::SumOfSquares(slot.grads.data(), static_cast<int64_t>(slot.grads.size()));
}

void RowExchange::Push(int64_t step, float scale, client::ParameterClient::PushPullCallback done) {
  Slot& slot = slots_[current_];
  if (scale != 1.0f) {
    for (float& v : slot.grads) v *= scale;
  }
  client_->PushPullSparseAsync(table_.name, step, slot.rows.rows, slot.grads, {}, std::move(done));
}

absl::StatusOr<engine::BatchView> RowExchange::FetchNow(const data::Batch& batch) {
  TESSERA_RETURN_IF_ERROR(mapper_.Map(batch, table_, &eval_.rows));
  eval_.asked = eval_.rows.rows;
  eval_.values.resize(eval_.asked.size() * dim_);
  if (!eval_.asked.empty()) {
    TESSERA_RETURN_IF_ERROR(
        client_->PullSparse(table_.name, -1, eval_.asked, absl::MakeSpan(eval_.values)));
  }
  TESSERA_RETURN_IF_ERROR(Install(eval_));
  return ViewWithRows(batch, eval_.rows);
}

}  // namespace tessera::trainer::internal
