#include "spec/device_spec.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "spec/model_spec.h"
#include "spec/pipeline_spec.h"

namespace tessera::spec {

absl::StatusOr<DeviceChoice> ParseDeviceChoice(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto" || t.empty()) return DeviceChoice::kAuto;
  if (t == "cpu") return DeviceChoice::kCpu;
  if (t == "cuda" || t == "gpu") return DeviceChoice::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("device: must be one of auto, cpu, cuda; got \"", text, "\""));
}

absl::StatusOr<int> ParseCpuReplicas(absl::string_view devices) {
  const std::string t = absl::AsciiStrToLower(devices);
  if (t.empty()) return 1;
  int n = 0;
  if (absl::StartsWith(t, "cpu:") && absl::SimpleAtoi(absl::string_view(t).substr(4), &n) &&
      n >= 1 && n <= kMaxCpuReplicas) {
    return n;
  }
  if (absl::StartsWith(t, "cuda") || absl::StartsWith(t, "gpu")) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: \"", devices,
                     "\": several GPUs in one worker are not supported yet; run one "
                     "worker per GPU (CUDA_VISIBLE_DEVICES) or use cpu:N"));
  }
  return absl::InvalidArgumentError(absl::StrCat("devices: must be cpu:N with N in [1, ",
                                                 kMaxCpuReplicas, "]; got \"", devices, "\""));
}

absl::Status CheckWorkerFitsModel(absl::string_view device, const v1::ModelSpec& model) {
  int devices = 1;
  if (absl::StartsWith(absl::AsciiStrToLower(device), "cpu:")) {
    absl::StatusOr<int> n = ParseCpuReplicas(device);
    if (!n.ok()) return n.status();
    devices = *n;
  }
  return CheckDevicesFitModel(devices, model);
}

absl::Status CheckDevicesFitModel(int devices, const v1::ModelSpec& model) {
  if (devices < 1 || devices > kMaxCpuReplicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: cpu:N needs N in [1, ", kMaxCpuReplicas, "], got ", devices));
  }
  if (devices == 1) return absl::OkStatus();
  const int stages = PipelineStageCount(model);
  if (stages > 1 && devices != stages) {
    return absl::InvalidArgumentError(absl::StrCat("devices: the model's pipeline has ", stages,
                                                   " stages, one per device, but the worker "
                                                   "drives ",
                                                   devices, " (use --devices cpu:", stages,
                                                   ", or one device to train the model unsplit)"));
  }
  return absl::OkStatus();
}

}  // namespace tessera::spec
