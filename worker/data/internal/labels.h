// Label checks shared by the readers.
#ifndef TESSERA_WORKER_DATA_INTERNAL_LABELS_H_
#define TESSERA_WORKER_DATA_INTERNAL_LABELS_H_

#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::data::internal {

// Checks a label read at `where` ("file:line 3" or "file: example 7 (byte 15)") and maps it to
// the stored value: a class id in [0, num_classes) when num_classes > 0, where -1 is accepted as
// class 0 for binary problems (LIBSVM's convention); any finite value otherwise.
inline absl::Status CheckLabel(double value, int num_classes, const std::string& where,
                               float* out) {
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": label is not finite: ", value));
  }
  if (num_classes == 0) {
    *out = static_cast<float>(value);
    return absl::OkStatus();
  }
  if (num_classes == 2 && value == -1.0) value = 0.0;
  if (value != std::floor(value) || value < 0 || value >= num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": label ", value, " is not a class id in [0, ", num_classes, ")"));
  }
  *out = static_cast<float>(value);
  return absl::OkStatus();
}

}  // namespace tessera::data::internal

#endif  // TESSERA_WORKER_DATA_INTERNAL_LABELS_H_
