#include "server/consistency_gate.h"

#include <algorithm>
#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "server/partition.h"
#include "server/shard_counters.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;  // NOLINT: request builders

// --- The gate alone ---------------------------------------------------------------------------

TEST(ConsistencyGateTest, MembershipTakesEffectAtItsStep) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 4);
  EXPECT_EQ(gate.NumLive(0), 4u);
  ASSERT_TRUE(gate.UpdateMembership({0, 1, 3}, 5).ok());
  EXPECT_EQ(gate.NumLive(4), 4u);
  EXPECT_EQ(gate.NumLive(5), 3u);
  EXPECT_FALSE(gate.IsLive(2, 7));
  EXPECT_TRUE(gate.IsLive(2, 4));
  // A later change from an earlier step replaces the history from there on.
  ASSERT_TRUE(gate.UpdateMembership({2}, 3).ok());
  EXPECT_EQ(gate.NumLive(2), 4u);
  EXPECT_EQ(gate.NumLive(9), 1u);
  EXPECT_EQ(gate.UpdateMembership({4}, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gate.UpdateMembership({}, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gate.UpdateMembership({0}, -1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConsistencyGateTest, SspWaitOpensWhenSlowestClockCatchesUp) {
  ConsistencyGate gate(v1::CONSISTENCY_SSP, 1, 2);
  auto clocks = std::make_shared<WorkerClocks>(2);
  (*clocks)[0] = 2;  // worker 0 completed steps 0 and 1, worker 1 none
  EXPECT_EQ(gate.SlowestClock(*clocks, 2), 0);
  bool opened = false;
  ConsistencyGate::Wait wait;
  wait.clocks.emplace_back(clocks, 2);  // a pull for step 2 needs slowest >= 1
  wait.done = [&](absl::Status s) {
    EXPECT_TRUE(s.ok());
    opened = true;
  };
  gate.Park(std::move(wait));
  gate.Notify();
  EXPECT_FALSE(opened);
  EXPECT_EQ(gate.NumParked(), 1u);
  (*clocks)[1] = 1;
  gate.Notify();
  EXPECT_TRUE(opened);
  EXPECT_EQ(gate.MaxStalenessServed(), 1);
  EXPECT_THAT(gate.CheckSspPushStep("w/0", *clocks, 4).message(), HasSubstr("step 4"));
  EXPECT_TRUE(gate.CheckSspPushStep("w/0", *clocks, 3).ok());
}

// A worker that joins at step 5 counts as having completed 5 steps; one that stays live keeps
// its own clock.
TEST(ConsistencyGateTest, JoiningWorkerDoesNotHoldSspBack) {
  ConsistencyGate gate(v1::CONSISTENCY_SSP, 0, 3);
  WorkerClocks clocks(3);
  clocks[0] = 6;
  clocks[1] = 4;
  ASSERT_TRUE(gate.UpdateMembership({0, 1}, 0).ok());
  EXPECT_EQ(gate.SlowestClock(clocks, 5), 4);
  ASSERT_TRUE(gate.UpdateMembership({0, 1, 2}, 5).ok());
  EXPECT_EQ(gate.SlowestClock(clocks, 5), 4);  // worker 2 counts from 5, worker 1 is at 4
  clocks[1] = 7;
  EXPECT_EQ(gate.SlowestClock(clocks, 5), 5);
}

TEST(ConsistencyGateTest, CloseFailsParkedAndLaterWaits) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 1);
  auto version = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<absl::Status> results;
  for (int i = 0; i < 2; ++i) {
    ConsistencyGate::Wait wait;
    wait.versions.emplace_back(version, 1);
    wait.done = [&](absl::Status s) { results.push_back(s); };
    if (i == 1) gate.Close(absl::AbortedError("dropped"));
    gate.Park(std::move(wait));
  }
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kAborted);
  EXPECT_EQ(results[1].code(), absl::StatusCode::kAborted);
}

