// Multi-input models (DLRM, Wide & Deep) on the CPU backend: the forward pass against a
// reference computed here in double from the parameters (the concatenation order, DLRM's pair
// order, the wide part, shared tables, weighted and mean-pooled fields), the gradients against
// central differences of the loss, and bad batches refused by name.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/engine/model.h"

namespace tessera::engine {
namespace {

using kernels::Backend;

std::unique_ptr<Backend> CpuBackend() {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  auto b = kernels::CreateBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

// A batch of dense features and fields that owns its storage.
struct OwnedFields {
  int64_t size = 0;
  std::vector<float> features, targets;
  std::vector<std::vector<int64_t>> offsets, ids;
  std::vector<std::vector<float>> values;
  std::vector<SparseFieldView> views;
  // The model reads each field once per table that reads it (the same ids serve every table:
  // each has the same rows installed).
  BatchView View(const Model& m) {
    views.clear();
    for (const SparseTableInfo& t : m.sparse_tables()) {
      for (int f : t.fields) {
        if (f < static_cast<int>(offsets.size())) views.push_back({offsets[f], ids[f], values[f]});
      }
    }
    BatchView v;
    v.size = size;
    v.features = features;
    v.targets = targets;
    v.fields = views;
    return v;
  }
};

v1::Layer Dense(int64_t units) {
  v1::Layer l;
  l.mutable_dense()->set_units(units);
  return l;
}

v1::Layer Tanh() {
  v1::Layer l;
  l.mutable_tanh();
  return l;
}

void AddTable(v1::ModelSpec* spec, const std::string& name, int64_t dim) {
  v1::EmbeddingTable* t = spec->add_tables();
  t->set_name(name);
  t->set_dim(dim);
}

void AddField(v1::ModelSpec* spec, const std::string& table,
              v1::EmbeddingBag::Combiner combiner = v1::EmbeddingBag::COMBINER_SUM) {
  v1::SparseFeature* f = spec->add_sparse_features();
  f->set_table(table);
  f->set_combiner(combiner);
}

// DLRM-shaped: 3 dense features, a bottom Dense(4) and tanh, fields f0 and f2 in table "a"
// (dim 4), f1 in table "b" (dim 4, mean pooled), the dot interaction, a top Dense(3) tanh
// Dense(1), sigmoid cross-entropy.
v1::ModelSpec DlrmSpec() {
  v1::ModelSpec spec;
  spec.set_dense_features(3);
  *spec.add_bottom_layers() = Dense(4);
  *spec.add_bottom_layers() = Tanh();
  AddTable(&spec, "a", 4);
  AddTable(&spec, "b", 4);
  AddField(&spec, "a");
  AddField(&spec, "b", v1::EmbeddingBag::COMBINER_MEAN);
  AddField(&spec, "a");
  spec.mutable_interaction()->set_kind(v1::Interaction::KIND_DOT);
  *spec.add_layers() = Dense(3);
  *spec.add_layers() = Tanh();
  *spec.add_layers() = Dense(1);
  spec.set_loss(v1::LOSS_SIGMOID_CROSS_ENTROPY);
  return spec;
}

// Wide & Deep-shaped: 2 dense features, no bottom layers, fields f0 (table "a", dim 3) and f1
// (table "b", dim 2), the concatenation, a top Dense(4) tanh Dense(1), and the wide table "w"
// (dim 1) over both fields.
v1::ModelSpec WideDeepSpec() {
  v1::ModelSpec spec;
  spec.set_dense_features(2);
  AddTable(&spec, "a", 3);
  AddTable(&spec, "b", 2);
  AddTable(&spec, "w", 1);
  AddField(&spec, "a");
  AddField(&spec, "b");
  spec.set_wide_table("w");
  *spec.add_layers() = Dense(4);
  *spec.add_layers() = Tanh();
  *spec.add_layers() = Dense(1);
  spec.set_loss(v1::LOSS_SIGMOID_CROSS_ENTROPY);
  return spec;
}

// 4 examples over 3 fields: empty bags, repeated ids, weights on field 0.
OwnedFields SmallBatch(int fields, int64_t dense, std::mt19937* rng) {
  OwnedFields b;
  b.size = 4;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  b.features.resize(static_cast<size_t>(4 * dense));
  for (float& f : b.features) f = normal(*rng);
  b.targets = {1.0f, 0.0f, 1.0f, 0.0f};
  const std::vector<std::vector<int64_t>> offsets = {
      {0, 2, 2, 3, 5}, {0, 1, 3, 3, 4}, {0, 1, 2, 4, 5}};
  const std::vector<std::vector<int64_t>> ids = {{0, 2, 1, 0, 0}, {1, 0, 1, 2}, {3, 1, 2, 0, 3}};
  for (int f = 0; f < fields; ++f) {
    b.offsets.push_back(offsets[f]);
    b.ids.push_back(ids[f]);
    b.values.push_back(f == 0 ? std::vector<float>{0.5f, -1.5f, 2.0f, 1.0f, 0.25f}
                              : std::vector<float>{});
  }
  return b;
}

// Installs `rows` random rows in every table and random values in every dense parameter.
std::vector<std::vector<float>> Randomise(Model* model, int64_t rows, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<std::vector<float>> tables;
  for (size_t t = 0; t < model->sparse_tables().size(); ++t) {
    std::vector<float> v(static_cast<size_t>(rows * model->sparse_tables()[t].dim));
    for (float& x : v) x = normal(*rng);
    EXPECT_TRUE(model->SetRows(static_cast<int>(t), rows, v).ok());
    tables.push_back(std::move(v));
  }
  for (const Parameter& p : model->parameters()) {
    if (!p.trainable || p.sparse) continue;
    std::vector<float> v(static_cast<size_t>(kernels::NumElements(p.shape)));
    for (float& x : v) x = normal(*rng);
    EXPECT_TRUE(model->CopyValueFromHost(p.name, v).ok());
  }
  return tables;
}

std::vector<double> Values(const Model& m, const std::string& name) {
  std::vector<float> v;
  EXPECT_TRUE(m.CopyValueToHost(name, &v).ok()) << name;
  return std::vector<double>(v.begin(), v.end());
}

// y = W x + b, W [out, in].
std::vector<double> DenseRef(const Model& m, const std::string& layer,
                             const std::vector<double>& x) {
  const std::vector<double> w = Values(m, layer + "/kernel"), b = Values(m, layer + "/bias");
  std::vector<double> y(b);
  const size_t in = x.size();
  for (size_t o = 0; o < y.size(); ++o) {
    for (size_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
  }
  return y;
}

std::vector<double> TanhRef(std::vector<double> x) {
  for (double& v : x) v = std::tanh(v);
  return x;
}

// The pooled bag b of `field` over `table` rows of `dim`.
std::vector<double> Pool(const OwnedFields& batch, int field, int64_t b,
                         const std::vector<float>& table, int64_t dim, bool mean) {
  std::vector<double> e(static_cast<size_t>(dim), 0.0);
  const int64_t lo = batch.offsets[field][b], hi = batch.offsets[field][b + 1];
  for (int64_t j = lo; j < hi; ++j) {
    const double w = batch.values[field].empty() ? 1.0 : batch.values[field][j];
    for (int64_t d = 0; d < dim; ++d) e[d] += w * table[batch.ids[field][j] * dim + d];
  }
  if (mean && hi > lo) {
    for (double& v : e) v /= static_cast<double>(hi - lo);
  }
  return e;
}

TEST(MultiInputModelTest, DlrmForwardIsTheDotInteractionOfBottomAndPooledFields) {
  auto backend = CpuBackend();
  const v1::ModelSpec spec = DlrmSpec();
  auto model = Model::Create(spec, backend.get(), 3);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  ASSERT_TRUE(m.multi_input());
  ASSERT_EQ(m.sparse_tables().size(), 2u);
  EXPECT_EQ(m.sparse_tables()[0].name, "a/embeddings");
  EXPECT_EQ(m.sparse_tables()[0].fields, (std::vector<int>{0, 2}));
  EXPECT_EQ(m.sparse_tables()[1].fields, (std::vector<int>{1}));
  // The top's input: u (4) and the 6 dot products of 4 vectors.
  EXPECT_EQ(m.input_dim(), 4 + 6);
  std::mt19937 rng(7);
  const auto tables = Randomise(&m, 4, &rng);
  OwnedFields batch = SmallBatch(3, 3, &rng);
  std::vector<float> out;
  ASSERT_TRUE(m.Predict(batch.View(m), &out).ok());
  ASSERT_EQ(out.size(), 4u);
  for (int64_t b = 0; b < 4; ++b) {
    std::vector<double> x(batch.features.begin() + b * 3, batch.features.begin() + b * 3 + 3);
    const std::vector<double> u = TanhRef(DenseRef(m, "bottom_dense_1", x));
    const std::vector<std::vector<double>> v = {u, Pool(batch, 0, b, tables[0], 4, false),
                                                Pool(batch, 1, b, tables[1], 4, true),
                                                Pool(batch, 2, b, tables[0], 4, false)};
    std::vector<double> z = u;
    for (int i = 1; i < 4; ++i) {
      for (int j = 0; j < i; ++j) {
        double dot = 0;
        for (int d = 0; d < 4; ++d) dot += v[i][d] * v[j][d];
        z.push_back(dot);
      }
    }
    const std::vector<double> y = DenseRef(m, "dense_2", TanhRef(DenseRef(m, "dense_1", z)));
    EXPECT_NEAR(out[b], y[0], 1e-5 * std::max(1.0, std::fabs(y[0]))) << "example " << b;
  }
}

TEST(MultiInputModelTest, WideAndDeepForwardAddsTheWideSumToTheDeepLogit) {
  auto backend = CpuBackend();
  const v1::ModelSpec spec = WideDeepSpec();
  auto model = Model::Create(spec, backend.get(), 5);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  ASSERT_EQ(m.sparse_tables().size(), 3u);
  EXPECT_EQ(m.sparse_tables()[2].fields, (std::vector<int>{0, 1}));  // the wide table reads all
  EXPECT_EQ(m.input_dim(), 2 + 3 + 2);
  std::mt19937 rng(9);
  const auto tables = Randomise(&m, 4, &rng);
  OwnedFields batch = SmallBatch(2, 2, &rng);
  std::vector<float> out;
  ASSERT_TRUE(m.Predict(batch.View(m), &out).ok());
  for (int64_t b = 0; b < 4; ++b) {
    std::vector<double> z(batch.features.begin() + b * 2, batch.features.begin() + b * 2 + 2);
    for (double v : Pool(batch, 0, b, tables[0], 3, false)) z.push_back(v);
    for (double v : Pool(batch, 1, b, tables[1], 2, false)) z.push_back(v);
    double y = DenseRef(m, "dense_2", TanhRef(DenseRef(m, "dense_1", z)))[0];
    y += Pool(batch, 0, b, tables[2], 1, false)[0] + Pool(batch, 1, b, tables[2], 1, false)[0];
    EXPECT_NEAR(out[b], y, 1e-5 * std::max(1.0, std::fabs(y))) << "example " << b;
  }
}

// The mean sigmoid cross-entropy of outputs y against the batch's targets, in double.
double Loss(const std::vector<float>& y, const OwnedFields& b) {
  double total = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double x = y[i], t = b.targets[i];
    total += std::max(x, 0.0) - x * t + std::log1p(std::exp(-std::fabs(x)));
  }
  return total / static_cast<double>(y.size());
}

void CheckGradients(const v1::ModelSpec& spec, int fields, int64_t dense, uint32_t seed) {
  auto backend = CpuBackend();
  auto model = Model::Create(spec, backend.get(), seed);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  std::mt19937 rng(seed);
  Randomise(&m, 4, &rng);
  OwnedFields batch = SmallBatch(fields, dense, &rng);
  auto step = m.TrainStep(batch.View(m));
  ASSERT_TRUE(step.ok()) << step.status();
  auto loss_at = [&]() {
    std::vector<float> y;
    EXPECT_TRUE(m.Forward(batch.View(m), /*training=*/true, &y).ok());
    return Loss(y, batch);
  };
  EXPECT_NEAR(step->loss, loss_at(), 1e-5);
  int parameters = 0;
  for (const Parameter& p : m.parameters()) {
    if (!p.trainable) continue;
    ++parameters;
    std::vector<float> analytic, values;
    ASSERT_TRUE(m.CopyGradToHost(p.name, &analytic).ok());
    ASSERT_TRUE(m.CopyValueToHost(p.name, &values).ok());
    double norm2 = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      const float original = values[i];
      const double eps = 2e-3;
      values[i] = static_cast<float>(original + eps);
      ASSERT_TRUE(m.CopyValueFromHost(p.name, values).ok());
      const double up = loss_at();
      values[i] = static_cast<float>(original - eps);
      ASSERT_TRUE(m.CopyValueFromHost(p.name, values).ok());
      const double down = loss_at();
      values[i] = original;
      ASSERT_TRUE(m.CopyValueFromHost(p.name, values).ok());
      const double numeric = (up - down) / (2 * eps);
      EXPECT_NEAR(analytic[i], numeric, 2e-4 + 1e-2 * std::fabs(numeric))
          << p.name << "[" << i << "]";
      norm2 += numeric * numeric;
    }
    EXPECT_GT(norm2, 0.0) << p.name << ": all gradients are zero, the check proves nothing";
  }
  EXPECT_EQ(parameters, static_cast<int>(m.parameters().size()));
}

TEST(MultiInputModelTest, DlrmGradientsMatchFiniteDifferences) {
  CheckGradients(DlrmSpec(), 3, 3, 11);
}

TEST(MultiInputModelTest, WideAndDeepGradientsMatchFiniteDifferences) {
  CheckGradients(WideDeepSpec(), 2, 2, 13);
}

TEST(MultiInputModelTest, DotWithoutDenseFeaturesUsesTheFieldsAlone) {
  v1::ModelSpec spec;
  AddTable(&spec, "a", 4);
  AddField(&spec, "a");
  AddField(&spec, "a");
  AddField(&spec, "a");
  spec.mutable_interaction()->set_kind(v1::Interaction::KIND_DOT);
  *spec.add_layers() = Dense(1);
  spec.set_loss(v1::LOSS_SIGMOID_CROSS_ENTROPY);
  auto backend = CpuBackend();
  auto model = Model::Create(spec, backend.get(), 1);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->input_dim(), 3);  // three pairs
  CheckGradients(spec, 3, 0, 17);
}

TEST(MultiInputModelTest, BadBatchesAreRefusedByName) {
  auto backend = CpuBackend();
  auto model = Model::Create(DlrmSpec(), backend.get(), 3);
  ASSERT_TRUE(model.ok()) << model.status();
  std::mt19937 rng(1);
  Randomise(model->get(), 4, &rng);
  auto refused = [&](OwnedFields b, const std::string& what) {
    auto step = (*model)->TrainStep(b.View(**model));
    ASSERT_FALSE(step.ok()) << what;
    EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(step.status().message().find(what), std::string::npos) << step.status();
  };
  OwnedFields b = SmallBatch(3, 3, &rng);
  b.features.pop_back();
  refused(b, "batch.features");
  b = SmallBatch(2, 3, &rng);
  refused(b, "batch.fields: the model's tables read 3 (table, field) pairs, got 2");
  b = SmallBatch(3, 3, &rng);
  b.ids[1][2] = 4;  // only 4 rows installed; field 1 is the third use (table b's)
  refused(b, "batch.fields[2].ids[2]: position 4 is outside the 4 rows of b/embeddings");
  b = SmallBatch(3, 3, &rng);
  b.offsets[2][2] = 0;  // field 2 is table a's second use
  refused(b, "batch.fields[1].offsets[2]");
  b = SmallBatch(3, 3, &rng);
  b.offsets[0].pop_back();
  refused(b, "batch.fields[0].offsets: expected 5 entries");
  // The model still trains.
  EXPECT_TRUE((*model)->TrainStep(SmallBatch(3, 3, &rng).View(**model)).ok());
}

}  // namespace
}  // namespace tessera::engine
