// The worker daemon's own Prometheus families (besides the process and RPC ones every daemon has,
// common/metrics.h), read from WorkerDaemon::stats() at scrape time:
//   tessera_worker_steps_total                  counter: training steps this process completed
//   tessera_worker_busy                         gauge: 1 while a task is in hand
//   tessera_worker_task_step{job,rank}          gauge: the task's step (only while busy)
//   tessera_worker_samples_per_second{job,rank} gauge: its throughput at the last report
//   tessera_worker_loss{job,rank}               gauge: its mean training loss at the last report
#ifndef TESSERA_WORKER_DAEMON_WORKER_METRICS_H_
#define TESSERA_WORKER_DAEMON_WORKER_METRICS_H_

#include <memory>

#include "prometheus/collectable.h"
#include "worker/daemon/worker_daemon.h"

namespace tessera::worker {

// A collectable over `daemon`, which must outlive it (and the Metrics it is added to).
std::shared_ptr<prometheus::Collectable> NewWorkerCollectable(const WorkerDaemon* daemon);

}  // namespace tessera::worker

#endif  // TESSERA_WORKER_DAEMON_WORKER_METRICS_H_