// A pull whose call is cancelled while it waits for a step that never comes must not stay parked
// forever: repeated retries of such a pull would pile up without bound.
TEST(ConsistencyGateTest, CancelledWaitsAreDroppedWithoutTheGateOpening) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 1);
  auto version = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<absl::Status> results;
  auto park = [&](std::shared_ptr<std::atomic<bool>> cancelled) {
    ConsistencyGate::Wait wait;
    wait.versions.emplace_back(version, 1000);
    wait.done = [&](absl::Status s) { results.push_back(s); };
    wait.cancelled = std::move(cancelled);
    gate.Park(std::move(wait));
  };
  auto first = std::make_shared<std::atomic<bool>>(false);
  park(first);
  first->store(true);
  gate.Notify();
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(gate.NumParked(), 0u);
  // Without any Notify: 10000 waits parked and cancelled one after another stay bounded.
  for (int i = 0; i < 10000; ++i) {
    auto cancelled = std::make_shared<std::atomic<bool>>(false);
    park(cancelled);
    cancelled->store(true);
  }
  EXPECT_LE(gate.NumParked(), 128u);
  EXPECT_GE(results.size(), 10001u - 128u);
  // A wait that is not cancelled stays parked through the sweeps and opens normally.
  results.clear();
  park(nullptr);
  for (int i = 0; i < 1000; ++i) {
    auto cancelled = std::make_shared<std::atomic<bool>>(true);
    park(cancelled);  // already cancelled: answered at once
  }
  EXPECT_EQ(results.size(), 1000u);
  version->store(1000);
  gate.Notify();
  EXPECT_EQ(gate.NumParked(), 0u);
  EXPECT_EQ(
      std::count_if(results.begin(), results.end(), [](const absl::Status& s) { return s.ok(); }),
      1);
  EXPECT_TRUE(results.back().ok());
}

// --- The gate's push policy on one partition ------------------------------------------------

// One dense partition of `n` values under SGD with learning rate 1, for `workers` workers.
std::shared_ptr<Partition> SgdPartition(uint32_t workers, int64_t n) {
  PartitionSetup setup;
  setup.budget = std::make_shared<MemoryBudget>(int64_t{1} << 20);
  setup.counters = std::make_shared<ShardCounters>();
  setup.workers = workers;
  kernels::OptimizerParams sgd;
  sgd.kind = v1::OPTIMIZER_KIND_SGD;
  sgd.learning_rate = 1.0f;
  return Partition::Dense(Dense("w", 0, n), sgd, setup, /*charged=*/0);
}

// Admits and applies one fp32 push of `worker` for `step` to p through the gate, as the store
// does; the admission must be OK.
ConsistencyGate::Applied PushThroughGate(ConsistencyGate& gate, const std::shared_ptr<Partition>& p,
                                         uint32_t worker, int64_t step,
                                         const std::vector<float>& g) {
  const std::string bytes = Fp32Bytes(g);
  SliceView view;
  view.tensor = "w";
  view.encoding = v1::ENCODING_FP32;
  view.data = bytes;
  PushPullView request;
  request.worker_id = worker;
  request.incarnation = 1;
  request.step = step;
  request.seq = static_cast<uint64_t>(step) + 1;
  PushSlice item;
  item.slice = &view;
  item.partition = p;
  item.data_size = bytes.size();
  std::vector<float> scratch;
  absl::MutexLock lock(&p->mu);
  absl::StatusOr<bool> staged = gate.AdmitLocked(*p, worker, step);
  EXPECT_TRUE(staged.ok()) << staged.status();
  EXPECT_FALSE(staged.value_or(true));
  item.staging_bytes = gate.StagingBytesLocked(*p, worker, view);
  item.partition->mu.AssertHeld();
  return gate.ApplyPushLocked(request, gate.PushScale(*p, step), item, &scratch);
}

std::vector<float> WeightsOf(const Partition& p) {
  absl::ReaderMutexLock lock(&p.mu);
  return std::vector<float>(p.weights.data(), p.weights.data() + p.weights.size());
}

