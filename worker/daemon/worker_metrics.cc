#include "worker/daemon/worker_metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "prometheus/metric_family.h"

namespace tessera::worker {
namespace {

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

prometheus::ClientMetric Value(prometheus::MetricType type, double value,
                               std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return metric;
}

class WorkerCollectable final : public prometheus::Collectable {
 public:
  explicit WorkerCollectable(const WorkerDaemon* daemon) : daemon_(daemon) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const WorkerDaemon::Stats stats = daemon_->stats();
    constexpr auto kCounter = prometheus::MetricType::Counter;
    constexpr auto kGauge = prometheus::MetricType::Gauge;
    std::vector<prometheus::MetricFamily> out;
    out.push_back(Family("tessera_worker_steps_total",
                         "Training steps this worker process has completed, every task together",
                         kCounter));
    out.back().metric.push_back(Value(kCounter, static_cast<double>(stats.steps_total)));
    out.push_back(Family("tessera_worker_busy", "1 while a task is in hand", kGauge));
    out.back().metric.push_back(Value(kGauge, stats.busy ? 1 : 0));
    if (!stats.busy) return out;
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"job", stats.job_id}, {"rank", std::to_string(stats.rank)}};
    out.push_back(Family("tessera_worker_task_step", "The step of the task in hand", kGauge));
    out.back().metric.push_back(Value(kGauge, static_cast<double>(stats.step), labels));
    out.push_back(Family("tessera_worker_samples_per_second",
                         "Samples per second of the task in hand at its last progress report",
                         kGauge));
    out.back().metric.push_back(Value(kGauge, stats.samples_per_second, labels));
    out.push_back(Family("tessera_worker_loss",
                         "Mean training loss of the task in hand at its last progress report",
                         kGauge));
    out.back().metric.push_back(Value(kGauge, stats.loss, labels));
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
