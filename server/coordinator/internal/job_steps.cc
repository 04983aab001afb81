#include "server/coordinator/internal/job_steps.h"

#include <algorithm>
#include <cmath>

namespace tessera::coordinator::internal {

int64_t MaxRankStep(const v1::Job& job) {
  int64_t max_step = 0;
  for (const v1::JobWorker& worker : job.workers()) {
    if (!worker.lost()) max_step = std::max(max_step, worker.step());
  }
  return max_step;
}

int64_t StepMargin(const v1::Job& job, int attempt) {
  int live = 0;
  for (const v1::JobWorker& worker : job.workers()) live += worker.lost() ? 0 : 1;
  const double per_step = static_cast<double>(job.spec().batch_size()) * std::max(1, live);
  const double rate = per_step > 0 ? job.samples_per_second() / per_step : 0;  // steps/s a rank
  // One second of steps: the reports trail the workers by at most one progress interval
  // (0.5 s). Doubled after each attempt that came too late.
  int64_t margin = std::max<int64_t>(10, static_cast<int64_t>(std::ceil(rate)));
  for (int i = 0; i < attempt && margin < (int64_t{1} << 40); ++i) margin *= 2;
  if (job.total_steps() > 0) margin = std::min(margin, job.total_steps());
  return margin;
}

uint64_t NextIncarnation(const v1::Job& job, int64_t now_ms) {
  uint64_t next = static_cast<uint64_t>(now_ms) * 1024;
  next = std::max(next, static_cast<uint64_t>(job.start_time_ms()) * 1024 +
                            static_cast<uint64_t>(job.workers_size()));
  for (const v1::JobWorker& worker : job.workers()) {
    next = std::max(next, worker.incarnation() + 1);
  }
  return next;
}

v1::DataPosition PositionAt(const v1::Job& job, int64_t step) {
  // The trainer derives the pass itself (it knows its split's size) and checks the rest.
  v1::DataPosition position;
  const int64_t spe = job.steps_per_epoch();
  position.set_epoch(spe > 0 ? static_cast<int32_t>(step / spe) : 0);
  position.set_batch_offset(spe > 0 ? step % spe : step);
  position.set_pass(0);
  position.set_seed(job.spec().seed());
  return position;
}

size_t KeepCheckpoints(const v1::JobSpec& spec) {
  return spec.keep_checkpoints() > 0 ? static_cast<size_t>(spec.keep_checkpoints()) : 3;
}

}  // namespace tessera::coordinator::internal
