// A sparse table's row lifecycle on the shard (kernels/sparse_rows.h): admission and eviction
// counted exactly through BSP steps, in the shard's statistics and metrics, and kept by a
// checkpoint so that a restored shard goes on exactly as an uninterrupted one.
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "server/checkpoint_file.h"
#include "server/parameter_store.h"
#include "server/shard_metrics.h"
#include "server/testing/store_calls.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;   // NOLINT: request builders
using namespace ::tessera::server::store_calls;  // NOLINT: store calls

// A BSP job of two workers with one table "emb" of width 2: constant 0.5 rows, SGD at lr 1,
// admitted on the second sighting, evicted after 3 idle updates.
v1::CreateJobStateRequest LifecycleJob(const std::string& id, int64_t checkpoint_every = 0) {
  v1::JobConfig config = Config(v1::CONSISTENCY_BSP, 2, 1.0f);
  config.set_checkpoint_every_steps(checkpoint_every);
  v1::CreateJobStateRequest r = JobRequest(id, config);
  v1::SparseTableDecl* t = r.add_tables();
  *t = Table("emb", 2, v1::Initializer::KIND_CONSTANT, 0);
  t->mutable_initializer()->set_value(0.5f);
  t->mutable_lifecycle()->set_admit_after(2);
  t->mutable_lifecycle()->set_evict_after(3);
  return r;
}

// Step `step` of a fixed script: worker w pushes `rows[w]`, each row's gradient 0.25.
void PushStep(ParameterStore& store, const std::string& job, int64_t step, uint64_t incarnation,
              const std::vector<std::vector<int64_t>>& rows) {
  for (uint32_t w = 0; w < 2; ++w) {
    const std::vector<float> g(rows[w].size() * 2, 0.25f);
    auto pushed = store.Push(Request(job, w, incarnation, step, static_cast<uint64_t>(step + 1),
                                     {RowsSlice("emb", rows[w], g)}));
    ASSERT_TRUE(pushed.ok()) << "step " << step << " worker " << w << ": " << pushed.status();
  }
}

// The script: ids 1, 2, 3 first seen at step 0 (pending); 1 and 2 admitted at step 1; from step
// 2 on only 1 is touched, so that the check at clock 6 evicts row 2 (last updated at clock 2)
// and the pending id 3 (last seen at clock 1). 8 steps.
std::vector<std::vector<int64_t>> ScriptStep(int64_t step) {
  if (step == 0) return {{1, 2}, {1, 3}};
  if (step == 1) return {{1}, {2}};
  return {{1}, {}};
}

TableStats OnlyTable(const ParameterStore& store) {
  const ShardStats s = store.GetShardStats();
  EXPECT_EQ(s.tables.size(), 1u);
  return s.tables.empty() ? TableStats{} : s.tables[0];
}

TEST(RowLifecycleStoreTest, BspCountsAreExactAndIdsNotAdmittedReadAsZeros) {
  ParameterStore store;
  ASSERT_TRUE(store.CreateJobState(LifecycleJob("j")).ok());
  PushStep(store, "j", 0, 1, ScriptStep(0));
  // Clock 1: 1, 2 and 3 seen once, merged over both workers: pending, zeros, no row.
  EXPECT_EQ(PullRows(store, "j", "emb", {1, 2, 3}), std::vector<float>(6, 0.0f));
  TableStats t = OnlyTable(store);
  EXPECT_EQ(t.job_id, "j");
  EXPECT_EQ(t.table, "emb");
  EXPECT_EQ(t.rows, 0);
  EXPECT_EQ(t.pending, 3);
  EXPECT_EQ(t.dropped_gradients, 3);
  PushStep(store, "j", 1, 1, ScriptStep(1));
  // Clock 2: 1 and 2 admitted with this step's gradient (0.25, averaged over 2 workers: 0.125).
  EXPECT_EQ(PullRows(store, "j", "emb", {1, 2, 3}),
            (std::vector<float>{0.375f, 0.375f, 0.375f, 0.375f, 0.0f, 0.0f}));
  t = OnlyTable(store);
  EXPECT_EQ(t.rows, 2);
  EXPECT_EQ(t.pending, 1);
  EXPECT_EQ(t.admitted, 2);
  for (int64_t s = 2; s < 5; ++s) PushStep(store, "j", s, 1, ScriptStep(s));
  // Clock 5: the check at 3 dropped nothing (row 2 idle 1, id 3 idle 2).
  EXPECT_EQ(OnlyTable(store).evicted, 0);
  PushStep(store, "j", 5, 1, ScriptStep(5));
  // Clock 6: row 2 (idle 4) and id 3 (idle 5) go; row 1 was updated at every clock since 2.
  t = OnlyTable(store);
  EXPECT_EQ(t.rows, 1);
  EXPECT_EQ(t.pending, 0);
  EXPECT_EQ(t.evicted, 1);
  EXPECT_EQ(t.pending_evicted, 1);
  EXPECT_EQ(t.admitted, 2);
  EXPECT_EQ(t.dropped_gradients, 3);
  // Row 1: 0.5 - 5 updates of 0.125. Row 2 is gone: pending again, read as zeros.
  EXPECT_EQ(PullRows(store, "j", "emb", {1, 2}), (std::vector<float>{-0.125f, -0.125f, 0, 0}));

  // The same counts in the shard's metrics, labelled by job and table.
  auto families = NewShardCollectable(&store)->Collect();
  auto value = [&](const std::string& name) {
    for (const prometheus::MetricFamily& f : families) {
      if (f.name != name) continue;
      EXPECT_EQ(f.metric.size(), 1u) << name;
      if (f.metric.empty()) return -1.0;
      const prometheus::ClientMetric& m = f.metric[0];
      EXPECT_EQ(m.label.size(), 2u);
      if (m.label.size() == 2) {
        EXPECT_EQ(m.label[0].value, "j");
        EXPECT_EQ(m.label[1].value, "emb");
      }
      return f.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    }
    ADD_FAILURE() << "no family " << name;
    return -1.0;
  };
  EXPECT_EQ(value("tessera_shard_table_rows"), 1);
  EXPECT_EQ(value("tessera_shard_table_pending_ids"), 0);
  EXPECT_EQ(value("tessera_shard_table_rows_admitted_total"), 2);
  EXPECT_EQ(value("tessera_shard_table_rows_evicted_total"), 1);
  EXPECT_EQ(value("tessera_shard_table_pending_evicted_total"), 1);
  EXPECT_EQ(value("tessera_shard_table_unadmitted_gradients_total"), 3);
}