// BSP stages each push and applies once, when the last live worker pushed: sum / contributors,
// whatever the arrival order; the version then moves to the next step.
TEST(ConsistencyGateTest, BspStagesUntilEveryLiveWorkerPushedThenAppliesTheMeanOnce) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 4);
  std::shared_ptr<Partition> p = SgdPartition(4, 2);
  EXPECT_EQ(gate.PushScale(*p, 0), 1.0f);
  const std::vector<std::vector<float>> grads = {{1, 2}, {3, 4}, {5, 6}, {7, 12}};
  for (uint32_t worker : {3u, 0u, 2u}) {
    const ConsistencyGate::Applied staged = PushThroughGate(gate, p, worker, 0, grads[worker]);
    EXPECT_FALSE(staged.version_changed);
    EXPECT_FALSE(staged.updated);
    EXPECT_FALSE(staged.boundary_moved);
  }
  {
    absl::MutexLock lock(&p->mu);
    EXPECT_EQ(p->staging.contributors, 3u);
    EXPECT_EQ(p->clocks[3].load(), 1);
    EXPECT_EQ(gate.BoundaryClockLocked(*p, 3), 0);  // staged, but the boundary is still step 0
    // A staged buffer is kept for later steps: only a worker's first push needs new bytes.
    EXPECT_EQ(gate.StagingBytesLocked(*p, 3, SliceView()), 0);
    EXPECT_EQ(gate.StagingBytesLocked(*p, 1, SliceView()), 8);
  }
  EXPECT_EQ(p->version.load(), 0);
  EXPECT_EQ(WeightsOf(*p), (std::vector<float>{0, 0}));
  const ConsistencyGate::Applied last = PushThroughGate(gate, p, 1, 0, grads[1]);
  EXPECT_TRUE(last.version_changed);
  EXPECT_TRUE(last.updated);
  EXPECT_TRUE(last.boundary_moved);
  EXPECT_EQ(p->version.load(), 1);
  // (1 + 3 + 5 + 7) / 4 = 4 and (2 + 4 + 6 + 12) / 4 = 6, learning rate 1.
  EXPECT_EQ(WeightsOf(*p), (std::vector<float>{-4, -6}));
  absl::MutexLock lock(&p->mu);
  EXPECT_EQ(p->staging.contributors, 0u);
  EXPECT_EQ(gate.StepsCompletedLocked(*p, 1), 1);
}

TEST(ConsistencyGateTest, BspAdmitsOnlyThePartitionsCurrentStep) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 2);
  std::shared_ptr<Partition> p = SgdPartition(2, 1);
  {
    absl::MutexLock lock(&p->mu);
    // One ahead: a lagging copy's, to be tried again; further: refused.
    absl::StatusOr<bool> next = gate.AdmitLocked(*p, 0, 1);
    EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(next.status().message(), HasSubstr("one ahead of the partition (version 0)"));
    absl::StatusOr<bool> future = gate.AdmitLocked(*p, 0, 2);
    EXPECT_EQ(future.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(future.status().message(), HasSubstr("from the future"));
  }
  PushThroughGate(gate, p, 0, 0, {2});
  {
    absl::MutexLock lock(&p->mu);
    // A second incarnation of worker 0 for the step it staged: counts as applied.
    EXPECT_EQ(gate.AdmitLocked(*p, 0, 0).value_or(false), true);
    EXPECT_EQ(gate.AdmitLocked(*p, 1, 0).value_or(true), false);
  }
  PushThroughGate(gate, p, 1, 0, {4});
  EXPECT_EQ(WeightsOf(*p), (std::vector<float>{-3}));
  absl::MutexLock lock(&p->mu);
  absl::StatusOr<bool> past = gate.AdmitLocked(*p, 1, 0);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(past.status().message(), HasSubstr("already applied"));
}

// A membership change completes a BSP step that waited only for the removed worker.
TEST(ConsistencyGateTest, CompleteStepAppliesWhenTheMissingWorkerLeaves) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 2);
  std::shared_ptr<Partition> p = SgdPartition(2, 1);
  PushThroughGate(gate, p, 0, 0, {6});
  {
    absl::MutexLock lock(&p->mu);
    EXPECT_FALSE(gate.CompleteStepLocked(*p).version_changed);
  }
  ASSERT_TRUE(gate.UpdateMembership({0}, 0).ok());
  absl::MutexLock lock(&p->mu);
  const ConsistencyGate::Applied applied = gate.CompleteStepLocked(*p);
  EXPECT_TRUE(applied.version_changed && applied.updated);
  EXPECT_EQ(p->version.load(), 1);
  EXPECT_EQ(p->weights.data()[0], -6.0f);
}

