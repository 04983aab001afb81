// Dense partitions declared DENSE_UPDATE_AVERAGE (BatchNorm moving statistics): what each
// consistency model makes of the pushed values, how declarations are checked and charged, and
// that a checkpoint keeps the update kind so that a restored shard goes on bit for bit.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint_file.h"
#include "server/parameter_store.h"
#include "server/testing/store_calls.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;   // NOLINT: request builders
using namespace ::tessera::server::store_calls;  // NOLINT: store calls

v1::DensePartitionDecl Averaged(const std::string& tensor, uint32_t index, int64_t n,
                                const std::vector<float>& initial = {}) {
  v1::DensePartitionDecl d = Dense(tensor, index, n, initial);
  d.set_update(v1::DENSE_UPDATE_AVERAGE);
  return d;
}

// A job of `workers` workers with a trained partition "w" (SGD at lr 1) and an averaged one "bn".
v1::CreateJobStateRequest MixedJob(const std::string& id, v1::Consistency consistency,
                                   uint32_t workers, uint32_t staleness = 0) {
  v1::CreateJobStateRequest r =
      JobRequest(id, Config(consistency, workers, 1.0f, v1::OPTIMIZER_KIND_SGD, staleness));
  *r.add_partitions() = Dense("w", 0, 3);
  *r.add_partitions() = Averaged("bn", 0, 3, {10, 10, 10});
  return r;
}

void PushBoth(ParameterStore& store, const std::string& job, uint32_t worker, int64_t step,
              const std::vector<float>& grad, const std::vector<float>& state) {
  auto pushed = store.Push(Request(job, worker, 1, step, static_cast<uint64_t>(step + 1),
                                   {GradSlice("w", 0, grad), GradSlice("bn", 0, state)}));
  ASSERT_TRUE(pushed.ok()) << "step " << step << " worker " << worker << ": " << pushed.status();
}

TEST(AveragePartitionTest, BspSetsTheMeanOfTheStepsPushesWhereGradientsAreSummedAndApplied) {
  ParameterStore store;
  ASSERT_TRUE(store.CreateJobState(MixedJob("j", v1::CONSISTENCY_BSP, 2)).ok());
  PushBoth(store, "j", 0, 0, {1, 1, 1}, {1, 2, 3});
  // Half a step: nothing applied yet.
  EXPECT_EQ(PullDense(store, "j", "bn", 0), (std::vector<float>{10, 10, 10}));
  PushBoth(store, "j", 1, 0, {1, 1, 1}, {3, 6, -3});
  // The mean, not the sum and not a step from the starting value.
  EXPECT_EQ(PullDense(store, "j", "bn", 0), (std::vector<float>{2, 4, 0}));
  // The gradient partition beside it is trained as before: -lr * mean gradient.
  EXPECT_EQ(PullDense(store, "j", "w", 0), (std::vector<float>{-1, -1, -1}));
  // The next step replaces the value, whatever it was.
  PushBoth(store, "j", 0, 1, {0, 0, 0}, {5, 5, 5});
  PushBoth(store, "j", 1, 1, {0, 0, 0}, {7, 7, 7});
  EXPECT_EQ(PullDense(store, "j", "bn", 0), (std::vector<float>{6, 6, 6}));
}

TEST(AveragePartitionTest, BspLeavesASkippedNonFinitePushOutOfTheMean) {
  ParameterStore store;
  v1::CreateJobStateRequest job = MixedJob("s", v1::CONSISTENCY_BSP, 3);
  job.mutable_config()->set_non_finite_policy(v1::NON_FINITE_POLICY_SKIP);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  PushBoth(store, "s", 0, 0, {0, 0, 0}, {1, 2, 3});
  auto ack = store.Push(
      Request("s", 1, 1, 0, 1, {GradSlice("w", 0, {0, 0, 0}), GradSlice("bn", 0, {NAN, 0, 0})}));
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->skipped_non_finite, 1u);
  PushBoth(store, "s", 2, 0, {0, 0, 0}, {3, 4, 5});
  // Two finite pushes: their mean, not a third of their sum.
  EXPECT_EQ(PullDense(store, "s", "bn", 0), (std::vector<float>{2, 3, 4}));
}

