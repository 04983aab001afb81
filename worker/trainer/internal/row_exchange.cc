#include "worker/trainer/internal/row_exchange.h"

#include <memory>
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
    *d.mutable_initializer() = spec::RowInitializer(t.shape, spec.seed(), t.name);
    if (t.shape.lifecycle.ByteSizeLong() > 0) *d.mutable_lifecycle() = t.shape.lifecycle;
    out.push_back(std::move(d));
  }
  return out;
}

RowExchange::RowExchange(client::ParameterClient* client, engine::Model* model,
                         LocalDevices* devices)
    : client_(client), model_(model), devices_(devices) {
  const int shards = client_->num_shards();
  for (const engine::SparseTableInfo& info : model->sparse_tables()) {
    Table t;
    t.info = info;
    t.dim = static_cast<size_t>(info.dim);
    t.probes.assign(static_cast<size_t>(shards), -1);
    int found = 0;
    for (int64_t id = 0; found < shards; ++id) {
      int64_t& probe = t.probes[static_cast<size_t>(
          ShardOfSparseRow(client_->options().job_id, info.name, id, shards))];
      if (probe < 0) {
        probe = id;
        ++found;
      }
    }
    tables_.push_back(std::move(t));
  }
  for (Slot* slot : {&slots_[0], &slots_[1], &eval_}) {
    slot->rows.resize(tables_.size());
    slot->asked.resize(tables_.size());
    slot->values.resize(tables_.size());
    slot->grads.resize(tables_.size());
  }
}

absl::Status RowExchange::Map(const data::Batch& batch, bool probes, Slot& slot) {
  const int shards = client_->num_shards();
  for (size_t t = 0; t < tables_.size(); ++t) {
    const Table& table = tables_[t];
    TESSERA_RETURN_IF_ERROR(mapper_.Map(batch, table.info, &slot.rows[t]));
    std::vector<int64_t>& asked = slot.asked[t];
    asked = slot.rows[t].rows;
    if (probes) {
      std::vector<bool> covered(static_cast<size_t>(shards), false);
      for (int64_t id : slot.rows[t].rows) {
        covered[static_cast<size_t>(
            ShardOfSparseRow(client_->options().job_id, table.info.name, id, shards))] = true;
      }
      for (int s = 0; s < shards; ++s) {
        if (!covered[static_cast<size_t>(s)]) asked.push_back(table.probes[static_cast<size_t>(s)]);
      }
    }
    slot.values[t].resize(asked.size() * table.dim);
  }
  return absl::OkStatus();
}

absl::Status RowExchange::Start(const data::Batch& batch, int64_t step) {
  Slot& slot = slots_[1 - current_];
  TESSERA_RETURN_IF_ERROR(Map(batch, /*probes=*/true, slot));
  {
    absl::MutexLock lock(&mu_);
    fetches_left_ = tables_.size();
    fetch_status_ = absl::OkStatus();
  }
  fetching_ = true;
  for (size_t t = 0; t < tables_.size(); ++t) {
    client_->PullSparseAsync(tables_[t].info.name, step, slot.asked[t],
                             absl::MakeSpan(slot.values[t]),
                             [this](absl::StatusOr<client::PushPullResult> r) {
                               absl::MutexLock lock(&mu_);
                               if (fetch_status_.ok()) fetch_status_ = r.status();
                               --fetches_left_;
                             });
  }
  return absl::OkStatus();
}

absl::Status RowExchange::Install(const Slot& slot, bool train) {
  for (size_t t = 0; t < tables_.size(); ++t) {
    const int64_t count = static_cast<int64_t>(slot.rows[t].rows.size());
    const absl::Span<const float> values =
        absl::MakeConstSpan(slot.values[t].data(), static_cast<size_t>(count) * tables_[t].dim);
    TESSERA_RETURN_IF_ERROR(train && devices_ != nullptr
                                ? devices_->SetRows(static_cast<int>(t), count, values)
                                : model_->SetRows(static_cast<int>(t), count, values));
  }
  return absl::OkStatus();
}

