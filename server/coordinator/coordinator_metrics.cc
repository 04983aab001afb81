#include "server/coordinator/coordinator_metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "common/metrics.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"

namespace tessera::coordinator {
namespace {

// "JOB_STATE_RUNNING" -> "running".
std::string Lower(const std::string& name, const std::string& prefix) {
  std::string out = name.compare(0, prefix.size(), prefix) == 0 ? name.substr(prefix.size()) : name;
  absl::AsciiStrToLower(&out);
  return out;
}

prometheus::MetricFamily Gauges(const char* name, const char* help) {
  return MetricFamilyOf(name, help, prometheus::MetricType::Gauge);
}

void Add(prometheus::MetricFamily* family, std::vector<prometheus::ClientMetric::Label> labels,
         double value) {
  AddSample(family, value, std::move(labels));
}

class CoordinatorCollectable final : public prometheus::Collectable {
 public:
  explicit CoordinatorCollectable(const Coordinator* coordinator) : coordinator_(coordinator) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const CoordinatorMetricsSnapshot s = coordinator_->MetricsSnapshot();
    prometheus::MetricFamily jobs = Gauges("tessera_jobs", "Jobs by state.");
    for (const auto& [state, n] : s.jobs) {
      Add(&jobs, {{"state", Lower(v1::JobState_Name(state), "JOB_STATE_")}},
          static_cast<double>(n));
    }
    prometheus::MetricFamily members =
        Gauges("tessera_members", "Registered members by role (server, worker) and state.");
    for (const auto& [key, n] : s.members) {
      Add(&members,
          {{"role", Lower(v1::MemberRole_Name(key.first), "MEMBER_ROLE_")},
           {"state", Lower(v1::MemberState_Name(key.second), "MEMBER_STATE_")}},
          static_cast<double>(n));
    }
    prometheus::MetricFamily step = Gauges("tessera_job_step", "Steps done by every worker.");
    prometheus::MetricFamily total =
        Gauges("tessera_job_total_steps", "Steps each worker of the job will do.");
    prometheus::MetricFamily rate =
        Gauges("tessera_job_step_rate", "Training steps per second of the job (0 once ended).");
    prometheus::MetricFamily loss =
        Gauges("tessera_job_loss", "Training loss over rank 0's last reporting interval.");
    prometheus::MetricFamily accuracy =
        Gauges("tessera_job_accuracy",
               "Accuracy: split=train over the last interval, split=test at "
               "the last evaluation.");
    prometheus::MetricFamily auc = Gauges(
        "tessera_job_auc", "Binary tasks: the ROC AUC of the test split at the last evaluation.");
    prometheus::MetricFamily checkpoint = Gauges(
        "tessera_job_checkpoint_step", "Step of the job's newest committed checkpoint (0: none).");
    prometheus::MetricFamily recoveries =
        MetricFamilyOf("tessera_job_recoveries_total",
                       "Times the job was rewound to a checkpoint after a shard was lost.",
                       prometheus::MetricType::Counter);
    prometheus::MetricFamily stalled = Gauges(
        "tessera_job_rank_stall_seconds",
        "How long the job's current step has waited for the rank to push it (0: not waited for).");
    for (const CoordinatorMetricsSnapshot::JobProgress& p : s.progress) {
      const prometheus::ClientMetric::Label job{"job", p.job_id};
      for (size_t rank = 0; rank < p.rank_stalled_seconds.size(); ++rank) {
        Add(&stalled, {job, {"rank", std::to_string(rank)}}, p.rank_stalled_seconds[rank]);
      }
      Add(&checkpoint, {job}, static_cast<double>(p.checkpoint_step));
      AddSample(&recoveries, static_cast<double>(p.recoveries), {job});
      Add(&step, {job}, static_cast<double>(p.step));
      Add(&total, {job}, static_cast<double>(p.total_steps));
      Add(&rate, {job}, p.step_rate);
      Add(&loss, {job}, p.loss);
      Add(&accuracy, {job, {"split", "train"}}, p.train_accuracy);
      if (p.evaluated) Add(&accuracy, {job, {"split", "test"}}, p.test_accuracy);
      if (p.test_auc.has_value()) Add(&auc, {job, {"split", "test"}}, *p.test_auc);
    }
    std::vector<prometheus::MetricFamily> out;
    out.push_back(std::move(jobs));
    out.push_back(std::move(members));
    for (prometheus::MetricFamily* f :
         {&step, &total, &rate, &loss, &accuracy, &auc, &checkpoint, &recoveries, &stalled}) {
      if (!f->metric.empty()) out.push_back(std::move(*f));
    }
    return out;
  }

 private:
  const Coordinator* const coordinator_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> NewCoordinatorCollectable(const Coordinator* coordinator) {
  return std::make_shared<CoordinatorCollectable>(coordinator);
}

void RegisterCoordinatorMetrics(tessera::Metrics* metrics, tessera::coordinator::Coordinator* c) {
  metrics->AddCollectable(NewCoordinatorCollectable(c));
}

}  // namespace tessera::coordinator