TEST(AveragePartitionTest, BspStepWhereEveryPushWasSkippedKeepsTheValue) {
  ParameterStore store;
  v1::CreateJobStateRequest job = MixedJob("k", v1::CONSISTENCY_BSP, 2);
  job.mutable_config()->set_non_finite_policy(v1::NON_FINITE_POLICY_SKIP);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  for (uint32_t w = 0; w < 2; ++w) {
    auto ack = store.Push(Request(
        "k", w, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1}), GradSlice("bn", 0, {0, INFINITY, 0})}));
    ASSERT_TRUE(ack.ok()) << ack.status();
  }
  EXPECT_EQ(PullDense(store, "k", "bn", 0), (std::vector<float>{10, 10, 10}));
  EXPECT_EQ(PullDense(store, "k", "w", 0), (std::vector<float>{-1, -1, -1}));
}

TEST(AveragePartitionTest, AspAndSspMoveTheValueOneLiveWorkersShareTowardEachPush) {
  for (v1::Consistency consistency : {v1::CONSISTENCY_ASP, v1::CONSISTENCY_SSP}) {
    SCOPED_TRACE(v1::Consistency_Name(consistency));
    ParameterStore store;
    ASSERT_TRUE(store
                    .CreateJobState(
                        MixedJob("a", consistency, 2, consistency == v1::CONSISTENCY_SSP ? 4 : 0))
                    .ok());
    // w += (p - w) / 2, push by push, in arrival order.
    PushBoth(store, "a", 0, 0, {0, 0, 0}, {2, 4, 6});
    EXPECT_EQ(PullDense(store, "a", "bn", 0), (std::vector<float>{6, 7, 8}));
    PushBoth(store, "a", 1, 0, {0, 0, 0}, {0, 0, 0});
    EXPECT_EQ(PullDense(store, "a", "bn", 0), (std::vector<float>{3, 3.5f, 4}));
    PushBoth(store, "a", 0, 1, {0, 0, 0}, {3, 3.5f, 4});
    EXPECT_EQ(PullDense(store, "a", "bn", 0), (std::vector<float>{3, 3.5f, 4}));
  }
  // One worker: each push is the value.
  ParameterStore single;
  ASSERT_TRUE(single.CreateJobState(MixedJob("one", v1::CONSISTENCY_ASP, 1)).ok());
  PushBoth(single, "one", 0, 0, {0, 0, 0}, {-1, 0.5f, 8});
  EXPECT_EQ(PullDense(single, "one", "bn", 0), (std::vector<float>{-1, 0.5f, 8}));
}

