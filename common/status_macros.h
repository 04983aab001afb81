// Early-return helpers for absl::Status, which Debian's Abseil 20220623 does not provide.
#ifndef TESSERA_COMMON_STATUS_MACROS_H_
#define TESSERA_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TESSERA_STATUS_CONCAT_INNER_(a, b) a##b
#define TESSERA_STATUS_CONCAT_(a, b) TESSERA_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define TESSERA_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::absl::Status tessera_status_ = (expr);          \
    if (!tessera_status_.ok()) return tessera_status_; \
  } while (0)

// TESSERA_ASSIGN_OR_RETURN(lhs, expr): evaluates the StatusOr `expr`; returns its status when not
// OK, otherwise moves its value into `lhs` (which may be a declaration).
#define TESSERA_ASSIGN_OR_RETURN(lhs, expr) \
  TESSERA_ASSIGN_OR_RETURN_IMPL_(TESSERA_STATUS_CONCAT_(tessera_statusor_, __LINE__), lhs, expr)

#define TESSERA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return std::move(tmp).status();       \
  lhs = std::move(tmp).value()

#endif  // TESSERA_COMMON_STATUS_MACROS_H_