absl::StatusOr<engine::BatchView> RowExchange::Finish(const data::Batch& batch,
                                                      const std::function<bool()>& cancelled) {
  {
    absl::MutexLock lock(&mu_);
    auto fetched = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return fetches_left_ == 0; };
    while (!mu_.AwaitWithTimeout(absl::Condition(&fetched), absl::Milliseconds(20))) {
      // The pulls still in flight write into the slot, which lives as long as the exchange; the
      // caller destroys the client (which waits for its calls) first.
      if (cancelled()) return absl::CancelledError("cancelled");
    }
    TESSERA_RETURN_IF_ERROR(fetch_status_);
  }
  fetching_ = false;
  current_ = 1 - current_;
  Slot& slot = slots_[current_];
  TESSERA_RETURN_IF_ERROR(Install(slot, /*train=*/true));
  return ViewWithRows(batch, *model_, slot.rows, &slot.uses);
}

absl::StatusOr<double> RowExchange::CopyGrads() {
  Slot& slot = slots_[current_];
  double sum = 0;
  for (size_t t = 0; t < tables_.size(); ++t) {
    TESSERA_RETURN_IF_ERROR(devices_ != nullptr
                                ? devices_->CopyRowGrads(static_cast<int>(t), &slot.grads[t])
                                : model_->CopyGradToHost(tables_[t].info.name, &slot.grads[t]));
    sum += kernels::SumOfSquares(slot.grads[t].data(), static_cast<int64_t>(slot.grads[t].size()));
  }
  return sum;
}

void RowExchange::Push(int64_t step, float scale, client::ParameterClient::PushPullCallback done) {
  Slot& slot = slots_[current_];
  // One answer for all the tables' pushes: the first error, or the counts summed.
  struct Pending {
    absl::Mutex mu;
    size_t left = 0;
    absl::Status status;
    client::PushPullResult sum;
    client::ParameterClient::PushPullCallback done;
  };
  auto pending = std::make_shared<Pending>();
  pending->left = tables_.size();
  pending->done = std::move(done);
  for (size_t t = 0; t < tables_.size(); ++t) {
    if (scale != 1.0f) {
      for (float& v : slot.grads[t]) v *= scale;
    }
    client_->PushPullSparseAsync(tables_[t].info.name, step, slot.rows[t].rows, slot.grads[t], {},
                                 [pending](absl::StatusOr<client::PushPullResult> r) {
                                   bool last = false;
                                   {
                                     absl::MutexLock lock(&pending->mu);
                                     if (!r.ok()) {
                                       if (pending->status.ok()) pending->status = r.status();
                                     } else {
                                       pending->sum.duplicates += r->duplicates;
                                       pending->sum.skipped_non_finite += r->skipped_non_finite;
                                       pending->sum.requests += r->requests;
                                       pending->sum.retries += r->retries;
                                     }
                                     last = --pending->left == 0;
                                   }
                                   if (!last) return;
                                   if (!pending->status.ok()) {
                                     pending->done(pending->status);
                                   } else {
                                     pending->done(pending->sum);
                                   }
                                 });
  }
}

absl::StatusOr<engine::BatchView> RowExchange::FetchNow(const data::Batch& batch) {
  TESSERA_RETURN_IF_ERROR(Map(batch, /*probes=*/false, eval_));
  for (size_t t = 0; t < tables_.size(); ++t) {
    if (eval_.asked[t].empty()) continue;
    TESSERA_RETURN_IF_ERROR(client_->PullSparse(tables_[t].info.name, -1, eval_.asked[t],
                                                absl::MakeSpan(eval_.values[t])));
  }
  TESSERA_RETURN_IF_ERROR(Install(eval_, /*train=*/false));
  return ViewWithRows(batch, *model_, eval_.rows, &eval_.uses);
}

}  // namespace tessera::trainer::internal
