// The compute device a job spec (JobSpec.device) or a worker's --device flag asks for
// (DESIGN.md §5: chosen at run time, CUDA where a GPU exists, otherwise CPU).
#ifndef TESSERA_SPEC_DEVICE_SPEC_H_
#define TESSERA_SPEC_DEVICE_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/model.pb.h"

namespace tessera::spec {

enum class DeviceChoice { kAuto, kCpu, kCuda };

// Parses "auto" (or ""), "cpu", or "cuda" (alias "gpu"), in any case. INVALID_ARGUMENT names the
// value otherwise: "device: must be one of auto, cpu, cuda; got \"tpu\"". Pure; thread-safe.
absl::StatusOr<DeviceChoice> ParseDeviceChoice(absl::string_view text);

// The most CPU replicas one worker drives.
inline constexpr int kMaxCpuReplicas = 256;

// The most GPUs one worker drives.
inline constexpr int kMaxCudaDevices = 64;

// The local devices a worker drives (DESIGN.md §5, `--devices`): `cpu` CPU devices, or the CUDA
// devices `cuda` names (then cpu is 1).
struct DeviceList {
  int cpu = 1;
  std::vector<int> cuda;  // CUDA ordinals, distinct, in the order given
  int count() const { return cuda.empty() ? cpu : static_cast<int>(cuda.size()); }
  // As a worker registers it: "cpu:2", "cuda:0,cuda:1".
  std::string Name() const;
};

// A worker's --devices, in any case: "cpu:N" (N model replicas or pipeline stages on the host's
// CPU, 1 <= N <= kMaxCpuReplicas); "cuda:I,cuda:J,..." (those GPUs, distinct, each
// 0 <= I < `visible_gpus`); "cuda" (alias "gpu": every visible GPU); empty: one device, the one
// --device names (cpu 1). INVALID_ARGUMENT starting "devices: " naming the value otherwise (a
// GPU named that is not visible, or "cuda" where none is, says how many are). Pure; thread-safe.
absl::StatusOr<DeviceList> ParseDevices(absl::string_view devices, int visible_gpus);

// Whether a worker with `devices` local devices (DeviceList::count) can train `model`, the one
// policy for it: any model on one device (a pipelined one unsplit); a model with a pipeline of
// S stages (ModelSpec.pipeline) on exactly S, one stage per device; any other model, sparse
// tables included, as replicas on any count (a pipeline takes no sparse tables:
// spec::PlanPipeline refuses them with the spec).
// INVALID_ARGUMENT starting "devices: " with the fix otherwise. Pure; thread-safe.
absl::Status CheckDevicesFitModel(int devices, const v1::ModelSpec& model);

// CheckDevicesFitModel for a worker that registered `device` ("cpu", "cuda:0", "cpu:N",
// "cuda:0,cuda:1": DeviceList::Name), as the coordinator's gang scheduler asks before it picks
// the worker for a job; a name that is not a device list counts as one device. Pure;
// thread-safe.
absl::Status CheckWorkerFitsModel(absl::string_view device, const v1::ModelSpec& model);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_DEVICE_SPEC_H_
