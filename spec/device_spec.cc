#include "spec/device_spec.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
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

std::string DeviceList::Name() const {
  if (cuda.empty()) return absl::StrCat("cpu:", cpu);
  return absl::StrJoin(cuda, ",",
                       [](std::string* out, int d) { absl::StrAppend(out, "cuda:", d); });
}

absl::StatusOr<DeviceList> ParseDevices(absl::string_view devices, int visible_gpus) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(devices));
  DeviceList list;
  if (t.empty()) return list;
  const auto visible = [visible_gpus] {
    return visible_gpus == 1 ? std::string("1 GPU is visible (cuda:0)")
                             : absl::StrCat(visible_gpus, " GPUs are visible");
  };
  if (t == "cuda" || t == "gpu") {
    if (visible_gpus < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "devices: \"", devices, "\" asks for every visible GPU, but none is visible here"));
    }
    for (int d = 0; d < std::min(visible_gpus, kMaxCudaDevices); ++d) list.cuda.push_back(d);
    return list;
  }
  if (absl::StartsWith(t, "cuda:") || absl::StartsWith(t, "gpu:")) {
    for (absl::string_view part : absl::StrSplit(t, ',')) {
      part = absl::StripAsciiWhitespace(part);
      int d = -1;
      const size_t colon = part.find(':');
      const absl::string_view kind = part.substr(0, colon);
      if (colon == absl::string_view::npos || (kind != "cuda" && kind != "gpu") ||
          !absl::SimpleAtoi(part.substr(colon + 1), &d) || d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "devices: must be cuda:I,cuda:J,... with distinct device numbers I >= 0; got \"",
            devices, "\" (\"", part, "\" is not one)"));
      }
      if (d >= visible_gpus) {
        return absl::InvalidArgumentError(
            absl::StrCat("devices: \"", devices, "\" names cuda:", d, ", but ", visible()));
      }
      if (std::find(list.cuda.begin(), list.cuda.end(), d) != list.cuda.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("devices: \"", devices, "\" names cuda:", d, " twice"));
      }
      list.cuda.push_back(d);
    }
    return list;
  }
  int n = 0;
  if (absl::StartsWith(t, "cpu:") && absl::SimpleAtoi(absl::string_view(t).substr(4), &n) &&
      n >= 1 && n <= kMaxCpuReplicas) {
    list.cpu = n;
    return list;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("devices: must be cpu:N with N in [1, ", kMaxCpuReplicas,
                   "], cuda:I,cuda:J,... or cuda; got \"", devices, "\""));
}

absl::Status CheckWorkerFitsModel(absl::string_view device, const v1::ModelSpec& model) {
  // Registered names are resolved lists; any GPU number is taken as visible.
  absl::StatusOr<DeviceList> list = ParseDevices(device, kMaxCudaDevices);
  return CheckDevicesFitModel(list.ok() ? list->count() : 1, model);
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
