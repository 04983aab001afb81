#include "spec/row_lifecycle_spec.h"

#include "absl/strings/str_cat.h"

namespace tessera::spec {

absl::Status ValidateRowLifecycle(const v1::RowLifecycle& lifecycle, absl::string_view field) {
  if (lifecycle.admit_after() > kMaxAdmitAfter) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".admit_after: must be at most ",
                                                   kMaxAdmitAfter, ", got ",
                                                   lifecycle.admit_after()));
  }
  if (lifecycle.evict_after() < 0 || lifecycle.evict_after() > kMaxEvictAfter) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".evict_after: must be in [0, ",
                                                   kMaxEvictAfter, "], got ",
                                                   lifecycle.evict_after()));
  }
  return absl::OkStatus();
}

}  // namespace tessera::spec
