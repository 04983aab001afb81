#include "kernels/backend.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/device.h"

namespace tessera::kernels {
namespace {

// Programmer errors only (a view that does not fit its tensor).
void CheckOrDie(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "tessera::kernels::Tensor: %s\n", what.c_str());
    std::abort();
  }
}

}  // namespace

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 4;
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t CheckedProduct(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return -1;
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}

int64_t CheckedNumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    n = CheckedProduct(n, d);
    if (n < 0) return -1;
  }
  return n;
}

int64_t HostMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return std::numeric_limits<int64_t>::max();
  const int64_t bytes = CheckedProduct(pages, page_size);
  return bytes < 0 ? std::numeric_limits<int64_t>::max() : bytes;
}

int64_t Backend::MemoryCapacityBytes() const { return HostMemoryBytes(); }

absl::Status Backend::SetThreads(int threads) {
  return absl::FailedPreconditionError(
      absl::StrCat(Name(), " has no CPU threads to set (asked for ", threads, ")"));
}

std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

Tensor Tensor::Reshaped(Shape shape) const {
  CheckOrDie(NumElements(shape) == num_elements(),
             absl::StrCat("Reshaped ", ShapeString(shape_), " to ", ShapeString(shape)));
  return Tensor(storage_, data_, std::move(shape), dtype_);
}

Tensor Tensor::LeadingRows(int64_t count) const {
  CheckOrDie(!shape_.empty() && count > 0 && count <= shape_[0],
             absl::StrCat("LeadingRows(", count, ") of ", ShapeString(shape_)));
  Shape s = shape_;
  s[0] = count;
  return Tensor(storage_, data_, std::move(s), dtype_);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options) {
  if (options.device == DeviceChoice::kCpu) return CreateCpuBackend(options);
  const int devices = CudaDeviceCount();
#ifdef TESSERA_HAVE_CUDA_BACKEND
  if (devices > 0) return CreateCudaBackend(options);
  if (options.device == DeviceChoice::kCuda) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: no usable CUDA device (", CudaUnavailableReason(), ")"));
  }
#else
  if (options.device == DeviceChoice::kCuda) {
    return absl::FailedPreconditionError(
        devices > 0
            ? "device cuda: this binary was built without the CUDA backend"
            : absl::StrCat("device cuda: no usable CUDA device (", CudaUnavailableReason(), ")"));
  }
#endif
  return CreateCpuBackend(options);
}

}  // namespace tessera::kernels
