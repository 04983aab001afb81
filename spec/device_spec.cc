#include "spec/device_spec.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tessera::spec {

absl::StatusOr<DeviceChoice> ParseDeviceChoice(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto" || t.empty()) return DeviceChoice::kAuto;
  if (t == "cpu") return DeviceChoice::kCpu;
  if (t == "cuda" || t == "gpu") return DeviceChoice::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("device: must be one of auto, cpu, cuda; got \"", text, "\""));
}

}  // namespace tessera::spec
