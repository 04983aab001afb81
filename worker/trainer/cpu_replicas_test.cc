// --devices cpu:N in the distributed trainer: two BSP ranks whose batches are split over 1, 2 or 4
// CPU replicas each train to the same weights (to float rounding), because each rank still pushes
// the gradient of its whole batch once per step; and a BatchNorm model trains with replicas, its
// statistics averaged over replicas and ranks and equal everywhere. A model with a pipeline of 2
// stages trains on cpu:2 (one stage per device, micro-batches) to the weights it reaches unsplit
// on one device, and a worker with another number of devices refuses it.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "spec/testing/example_jobs.h"
#include "worker/client/parameter_client.h"
#include "worker/trainer/distributed_trainer.h"
#include "worker/trainer/testing/ranks.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::trainer::testing_ranks;  // NOLINT: ranks in one process

class CpuReplicasTest : public ShardsTest {
 protected:
  // The blobs MLP (2-16-3), SGD, BSP, 2 workers, batch 32, 12 steps.
  v1::JobSpec Spec(const std::string& first_layer = "") const {
    v1::JobSpec spec;
    const std::string text = absl::StrCat(spec::examples::BlobsJobText(dir_, 16), R"pb(
      optimizer { kind: OPTIMIZER_KIND_SGD learning_rate: 0.2 }
      consistency: "bsp"
      batch_size: 32
      seed: 3
      partition_bytes: 1024
      num_workers: 2
      max_steps: 12
    )pb");
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
    if (!first_layer.empty()) {
      v1::Layer layer;
      EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(first_layer, &layer));
      auto* layers = spec.mutable_model()->mutable_layers();
      layers->Add()->CopyFrom(layer);
      std::rotate(layers->rbegin(), layers->rbegin() + 1, layers->rend());
    }
    return spec;
  }

  struct Run {
    std::vector<absl::StatusOr<v1::ProgressReport>> results;
    std::vector<std::map<std::string, std::vector<float>>> values;  // per rank, every dense tensor
  };

  // Both ranks with `replicas` CPU replicas each (or the GPUs `gpus`), to the end; then every
  // tensor they hold.
  Run Train(const std::string& job, const v1::JobSpec& spec, int replicas,
            const std::vector<int>& gpus = {}) {
    FakeCoordinator coordinator(2);
    std::vector<std::unique_ptr<DistributedTrainer>> ranks;
    for (int r = 0; r < 2; ++r) {
      DistributedOptions o = RankOptions(job, spec, r, shards_->addresses());
      o.cpu_devices = replicas;
      o.cuda_devices = gpus;
      if (r == 0) {
        o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
      }
      auto made = DistributedTrainer::Create(std::move(o));
      EXPECT_TRUE(made.ok()) << made.status();
      if (!made.ok()) return {};
      ranks.push_back(std::move(*made));
    }
    Run run;
    run.results = RunAll(ranks, &coordinator, absl::Seconds(60));
    for (const auto& t : ranks) {
      std::map<std::string, std::vector<float>> all;
      for (const engine::Parameter& p : t->model().parameters()) {
        EXPECT_TRUE(t->model().CopyValueToHost(p.name, &all[p.name]).ok()) << p.name;
      }
      run.values.push_back(std::move(all));
    }
    DropJob(job);
    return run;
  }
};

TEST_F(CpuReplicasTest, OneTwoAndFourReplicasPerRankTrainToTheSameWeights) {
  const v1::JobSpec spec = Spec();
  const Run one = Train("replicas-1", spec, 1);
  ASSERT_EQ(one.values.size(), 2u);
  for (int n : {2, 4}) {
    SCOPED_TRACE(absl::StrCat("cpu:", n));
    const Run split = Train(absl::StrCat("replicas-", n), spec, n);
    ASSERT_EQ(split.values.size(), 2u);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(split.results[r].ok()) << split.results[r].status();
      EXPECT_EQ(split.results[r]->step(), 12);
      // Both ranks hold the same weights, and they are one device's to float rounding.
      EXPECT_EQ(split.values[r], split.values[0]) << "rank " << r;
      for (const auto& [name, w] : one.values[0]) {
        const std::vector<float>& got = split.values[r].at(name);
        ASSERT_EQ(got.size(), w.size()) << name;
        for (size_t i = 0; i < w.size(); ++i) {
          EXPECT_NEAR(got[i], w[i], 1e-5f + 1e-5f * std::abs(w[i])) << name << "[" << i << "]";
        }
      }
    }
    EXPECT_NEAR(split.results[0]->loss(), one.results[0]->loss(), 1e-4);
  }
}

