#include "spec/optimizer_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace tessera::spec {
namespace {

absl::Status FieldError(absl::string_view field, absl::string_view requirement, float value) {
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer.", field, ": must be ", requirement, ", got ", value));
}

// Checks value against [0, 1) and NaN.
absl::Status CheckUnitInterval(absl::string_view field, float value) {
  if (!(value >= 0.0f && value < 1.0f)) return FieldError(field, "in [0, 1)", value);
  return absl::OkStatus();
}

absl::Status CheckNonNegative(absl::string_view field, float value) {
  if (!(std::isfinite(value) && value >= 0.0f)) {
    return FieldError(field, "a finite number >= 0", value);
  }
  return absl::OkStatus();
}

absl::Status CheckKind(v1::OptimizerKind kind, bool sparse) {
  if (kind == v1::OPTIMIZER_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "optimizer.kind: must be set, got OPTIMIZER_KIND_UNSPECIFIED");
  }
  if (!v1::OptimizerKind_IsValid(kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.kind: unknown optimizer kind ", static_cast<int>(kind)));
  }
  const bool dense_only = kind == v1::OPTIMIZER_KIND_MOMENTUM ||
                          kind == v1::OPTIMIZER_KIND_NESTEROV || kind == v1::OPTIMIZER_KIND_ADAMW;
  const bool sparse_only = kind == v1::OPTIMIZER_KIND_FTRL;
  if (sparse && dense_only) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.kind: ", v1::OptimizerKind_Name(kind),
                     " is for dense tensors only; sparse tables take SGD, ADAGRAD, ADAM or FTRL"));
  }
  if (!sparse && sparse_only) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.kind: ", v1::OptimizerKind_Name(kind),
        " is for sparse tables only; dense tensors take SGD, MOMENTUM, NESTEROV, ADAGRAD, ADAM or "
        "ADAMW"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptimizer(const v1::OptimizerConfig& config, bool sparse) {
  TESSERA_RETURN_IF_ERROR(CheckKind(config.kind(), sparse));
  if (!(std::isfinite(config.learning_rate()) && config.learning_rate() > 0.0f)) {
    return FieldError("learning_rate", "a finite number > 0", config.learning_rate());
  }
  TESSERA_RETURN_IF_ERROR(CheckUnitInterval("momentum", config.momentum()));
  TESSERA_RETURN_IF_ERROR(CheckUnitInterval("beta1", config.beta1()));
  TESSERA_RETURN_IF_ERROR(CheckUnitInterval("beta2", config.beta2()));
  TESSERA_RETURN_IF_ERROR(CheckNonNegative("epsilon", config.epsilon()));
  TESSERA_RETURN_IF_ERROR(CheckNonNegative("weight_decay", config.weight_decay()));
  TESSERA_RETURN_IF_ERROR(CheckNonNegative("initial_accumulator", config.initial_accumulator()));
  TESSERA_RETURN_IF_ERROR(CheckNonNegative("ftrl_beta", config.ftrl_beta()));
  TESSERA_RETURN_IF_ERROR(CheckNonNegative("ftrl_l1", config.ftrl_l1()));
  TESSERA_RETURN_IF_ERROR(CheckNonNegative("ftrl_l2", config.ftrl_l2()));
  if (!(std::isfinite(config.ftrl_lr_power()) && config.ftrl_lr_power() <= 0.0f)) {
    return FieldError("ftrl_lr_power", "a finite number <= 0", config.ftrl_lr_power());
  }
  return absl::OkStatus();
}

}  // namespace tessera::spec
