#include "server/shard_metrics.h"

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"

namespace tessera::server {
namespace {

prometheus::MetricFamily Scalar(const char* name, const char* help, prometheus::MetricType type,
                                int64_t value) {
  prometheus::MetricFamily family = MetricFamilyOf(name, help, type);
  AddSample(&family, static_cast<double>(value));
  return family;
}

// A StoreHistogram snapshot as a Prometheus histogram, values multiplied by `scale`.
prometheus::ClientMetric Histogram(const StoreHistogram::Snapshot& snapshot, double scale,
                                   std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < snapshot.bounds.size(); ++i) {
    cumulative += snapshot.counts[i];
    prometheus::ClientMetric::Bucket bucket;
    bucket.upper_bound = static_cast<double>(snapshot.bounds[i]) * scale;
    bucket.cumulative_count = cumulative;
    metric.histogram.bucket.push_back(bucket);
  }
  cumulative += snapshot.counts.back();
  prometheus::ClientMetric::Bucket inf;
  inf.upper_bound = std::numeric_limits<double>::infinity();
  inf.cumulative_count = cumulative;
  metric.histogram.bucket.push_back(inf);
  // The buckets and the count are read one after the other while pushes go on: report the
  // buckets' total, so that the +Inf bucket always equals the count.
  metric.histogram.sample_count = cumulative;
  metric.histogram.sample_sum = static_cast<double>(snapshot.sum) * scale;
  return metric;
}

// Per sparse table, labelled {job, table}: its rows and what its lifecycle did.
void AddTableFamilies(const std::vector<TableStats>& tables,
                      std::vector<prometheus::MetricFamily>* out) {
  using prometheus::MetricType;
  struct Family {
    const char* name;
    const char* help;
    MetricType type;
    int64_t TableStats::*value;
  };
  const Family families[] = {
      {"tessera_shard_table_rows", "Rows a sparse table holds on this shard.", MetricType::Gauge,
       &TableStats::rows},
      {"tessera_shard_table_pending_ids",
       "Ids of a sparse table seen but not admitted yet (lifecycle.admit_after).",
       MetricType::Gauge, &TableStats::pending},
      {"tessera_shard_table_rows_admitted_total", "Rows of a sparse table created.",
       MetricType::Counter, &TableStats::admitted},
      {"tessera_shard_table_rows_evicted_total",
       "Rows of a sparse table dropped after lifecycle.evict_after idle updates.",
       MetricType::Counter, &TableStats::evicted},
      {"tessera_shard_table_pending_evicted_total",
       "Pending ids of a sparse table dropped idle before admission.", MetricType::Counter,
       &TableStats::pending_evicted},
      {"tessera_shard_table_unadmitted_gradients_total",
       "Row gradients dropped because their id was not admitted yet.", MetricType::Counter,
       &TableStats::dropped_gradients},
  };
  for (const Family& f : families) {
    prometheus::MetricFamily family = MetricFamilyOf(f.name, f.help, f.type);
    for (const TableStats& t : tables) {
      AddSample(&family, static_cast<double>(t.*f.value), {{"job", t.job_id}, {"table", t.table}});
    }
    out->push_back(std::move(family));
  }
}

class ShardCollectable final : public prometheus::Collectable {
 public:
  explicit ShardCollectable(const ParameterStore* store) : store_(store) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const ShardStats s = store_->GetShardStats();
    std::vector<prometheus::MetricFamily> out;
    out.push_back(Scalar("tessera_shard_jobs", "Jobs whose state this shard holds.",
                         MetricType::Gauge, s.jobs));
    out.push_back(Scalar("tessera_shard_parked_pulls", "Pulls waiting on a consistency gate now.",
                         MetricType::Gauge, s.parked_pulls));
    out.push_back(Scalar("tessera_shard_fill_journals",
                         "Jobs being filled here whose pushes a journal keeps until the fill is "
                         "installed and caught up.",
                         MetricType::Gauge, s.fill_journals));
    out.push_back(Scalar("tessera_shard_fill_journal_bytes",
                         "Bytes of pushes the fill journals keep now.", MetricType::Gauge,
                         s.fill_journal_bytes));
    out.push_back(Scalar("tessera_shard_pushed_bytes_total",
                         "Gradient bytes of pushes applied or staged (duplicates excluded).",
                         MetricType::Counter, s.bytes_pushed));
    out.push_back(Scalar("tessera_shard_pulled_bytes_total", "Weight bytes answered to pulls.",
                         MetricType::Counter, s.bytes_pulled));
    out.push_back(Scalar("tessera_shard_updates_applied_total",
                         "Optimizer updates applied to partitions and tables.", MetricType::Counter,
                         s.updates_applied));
    out.push_back(Scalar("tessera_shard_duplicate_pushes_total",
                         "Push slices acknowledged as already applied and dropped (exactly-once).",
                         MetricType::Counter, s.duplicates));
    out.push_back(Scalar("tessera_shard_non_finite_skipped_total",
                         "Push slices skipped for NaN or Inf values (non_finite_policy SKIP).",
                         MetricType::Counter, s.skipped_non_finite));
    out.push_back(Scalar("tessera_shard_weight_copies_on_write_total",
                         "Dense partitions whose weights were copied before an update because an "
                         "answer still being sent or a checkpoint held them.",
                         MetricType::Counter, s.weight_copies_on_write));
    prometheus::MetricFamily wait =
        MetricFamilyOf("tessera_shard_gate_wait_seconds",
                       "Seconds a gated pull waited at its job's consistency gate (BSP: the step's "
                       "update; SSP: the slowest worker).",
                       MetricType::Histogram);
    wait.metric.push_back(Histogram(s.bsp_wait_ns, 1e-9, {{"consistency", "bsp"}}));
    wait.metric.push_back(Histogram(s.ssp_wait_ns, 1e-9, {{"consistency", "ssp"}}));
    out.push_back(std::move(wait));
    prometheus::MetricFamily staleness =
        MetricFamilyOf("tessera_shard_ssp_staleness_steps",
                       "SSP: steps between a push and the slowest live worker's clock, per applied "
                       "push slice.",
                       MetricType::Histogram);
    staleness.metric.push_back(Histogram(s.ssp_staleness, 1, {}));
    out.push_back(std::move(staleness));
    AddTableFamilies(s.tables, &out);
    return out;
  }

 private:
  const ParameterStore* const store_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> NewShardCollectable(const ParameterStore* store) {
  return std::make_shared<ShardCollectable>(store);
}

void RegisterShardMetrics(tessera::Metrics* metrics, tessera::server::ParameterStore* store) {
  metrics->AddCollectable(NewShardCollectable(store));
}

}  // namespace tessera::server
