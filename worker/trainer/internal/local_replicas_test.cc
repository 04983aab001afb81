// cpu:N replicas in one worker: N replicas with B/N examples each reduce to the gradient one
// device computes with B, for even and uneven splits and batches smaller than N, and for
// regression targets; BatchNorm state is the replicas' mean; with SyncBN the replicas train
// exactly as one device with the whole batch, and a failing replica does not leave the others
// waiting; Install keeps the replicas equal; sparse tables (an embedding_bag first layer, a
// multi-input model with a wide table and a dot interaction) give one device's row gradients.
#include "worker/trainer/internal/local_replicas.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "worker/trainer/testing/one_device.h"

namespace tessera::trainer::internal {
namespace {

using namespace ::tessera::trainer::testing_devices;  // NOLINT: the tests' shared helpers

using ::testing::HasSubstr;

constexpr char kBatchNormMlp[] = R"pb(
  input_shape: [ 3 ]
  layers { batch_norm {} }
  layers { dense { units: 4 } }
  layers { relu {} }
  layers { dense { units: 2 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

// BatchNorm after a convolution (per channel over N, H, W) and after a dense layer, both SyncBN.
constexpr char kSyncBatchNormCnn[] = R"pb(
  input_shape: [ 2, 4, 4 ]
  layers { conv2d { filters: 3 kernel_h: 3 kernel_w: 3 padding_h: 1 padding_w: 1 } }
  layers { batch_norm { sync: true } }
  layers { relu {} }
  layers { flatten {} }
  layers { dense { units: 4 } }
  layers { batch_norm { sync: true momentum: 0.3 } }
  layers { dense { units: 3 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

// n CPU replicas, or one on each of `gpus` (n is then their number).
std::unique_ptr<LocalReplicas> Replicas(const v1::ModelSpec& spec, int n,
                                        const std::vector<int>& gpus = {}) {
  LocalReplicas::Options o;
  o.devices = n;
  o.threads = 1;
  o.cuda_devices = gpus;
  auto r = LocalReplicas::Create(spec, 11, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

TEST(LocalReplicasTest, NReplicasWithBOverNExamplesGiveTheGradientOfOneDeviceWithB) {
  const v1::ModelSpec spec = Parse(kSmallCnn);
  // Even (12 over 1, 2, 4), uneven (10 over 4: 3, 3, 2, 2) and smaller than N (3 over 4).
  for (const auto& [n, size] : {std::pair{1, 12}, {2, 12}, {4, 12}, {4, 10}, {4, 3}}) {
    SCOPED_TRACE(testing::Message() << "cpu:" << n << ", batch " << size);
    const Batch batch = RandomBatch(size, 36, 3, static_cast<uint32_t>(size * 7 + n));
    Reference one = OneDevice(spec);
    absl::StatusOr<engine::StepResult> expected = one.model->TrainStep(batch.View());
    ASSERT_TRUE(expected.ok()) << expected.status();

    std::unique_ptr<LocalReplicas> replicas = Replicas(spec, n);
    ASSERT_NE(replicas, nullptr);
    ASSERT_EQ(replicas->size(), n);
    const std::vector<std::string> names = TrainableNames(*one.model);
    ASSERT_EQ(names.size(), 6u);
    std::vector<std::vector<float>> want(names.size()), got(names.size());
    for (size_t k = 0; k < names.size(); ++k) {
      ASSERT_TRUE(one.model->CopyGradToHost(names[k], &want[k]).ok());
      got[k].assign(want[k].size(), NAN);
    }
    const std::vector<bool> no_state(names.size(), false);
    absl::StatusOr<engine::StepResult> r =
        replicas->TrainStep(batch.View(), 0, names, no_state, &got);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->examples, size);
    EXPECT_EQ(r->correct, expected->correct);
    EXPECT_NEAR(r->loss, expected->loss, 1e-5);
    double norm = 0;
    for (size_t k = 0; k < names.size(); ++k) {
      ASSERT_EQ(got[k].size(), want[k].size());
      for (size_t e = 0; e < want[k].size(); ++e) {
        norm += std::abs(want[k][e]);
        EXPECT_NEAR(got[k][e], want[k][e], 1e-5f + 1e-4f * std::abs(want[k][e]))
            << names[k] << "[" << e << "]";
      }
    }
    EXPECT_GT(norm, 1e-3) << "a zero gradient would compare equal to anything";
  }
}

TEST(LocalReplicasTest, BatchNormStateIsTheMeanOfThePerReplicaMovingStatistics) {
  const v1::ModelSpec spec = Parse(kBatchNormMlp);
  const Batch batch = RandomBatch(8, 3, 2, 5);
  std::unique_ptr<LocalReplicas> replicas = Replicas(spec, 2);
  ASSERT_NE(replicas, nullptr);
  const std::vector<std::string> names = {"batch_norm_1/moving_mean", "dense_1/kernel"};
  const std::vector<bool> state = {true, false};
  std::vector<std::vector<float>> out = {std::vector<float>(3), std::vector<float>(12)};
  ASSERT_TRUE(replicas->TrainStep(batch.View(), 0, names, state, &out).ok());
  // From zeros with momentum 0.1: 0.1 x the mean over the two halves of each half's batch mean.
  for (int c = 0; c < 3; ++c) {
    double halves = 0;
    for (int half = 0; half < 2; ++half) {
      double mean = 0;
      for (int i = 0; i < 4; ++i) mean += batch.features[(half * 4 + i) * 3 + c];
      halves += mean / 4;
    }
    EXPECT_NEAR(out[0][c], 0.1 * halves / 2, 1e-6) << "channel " << c;
  }
  // Each replica still holds its own statistics until the average is installed.
  std::vector<float> m0, m1;
  ASSERT_TRUE(replicas->model(0).CopyValueToHost(names[0], &m0).ok());
  ASSERT_TRUE(replicas->model(1).CopyValueToHost(names[0], &m1).ok());
  EXPECT_NE(m0, m1);
  ASSERT_TRUE(replicas->Install({names[0]}, {out[0]}).ok());
  ASSERT_TRUE(replicas->model(0).CopyValueToHost(names[0], &m0).ok());
  ASSERT_TRUE(replicas->model(1).CopyValueToHost(names[0], &m1).ok());
  EXPECT_EQ(m0, out[0]);
  EXPECT_EQ(m1, out[0]);
}

TEST(LocalReplicasTest, ReplicasStartEqualAndInstallKeepsThemEqual) {
  const v1::ModelSpec spec = Parse(kSmallCnn);
  std::unique_ptr<LocalReplicas> replicas = Replicas(spec, 3);
  ASSERT_NE(replicas, nullptr);
  std::vector<float> w0, w2;
  ASSERT_TRUE(replicas->model(0).CopyValueToHost("dense_1/kernel", &w0).ok());
  ASSERT_TRUE(replicas->model(2).CopyValueToHost("dense_1/kernel", &w2).ok());
  EXPECT_EQ(w0, w2);
  std::vector<float> fresh(w0.size());
  for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = 0.01f * static_cast<float>(i);
  ASSERT_TRUE(replicas->Install({"dense_1/kernel"}, {fresh}).ok());
  for (int i = 0; i < 3; ++i) {
    std::vector<float> w;
    ASSERT_TRUE(replicas->model(i).CopyValueToHost("dense_1/kernel", &w).ok());
    EXPECT_EQ(w, fresh) << "replica " << i;
  }
  // A wrong size is the model's INVALID_ARGUMENT, and the replicas serve on.
  EXPECT_EQ(replicas->Install({"dense_1/kernel"}, {std::vector<float>(3)}).code(),
            absl::StatusCode::kInvalidArgument);
  const Batch batch = RandomBatch(6, 36, 3, 1);
  std::vector<std::vector<float>> out = {std::vector<float>(fresh.size())};
  const std::vector<bool> state = {false};
  EXPECT_TRUE(replicas->TrainStep(batch.View(), 0, {"dense_1/kernel"}, state, &out).ok());
}

// Every tensor's gradient (trainable) or value (state) after one step, by name.
std::map<std::string, std::vector<float>> AfterStep(const engine::Model& m) {
  std::map<std::string, std::vector<float>> out;
  for (const engine::Parameter& p : m.parameters()) {
    EXPECT_TRUE((p.trainable ? m.CopyGradToHost(p.name, &out[p.name])
                             : m.CopyValueToHost(p.name, &out[p.name]))
                    .ok());
  }
  return out;
}

// The largest difference between the replicas' step and one device's, relative to the values.
double StepDifference(const v1::ModelSpec& spec, int n, const Batch& batch, double* loss_diff) {
  Reference one = OneDevice(spec);
  absl::StatusOr<engine::StepResult> expected = one.model->TrainStep(batch.View());
  EXPECT_TRUE(expected.ok()) << expected.status();
  const std::map<std::string, std::vector<float>> want = AfterStep(*one.model);
  std::unique_ptr<LocalReplicas> replicas = Replicas(spec, n);
  if (replicas == nullptr) return 1e9;
  std::vector<std::string> names;
  std::vector<bool> state;
  std::vector<std::vector<float>> got;
  for (const engine::Parameter& p : one.model->parameters()) {
    names.push_back(p.name);
    state.push_back(!p.trainable);
    got.emplace_back(want.at(p.name).size(), NAN);
  }
  absl::StatusOr<engine::StepResult> r = replicas->TrainStep(batch.View(), 0, names, state, &got);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return 1e9;
  *loss_diff = std::abs(r->loss - expected->loss);
  double worst = 0;
  for (size_t k = 0; k < names.size(); ++k) {
    const std::vector<float>& w = want.at(names[k]);
    EXPECT_EQ(got[k].size(), w.size()) << names[k];
    for (size_t e = 0; e < w.size() && e < got[k].size(); ++e) {
      worst = std::max(worst, std::abs(static_cast<double>(got[k][e]) - w[e]) /
                                  (1e-4 + std::abs(static_cast<double>(w[e]))));
    }
  }
  return worst;
}

TEST(LocalReplicasTest, SyncBatchNormReplicasTrainExactlyAsOneDeviceWithTheWholeBatch) {
  const v1::ModelSpec spec = Parse(kSyncBatchNormCnn);
  // Even, uneven (10 over 3: 4, 3, 3) and one example per replica (3 over 4: one idle).
  for (const auto& [n, size] : {std::pair{2, 12}, {3, 10}, {4, 3}}) {
    SCOPED_TRACE(testing::Message() << "cpu:" << n << ", batch " << size);
    const Batch batch = RandomBatch(size, 32, 3, static_cast<uint32_t>(size + n));
    double loss_diff = 1;
    // Gradients and moving statistics both, to float rounding.
    EXPECT_LT(StepDifference(spec, n, batch, &loss_diff), 1e-3);
    EXPECT_LT(loss_diff, 1e-5);
  }
  // Without sync each replica normalises its own part, and the same check fails: the one above
  // is not vacuous.
  v1::ModelSpec per_device = spec;
  for (v1::Layer& layer : *per_device.mutable_layers()) {
    if (layer.has_batch_norm()) layer.mutable_batch_norm()->set_sync(false);
  }
  double loss_diff = 0;
  EXPECT_GT(StepDifference(per_device, 2, RandomBatch(12, 32, 3, 14), &loss_diff), 1e-2);
}

TEST(LocalReplicasTest, ASyncBatchNormReplicaThatFailsReleasesTheOthers) {
  std::unique_ptr<LocalReplicas> replicas = Replicas(Parse(kSyncBatchNormCnn), 2);
  ASSERT_NE(replicas, nullptr);
  Batch batch = RandomBatch(8, 32, 3, 4);
  batch.labels[6] = 9;  // replica 1's part: refused before its forward pass
  std::vector<std::vector<float>> out = {std::vector<float>(12)};
  const absl::StatusOr<engine::StepResult> r =
      replicas->TrainStep(batch.View(), 0, {"dense_2/kernel"}, {false}, &out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("batch.labels"));
  batch.labels[6] = 2;
  EXPECT_TRUE(replicas->TrainStep(batch.View(), 0, {"dense_2/kernel"}, {false}, &out).ok());
}

TEST(LocalReplicasTest, RegressionTargetsTravelWithTheirExamples) {
  const v1::ModelSpec spec = Parse(R"pb(
    input_shape: [ 3 ]
    layers { dense { units: 5 } }
    layers { tanh {} }
    layers { dense { units: 2 } }
    loss: LOSS_MEAN_SQUARED_ERROR
  )pb");
  const Batch batch = WithTargets(RandomBatch(9, 3, 2, 8), 2);
  double loss_diff = 1;
  EXPECT_LT(StepDifference(spec, 2, batch, &loss_diff), 1e-3);
  EXPECT_LT(loss_diff, 1e-5);
}

// A sparse batch laid out as the trainer's row exchange gives it: ids are positions among each
// table's installed rows (rows[t] of them), bags of 0 to 3 ids with per-id weights, and one 0/1
// target per example.
struct SparseBatch {
  int64_t size = 0;
  std::vector<float> features, targets;
  // Per view (the single bag input, or per (table, field) pair of a multi-input model).
  std::vector<std::vector<int64_t>> offsets, ids;
  std::vector<std::vector<float>> values;
  std::vector<engine::SparseFieldView> fields;
  engine::BatchView View() {
    engine::BatchView v;
    v.size = size;
    v.features = features;
    v.targets = targets;
    if (fields.empty() && offsets.size() == 1 && features.empty()) {
      v.sparse_offsets = offsets[0];
      v.sparse_ids = ids[0];
      v.sparse_values = values[0];
      return v;
    }
    fields.clear();
    for (size_t f = 0; f < offsets.size(); ++f) fields.push_back({offsets[f], ids[f], values[f]});
    v.fields = fields;
    return v;
  }
};

// `views_rows[f]`: the rows of the table view f reads; `dense` features per example.
SparseBatch RandomSparseBatch(int64_t size, int64_t dense, const std::vector<int64_t>& view_rows,
                              uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> x(0.0f, 1.0f);
  SparseBatch b;
  b.size = size;
  for (int64_t i = 0; i < size * dense; ++i) b.features.push_back(x(rng));
  for (int64_t i = 0; i < size; ++i) b.targets.push_back(static_cast<float>(rng() % 2));
  for (int64_t rows : view_rows) {
    std::vector<int64_t> offsets = {0}, ids;
    std::vector<float> values;
    for (int64_t e = 0; e < size; ++e) {
      // Some bags empty, except in small batches, where every view must touch some row.
      const int bag = static_cast<int>(size < 4 ? 1 + rng() % 3 : rng() % 4);
      for (int j = 0; j < bag; ++j) {
        ids.push_back(static_cast<int64_t>(rng() % static_cast<uint32_t>(rows)));
        values.push_back(0.5f + 0.25f * static_cast<float>(rng() % 4));
      }
      offsets.push_back(static_cast<int64_t>(ids.size()));
    }
    b.offsets.push_back(std::move(offsets));
    b.ids.push_back(std::move(ids));
    b.values.push_back(std::move(values));
  }
  return b;
}

// An embedding_bag first layer, and DLRM's shape: a bottom MLP, tables "a" (two fields) and "b",
// a wide table over all three fields, the dot interaction.
constexpr char kBagModel[] = R"pb(
  input_shape: [ 40 ]
  layers { embedding_bag { num_rows: 40 dim: 3 } }
  layers { dense { units: 4 } }
  layers { tanh {} }
  layers { dense { units: 1 } }
  loss: LOSS_SIGMOID_CROSS_ENTROPY
)pb";
constexpr char kMultiTableModel[] = R"pb(
  dense_features: 2
  bottom_layers { dense { units: 3 } }
  bottom_layers { tanh {} }
  tables { name: "a" dim: 3 }
  tables { name: "b" dim: 3 }
  tables { name: "w" dim: 1 }
  wide_table: "w"
  sparse_features { table: "a" combiner: COMBINER_MEAN }
  sparse_features { table: "a" combiner: COMBINER_MEAN }
  sparse_features { table: "b" }
  interaction { kind: KIND_DOT }
  layers { dense { units: 4 } }
  layers { relu {} }
  layers { dense { units: 1 } }
  loss: LOSS_SIGMOID_CROSS_ENTROPY
)pb";

// The replicas (n on the CPU, or one per GPU of `gpus`) against one CPU device with the whole
// batch: the dense and the row gradients, to `tolerance` (relative, plus a tenth of it absolute).
void ExpectSparseStepsMatch(const std::vector<int>& gpus, float tolerance) {
  struct Case {
    const char* spec;
    std::vector<int64_t> table_rows;  // rows installed per table
    std::vector<int64_t> view_rows;   // per view of the batch, its table's rows
    int64_t dense;
  };
  const std::vector<Case> cases = {
      {kBagModel, {9}, {9}, 0},
      // Views: a's two fields, b's, then the wide table's over the three fields.
      {kMultiTableModel, {7, 5, 11}, {7, 7, 5, 11, 11, 11}, 2},
  };
  std::vector<std::pair<int, int64_t>> splits = {{1, 12}, {2, 12}, {4, 10}, {4, 3}};
  if (!gpus.empty()) {
    const int n = static_cast<int>(gpus.size());
    splits = {{n, 12}, {n, n > 1 ? int64_t{n - 1} : 1}};  // also a batch that idles one GPU
  }
  for (const Case& c : cases) {
    const v1::ModelSpec spec = Parse(c.spec);
    for (const auto& [n, size] : splits) {
      SCOPED_TRACE(testing::Message()
                   << (c.dense == 0 ? "bag" : "multi-table") << ", "
                   << (gpus.empty() ? "cpu:" : "GPUs: ") << n << ", batch " << size);
      SparseBatch batch = RandomSparseBatch(size, c.dense, c.view_rows, 31 * size + n);
      std::mt19937 rng(7);
      std::normal_distribution<float> w(0.0f, 0.5f);
      Reference one = OneDevice(spec);
      ASSERT_NE(one.model, nullptr);
      const std::vector<engine::SparseTableInfo>& tables = one.model->sparse_tables();
      ASSERT_EQ(tables.size(), c.table_rows.size());
      std::vector<std::vector<float>> rows(tables.size());
      for (size_t t = 0; t < tables.size(); ++t) {
        for (int64_t e = 0; e < c.table_rows[t] * tables[t].dim; ++e) rows[t].push_back(w(rng));
        ASSERT_TRUE(one.model->SetRows(static_cast<int>(t), c.table_rows[t], rows[t]).ok());
      }
      absl::StatusOr<engine::StepResult> expected = one.model->TrainStep(batch.View());
      ASSERT_TRUE(expected.ok()) << expected.status();

      std::unique_ptr<LocalReplicas> replicas = Replicas(spec, n, gpus);
      ASSERT_NE(replicas, nullptr);
      for (size_t t = 0; t < tables.size(); ++t) {
        ASSERT_TRUE(replicas->SetRows(static_cast<int>(t), c.table_rows[t], rows[t]).ok());
      }
      std::vector<std::string> names;
      for (const engine::Parameter& p : one.model->parameters()) {
        if (p.trainable && !p.sparse) names.push_back(p.name);
      }
      std::vector<std::vector<float>> want(names.size()), got(names.size());
      for (size_t k = 0; k < names.size(); ++k) {
        ASSERT_TRUE(one.model->CopyGradToHost(names[k], &want[k]).ok());
        got[k].assign(want[k].size(), NAN);
      }
      absl::StatusOr<engine::StepResult> r =
          replicas->TrainStep(batch.View(), 0, names, std::vector<bool>(names.size(), false), &got);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->examples, size);
      EXPECT_NEAR(r->loss, expected->loss, 10 * tolerance);
      for (size_t t = 0; t < tables.size(); ++t) {
        names.push_back(tables[t].name);
        want.emplace_back();
        ASSERT_TRUE(one.model->CopyGradToHost(tables[t].name, &want.back()).ok());
        got.emplace_back();
        ASSERT_TRUE(replicas->CopyRowGrads(static_cast<int>(t), &got.back()).ok());
      }
      for (size_t k = 0; k < names.size(); ++k) {
        ASSERT_EQ(got[k].size(), want[k].size()) << names[k];
        double norm = 0;
        for (size_t e = 0; e < want[k].size(); ++e) {
          norm += std::abs(want[k][e]);
          EXPECT_NEAR(got[k][e], want[k][e], tolerance / 10 + tolerance * std::abs(want[k][e]))
              << names[k] << "[" << e << "]";
        }
        EXPECT_GT(norm, 1e-4) << names[k] << ": a zero gradient would compare equal to anything";
      }
    }
  }
}

TEST(LocalReplicasTest, SparseTablesGiveTheRowGradientsOfOneDeviceWithTheWholeBatch) {
  ExpectSparseStepsMatch({}, 1e-4f);
}

// On GPUs (up to 4; NCCL sums the gradients where there are several): the dense CNN and the
// sparse models give the CPU device's gradients, to the looser tolerance of cuDNN against oneDNN.
TEST(LocalReplicasTest, GpuReplicasGiveTheGradientOfOneCpuDeviceWithTheWholeBatch) {
  const int count = kernels::CudaDeviceCount();
  if (count < 1) GTEST_SKIP() << "no CUDA device: " << kernels::CudaUnavailableReason();
  std::vector<int> gpus;
  for (int d = 0; d < std::min(count, 4); ++d) gpus.push_back(d);
  const int n = static_cast<int>(gpus.size());
  const v1::ModelSpec spec = Parse(kSmallCnn);
  const Batch batch = RandomBatch(12, 36, 3, 21);
  Reference one = OneDevice(spec);
  ASSERT_TRUE(one.model->TrainStep(batch.View()).ok());
  std::unique_ptr<LocalReplicas> replicas = Replicas(spec, n, gpus);
  ASSERT_NE(replicas, nullptr);
  EXPECT_THAT(replicas->Describe(), HasSubstr("GPU replicas (cuda:0"));
  const std::vector<std::string> names = TrainableNames(*one.model);
  std::vector<std::vector<float>> want(names.size()), got(names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    ASSERT_TRUE(one.model->CopyGradToHost(names[k], &want[k]).ok());
    got[k].assign(want[k].size(), NAN);
  }
  // Twice: NCCL sums into replica 0's gradients, which the second step must overwrite.
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(
        replicas->TrainStep(batch.View(), 0, names, std::vector<bool>(names.size(), false), &got)
            .ok());
    for (size_t k = 0; k < names.size(); ++k) {
      for (size_t e = 0; e < want[k].size(); ++e) {
        EXPECT_NEAR(got[k][e], want[k][e], 1e-4f + 1e-3f * std::abs(want[k][e]))
            << names[k] << "[" << e << "] step " << step;
      }
    }
  }
  ExpectSparseStepsMatch(gpus, 1e-3f);
}

TEST(LocalReplicasTest, AGpuThatIsNotThereIsRefusedNamingIt) {
  const int count = kernels::CudaDeviceCount();
  LocalReplicas::Options o;
  o.devices = 2;
  o.cuda_devices = {0, count};
  const absl::Status refused = LocalReplicas::Create(Parse(kSmallCnn), 1, o).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  // A build without NCCL refuses any GPU list, saying so.
  EXPECT_THAT(refused.message(),
              ::testing::AnyOf(HasSubstr(absl::StrCat("cuda:", count, " is not usable")),
                               HasSubstr("built without NCCL")));
}

TEST(LocalReplicasTest, RefusesBadCounts) {
  LocalReplicas::Options o;
  o.devices = 0;
  auto zero = LocalReplicas::Create(Parse(kSmallCnn), 1, o);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("cpu:N"));
  // A spec the engine refuses comes back with the replica named, and nothing is left running.
  v1::ModelSpec bad = Parse(kSmallCnn);
  bad.mutable_layers(0)->mutable_conv2d()->set_filters(0);
  o.devices = 2;
  auto engine_error = LocalReplicas::Create(bad, 1, o);
  EXPECT_EQ(engine_error.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(engine_error.status().message(), HasSubstr("cpu replica"));
}

}  // namespace
}  // namespace tessera::trainer::internal