// SSP applies at once, scaled by 1 / live workers, and admits steps up to slowest + k + 1; ASP
// applies at once, unscaled. Neither stages.
TEST(ConsistencyGateTest, SspScalesByLiveWorkersAndAspAppliesAsIs) {
  ConsistencyGate ssp(v1::CONSISTENCY_SSP, 1, 2);
  std::shared_ptr<Partition> p = SgdPartition(2, 2);
  EXPECT_EQ(ssp.PushScale(*p, 0), 0.5f);
  const ConsistencyGate::Applied applied = PushThroughGate(ssp, p, 0, 0, {2, 4});
  EXPECT_TRUE(applied.version_changed && applied.updated && applied.boundary_moved);
  EXPECT_EQ(p->version.load(), 1);
  EXPECT_EQ(WeightsOf(*p), (std::vector<float>{-1, -2}));
  std::optional<int64_t> staleness;
  EXPECT_EQ(ssp.AdmitSlice("w/0", *p, 4, &staleness).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ssp.AdmitSlice("w/0", *p, 3, &staleness).code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(ssp.AdmitSlice("w/0", *p, 2, &staleness).ok());
  EXPECT_EQ(staleness, std::optional<int64_t>(2));  // worker 1 has completed no step
  ASSERT_TRUE(ssp.UpdateMembership({0}, 0).ok());
  EXPECT_EQ(ssp.PushScale(*p, 0), 1.0f);

  ConsistencyGate asp(v1::CONSISTENCY_ASP, 0, 2);
  std::shared_ptr<Partition> q = SgdPartition(2, 2);
  EXPECT_EQ(asp.PushScale(*q, 0), 1.0f);
  std::optional<int64_t> none;
  EXPECT_TRUE(asp.AdmitSlice("w/0", *q, 1000, &none).ok());
  EXPECT_FALSE(none.has_value());
  PushThroughGate(asp, q, 1, 5, {2, 4});
  EXPECT_EQ(WeightsOf(*q), (std::vector<float>{-2, -4}));
  EXPECT_EQ(q->clocks[1].load(), 6);
}

// --- Gates through the store, under threads ---------------------------------------------------

v1::CreateJobStateRequest Job(const std::string& id, const v1::JobConfig& config, int partitions,
                              int64_t n) {
  v1::CreateJobStateRequest r;
  r.set_job_id(id);
  *r.mutable_config() = config;
  for (int p = 0; p < partitions; ++p) *r.add_partitions() = Dense("w", p, n);
  return r;
}

// Blocks until the store answers (a parked pull is answered from another worker's thread).
absl::StatusOr<v1::PushPullResponse> PushPullWait(ParameterStore& store,
                                                  const v1::PushPullRequest& r) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<v1::PushPullResponse>>>();
  auto future = promise->get_future();
  store.PushPull(r, [promise](absl::StatusOr<v1::PushPullResponse> response) {
    promise->set_value(std::move(response));
  });
  return future.get();
}

float Grad(int worker, int step, int partition, int i) {
  return static_cast<float>((worker * 7 + step * 3 + partition * 5 + i) % 11 - 5);
}

