// The compute device a job spec (JobSpec.device) or a worker's --device flag asks for
// (DESIGN.md §5: chosen at run time, CUDA where a GPU exists, otherwise CPU).
#ifndef TESSERA_SPEC_DEVICE_SPEC_H_
#define TESSERA_SPEC_DEVICE_SPEC_H_

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

// A worker's --devices: "cpu:N" (N model replicas on the host's CPU, 1 <= N <= kMaxCpuReplicas)
// gives N; empty gives 1 (the one device --device names). INVALID_ARGUMENT naming `devices`
// otherwise. Several GPUs in one worker (cuda:0,cuda:1) are not built yet and are refused as
// such. Pure; thread-safe.
absl::StatusOr<int> ParseCpuReplicas(absl::string_view devices);

// Whether a worker with `devices` CPU devices (ParseCpuReplicas' N) can train `model`, the one
// policy for it: any model on one device (a pipelined one unsplit); a model with a pipeline of
// S stages (ModelSpec.pipeline) on exactly S, one stage per device; any other model, sparse
// tables included, as replicas on any count (a pipeline takes no sparse tables:
// spec::PlanPipeline refuses them with the spec).
// INVALID_ARGUMENT starting "devices: " with the fix otherwise. Pure; thread-safe.
absl::Status CheckDevicesFitModel(int devices, const v1::ModelSpec& model);

// CheckDevicesFitModel for a worker that registered `device` ("cpu", "cuda:0", "cpu:N"), as the
// coordinator's gang scheduler asks before it picks the worker for a job. Pure; thread-safe.
absl::Status CheckWorkerFitsModel(absl::string_view device, const v1::ModelSpec& model);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_DEVICE_SPEC_H_
