#include "worker/trainer/internal/local_replicas.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "spec/model_spec.h"

namespace tessera::trainer::internal {

absl::StatusOr<std::unique_ptr<LocalReplicas>> LocalReplicas::Create(const v1::ModelSpec& spec,
                                                                     uint64_t seed,
                                                                     const Options& options) {
  if (options.replicas < 1 || options.replicas > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: cpu:N needs N in [1, 256], got ", options.replicas));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: each CPU replica needs >= 1 thread, got ", options.threads));
  }
  if (spec::HasSparseTables(spec)) {
    return absl::InvalidArgumentError(
        "devices: cpu:N replicas train dense models only; this model has sparse tables, whose "
        "rows travel per batch (use one device per worker and more workers)");
  }
  std::unique_ptr<LocalReplicas> r(new LocalReplicas());
  {
    absl::MutexLock lock(&r->mu_);
    r->running_ = options.replicas;
  }
  for (int i = 0; i < options.replicas; ++i) r->replicas_.push_back(std::make_unique<Replica>());
  // Each replica's backend is made on the thread that drives it: OpenMP's thread count and the
  // denormal flush are per calling thread.
  for (int i = 0; i < options.replicas; ++i) {
    r->replicas_[i]->thread = std::thread(
        [raw = r.get(), i, spec, seed, options] { raw->Serve(i, spec, seed, options); });
  }
  absl::Status built;
  {
    absl::MutexLock lock(&r->mu_);
    r->mu_.Await(absl::Condition(
        +[](int* running) { return *running == 0; }, &r->running_));
    built = r->error_;
    r->error_ = absl::OkStatus();
  }
  if (!built.ok()) return built;  // the destructor stops the threads
  return r;
}

LocalReplicas::~LocalReplicas() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::unique_ptr<Replica>& r : replicas_) {
    if (r->thread.joinable()) r->thread.join();
  }
}

void LocalReplicas::Serve(int i, const v1::ModelSpec& spec, uint64_t seed, const Options& options) {
  Replica& self = *replicas_[i];
  absl::Status status = [&]() -> absl::Status {
    kernels::BackendOptions b;
    b.device = kernels::DeviceChoice::kCpu;
    b.num_threads = options.threads;
    b.memory_limit_bytes = options.memory_limit_bytes;
    TESSERA_ASSIGN_OR_RETURN(self.backend, kernels::CreateBackend(b));
    TESSERA_ASSIGN_OR_RETURN(self.model, engine::Model::Create(spec, self.backend.get(), seed));
    return absl::OkStatus();
  }();
  uint64_t seen = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.ok()) {
      error_ = absl::Status(status.code(), absl::StrCat("cpu replica ", i, ": ", status.message()));
    }
    --running_;
    seen = generation_;
  }
  while (true) {
    const std::function<absl::Status(int)>* task = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, &seen]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || generation_ != seen; };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      seen = generation_;
      task = task_;
    }
    absl::Status s = (*task)(i);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) error_ = std::move(s);
    --running_;
  }
}

absl::Status LocalReplicas::RunOnAll(const std::function<absl::Status(int)>& task) {
  absl::MutexLock lock(&mu_);
  task_ = &task;
  running_ = size();
  error_ = absl::OkStatus();
  ++generation_;
  mu_.Await(absl::Condition(
      +[](int* running) { return *running == 0; }, &running_));
  task_ = nullptr;
  return std::exchange(error_, absl::OkStatus());
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
  const int64_t width = static_cast<int64_t>(batch.features.size()) / batch.size;
  // Replica i trains examples [begin[i], begin[i + 1]).
  std::vector<int64_t> begin(n + 1);
  for (int i = 0; i <= n; ++i) {
    begin[i] = batch.size / n * i + std::min<int64_t>(i, batch.size % n);
  }
  int active = 0;
  while (active < n && begin[active + 1] > begin[active]) ++active;
  std::vector<absl::StatusOr<engine::StepResult>> results(n, engine::StepResult{});
  const std::function<absl::Status(int)> train = [&](int i) -> absl::Status {
    if (i >= active) return absl::OkStatus();
    const int64_t b = begin[i];
    const int64_t size = begin[i + 1] - b;
    engine::BatchView part;
    part.size = size;
    part.features = batch.features.subspan(b * width, size * width);
    if (!batch.labels.empty()) part.labels = batch.labels.subspan(b, size);
    if (!batch.targets.empty()) part.targets = batch.targets.subspan(b, size);
    engine::Model& model = *replicas_[i]->model;
    model.set_dropout_seed(dropout_seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(i));
    results[i] = model.TrainStep(part);
    TESSERA_RETURN_IF_ERROR(results[i].status());
    std::vector<std::vector<float>>& host = replicas_[i]->host;
    host.resize(names.size());
    for (size_t k = 0; k < names.size(); ++k) {
      host[k].resize((*out)[k].size());
      TESSERA_RETURN_IF_ERROR(state[k] ? model.CopyValueToHost(names[k], &host[k])
                                       : model.CopyGradToHost(names[k], &host[k]));
    }
    return absl::OkStatus();
  };
  TESSERA_RETURN_IF_ERROR(RunOnAll(train));

  // Gradients weighted by each part's share of the batch; state averaged evenly.
  std::vector<float> share(active);
  for (int j = 0; j < active; ++j) {
    share[j] = static_cast<float>(begin[j + 1] - begin[j]) / static_cast<float>(batch.size);
  }
  const float even = 1.0f / static_cast<float>(active);
  const absl::Time reduce_start = absl::Now();
  const std::function<absl::Status(int)> reduce = [&](int i) -> absl::Status {
    for (size_t k = 0; k < names.size(); ++k) {
      std::vector<float>& dst = (*out)[k];
      const int64_t len = static_cast<int64_t>(dst.size());
      const int64_t lo = len * i / n;
      const int64_t hi = len * (i + 1) / n;
      for (int j = 0; j < active; ++j) {
        const float w = state[k] ? even : share[j];
        const float* src = replicas_[j]->host[k].data();
        if (j == 0) {
          for (int64_t e = lo; e < hi; ++e) dst[e] = w * src[e];
        } else {
          for (int64_t e = lo; e < hi; ++e) dst[e] += w * src[e];
        }
      }
    }
    return absl::OkStatus();
  };
  TESSERA_RETURN_IF_ERROR(RunOnAll(reduce));
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
  return RunOnAll([&](int i) -> absl::Status {
    for (size_t k = 0; k < names.size(); ++k) {
      TESSERA_RETURN_IF_ERROR(replicas_[i]->model->CopyValueFromHost(names[k], values[k]));
    }
    return absl::OkStatus();
  });
}

}  // namespace tessera::trainer::internal
