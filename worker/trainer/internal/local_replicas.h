// Data parallelism inside one worker (DESIGN.md §5): N model replicas on the host's CPU, each on
// its own oneDNN backend driven by its own thread with its own OpenMP threads (`--devices cpu:N`).
//
// A step splits the batch into N contiguous parts (the first B mod N parts one example larger),
// trains each part on its replica at once, and reduces on the host: every trainable tensor's
// gradient becomes the example-weighted mean of the replicas' gradients, which is the gradient of
// the whole batch's mean loss, so N replicas with B/N examples each push what one device with B
// would (to float rounding). Non-trainable state (BatchNorm moving statistics, from per-replica
// batch statistics) becomes the replicas' mean. The reduce itself runs on the replicas' threads,
// each summing its own range of every tensor.
//
// Every replica is built from the same spec and seed, so they start equal; Install() keeps them
// equal with the weights pulled back from the shards. Models with sparse tables are refused: their
// rows travel per batch (row_exchange.h), which this splits nothing of yet.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_REPLICAS_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_REPLICAS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/model.h"

namespace tessera::trainer::internal {

class LocalReplicas {
 public:
  struct Options {
    int replicas = 2;                // >= 1
    int threads = 1;                 // OpenMP threads per replica, >= 1
    int64_t memory_limit_bytes = 0;  // per replica's backend (0: the host's memory)
  };

  // Builds every replica on its own thread. INVALID_ARGUMENT naming `devices` for a bad count or a
  // model with sparse tables; the spec's own errors as engine::Model::Create gives them.
  static absl::StatusOr<std::unique_ptr<LocalReplicas>> Create(const v1::ModelSpec& spec,
                                                               uint64_t seed,
                                                               const Options& options);
  ~LocalReplicas();
  LocalReplicas(const LocalReplicas&) = delete;
  LocalReplicas& operator=(const LocalReplicas&) = delete;

  int size() const { return static_cast<int>(replicas_.size()); }
  // Replica i's model, for reading (tests). Not to be driven while a step runs.
  const engine::Model& model(int i) const { return *replicas_[i]->model; }

  // One training step of `batch` split across the replicas (replica i's dropout masks derive from
  // `dropout_seed` and i). out[k] gets tensor names[k]'s reduced gradient, or, where state[k], the
  // replicas' mean value; out[k] must already have the tensor's size. A batch smaller than the
  // number of replicas leaves the last ones idle that step.
  absl::StatusOr<engine::StepResult> TrainStep(const engine::BatchView& batch,
                                               uint64_t dropout_seed,
                                               absl::Span<const std::string> names,
                                               const std::vector<bool>& state,
                                               std::vector<std::vector<float>>* out);
  // Sets tensor names[k] to values[k] in every replica.
  absl::Status Install(absl::Span<const std::string> names,
                       absl::Span<const std::vector<float>> values);

  // Seconds the last TrainStep spent in the reduce (wall time, all replicas at once).
  double last_reduce_seconds() const { return last_reduce_seconds_; }

 private:
  struct Replica {
    std::unique_ptr<kernels::Backend> backend;
    std::unique_ptr<engine::Model> model;
    std::vector<std::vector<float>> host;  // per tensor of the step: this replica's gradient
    std::thread thread;
  };
  LocalReplicas() = default;
  // Runs task(i) on every replica's thread at once and waits; the first error wins.
  absl::Status RunOnAll(const std::function<absl::Status(int)>& task);
  void Serve(int i, const v1::ModelSpec& spec, uint64_t seed, const Options& options);

  std::vector<std::unique_ptr<Replica>> replicas_;
  absl::Mutex mu_;
  const std::function<absl::Status(int)>* task_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped per task
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  double last_reduce_seconds_ = 0;
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_REPLICAS_H_