TEST(RowLifecycleStoreTest, ACheckpointKeepsRowsPendingIdsAndCountsAndTheReplayIsExact) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(LifecycleJob("k")).ok());
  // Checkpoint at boundary 4: row 1 and 2 held, id 3 pending, one check (clock 3) done.
  v1::CheckpointRequest ask;
  ask.set_job_id("k");
  ask.set_step(4);
  absl::Notification written;
  absl::StatusOr<v1::CheckpointResponse> response = absl::UnknownError("unanswered");
  store.Checkpoint(ask, [&](absl::StatusOr<v1::CheckpointResponse> r) {
    response = std::move(r);
    written.Notify();
  });
  for (int64_t s = 0; s < 8; ++s) PushStep(store, "k", s, 1, ScriptStep(s));
  ASSERT_TRUE(written.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(response.ok()) << response.status();
  const TableStats uninterrupted = OnlyTable(store);
  const std::vector<float> rows = PullRows(store, "k", "emb", {1, 2, 3});
  EXPECT_EQ(uninterrupted.evicted, 1);

  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(response->path());
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->header.partitions_size(), 1);
  const v1::PartitionCheckpoint& pc = file->header.partitions(0);
  EXPECT_EQ(pc.num_rows(), 2u);
  EXPECT_EQ(pc.num_pending(), 1u);
  EXPECT_EQ(pc.row_counts().admitted(), 2);
  EXPECT_EQ(pc.row_counts().dropped_gradients(), 3);
  EXPECT_EQ(pc.row_counts().last_sweep_clock(), 3);
  EXPECT_EQ(pc.table().lifecycle().admit_after(), 2u);

  v1::RestoreRequest restore;
  restore.set_job_id("k");
  restore.set_step(4);
  restore.set_min_incarnation(2);
  ASSERT_TRUE(store.Restore(restore).ok());
  TableStats t = OnlyTable(store);
  EXPECT_EQ(t.rows, 2);
  EXPECT_EQ(t.pending, 1);
  EXPECT_EQ(t.evicted, 0);
  for (int64_t s = 4; s < 8; ++s) PushStep(store, "k", s, 2, ScriptStep(s));
  t = OnlyTable(store);
  EXPECT_EQ(t.rows, uninterrupted.rows);
  EXPECT_EQ(t.pending, uninterrupted.pending);
  EXPECT_EQ(t.admitted, uninterrupted.admitted);
  EXPECT_EQ(t.evicted, uninterrupted.evicted);
  EXPECT_EQ(t.pending_evicted, uninterrupted.pending_evicted);
  EXPECT_EQ(t.dropped_gradients, uninterrupted.dropped_gradients);
  EXPECT_EQ(PullRows(store, "k", "emb", {1, 2, 3}), rows);
}

TEST(RowLifecycleStoreTest, BadLifecyclesAreRefusedByField) {
  ParameterStore store;
  v1::CreateJobStateRequest r = LifecycleJob("bad");
  r.mutable_tables(0)->mutable_lifecycle()->set_evict_after(-5);
  absl::Status s = store.CreateJobState(r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tables[0].lifecycle.evict_after"));
  EXPECT_THAT(s.message(), HasSubstr("table emb"));
  r.mutable_tables(0)->mutable_lifecycle()->set_evict_after(0);
  r.mutable_tables(0)->mutable_lifecycle()->set_admit_after(1u << 30);
  s = store.CreateJobState(r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tables[0].lifecycle.admit_after"));
  // The shard still serves: the job as declared is accepted.
  EXPECT_TRUE(store.CreateJobState(LifecycleJob("bad")).ok());
}

}  // namespace
}  // namespace tessera::server
