#include "server/partition.h"

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer.h"
#include "server/memory_budget.h"
#include "server/shard_counters.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;  // NOLINT: request builders

PartitionSetup TestSetup(uint32_t workers, int64_t budget_bytes = int64_t{1} << 20) {
  PartitionSetup setup;
  setup.budget = std::make_shared<MemoryBudget>(budget_bytes);
  setup.counters = std::make_shared<ShardCounters>();
  setup.workers = workers;
  return setup;
}

kernels::OptimizerParams Sgd(float lr) {
  kernels::OptimizerParams sgd;
  sgd.kind = v1::OPTIMIZER_KIND_SGD;
  sgd.learning_rate = lr;
  return sgd;
}

// True when every partition's lock can be taken by another thread within 5 s.
bool AllReleased(const std::vector<std::shared_ptr<Partition>>& partitions) {
  auto probe = std::async(std::launch::async, [&partitions] {
    for (const std::shared_ptr<Partition>& p : partitions) absl::MutexLock lock(&p->mu);
  });
  return probe.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
}

// Two threads take the locks of overlapping sets given in opposite orders, many times: the
// address order makes that deadlock-free, each guard holds all of its locks, and releases them.
TEST(PartitionLocksTest, OverlappingSetsInAnyOrderNeverDeadlockAndAreReleased) {
  const PartitionSetup setup = TestSetup(1);
  std::vector<std::shared_ptr<Partition>> parts;
  for (uint32_t i = 0; i < 3; ++i)
    parts.push_back(Partition::Dense(Dense("w", i, 1), Sgd(1), setup, 0));
  int64_t inside = 0;  // written only while both guards' common partition (parts[1]) is locked
  auto run = [&](std::vector<Partition*> order) {
    for (int i = 0; i < 2000; ++i) {
      PartitionLocks locks(absl::InlinedVector<Partition*, 8>(order.begin(), order.end()));
      for (Partition* p : order) p->mu.AssertHeld();
      ++inside;
    }
  };
  std::thread a(run, std::vector<Partition*>{parts[0].get(), parts[1].get(), parts[2].get()});
  std::thread b(run, std::vector<Partition*>{parts[2].get(), parts[1].get()});
  a.join();
  b.join();
  EXPECT_EQ(inside, 4000);
  EXPECT_TRUE(AllReleased(parts));
}

// More partitions than the guard holds inline.
TEST(PartitionLocksTest, HoldsAnyNumberOfPartitions) {
  const PartitionSetup setup = TestSetup(1);
  std::vector<std::shared_ptr<Partition>> parts;
  absl::InlinedVector<Partition*, 8> order;
  for (uint32_t i = 0; i < 20; ++i) {
    parts.push_back(Partition::Dense(Dense("w", i, 1), Sgd(1), setup, 0));
    order.push_back(parts.back().get());
  }
  {
    PartitionLocks locks(order);
    for (Partition* p : order) p->mu.AssertHeld();
  }
  EXPECT_TRUE(AllReleased(parts));
}