TEST_F(CpuReplicasTest, BatchNormTrainsWithReplicasAndEveryRankHoldsTheSameStatistics) {
  const v1::JobSpec spec = Spec("batch_norm {}");
  const Run run = Train("replicas-bn", spec, 2);
  ASSERT_EQ(run.values.size(), 2u);
  ASSERT_TRUE(run.results[0].ok()) << run.results[0].status();
  EXPECT_EQ(run.values[0], run.values[1]);
  const std::vector<float>& var = run.values[0].at("batch_norm_1/moving_variance");
  ASSERT_EQ(var.size(), 2u);
  // 12 steps of EMA toward the blobs' feature variance moved it off its starting ones.
  EXPECT_GT(std::abs(var[0] - 1.0f), 1e-3f);
  EXPECT_TRUE(run.results[0]->evaluated());
  EXPECT_GT(run.results[0]->test_accuracy(), 0.8);
}

TEST_F(CpuReplicasTest, APipelinedModelTrainsOnTwoStagesToTheWeightsItReachesUnsplit) {
  v1::JobSpec spec = Spec();
  spec.mutable_model()->mutable_pipeline()->add_stage_starts("relu_1");
  spec.mutable_model()->mutable_pipeline()->set_micro_batches(4);
  const Run one = Train("pipeline-1", spec, 1);
  const Run split = Train("pipeline-2", spec, 2);
  ASSERT_EQ(one.values.size(), 2u);
  ASSERT_EQ(split.values.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(split.results[r].ok()) << split.results[r].status();
    EXPECT_EQ(split.results[r]->step(), 12);
    EXPECT_EQ(split.values[r], split.values[0]) << "rank " << r;
    double moved = 0;
    for (const auto& [name, w] : one.values[0]) {
      const std::vector<float>& got = split.values[r].at(name);
      ASSERT_EQ(got.size(), w.size()) << name;
      for (size_t i = 0; i < w.size(); ++i) {
        EXPECT_NEAR(got[i], w[i], 1e-5f + 1e-5f * std::abs(w[i])) << name << "[" << i << "]";
        moved += std::abs(w[i]);
      }
    }
    EXPECT_GT(moved, 0.1);
  }
  EXPECT_NEAR(split.results[0]->loss(), one.results[0]->loss(), 1e-4);
  // Three devices for two stages: refused when the task starts, naming the fix.
  DistributedOptions o = RankOptions("pipeline-3", spec, 0, shards_->addresses());
  o.cpu_devices = 3;
  auto refused = DistributedTrainer::Create(std::move(o));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("use --devices cpu:2"));
}

// Each rank on up to two GPUs (one GPU trains alone; two sum with NCCL): the weights of one CPU
// device, to the tolerance of cuBLAS/cuDNN against oneDNN over 12 steps.
TEST_F(CpuReplicasTest, RanksOnGpusTrainToTheWeightsOfOneCpuDevice) {
  const int count = kernels::CudaDeviceCount();
  if (count < 1) GTEST_SKIP() << "no CUDA device: " << kernels::CudaUnavailableReason();
  std::vector<int> gpus = {0};
  if (count > 1) gpus.push_back(1);
  const v1::JobSpec spec = Spec();  // device "cpu"
  v1::JobSpec on_gpus = spec;
  on_gpus.set_device("cuda");
  const Run one = Train("gpus-reference", spec, 1);
  const Run split = Train("gpus", on_gpus, 1, gpus);
  ASSERT_EQ(split.values.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(split.results[r].ok()) << split.results[r].status();
    EXPECT_EQ(split.results[r]->step(), 12);
    for (const auto& [name, w] : one.values[0]) {
      const std::vector<float>& got = split.values[r].at(name);
      ASSERT_EQ(got.size(), w.size()) << name;
      for (size_t i = 0; i < w.size(); ++i) {
        EXPECT_NEAR(got[i], w[i], 1e-3f + 1e-3f * std::abs(w[i])) << name << "[" << i << "]";
      }
    }
  }
}

TEST_F(CpuReplicasTest, RefusesABadCountAndReplicasOnCuda) {
  v1::JobSpec spec = Spec();
  DistributedOptions o = RankOptions("refused", spec, 0, shards_->addresses());
  o.cpu_devices = 0;
  auto zero = DistributedTrainer::Create(o);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("devices: cpu:N"));
  o.cpu_devices = 2;
  o.device = "cuda";
  auto cuda = DistributedTrainer::Create(o);
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cuda.status().message(), HasSubstr("trains on the CPU"));
  // GPUs and cpu:N at once, or GPUs with a spec that asks for the CPU.
  o.device = "";
  o.cuda_devices = {0};
  auto both = DistributedTrainer::Create(o);
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("name one or the other"));
  o.cpu_devices = 1;
  o.device = "cpu";
  auto cpu = DistributedTrainer::Create(o);
  EXPECT_EQ(cpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cpu.status().message(), HasSubstr("GPUs were named"));
}

}  // namespace
}  // namespace tessera::trainer