TEST(AveragePartitionTest, DeclarationsAreValidatedAndRedeclarationsKeepTheKind) {
  ParameterStore store;
  v1::CreateJobStateRequest bad = MixedJob("v", v1::CONSISTENCY_BSP, 2);
  bad.mutable_partitions(1)->set_update(static_cast<v1::DenseUpdate>(7));
  const absl::Status unknown = store.CreateJobState(bad).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.message(), HasSubstr("partitions[1].update"));
  EXPECT_THAT(unknown.message(), HasSubstr("bn/0"));
  EXPECT_EQ(store.GetJobStats("v").status().code(), absl::StatusCode::kNotFound);

  ASSERT_TRUE(store.CreateJobState(MixedJob("v", v1::CONSISTENCY_BSP, 2)).ok());
  // The same declaration again is a no-op; the other kind for the same key is refused.
  ASSERT_TRUE(store.CreateJobState(MixedJob("v", v1::CONSISTENCY_BSP, 2)).ok());
  v1::CreateJobStateRequest flipped = MixedJob("v", v1::CONSISTENCY_BSP, 2);
  flipped.mutable_partitions(1)->set_update(v1::DENSE_UPDATE_OPTIMIZER);
  const absl::Status conflict = store.CreateJobState(flipped).status();
  EXPECT_EQ(conflict.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(conflict.message(), HasSubstr("partitions[1]"));
  EXPECT_THAT(conflict.message(), HasSubstr("DENSE_UPDATE_AVERAGE"));
  v1::CreateJobStateRequest to_average = MixedJob("v", v1::CONSISTENCY_BSP, 2);
  to_average.mutable_partitions(0)->set_update(v1::DENSE_UPDATE_AVERAGE);
  EXPECT_EQ(store.CreateJobState(to_average).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The shard still serves the job as declared first.
  PushBoth(store, "v", 0, 0, {1, 1, 1}, {4, 4, 4});
  PushBoth(store, "v", 1, 0, {1, 1, 1}, {0, 0, 0});
  EXPECT_EQ(PullDense(store, "v", "bn", 0), (std::vector<float>{2, 2, 2}));
}

TEST(AveragePartitionTest, ASparseOnlyOptimizerTakesAveragedPartitionsButNotTrainedOnes) {
  ParameterStore store;
  v1::CreateJobStateRequest job =
      JobRequest("f", Config(v1::CONSISTENCY_BSP, 2, 0.1f, v1::OPTIMIZER_KIND_FTRL));
  *job.add_tables() = Table("emb", 2, v1::Initializer::KIND_CONSTANT, 0);
  *job.add_partitions() = Averaged("bn", 0, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  for (uint32_t w = 0; w < 2; ++w) {
    ASSERT_TRUE(
        store
            .Push(Request("f", w, 1, 0, 1, {GradSlice("bn", 0, {static_cast<float>(w), 1.0f + w})}))
            .ok());
  }
  EXPECT_EQ(PullDense(store, "f", "bn", 0), (std::vector<float>{0.5f, 1.5f}));
  v1::CreateJobStateRequest trained =
      JobRequest("g", Config(v1::CONSISTENCY_BSP, 2, 0.1f, v1::OPTIMIZER_KIND_FTRL));
  *trained.add_partitions() = Dense("w", 0, 2);
  const absl::Status refused = store.CreateJobState(trained).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("cannot update dense partitions"));
}

TEST(AveragePartitionTest, AnAveragedPartitionIsChargedNoOptimizerSlots) {
  // 1M values: 4 MiB of weights; with Adam's two slots 12 MiB, over a budget of 8 MiB.
  ParameterStoreOptions options;
  options.max_memory_bytes = 8 << 20;
  ParameterStore store(options);
  v1::CreateJobStateRequest adam =
      JobRequest("m", Config(v1::CONSISTENCY_ASP, 1, 0.01f, v1::OPTIMIZER_KIND_ADAM));
  *adam.add_partitions() = Dense("w", 0, 1 << 20);
  const absl::Status refused = store.CreateJobState(adam).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("max_memory_bytes"));
  v1::CreateJobStateRequest averaged =
      JobRequest("m", Config(v1::CONSISTENCY_ASP, 1, 0.01f, v1::OPTIMIZER_KIND_ADAM));
  *averaged.add_partitions() = Averaged("w", 0, 1 << 20);
  ASSERT_TRUE(store.CreateJobState(averaged).ok());
  ASSERT_TRUE(
      store.Push(Request("m", 0, 1, 0, 1, {GradSlice("w", 0, std::vector<float>(1 << 20, 0.75f))}))
          .ok());
  const std::vector<float> w = PullDense(store, "m", "w", 0);
  ASSERT_EQ(w.size(), size_t{1} << 20);
  EXPECT_EQ(w.front(), 0.75f);
  EXPECT_EQ(w.back(), 0.75f);
}