// Four worker threads run 25 BSP steps over 3 partitions; each pushes all partitions with
// want_weights and waits. Every answer must be exactly the reference after step s: the mean of
// the four gradients applied once per step.
TEST(ConsistencyGateTest, BspAveragesExactlyOncePerStep) {
  constexpr int kWorkers = 4, kSteps = 25, kParts = 3;
  constexpr int64_t kN = 257;
  ParameterStore store;
  ASSERT_TRUE(
      store.CreateJobState(Job("b", Config(v1::CONSISTENCY_BSP, kWorkers, 0.5f), kParts, kN)).ok());
  // reference[s][p][i]: weights after steps 0..s.
  std::vector<std::vector<std::vector<float>>> reference(kSteps);
  std::vector<std::vector<double>> w(kParts, std::vector<double>(kN, 0.0));
  for (int s = 0; s < kSteps; ++s) {
    for (int p = 0; p < kParts; ++p) {
      for (int i = 0; i < kN; ++i) {
        double sum = 0;
        for (int k = 0; k < kWorkers; ++k) sum += Grad(k, s, p, i);
        w[p][i] -= 0.5 * sum / kWorkers;
      }
      reference[s].emplace_back(w[p].begin(), w[p].end());
    }
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < kWorkers; ++k) {
    threads.emplace_back([&, k] {
      for (int s = 0; s < kSteps; ++s) {
        std::vector<v1::Slice> push;
        for (int p = 0; p < kParts; ++p) {
          std::vector<float> g(kN);
          for (int i = 0; i < kN; ++i) g[i] = Grad(k, s, p, i);
          push.push_back(GradSlice("w", p, g, /*want_weights=*/true));
        }
        auto r = PushPullWait(store, Request("b", k, 1, s, s + 1, push));
        if (!r.ok() || r->weights_size() != kParts) {
          ++mismatches;
          return;
        }
        for (int p = 0; p < kParts; ++p) {
          if (r->weights(p).version() != s + 1 || Floats(r->weights(p)) != reference[s][p]) {
            ++mismatches;
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
  auto stats = store.GetJobStats("b");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->updates_applied, kSteps * kParts);  // once per step and partition
}

TEST(ConsistencyGateTest, BspRefusesStepsFromTheFutureAndThePast) {
  ParameterStore store;
  ASSERT_TRUE(store.CreateJobState(Job("b", Config(v1::CONSISTENCY_BSP, 2, 0.5f), 1, 2)).ok());
  // One step ahead: what a lagging copy of a replicated job sees, to be tried again.
  auto next = store.Push(Request("b", 0, 1, 1, 1, {GradSlice("w", 0, {1, 1})})).status();
  EXPECT_EQ(next.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(next.message(), HasSubstr("w/0"));
  auto future = store.Push(Request("b", 0, 1, 2, 1, {GradSlice("w", 0, {1, 1})})).status();
  EXPECT_EQ(future.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(future.message(), HasSubstr("w/0"));
  EXPECT_THAT(future.message(), HasSubstr("step 2"));
  EXPECT_THAT(future.message(), HasSubstr("version 0"));
  auto negative = store.Push(Request("b", 0, 1, -1, 1, {GradSlice("w", 0, {1, 1})})).status();
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("step"));
}

// SSP(k) with 4 workers at different speeds: no pull is ever answered staler than k, and a worker
// that runs ahead does wait.
TEST(ConsistencyGateTest, SspNeverServesStalerThanK) {
  constexpr int kWorkers = 4, kSteps = 40;
  constexpr uint32_t kStaleness = 2;
  ParameterStore store;
  ASSERT_TRUE(
      store
          .CreateJobState(Job(
              "s", Config(v1::CONSISTENCY_SSP, kWorkers, 0.5f, v1::OPTIMIZER_KIND_SGD, kStaleness),
              2, 64))
          .ok());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < kWorkers; ++k) {
    threads.emplace_back([&, k] {
      std::mt19937 rng(k);
      for (int s = 0; s < kSteps; ++s) {
        // Worker 0 runs flat out; the others yield a random number of times.
        if (k != 0) {
          for (int y = rng() % (50 * k); y > 0; --y) std::this_thread::yield();
        }
        // One request per partition, as the client library sends them; each answer is for step
        // s + 1, so every worker's steps [0, s + 1 - k) must be in that partition, and our own
        // s + 1 pushes too.
        std::vector<float> g(64, 1.0f);
        for (uint32_t p = 0; p < 2; ++p) {
          auto r = PushPullWait(store, Request("s", k, 1, s, 2 * s + p + 1,
                                               {GradSlice("w", p, g, /*want_weights=*/true)}));
          if (!r.ok() || r->weights_size() != 1) {
            ++failures;
            continue;
          }
          const int64_t floor =
              std::max<int64_t>(kWorkers * (s + 1 - static_cast<int64_t>(kStaleness)), s + 1);
          if (r->weights(0).version() < floor) ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  auto stats = store.GetJobStats("s");
  ASSERT_TRUE(stats.ok());
  EXPECT_LE(stats->max_staleness_served, kStaleness);
  EXPECT_EQ(stats->updates_applied, 2 * kSteps * kWorkers);

  // Deterministic part: worker 0 alone pushes steps 0..k; its pull for step k+1 must park until
  // worker 1 completes step 0.
  ParameterStore alone;
  ASSERT_TRUE(
      alone
          .CreateJobState(Job(
              "s", Config(v1::CONSISTENCY_SSP, 2, 0.5f, v1::OPTIMIZER_KIND_SGD, kStaleness), 1, 4))
          .ok());
  std::vector<std::optional<absl::StatusOr<v1::PushPullResponse>>> answers(kStaleness + 1);
  for (uint32_t s = 0; s <= kStaleness; ++s) {
    alone.PushPull(Request("s", 0, 1, s, s + 1, {GradSlice("w", 0, {1, 1, 1, 1}, true)}),
                   [&answers, s](absl::StatusOr<v1::PushPullResponse> r) { answers[s] = r; });
  }
  for (uint32_t s = 0; s < kStaleness; ++s) EXPECT_TRUE(answers[s].has_value()) << s;
  EXPECT_FALSE(answers[kStaleness].has_value());  // pull for step k+1 waits for worker 1
  // A push one beyond slowest + k + 1 is to be tried again (a lagging copy's); further, it is
  // from the future.
  auto next = alone.Push(Request("s", 0, 1, kStaleness + 2, 99, {GradSlice("w", 0, {1, 1, 1, 1})}));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable);
  auto too_far =
      alone.Push(Request("s", 0, 1, kStaleness + 3, 100, {GradSlice("w", 0, {1, 1, 1, 1})}));
  EXPECT_EQ(too_far.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_far.status().message(), HasSubstr("w/0"));
  ASSERT_TRUE(alone.Push(Request("s", 1, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})})).ok());
  ASSERT_TRUE(answers[kStaleness].has_value());
  ASSERT_TRUE(answers[kStaleness]->ok());
  auto stats_alone = alone.GetJobStats("s");
  EXPECT_EQ(stats_alone->max_staleness_served, kStaleness);
}

// ASP never waits: one worker pushes 100 steps while the others never push, and every answer
// comes back before PushPull returns.
TEST(ConsistencyGateTest, AspNeverBlocks) {
  ParameterStore store;
  ASSERT_TRUE(store.CreateJobState(Job("a", Config(v1::CONSISTENCY_ASP, 3, 0.5f), 1, 8)).ok());
  for (int s = 0; s < 100; ++s) {
    bool answered = false;
    store.PushPull(Request("a", 0, 1, s, s + 1, {GradSlice("w", 0, std::vector<float>(8, 2), true)},
                           {PullKey("w", 0)}),
                   [&](absl::StatusOr<v1::PushPullResponse> r) {
                     ASSERT_TRUE(r.ok()) << r.status();
                     ASSERT_EQ(r->weights_size(), 2);
                     EXPECT_EQ(r->weights(0).version(), s + 1);
                     answered = true;
                   });
    ASSERT_TRUE(answered) << "step " << s;
  }
  auto stats = store.GetJobStats("a");
  EXPECT_EQ(stats->parked_pulls, 0u);
}

// BSP on a sparse table: a worker with no rows for this shard in a step pushes an empty slice,
// which counts towards the step; rows are averaged over the workers of the step.
TEST(ConsistencyGateTest, BspSparseStepCountsEmptyPushes) {
  ParameterStore store;
  v1::CreateJobStateRequest job;
  job.set_job_id("sp");
  *job.mutable_config() = Config(v1::CONSISTENCY_BSP, 2, 0.5f);
  job.add_tables()->set_name("emb");
  job.mutable_tables(0)->set_dim(2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  std::optional<absl::StatusOr<v1::PushPullResponse>> first;
  store.PushPull(Request("sp", 0, 1, 0, 1, {RowsSlice("emb", {7, 3, 7}, {1, 1, 2, 2, 3, 3}, true)}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { first = r; });
  EXPECT_FALSE(first.has_value());
  v1::Slice empty = RowsSlice("emb", {}, {}, true);
  auto second = PushPullWait(store, Request("sp", 1, 1, 0, 1, {empty}));
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->weights_size(), 1);
  EXPECT_EQ(second->weights(0).row_ids_size(), 0);
  ASSERT_TRUE(first.has_value() && first->ok());
  // Row 7 got 1 + 3 = 4 from worker 0 and nothing from worker 1: mean 2, lr 0.5 -> -1; row 3
  // got 2: -0.5. The answer lists the pushed rows in push order (7, 3, 7).
  EXPECT_EQ(Floats((*first)->weights(0)), (std::vector<float>{-1, -1, -0.5, -0.5, -1, -1}));
  EXPECT_EQ((*first)->weights(0).version(), 1);
}

// Hybrid (PERSIA's): the dense partition is BSP, staged until both workers pushed; the table is
// SSP(1): a row push is applied at once, scaled by 1 / 2 live workers, and answered without
// waiting for the other worker; a row pull two steps ahead of the slowest waits.
TEST(ConsistencyGateTest, HybridGatesDensePartitionsAsBspAndTablesAsSsp) {
  ParameterStore store;
  v1::CreateJobStateRequest job;
  job.set_job_id("hy");
  *job.mutable_config() =
      Config(v1::CONSISTENCY_HYBRID, 2, 0.5f, v1::OPTIMIZER_KIND_SGD, /*staleness=*/1);
  *job.add_partitions() = Dense("w", 0, 2);
  job.add_tables()->set_name("emb");
  job.mutable_tables(0)->set_dim(2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  // Worker 0, step 0: the dense push waits for worker 1 (BSP).
  std::optional<absl::StatusOr<v1::PushPullResponse>> dense0;
  store.PushPull(Request("hy", 0, 1, 0, 1, {GradSlice("w", 0, {2, 4}, true)}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { dense0 = r; });
  EXPECT_FALSE(dense0.has_value()) << "BSP waits for worker 1";
  // Its row push is applied and answered at once (SSP: the pull for step 1 needs clock >= 0).
  auto rows0 =
      PushPullWait(store, Request("hy", 0, 1, 0, 2, {RowsSlice("emb", {7}, {4, 8}, true)}));
  ASSERT_TRUE(rows0.ok()) << rows0.status();
  ASSERT_EQ(rows0->weights_size(), 1);
  // 4 and 8, times 1/2 (two live workers), lr 0.5.
  EXPECT_EQ(Floats(rows0->weights(0)), (std::vector<float>{-1, -2}));
  // Worker 0 runs ahead on the table: its step 1 is admitted (clock 1 <= slowest 0 + k + 1)...
  auto rows1 = PushPullWait(store, Request("hy", 0, 1, 1, 3, {RowsSlice("emb", {7}, {4, 8})}));
  ASSERT_TRUE(rows1.ok()) << rows1.status();
  // ... but a pull of the table for step 2 waits until worker 1 has completed step 0 there.
  std::optional<absl::StatusOr<v1::PushPullResponse>> pull2;
  store.PushPull(Request("hy", 0, 1, 2, 4, {}, {PullKey("emb", 0, {7})}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { pull2 = r; });
  EXPECT_FALSE(pull2.has_value()) << "SSP(1) parks a pull 2 steps ahead of the slowest";
  EXPECT_FALSE(dense0.has_value());
  // Worker 1 pushes its dense step 0: the step completes with the mean.
  auto dense1 = PushPullWait(store, Request("hy", 1, 1, 0, 1, {GradSlice("w", 0, {6, 8}, true)}));
  ASSERT_TRUE(dense1.ok()) << dense1.status();
  EXPECT_EQ(Floats(dense1->weights(0)), (std::vector<float>{-2, -3}));  // (2+6)/2, (4+8)/2, lr .5
  ASSERT_TRUE(dense0.has_value() && dense0->ok());
  EXPECT_FALSE(pull2.has_value()) << "the table's clock of worker 1 has not moved";
  auto rows_w1 = PushPullWait(store, Request("hy", 1, 1, 0, 2, {RowsSlice("emb", {}, {})}));
  ASSERT_TRUE(rows_w1.ok()) << rows_w1.status();
  ASSERT_TRUE(pull2.has_value() && pull2->ok());
  EXPECT_EQ(Floats((*pull2)->weights(0)), (std::vector<float>{-2, -4}));
}

// Three BSP workers; worker 2 dies. Steps wait for it until the coordinator removes it, which
// completes the pending step with the mean of the two live gradients.
TEST(ConsistencyGateTest, MembershipChangeUnblocksBsp) {
  ParameterStore store;
  ASSERT_TRUE(store.CreateJobState(Job("m", Config(v1::CONSISTENCY_BSP, 3, 0.5f), 2, 2)).ok());
  std::vector<std::optional<absl::StatusOr<v1::PushPullResponse>>> answers(2);
  for (int k = 0; k < 2; ++k) {
    store.PushPull(
        Request("m", k, 1, 0, 1,
                {GradSlice("w", 0, {2.0f * (k + 1), 4}, true), GradSlice("w", 1, {1, 1})}),
        [&answers, k](absl::StatusOr<v1::PushPullResponse> r) { answers[k] = r; });
  }
  EXPECT_FALSE(answers[0].has_value());
  EXPECT_FALSE(answers[1].has_value());
  v1::UpdateMembershipRequest change;
  change.set_job_id("m");
  change.add_live_workers(0);
  change.add_live_workers(1);
  change.set_effective_step(0);
  ASSERT_TRUE(store.UpdateMembership(change).ok());
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(answers[k].has_value());
    ASSERT_TRUE(answers[k]->ok()) << answers[k]->status();
    // mean of {2, 4} and {4, 4} is {3, 4}; lr 0.5.
    EXPECT_EQ(Floats((*answers[k])->weights(0)), (std::vector<float>{-1.5f, -2.0f}));
  }
  // Step 1 needs only workers 0 and 1; the dead worker is refused.
  auto dead = store.Push(Request("m", 2, 1, 1, 1, {GradSlice("w", 0, {1, 1})}));
  EXPECT_EQ(dead.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store.Push(Request("m", 0, 1, 1, 2, {GradSlice("w", 0, {1, 1})})).ok());
  auto last = PushPullWait(store, Request("m", 1, 1, 1, 2, {GradSlice("w", 0, {1, 1}, true)}));
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->weights(0).version(), 2);
  EXPECT_EQ(Floats(last->weights(0)), (std::vector<float>{-2.0f, -2.5f}));
}

// --- The stall inspector ---------------------------------------------------------------------

// The ranks of a stall, with the partitions each has not pushed: "rank:partitions ...".
std::string Laggards(const v1::ShardStall& stall) {
  std::string out;
  for (const v1::LaggingRank& l : stall.lagging()) {
    absl::StrAppend(&out, out.empty() ? "" : " ", l.rank(), ":", l.partitions());
  }
  return out;
}

// BSP: the oldest step pushed somewhere, and per live worker the partitions it has not pushed;
// from the step's first push, and only once it has waited the minimum.
TEST(ConsistencyGateTest, BspStallNamesTheLiveWorkersThatHaveNotPushedTheStep) {
  ConsistencyGate gate(v1::CONSISTENCY_BSP, 0, 3);
  const std::vector<std::shared_ptr<Partition>> parts = {SgdPartition(3, 1), SgdPartition(3, 1),
                                                         SgdPartition(3, 1)};
  const int64_t second = 1'000'000'000;
  EXPECT_FALSE(gate.FindStall(parts, SteadyNowNs(), 0).has_value());  // nothing pushed yet
  for (const auto& p : parts) PushThroughGate(gate, p, 0, 0, {1});
  PushThroughGate(gate, parts[0], 2, 0, {1});
  const int64_t later = SteadyNowNs() + 5 * second;
  std::optional<v1::ShardStall> stall = gate.FindStall(parts, later, second);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->step(), 0);
  EXPECT_GE(stall->waiting_ms(), 5000);
  EXPECT_LT(stall->waiting_ms(), 6000);
  EXPECT_EQ(stall->partitions(), 3);
  EXPECT_EQ(Laggards(*stall), "1:3 2:2");
  // Not yet waited the minimum.
  EXPECT_FALSE(gate.FindStall(parts, SteadyNowNs(), 60 * second).has_value());
  // Everyone pushed: step 0 is done and step 1 not begun.
  for (const auto& p : parts) PushThroughGate(gate, p, 1, 0, {1});
  PushThroughGate(gate, parts[1], 2, 0, {1});
  PushThroughGate(gate, parts[2], 2, 0, {1});
  EXPECT_FALSE(gate.FindStall(parts, later, 0).has_value());
  // Worker 1 leaves at step 1: step 1 waits only for worker 2 then.
  ASSERT_TRUE(gate.UpdateMembership({0, 2}, 1).ok());
  PushThroughGate(gate, parts[0], 0, 1, {1});
  stall = gate.FindStall(parts, later, 0);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->step(), 1);
  EXPECT_EQ(Laggards(*stall), "0:2 2:3");
}

// SSP: the oldest parked pull, with the workers further behind than the staleness on it; ASP
// never waits.
TEST(ConsistencyGateTest, SspStallNamesTheWorkersAPulledStepWaitsFor) {
  ConsistencyGate gate(v1::CONSISTENCY_SSP, 1, 3);
  auto clocks = std::make_shared<WorkerClocks>(3);
  (*clocks)[0] = 3;
  (*clocks)[1] = 0;
  (*clocks)[2] = 2;
  ConsistencyGate::Wait wait;
  wait.clocks.emplace_back(clocks, 3);  // a pull for step 3 needs every clock >= 2
  wait.done = [](absl::Status) {};
  gate.Park(std::move(wait));
  const int64_t second = 1'000'000'000;
  std::optional<v1::ShardStall> stall = gate.FindStall({}, SteadyNowNs() + 3 * second, second);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->step(), 3);
  EXPECT_GE(stall->waiting_ms(), 3000);
  ASSERT_EQ(stall->lagging_size(), 1);
  EXPECT_EQ(stall->lagging(0).rank(), 1);
  EXPECT_EQ(stall->lagging(0).clock(), 0);
  EXPECT_FALSE(gate.FindStall({}, SteadyNowNs(), 60 * second).has_value());
  (*clocks)[1] = 2;
  gate.Notify();
  EXPECT_FALSE(gate.FindStall({}, SteadyNowNs() + 3 * second, 0).has_value());

  ConsistencyGate asp(v1::CONSISTENCY_ASP, 0, 2);
  EXPECT_FALSE(asp.FindStall({SgdPartition(2, 1)}, SteadyNowNs(), 0).has_value());
}

}  // namespace
}  // namespace tessera::server
