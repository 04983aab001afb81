// The devices of one worker that train each batch together (DESIGN.md §5, `--devices cpu:N`):
// N data-parallel replicas (local_replicas.h), or the N stages of a pipelined model
// (pipeline_stages.h). Either way a step ends with the whole batch's gradient on the host, which
// the trainer pushes once, and the weights it pulls back are installed on every device. The
// trainer's own model (on its own backend) evaluates and holds what is exported. A model's sparse
// tables (replicas only: a pipeline refuses them) hold the rows of one batch: the trainer's row
// exchange installs them on every device with SetRows and takes the batch's row gradients, summed
// over the devices, from CopyRowGrads.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_DEVICES_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_DEVICES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/model.h"

namespace tessera::trainer::internal {

class LocalDevices {
 public:
  struct Options {
    int devices = 2;                 // >= 1
    int threads = 1;                 // OpenMP threads per CPU device, >= 1
    int64_t memory_limit_bytes = 0;  // per CPU device's backend (0: the host's memory)
    // GPUs (--devices cuda:0,cuda:1): device i is CUDA device cuda_devices[i], and `devices`
    // must equal their number. Empty: CPU devices.
    std::vector<int> cuda_devices;
  };

  // The policy in one place: a model with a pipeline (spec.pipeline) of S stages runs as a
  // pipeline over exactly S devices; any other model as data-parallel replicas. INVALID_ARGUMENT
  // naming `devices` when the count does not fit the model (a pipeline over another number of
  // devices, sparse tables); the spec's own errors as engine::Model::Create gives them.
  static absl::StatusOr<std::unique_ptr<LocalDevices>> Create(const v1::ModelSpec& spec,
                                                              uint64_t seed,
                                                              const Options& options);

  virtual ~LocalDevices() = default;

  virtual int size() const = 0;
  // For the log: "splits each batch over 2 CPU replicas", "runs the model as a pipeline of 2
  // stages on 2 CPU devices, 8 micro-batches a batch".
  virtual std::string Describe() const = 0;

  // One training step of `batch` (dropout masks derive from `dropout_seed`). out[k] gets tensor
  // names[k]'s gradient of the whole batch's mean loss, or, where state[k], its value after the
  // step (the devices' mean where several hold it); out[k] must already have the tensor's size.
  virtual absl::StatusOr<engine::StepResult> TrainStep(const engine::BatchView& batch,
                                                       uint64_t dropout_seed,
                                                       absl::Span<const std::string> names,
                                                       const std::vector<bool>& state,
                                                       std::vector<std::vector<float>>* out) = 0;
  // Sets tensor names[k] to values[k] on every device that holds it.
  virtual absl::Status Install(absl::Span<const std::string> names,
                               absl::Span<const std::vector<float>> values) = 0;

  // Installs `count` rows of the model's sparse table `table` (engine::Model::SetRows) for the
  // next TrainStep, on every device that holds the table.
  virtual absl::Status SetRows(int table, int64_t count, absl::Span<const float> values) = 0;
  // After TrainStep: the gradient of table `table`'s installed rows over the whole batch (the
  // devices' sum), row by row as SetRows installed them; `out` is resized to count x dim.
  virtual absl::Status CopyRowGrads(int table, std::vector<float>* out) const = 0;
};

// Where a task trains (the one policy for it): the trainer's own backend, and the local devices
// that train each batch when there are several.
struct DevicePlan {
  kernels::BackendOptions trainer;  // the trainer's model: trains alone, or evaluates and exports
  int devices = 1;                  // 1: the trainer's model trains
  LocalDevices::Options local;      // when devices > 1
};
// `device`: the spec's device (after any --device override, "" for auto); `cpu_devices` (cpu:N)
// or `cuda_devices` (at most one of them names several); `threads` per the worker (0: the
// default; then 1 per device when there are several). GPUs train on CUDA, the trainer's model on
// the first of them; cpu:N on the CPU, the trainer's model too. INVALID_ARGUMENT starting
// "devices: " when the devices contradict the device or cannot train `model`
// (spec::CheckDevicesFitModel), or "device: " for a bad device.
absl::StatusOr<DevicePlan> PlanDevices(absl::string_view device, int cpu_devices,
                                       const std::vector<int>& cuda_devices, int threads,
                                       int64_t memory_limit_bytes, const v1::ModelSpec& model);

// Splits `size` examples into `parts` contiguous parts, the first size mod parts one example
// larger: part i is [begin[i], begin[i + 1]) of the returned parts + 1 bounds (a part is empty
// when size < parts). Replicas split batches this way, pipelines their micro-batches.
std::vector<int64_t> SplitExamples(int64_t size, int parts);

// Examples [begin, end) of `batch`: its features, labels and targets (each example's share of
// them, whatever the width), and its bags: the slice's offsets are a window of the batch's, over
// the batch's whole id arrays (the engine reads offsets that do not start at 0). A multi-input
// batch's field views are written to `fields`, which outlives the view (null: the slice has no
// fields, and the engine refuses it). REQUIRES: 0 <= begin <= end <= batch.size.
engine::BatchView SliceBatch(const engine::BatchView& batch, int64_t begin, int64_t end,
                             std::vector<engine::SparseFieldView>* fields);

// The backend of local device `i`: a oneDNN backend with options.threads OpenMP threads, or, with
// options.cuda_devices, a CUDA backend on cuda_devices[i]. Call it on the thread that will drive
// it (DeviceThreads' init).
absl::StatusOr<std::unique_ptr<kernels::Backend>> DeviceBackend(
    const LocalDevices::Options& options, int i);
// For Describe(): "2 CPU <noun>", or "2 GPU <noun> (cuda:0,cuda:1)".
std::string DescribeDevices(const LocalDevices::Options& options, absl::string_view noun);

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_LOCAL_DEVICES_H_