TEST(PartitionTest, ExactlyOnceTableKnowsAppliedSeqsAndRefusesOlderIncarnations) {
  std::shared_ptr<Partition> p = Partition::Dense(Dense("w", 3, 1), Sgd(1), TestSetup(2), 0);
  absl::MutexLock lock(&p->mu);
  EXPECT_EQ(p->IsAppliedLocked(1, 0, 0).value_or(true), false);  // nothing applied yet
  p->RecordAppliedLocked(1, 2, 5);
  EXPECT_EQ(p->IsAppliedLocked(1, 2, 5).value_or(false), true);
  EXPECT_EQ(p->IsAppliedLocked(1, 2, 4).value_or(false), true);
  EXPECT_EQ(p->IsAppliedLocked(1, 2, 6).value_or(true), false);
  EXPECT_EQ(p->IsAppliedLocked(1, 3, 1).value_or(true), false);  // a new incarnation starts over
  EXPECT_EQ(p->IsAppliedLocked(0, 0, 9).value_or(true), false);  // another worker
  absl::StatusOr<bool> older = p->IsAppliedLocked(1, 1, 9);
  EXPECT_EQ(older.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(older.status().message(),
            "key w/3: worker 1 incarnation 1 is older than incarnation 2 already applied");
}

// An update writes in place while the partition holds the only reference to its weights, and
// writes a fresh copy (counted) while an answer or a checkpoint still holds the old one.
TEST(PartitionTest, UpdatesCopyWeightsOnlyWhileAReferenceIsHeld) {
  const PartitionSetup setup = TestSetup(1);
  std::shared_ptr<Partition> p = Partition::Dense(Dense("w", 0, 2, {1, 2}), Sgd(0.5f), setup, 0);
  const std::vector<float> g = {2, 4};
  absl::MutexLock lock(&p->mu);
  const float* before = p->weights.data();
  p->ApplyDenseLocked(0, 1.0f, g.data());
  EXPECT_EQ(p->weights.data(), before);
  EXPECT_EQ(setup.counters->weight_copies_on_write.load(), 0);
  const SharedWeights held = p->weights;
  p->ApplyDenseLocked(1, 1.0f, g.data());
  EXPECT_NE(p->weights.data(), held.data());
  EXPECT_EQ(setup.counters->weight_copies_on_write.load(), 1);
  EXPECT_EQ(std::vector<float>(held.data(), held.data() + 2), (std::vector<float>{0, 0}));
  EXPECT_EQ(std::vector<float>(p->weights.data(), p->weights.data() + 2),
            (std::vector<float>{-1, -2}));
}

// Rows come from the initializer on first touch and are charged to the budget, which gets every
// byte back when the table goes.
TEST(PartitionTest, SparseRowsAreInitialisedOnFirstTouchAndChargedToTheBudget) {
  const PartitionSetup setup = TestSetup(1, 4096);
  v1::SparseTableDecl decl;
  decl.set_name("emb");
  decl.set_dim(3);
  decl.mutable_initializer()->set_kind(v1::Initializer::KIND_CONSTANT);
  decl.mutable_initializer()->set_value(0.25f);
  std::shared_ptr<Partition> t = Partition::Table(decl, Sgd(1), setup, /*charged=*/0);
  EXPECT_EQ(t->name, "emb/0");
  SliceView two_rows;
  const std::vector<int64_t> ids = {4, 9};
  two_rows.row_ids = ids;
  EXPECT_EQ(t->NewRowsBound(two_rows), 2 * t->RowBytes());
  {
    absl::MutexLock lock(&t->mu);
    SparseGrad zero;
    zero.ids = {9};
    zero.values = {0.0f, 0.0f, 0.0f};
    t->ApplySparseLocked(0, 1.0f, zero);
    ASSERT_NE(t->rows->Find(9), nullptr);
    EXPECT_EQ(t->rows->Find(9)->values, (std::vector<float>{0.25f, 0.25f, 0.25f}));
    EXPECT_EQ(t->rows->Find(4), nullptr);
    EXPECT_EQ(t->charged.load(), t->RowBytes());
  }
  // The budget holds exactly the row: a reservation of the rest fits, one byte more does not.
  EXPECT_FALSE(setup.budget->TryReserve(4096 - t->RowBytes() + 1));
  EXPECT_TRUE(setup.budget->TryReserve(4096 - t->RowBytes()));
  setup.budget->Release(4096 - t->RowBytes());
  t.reset();
  EXPECT_TRUE(setup.budget->TryReserve(4096));
}

TEST(MemoryBudgetTest, ReservesUpToTheLimitAndNamesItWhenExhausted) {
  MemoryBudget budget(100);
  EXPECT_TRUE(budget.TryReserve(60));
  EXPECT_FALSE(budget.TryReserve(41));
  EXPECT_TRUE(budget.TryReserve(40));
  budget.Release(30);
  EXPECT_TRUE(budget.TryReserve(30));
  EXPECT_FALSE(budget.TryReserve(1));
  budget.ForceReserve(5);  // growth checked beforehand may pass the limit
  EXPECT_FALSE(budget.TryReserve(1));
  const absl::Status exhausted = budget.Exhausted("key w/0", 7);
  EXPECT_EQ(exhausted.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(exhausted.message(),
            "key w/0 needs 7 more bytes of state, but the shard already holds 105 of its "
            "max_memory_bytes 100");
  EXPECT_GT(DefaultMemoryLimit(), 0);
}

}  // namespace
}  // namespace tessera::server
