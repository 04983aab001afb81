// Sizes of example shapes from untrusted specs (private to spec/). kernels/backend.h keeps the
// same arithmetic for device tensors; spec/ and kernels/ are siblings and share no code but
// common/ and proto/.
#ifndef TESSERA_SPEC_INTERNAL_SHAPE_MATH_H_
#define TESSERA_SPEC_INTERNAL_SHAPE_MATH_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spec/model_spec.h"

namespace tessera::spec::internal {

// The product of `shape`'s dimensions (1 for the empty shape). REQUIRES: it fits in an int64.
inline int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// a * b for a, b >= 0, or -1 when the product does not fit in an int64.
inline int64_t CheckedProduct(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return -1;
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}

// The product of `shape`'s dimensions (each >= 0), or -1 when it does not fit in an int64.
inline int64_t CheckedNumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    n = CheckedProduct(n, d);
    if (n < 0) return -1;
  }
  return n;
}

// "[1, 28, 28]".
inline std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace tessera::spec::internal

#endif  // TESSERA_SPEC_INTERNAL_SHAPE_MATH_H_
