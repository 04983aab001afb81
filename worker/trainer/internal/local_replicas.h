// Data parallelism inside one worker (DESIGN.md §5): N model replicas, each on its own backend
// driven by its own thread: on the host's CPU, a oneDNN backend with its own OpenMP threads
// (`--devices cpu:N`), or on GPUs, a CUDA backend per device (`--devices cuda:0,cuda:1`).
//
// A step splits the batch into N contiguous parts (the first B mod N parts one example larger),
// trains each part on its replica at once, with the part's loss gradient scaled by its share of
// the batch, and reduces on the host: every trainable tensor's gradient becomes the sum of the
// replicas' gradients, which is the gradient of the whole batch's mean loss, so N replicas with
// B/N examples each push what one device with B would (to float rounding). Non-trainable state
// (BatchNorm moving statistics) becomes the replicas' mean. BatchNorm uses each replica's batch
// statistics, or, with batch_norm.sync (SyncBN), the whole batch's: the replicas sum them through
// a HostAllReduce in the forward and backward passes, and then train exactly as one device. On
// the CPU the reduce runs on the replicas' threads, each summing its own range of every tensor;
// on several GPUs NCCL sums the gradients into replica 0's on the devices (kernels::DeviceReduce,
// one NCCL stream per device), and replica 0 alone copies them to the host (a step whose batch
// leaves a replica idle sums on the host, since NCCL needs every rank).
//
// Every replica is built from the same spec and seed, so they start equal; Install() keeps them
// equal with the weights pulled back from the shards. Sparse tables hold one batch's rows
// (row_exchange.h fetches them once per worker): SetRows installs all of them on every replica,
// each replica's part reads those of its own bags (the slice keeps the batch's positions), and
// the reduce sums the replicas' row gradients as it sums the dense ones, so one push per row and
// step goes out, as from one device. Made through LocalDevices::Create (local_devices.h), which
// chooses between replicas and pipeline stages.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_REPLICAS_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_REPLICAS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/device_reduce.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/model.h"
#include "worker/trainer/internal/device_threads.h"
#include "worker/trainer/internal/host_all_reduce.h"
#include "worker/trainer/internal/local_devices.h"

namespace tessera::trainer::internal {

class LocalReplicas final : public LocalDevices {
 public:
  // Builds options.devices replicas, each on its own thread. INVALID_ARGUMENT naming `devices`
  // for a bad count; the spec's own errors as engine::Model::Create gives them.
  static absl::StatusOr<std::unique_ptr<LocalReplicas>> Create(const v1::ModelSpec& spec,
                                                               uint64_t seed,
                                                               const Options& options);
  ~LocalReplicas() override;
  LocalReplicas(const LocalReplicas&) = delete;
  LocalReplicas& operator=(const LocalReplicas&) = delete;

  int size() const override { return static_cast<int>(replicas_.size()); }
  std::string Describe() const override;
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
                                               std::vector<std::vector<float>>* out) override;
  // Sets tensor names[k] to values[k] in every replica.
  absl::Status Install(absl::Span<const std::string> names,
                       absl::Span<const std::vector<float>> values) override;
  // Installs the rows on every replica (each from its own thread).
  absl::Status SetRows(int table, int64_t count, absl::Span<const float> values) override;
  // The last TrainStep's row gradients of `table`, summed over the replicas. FAILED_PRECONDITION
  // before a step.
  absl::Status CopyRowGrads(int table, std::vector<float>* out) const override;

  // Seconds the last TrainStep spent in the reduce (wall time, all replicas at once).
  double last_reduce_seconds() const { return last_reduce_seconds_; }

 private:
  struct Replica {
    std::unique_ptr<kernels::Backend> backend;
    std::unique_ptr<engine::Model> model;
    std::vector<std::vector<float>> host;         // per tensor of the step: this replica's gradient
    std::vector<std::vector<float>> row_grads;    // per sparse table: its rows' gradients
    std::vector<engine::SparseFieldView> fields;  // the step's slice of a multi-input batch
  };
  LocalReplicas() = default;

  // SyncBN (a batch_norm with sync): the replicas' models sum their statistics with it.
  std::unique_ptr<HostAllReduce> sync_;
  std::unique_ptr<kernels::DeviceReduce> nccl_;  // several GPUs: the gradients' sum
  std::string devices_name_;                     // "2 CPU replicas", "2 GPU replicas (...)"
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::vector<std::vector<float>> row_grads_;  // per sparse table: the last step's reduced
  std::unique_ptr<DeviceThreads> threads_;     // after replicas_: stops before they go
  double last_reduce_seconds_ = 0;
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_REPLICAS_H_
