// The parameter shard's Prometheus families (issue #5), read at scrape time from
// ParameterStore::GetShardStats(): the push/pull hot path only does relaxed atomic adds.
//
//   tessera_shard_jobs                           gauge      jobs held
//   tessera_shard_parked_pulls                   gauge      pulls waiting on a gate now
//   tessera_shard_fill_journals                  gauge      jobs being filled here (fill_journal.h)
//   tessera_shard_fill_journal_bytes             gauge      bytes of pushes their journals keep
//   tessera_shard_pushed_bytes_total             counter    gradient bytes applied or staged
//   tessera_shard_pulled_bytes_total             counter    weight bytes answered
//   tessera_shard_updates_applied_total          counter    optimizer applications
//   tessera_shard_duplicate_pushes_total         counter    push slices dropped as already applied
//   tessera_shard_non_finite_skipped_total       counter    push slices skipped for NaN/Inf
//   tessera_shard_weight_copies_on_write_total   counter    dense weights copied before an update
//                                                           because an answer or checkpoint held
//                                                           them
//   tessera_shard_gate_wait_seconds{consistency} histogram  how long a gated pull waited (bsp, ssp)
//   tessera_shard_ssp_staleness_steps            histogram  SSP: step - slowest live clock, per
//                                                           applied push slice
// and per sparse table, labelled {job, table} (kernels/sparse_rows.h):
//   tessera_shard_table_rows                        gauge    rows held
//   tessera_shard_table_pending_ids                 gauge    ids seen, not admitted yet
//   tessera_shard_table_rows_admitted_total         counter  rows created
//   tessera_shard_table_rows_evicted_total          counter  rows dropped idle
//   tessera_shard_table_pending_evicted_total       counter  pending ids dropped idle
//   tessera_shard_table_unadmitted_gradients_total  counter  row gradients dropped before admission
#ifndef TESSERA_SERVER_SHARD_METRICS_H_
#define TESSERA_SERVER_SHARD_METRICS_H_

#include <memory>

#include "common/metrics.h"
#include "prometheus/collectable.h"
#include "server/parameter_store.h"

namespace tessera::server {

// The collectable behind RegisterShardMetrics, for tests that read it without a Metrics.
// `store` must outlive it. Thread-safe.
std::shared_ptr<prometheus::Collectable> NewShardCollectable(const ParameterStore* store);

// Adds the families above to `metrics`. `store` must outlive every scrape of `metrics` (destroy
// the Metrics, or stop its endpoint, first). Thread-safe.
void RegisterShardMetrics(tessera::Metrics* metrics, tessera::server::ParameterStore* store);

}  // namespace tessera::server

#endif  // TESSERA_SERVER_SHARD_METRICS_H_
