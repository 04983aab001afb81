#include "worker/daemon/worker_metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "prometheus/metric_family.h"

namespace tessera::worker {
namespace {

class WorkerCollectable final : public prometheus::Collectable {
 public:
  explicit WorkerCollectable(const WorkerDaemon* daemon) : daemon_(daemon) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const WorkerDaemon::Stats stats = daemon_->stats();
    constexpr auto kCounter = prometheus::MetricType::Counter;
    constexpr auto kGauge = prometheus::MetricType::Gauge;
    std::vector<prometheus::MetricFamily> out;
    out.push_back(MetricFamilyOf(
        "tessera_worker_steps_total",
        "Training steps this worker process has completed, every task together", kCounter));
    AddSample(&out.back(), static_cast<double>(stats.steps_total));
    out.push_back(MetricFamilyOf("tessera_worker_busy", "1 while a task is in hand", kGauge));
    AddSample(&out.back(), stats.busy ? 1 : 0);
    if (!stats.busy) return out;
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"job", stats.job_id}, {"rank", std::to_string(stats.rank)}};
    out.push_back(
        MetricFamilyOf("tessera_worker_task_step", "The step of the task in hand", kGauge));
    AddSample(&out.back(), static_cast<double>(stats.step), labels);
    out.push_back(MetricFamilyOf(
        "tessera_worker_samples_per_second",
        "Samples per second of the task in hand at its last progress report", kGauge));
    AddSample(&out.back(), stats.samples_per_second, labels);
    out.push_back(MetricFamilyOf(
        "tessera_worker_loss", "Mean training loss of the task in hand at its last progress report",
        kGauge));
    AddSample(&out.back(), stats.loss, labels);
    return out;
  }

 private:
  const WorkerDaemon* const daemon_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> NewWorkerCollectable(const WorkerDaemon* daemon) {
  return std::make_shared<WorkerCollectable>(daemon);
}

}  // namespace tessera::worker
