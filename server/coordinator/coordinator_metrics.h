// The coordinator's Prometheus families (issue #5), read at scrape time from
// Coordinator::MetricsSnapshot() (the coordinator's lock, briefly):
//
//   tessera_jobs{state}                  gauge  jobs by state (pending, running, succeeded, ...)
//   tessera_members{role,state}          gauge  members by role (server, worker) and state
//   tessera_job_step{job}                gauge  steps done by every worker
//   tessera_job_total_steps{job}         gauge  steps each worker will do
//   tessera_job_step_rate{job}           gauge  steps per second (0 once ended)
//   tessera_job_loss{job}                gauge  rank 0's training loss over its last interval
//   tessera_job_accuracy{job,split}      gauge  train accuracy; test accuracy once evaluated
//   tessera_job_auc{job,split="test"}    gauge  binary tasks: test ROC AUC once evaluated
//   tessera_job_rank_stall_seconds{job,rank}  gauge  RUNNING jobs: how long the step has waited
//                                                    for the rank (0: not waited for)
//
// Per-job series cover the RUNNING jobs and the newest Coordinator::kMetricsRecentJobs ended
// ones, so label sets stay bounded.
#ifndef TESSERA_SERVER_COORDINATOR_COORDINATOR_METRICS_H_
#define TESSERA_SERVER_COORDINATOR_COORDINATOR_METRICS_H_

#include <memory>

#include "common/metrics.h"
#include "prometheus/collectable.h"
#include "server/coordinator/coordinator.h"

namespace tessera::coordinator {

// The collectable behind RegisterCoordinatorMetrics. `coordinator` must outlive it. Thread-safe.
std::shared_ptr<prometheus::Collectable> NewCoordinatorCollectable(const Coordinator* coordinator);

// Adds the families above to `metrics`. `c` must outlive every scrape of `metrics` (destroy the
// Metrics first). Thread-safe.
void RegisterCoordinatorMetrics(tessera::Metrics* metrics, tessera::coordinator::Coordinator* c);

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_COORDINATOR_METRICS_H_
