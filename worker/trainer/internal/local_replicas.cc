#include "worker/trainer/internal/local_replicas.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device_reduce.h"
#include "spec/device_spec.h"
#include "spec/model_spec.h"

namespace tessera::trainer::internal {

absl::StatusOr<std::unique_ptr<LocalReplicas>> LocalReplicas::Create(const v1::ModelSpec& spec,
                                                                     uint64_t seed,
                                                                     const Options& options) {
  TESSERA_RETURN_IF_ERROR(spec::CheckDevicesFitModel(options.devices, spec));
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: each CPU replica needs >= 1 thread, got ", options.threads));
  }
  std::unique_ptr<LocalReplicas> r(new LocalReplicas());
  r->devices_name_ = DescribeDevices(options, "replicas");
  // Several GPUs sum the gradients with NCCL, on the devices; one has nothing to sum.
  if (options.cuda_devices.size() > 1) {
    TESSERA_ASSIGN_OR_RETURN(r->nccl_, kernels::CreateNcclReduce(options.cuda_devices));
  }
  for (int i = 0; i < options.devices; ++i) r->replicas_.push_back(std::make_unique<Replica>());
  if (options.devices > 1 && spec::HasSyncBatchNorm(spec)) {
    r->sync_ = std::make_unique<HostAllReduce>();
  }
  LocalReplicas* raw = r.get();
  TESSERA_ASSIGN_OR_RETURN(
      r->threads_,
      DeviceThreads::Start(options.devices,
                           options.cuda_devices.empty() ? "cpu replica" : "gpu replica",
                           [raw, &spec, seed, &options](int i) -> absl::Status {
                             Replica& self = *raw->replicas_[i];
                             TESSERA_ASSIGN_OR_RETURN(self.backend, DeviceBackend(options, i));
                             TESSERA_ASSIGN_OR_RETURN(
                                 self.model, engine::Model::Create(spec, self.backend.get(), seed));
                             self.model->set_cross_device_sum(raw->sync_.get());
                             return absl::OkStatus();
                           }));
  return r;
}

LocalReplicas::~LocalReplicas() = default;

std::string LocalReplicas::Describe() const {
  return absl::StrCat("splits each batch over ", devices_name_,
                      nccl_ != nullptr ? ", gradients summed with NCCL" : "");
}

