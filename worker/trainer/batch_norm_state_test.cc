// BatchNorm's moving statistics in a distributed job (DESIGN.md §5): the shards hold them as
// averaged partitions, so after every BSP step each rank and the shards hold the EMA of the
// ranks' batch statistics averaged over the ranks, which is what a single device computes from
// the same batches' statistics; the final evaluation and the export use those values.
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/testing/example_jobs.h"
#include "worker/client/parameter_client.h"
#include "worker/trainer/distributed_trainer.h"
#include "worker/trainer/testing/ranks.h"

namespace tessera::trainer {
namespace {

using namespace ::tessera::trainer::testing_ranks;  // NOLINT: ranks in one process

constexpr int kFeatures = 2;
constexpr double kMomentum = 0.1;

// Per channel, over a batch of size x kFeatures row-major features.
struct BatchStats {
  std::vector<double> mean = std::vector<double>(kFeatures, 0.0);
  std::vector<double> unbiased_var = std::vector<double>(kFeatures, 0.0);
};

BatchStats StatsOf(const data::Batch& b) {
  BatchStats s;
  const double n = static_cast<double>(b.size);
  for (int c = 0; c < kFeatures; ++c) {
    for (int64_t i = 0; i < b.size; ++i) s.mean[c] += b.features[i * kFeatures + c];
    s.mean[c] /= n;
    for (int64_t i = 0; i < b.size; ++i) {
      const double d = b.features[i * kFeatures + c] - s.mean[c];
      s.unbiased_var[c] += d * d;
    }
    s.unbiased_var[c] /= n - 1;
  }
  return s;
}

class BatchNormStateTest : public ShardsTest {
 protected:
  // batch_norm over the 2 input features, then 8 relu units and 3 classes; BSP, 2 workers.
  v1::JobSpec Spec(int epochs) const {
    constexpr char kText[] = R"pb(
      name: "blobs-bn"
      model {
        input_shape: [ 2 ]
        layers { batch_norm {} }
        layers { dense { units: 8 } }
        layers { relu {} }
        layers { dense { units: 3 } }
        loss: LOSS_SOFTMAX_CROSS_ENTROPY
      }
      dataset { format: FORMAT_CSV num_classes: 3 }
      device: "cpu"
      optimizer { kind: OPTIMIZER_KIND_ADAM learning_rate: 0.01 }
      consistency: "bsp"
      batch_size: 32
      seed: 7
      partition_bytes: 1024
      num_workers: 2
    )pb";
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kText, &spec));
    spec.mutable_dataset()->set_train_path(dir_ + "/train.csv");
    spec.mutable_dataset()->set_test_path(dir_ + "/test.csv");
    spec.set_epochs(epochs);
    return spec;
  }

  void RunAndCheck(const std::string& job, float max_global_norm);
};

// Runs the job to the end and checks the statistics on both ranks and on the shards.
void BatchNormStateTest::RunAndCheck(const std::string& job, float max_global_norm) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_clipping()->set_max_global_norm(max_global_norm);
  FakeCoordinator coordinator(2);
  absl::Mutex mu;
  std::map<int64_t, std::vector<BatchStats>> stats;  // by step, per rank
  std::vector<std::unique_ptr<DistributedTrainer>> ranks;
  for (int r = 0; r < 2; ++r) {
    DistributedOptions o = RankOptions(job, spec, r, shards_->addresses());
    o.on_batch = [&mu, &stats, r](int64_t step, const data::Batch& b) {
      absl::MutexLock lock(&mu);
      std::vector<BatchStats>& at = stats[step];
      at.resize(2);
      at[r] = StatsOf(b);
    };
    if (r == 0) {
      o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
    }
    auto made = DistributedTrainer::Create(std::move(o));
    ASSERT_TRUE(made.ok()) << made.status();
    ranks.push_back(std::move(*made));
  }
  const std::vector<absl::StatusOr<v1::ProgressReport>> results = RunAll(ranks, &coordinator);
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  const int64_t steps = ranks[0]->total_steps();
  ASSERT_EQ(steps, 20);
  ASSERT_EQ(static_cast<int64_t>(stats.size()), steps);

  // PyTorch's convention, from the starting zeros and ones, over the ranks' mean statistics.
  std::vector<double> mean(kFeatures, 0.0);
  std::vector<double> var(kFeatures, 1.0);
  for (const auto& [step, per_rank] : stats) {
    for (int c = 0; c < kFeatures; ++c) {
      const double batch_mean = (per_rank[0].mean[c] + per_rank[1].mean[c]) / 2;
      const double batch_var = (per_rank[0].unbiased_var[c] + per_rank[1].unbiased_var[c]) / 2;
      mean[c] = (1 - kMomentum) * mean[c] + kMomentum * batch_mean;
      var[c] = (1 - kMomentum) * var[c] + kMomentum * batch_var;
    }
  }
  // The statistics moved well away from where they started, so the comparison has teeth.
  ASSERT_GT(std::abs(var[0] - 1.0) + std::abs(mean[0]), 0.05);

  const std::string mean_name = "batch_norm_1/moving_mean";
  const std::string var_name = "batch_norm_1/moving_variance";
  const std::vector<std::vector<float>> shard =
      ShardValues(job, {{mean_name, {kFeatures}, {}}, {var_name, {kFeatures}, {}}});
  ASSERT_EQ(shard.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    std::vector<float> m, v;
    ASSERT_TRUE(ranks[r]->model().CopyValueToHost(mean_name, &m).ok());
    ASSERT_TRUE(ranks[r]->model().CopyValueToHost(var_name, &v).ok());
    ASSERT_EQ(m.size(), static_cast<size_t>(kFeatures));
    // Every rank ends with the shards' values, bit for bit.
    EXPECT_EQ(m, shard[0]) << "rank " << r;
    EXPECT_EQ(v, shard[1]) << "rank " << r;
    for (int c = 0; c < kFeatures; ++c) {
      EXPECT_NEAR(m[c], mean[c], 1e-5) << "rank " << r << " channel " << c;
      EXPECT_NEAR(v[c], var[c], 1e-5 * var[c]) << "rank " << r << " channel " << c;
    }
  }
  // Rank 0 evaluated with those statistics; the blobs are easy.
  EXPECT_TRUE(results[0]->evaluated());
  EXPECT_GT(results[0]->test_accuracy(), 0.9);
  DropJob(job);
}

TEST_F(BatchNormStateTest, BspRanksAndShardsHoldTheEmaOfTheRanksAveragedBatchStatistics) {
  RunAndCheck("bn-state", 0);
}

// Clipping scales the gradients, never the statistics (they are values, not a gradient).
TEST_F(BatchNormStateTest, ClippingLeavesTheStatisticsAlone) {
  RunAndCheck("bn-state-clipped", 0.05f);
}

}  // namespace
}  // namespace tessera::trainer