// BSP, 2 workers, Adam: trained "w" beside averaged "bn"; a deterministic stream of values.
v1::CreateJobStateRequest CheckpointedJob(const std::string& id) {
  v1::CreateJobStateRequest r =
      JobRequest(id, Config(v1::CONSISTENCY_BSP, 2, 0.01f, v1::OPTIMIZER_KIND_ADAM));
  *r.add_partitions() = Dense("w", 0, 64);
  *r.add_partitions() = Averaged("bn", 0, 33, std::vector<float>(33, 1.0f));
  return r;
}

std::vector<float> Stream(size_t n, int64_t step, uint32_t worker, float salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = std::sin(salt + 0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(step) +
                    2.9f * static_cast<float>(worker));
  }
  return v;
}

void PushStreamStep(ParameterStore& store, const std::string& job, int64_t step,
                    uint64_t incarnation) {
  for (uint32_t w = 0; w < 2; ++w) {
    auto pushed = store.Push(Request(job, w, incarnation, step, static_cast<uint64_t>(step + 1),
                                     {GradSlice("w", 0, Stream(64, step, w, 0.5f)),
                                      GradSlice("bn", 0, Stream(33, step, w, 2))}));
    ASSERT_TRUE(pushed.ok()) << "step " << step << " worker " << w << ": " << pushed.status();
  }
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(AveragePartitionTest, ACheckpointKeepsTheKindAndARestoredShardReplaysBitForBit) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointedJob("c")).ok());
  constexpr int64_t kAt = 3;
  constexpr int64_t kSteps = 7;
  for (int64_t s = 0; s < kAt; ++s) PushStreamStep(store, "c", s, 1);
  absl::StatusOr<v1::CheckpointResponse> written = CheckpointAndWait(store, "c", kAt);
  ASSERT_TRUE(written.ok()) << written.status();
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(written->path());
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->header.partitions_size(), 2);
  for (const v1::PartitionCheckpoint& p : file->header.partitions()) {
    const bool averaged = p.key().tensor() == "bn";
    EXPECT_EQ(p.update(), averaged ? v1::DENSE_UPDATE_AVERAGE : v1::DENSE_UPDATE_OPTIMIZER);
    EXPECT_EQ(p.slots_size(), averaged ? 0 : 2) << p.key().tensor();
  }
  for (int64_t s = kAt; s < kSteps; ++s) PushStreamStep(store, "c", s, 1);
  const std::vector<float> w = PullDense(store, "c", "w", 0);
  const std::vector<float> bn = PullDense(store, "c", "bn", 0);
  // The last step's mean: what an uninterrupted shard holds.
  std::vector<float> mean(33);
  const std::vector<float> a = Stream(33, kSteps - 1, 0, 2);
  const std::vector<float> b = Stream(33, kSteps - 1, 1, 2);
  for (size_t i = 0; i < mean.size(); ++i) mean[i] = (a[i] + b[i]) * 0.5f;
  EXPECT_TRUE(BitEqual(bn, mean));

  // A fresh shard restores the file and replays steps 3..6 from workers of a new incarnation.
  ParameterStore restored(CheckpointOptions(dir));
  v1::RestoreRequest restore;
  restore.set_job_id("c");
  restore.set_step(kAt);
  restore.set_min_incarnation(10);
  absl::StatusOr<v1::RestoreResponse> answer = restored.Restore(restore);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->partitions(), 2u);
  // The kind came back: the averaged partition still refuses an optimizer redeclaration.
  v1::CreateJobStateRequest flipped = CheckpointedJob("c");
  flipped.mutable_partitions(1)->set_update(v1::DENSE_UPDATE_OPTIMIZER);
  EXPECT_EQ(restored.CreateJobState(flipped).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (int64_t s = kAt; s < kSteps; ++s) PushStreamStep(restored, "c", s, 10);
  EXPECT_TRUE(BitEqual(PullDense(restored, "c", "w", 0), w));
  EXPECT_TRUE(BitEqual(PullDense(restored, "c", "bn", 0), bn));
}

}  // namespace
}  // namespace tessera::server