absl::StatusOr<engine::StepResult> LocalReplicas::TrainStep(const engine::BatchView& batch,
                                                            uint64_t dropout_seed,
                                                            absl::Span<const std::string> names,
                                                            const std::vector<bool>& state,
                                                            std::vector<std::vector<float>>* out) {
  const int n = size();
  if (batch.size <= 0) return absl::InvalidArgumentError("batch: empty");
  if (names.size() != state.size() || out->size() != names.size()) {
    return absl::InternalError("LocalReplicas::TrainStep: names, state and out differ in size");
  }
  // Replica i trains examples [begin[i], begin[i + 1]).
  const std::vector<int64_t> begin = SplitExamples(batch.size, n);
  int active = 0;
  while (active < n && begin[active + 1] > begin[active]) ++active;
  // Each part's loss gradient is scaled by its share of the batch, so the replicas' gradients
  // are the whole batch's loss's in parts (what SyncBN's sums need) and the reduce adds them.
  std::vector<float> share(active);
  for (int j = 0; j < active; ++j) {
    share[j] = static_cast<float>(begin[j + 1] - begin[j]) / static_cast<float>(batch.size);
  }
  if (sync_ != nullptr) sync_->Begin(active);
  // With NCCL (every replica active: NCCL needs each rank) the gradients are summed on the GPUs
  // into replica 0's, which alone copies them to the host; state and rows go through the host.
  const bool on_devices = nccl_ != nullptr && active == n;
  const auto on_host = [&](size_t k) { return state[k] || !on_devices; };
  std::vector<absl::StatusOr<engine::StepResult>> results(n, engine::StepResult{});
  const std::function<absl::Status(int)> train = [&](int i) -> absl::Status {
    if (i >= active) return absl::OkStatus();
    Replica& self = *replicas_[i];
    const engine::BatchView part = SliceBatch(batch, begin[i], begin[i + 1], &self.fields);
    engine::Model& model = *self.model;
    model.set_dropout_seed(dropout_seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(i));
    results[i] = model.TrainPart(part, share[i]);
    if (!results[i].ok() && sync_ != nullptr) sync_->Abort(results[i].status());
    TESSERA_RETURN_IF_ERROR(results[i].status());
    std::vector<std::vector<float>>& host = self.host;
    host.resize(names.size());
    for (size_t k = 0; k < names.size(); ++k) {
      if (!on_host(k)) continue;
      host[k].resize((*out)[k].size());
      TESSERA_RETURN_IF_ERROR(state[k] ? model.CopyValueToHost(names[k], &host[k])
                                       : model.CopyGradToHost(names[k], &host[k]));
    }
    // Every replica holds all of the batch's rows; those its part does not read get zeros.
    const std::vector<engine::SparseTableInfo>& tables = model.sparse_tables();
    self.row_grads.resize(tables.size());
    for (size_t t = 0; t < tables.size(); ++t) {
      self.row_grads[t].resize(
          static_cast<size_t>(model.rows_installed(static_cast<int>(t)) * tables[t].dim));
      TESSERA_RETURN_IF_ERROR(model.CopyGradToHost(tables[t].name, &self.row_grads[t]));
    }
    return absl::OkStatus();
  };
  TESSERA_RETURN_IF_ERROR(threads_->RunOnAll(train));
  const absl::Time reduce_start = absl::Now();
  if (on_devices) {
    // Each replica's gradients complete on its device (an asynchronous fault shows here, before
    // NCCL starts), then one NCCL group for all of them, then replica 0's copy to the host.
    std::vector<std::vector<kernels::Tensor>> grads(static_cast<size_t>(n));
    TESSERA_RETURN_IF_ERROR(threads_->RunOnAll([&](int i) -> absl::Status {
      Replica& self = *replicas_[i];
      for (size_t k = 0; k < names.size(); ++k) {
        if (on_host(k)) continue;
        const engine::Parameter* p = self.model->FindParameter(names[k]);
        if (p == nullptr) return absl::NotFoundError(absl::StrCat("no tensor ", names[k]));
        grads[i].push_back(p->grad);
      }
      return self.backend->Synchronize();
    }));
    TESSERA_RETURN_IF_ERROR(nccl_->SumToFirst(grads));
    TESSERA_RETURN_IF_ERROR(threads_->RunOnAll([&](int i) -> absl::Status {
      if (i != 0) return absl::OkStatus();
      for (size_t k = 0; k < names.size(); ++k) {
        if (on_host(k)) continue;
        TESSERA_RETURN_IF_ERROR(replicas_[0]->model->CopyGradToHost(names[k], &(*out)[k]));
      }
      return absl::OkStatus();
    }));
  }
  // On the host: gradients summed (each is already weighted); state averaged evenly. Replica i
  // sums its range [len i / n, len (i + 1) / n) of each tensor, weighted by w.
  const float even = 1.0f / static_cast<float>(active);
  const auto sum_range = [&](int i, std::vector<float>& dst, float w, auto source) {
    const int64_t len = static_cast<int64_t>(dst.size());
    const int64_t lo = len * i / n;
    const int64_t hi = len * (i + 1) / n;
    for (int j = 0; j < active; ++j) {
      const float* src = source(*replicas_[j]).data();
      if (j == 0) {
        for (int64_t e = lo; e < hi; ++e) dst[e] = w * src[e];
      } else {
        for (int64_t e = lo; e < hi; ++e) dst[e] += w * src[e];
      }
    }
  };
  const size_t tables = replicas_[0]->row_grads.size();
  row_grads_.resize(tables);
  for (size_t t = 0; t < tables; ++t) row_grads_[t].resize(replicas_[0]->row_grads[t].size());
  const std::function<absl::Status(int)> reduce = [&](int i) -> absl::Status {
    for (size_t k = 0; k < names.size(); ++k) {
      if (!on_host(k)) continue;
      sum_range(i, (*out)[k], state[k] ? even : 1.0f,
                [k](const Replica& r) -> const std::vector<float>& { return r.host[k]; });
    }
    for (size_t t = 0; t < tables; ++t) {
      sum_range(i, row_grads_[t], 1.0f,
                [t](const Replica& r) -> const std::vector<float>& { return r.row_grads[t]; });
    }
    return absl::OkStatus();
  };
  TESSERA_RETURN_IF_ERROR(threads_->RunOnAll(reduce));
  last_reduce_seconds_ = absl::ToDoubleSeconds(absl::Now() - reduce_start);

  engine::StepResult total;
  for (int j = 0; j < active; ++j) {
    total.loss += static_cast<double>(share[j]) * results[j]->loss;
    total.correct += results[j]->correct;
    total.examples += results[j]->examples;
  }
  return total;
}

absl::Status LocalReplicas::Install(absl::Span<const std::string> names,
                                    absl::Span<const std::vector<float>> values) {
  if (names.size() != values.size()) {
    return absl::InternalError("LocalReplicas::Install: names and values differ in size");
  }
  return threads_->RunOnAll([&](int i) -> absl::Status {
    for (size_t k = 0; k < names.size(); ++k) {
      TESSERA_RETURN_IF_ERROR(replicas_[i]->model->CopyValueFromHost(names[k], values[k]));
    }
    return absl::OkStatus();
  });
}

absl::Status LocalReplicas::SetRows(int table, int64_t count, absl::Span<const float> values) {
  return threads_->RunOnAll(
      [&](int i) { return replicas_[i]->model->SetRows(table, count, values); });
}

absl::Status LocalReplicas::CopyRowGrads(int table, std::vector<float>* out) const {
  if (table < 0 || static_cast<size_t>(table) >= row_grads_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "LocalReplicas::CopyRowGrads: no gradient of table ", table, " (no step trained it)"));
  }
  *out = row_grads_[static_cast<size_t>(table)];
  return absl::OkStatus();
}

}  // namespace tessera::trainer::internal
