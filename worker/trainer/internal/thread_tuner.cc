#include "worker/trainer/internal/thread_tuner.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_format.h"

namespace tessera::trainer::internal {

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

ThreadTuner::ThreadTuner(kernels::Backend* backend, int requested_threads) : backend_(backend) {
  if (backend == nullptr || requested_threads != 0 || backend->IsCuda()) return;
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;
  many_ = backend->Threads();
  if (many_ > 1) step_ = 0;
}

void ThreadTuner::BeforeStep() {
  if (!active() || step_ % kBlockSteps != 0) return;
  // A failure leaves the count as it was; the measurement then compares like with like.
  backend_->SetThreads(Candidate(step_ / kBlockSteps)).IgnoreError();
}

std::optional<std::string> ThreadTuner::AfterStep(double seconds) {
  if (!active()) return std::nullopt;
  const int block = step_ / kBlockSteps;
  if (step_ % kBlockSteps != 0) {
    (Candidate(block) == 1 ? one_seconds_ : many_seconds_).push_back(seconds);
  }
  ++step_;
  if (active()) return std::nullopt;
  const double many = Median(many_seconds_);
  const double one = Median(one_seconds_);
  const int chosen = many < 0.97 * one ? many_ : 1;
  backend_->SetThreads(chosen).IgnoreError();
  return absl::StrFormat(
      "threads: %d of %d, measured on the first %d steps: %.3f ms a step with 1 thread, %.3f ms "
      "with %d (--threads sets the count)",
      chosen, many_, kBlocks * kBlockSteps, one * 1e3, many * 1e3, many_);
}

}  // namespace tessera::trainer::internal
