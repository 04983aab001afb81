#include "worker/trainer/internal/host_all_reduce.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tessera::trainer::internal {

void HostAllReduce::Begin(int devices) {
  absl::MutexLock lock(&mu_);
  devices_ = std::max(devices, 1);
  arrived_ = 0;
  departed_ = 0;
  full_ = false;
  aborted_ = absl::OkStatus();
}

void HostAllReduce::Abort(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (aborted_.ok()) aborted_ = why.ok() ? absl::CancelledError("all-reduce abandoned") : why;
}

absl::Status HostAllReduce::Sum(absl::Span<double> values) {
  absl::MutexLock lock(&mu_);
  // The previous round's devices are still reading its total.
  mu_.Await(absl::Condition(
      +[](HostAllReduce* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return !self->full_ || !self->aborted_.ok();
      },
      this));
  if (!aborted_.ok()) return aborted_;
  if (arrived_ == 0) {
    total_.assign(values.begin(), values.end());
  } else if (total_.size() != values.size()) {
    aborted_ = absl::InternalError(absl::StrCat("all-reduce: a device brought ", values.size(),
                                                " values, another ", total_.size()));
    return aborted_;
  } else {
    for (size_t i = 0; i < values.size(); ++i) total_[i] += values[i];
  }
  if (++arrived_ == devices_) full_ = true;
  mu_.Await(absl::Condition(
      +[](HostAllReduce* self)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->full_ || !self->aborted_.ok(); },
      this));
  if (!aborted_.ok()) return aborted_;
  std::copy(total_.begin(), total_.end(), values.begin());
  if (++departed_ == devices_) {
    arrived_ = 0;
    departed_ = 0;
    full_ = false;
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer::internal
