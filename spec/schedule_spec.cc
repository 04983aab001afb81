#include "spec/schedule_spec.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tessera::spec {
namespace {

absl::Status CountError(absl::string_view field, absl::string_view requirement, int64_t value) {
  return absl::InvalidArgumentError(
      absl::StrCat("schedule.", field, ": must be ", requirement, ", got ", value));
}

absl::Status ValueError(absl::string_view field, absl::string_view requirement, float value) {
  return absl::InvalidArgumentError(
      absl::StrCat("schedule.", field, ": must be ", requirement, ", got ", value));
}

}  // namespace

absl::Status ValidateSchedule(const v1::LearningRateSchedule& schedule) {
  if (!v1::LearningRateSchedule::Kind_IsValid(schedule.kind())) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule.kind: unknown schedule kind ", static_cast<int>(schedule.kind())));
  }
  if (schedule.warmup_steps() < 0) {
    return CountError("warmup_steps", ">= 0", schedule.warmup_steps());
  }
  if (schedule.step_size() < 0) return CountError("step_size", ">= 0", schedule.step_size());
  if (schedule.total_steps() < 0) return CountError("total_steps", ">= 0", schedule.total_steps());
  if (!std::isfinite(schedule.gamma())) {
    return ValueError("gamma", "a finite number", schedule.gamma());
  }
  if (!(std::isfinite(schedule.min_learning_rate()) && schedule.min_learning_rate() >= 0.0f)) {
    return ValueError("min_learning_rate", "a finite number >= 0", schedule.min_learning_rate());
  }
  switch (schedule.kind()) {
    case v1::LearningRateSchedule::KIND_STEP:
      if (schedule.step_size() <= 0) {
        return CountError("step_size", "> 0 for KIND_STEP", schedule.step_size());
      }
      if (!(schedule.gamma() > 0.0f && schedule.gamma() <= 1.0f)) {
        return ValueError("gamma", "in (0, 1] for KIND_STEP", schedule.gamma());
      }
      break;
    case v1::LearningRateSchedule::KIND_COSINE:
      if (schedule.total_steps() <= 0) {
        return CountError("total_steps", "> 0 for KIND_COSINE", schedule.total_steps());
      }
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

}  // namespace tessera::spec
