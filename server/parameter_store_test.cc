// ParameterStore: job state, updates against reference optimizers, sparse tables, exactly-once,
// validation, memory budgets. The answers (pieced gradients, shared weights) and the statistics
// are in parameter_store_answers_test.cc, checkpoints in parameter_store_checkpoint_test.cc.
#include "server/parameter_store.h"

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/store_calls.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;   // NOLINT: request builders
using namespace ::tessera::server::store_calls;  // NOLINT: store calls

// --- CreateJobState --------------------------------------------------------------------------

TEST(ParameterStoreTest, CreateJobStateIsAdditiveAndIdempotent) {
  ParameterStore store;
  v1::CreateJobStateRequest r = JobRequest("j", Config(v1::CONSISTENCY_ASP, 2, 0.5f));
  *r.add_partitions() = Dense("w", 0, 4, {1, 2, 3, 4});
  auto first = store.CreateJobState(r);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->partitions(), 1u);

  // Same declaration again plus a new partition: the existing one keeps its (updated) weights.
  ASSERT_TRUE(store.Push(Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {2, 2, 2, 2})})).ok());
  *r.add_partitions() = Dense("w", 1, 3);
  auto second = store.CreateJobState(r);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->partitions(), 2u);
  EXPECT_EQ(PullDense(store, "j", "w", 0), (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(PullDense(store, "j", "w", 1), (std::vector<float>{0, 0, 0}));
}

TEST(ParameterStoreTest, CreateJobStateRefusesConflicts) {
  ParameterStore store;
  v1::CreateJobStateRequest r = JobRequest("j", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
  *r.add_partitions() = Dense("w", 0, 4);
  ASSERT_TRUE(store.CreateJobState(r).ok());

  v1::CreateJobStateRequest resized = r;
  resized.mutable_partitions(0)->set_num_elements(5);
  *resized.add_partitions() = Dense("fresh", 0, 2);
  auto status = store.CreateJobState(resized).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("w/0"));
  // All or nothing: the fresh partition of the refused call does not exist.
  EXPECT_EQ(PullNow(store, "j", {PullKey("fresh", 0)}).status().code(),
            absl::StatusCode::kNotFound);

  v1::CreateJobStateRequest other_config = r;
  other_config.mutable_config()->set_num_workers(3);
  status = store.CreateJobState(other_config).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("config"));
}

struct BadConfigCase {
  std::string name;
  std::function<void(v1::CreateJobStateRequest*)> mutate;
  std::string field;
};

TEST(ParameterStoreTest, CreateJobStateValidatesEveryField) {
  const std::vector<BadConfigCase> cases = {
      {"no workers", [](auto* r) { r->mutable_config()->set_num_workers(0); },
       "config.num_workers"},
      {"bad lr", [](auto* r) { r->mutable_config()->mutable_optimizer()->set_learning_rate(-1); },
       "learning_rate"},
      {"staleness without SSP", [](auto* r) { r->mutable_config()->set_staleness(3); },
       "config.staleness"},
      {"bad schedule",
       [](auto* r) {
         r->mutable_config()->mutable_schedule()->set_kind(v1::LearningRateSchedule::KIND_STEP);
       },
       "config."},
      {"bad consistency",
       [](auto* r) { r->mutable_config()->set_consistency(static_cast<v1::Consistency>(17)); },
       "config.consistency"},
      {"empty partition", [](auto* r) { *r->add_partitions() = Dense("x", 0, 0); },
       "partitions[0].num_elements"},
      {"short initial values",
       [](auto* r) {
         *r->add_partitions() = Dense("x", 0, 3, {1, 2});
       },
       "partitions[0].initial_values"},
      {"table dim 0",
       [](auto* r) {
         auto* t = r->add_tables();
         t->set_name("emb");
       },
       "tables[0].dim"},
      {"table momentum",
       [](auto* r) {
         auto* t = r->add_tables();
         t->set_name("emb");
         t->set_dim(4);
         t->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
         t->mutable_optimizer()->set_learning_rate(0.1f);
       },
       "tables[0]"},
      {"empty job id", [](auto* r) { r->set_job_id(""); }, "job_id"},
      {"same key twice with other sizes",
       [](auto* r) {
         *r->add_partitions() = Dense("x", 0, 3);
         *r->add_partitions() = Dense("x", 0, 5);
       },
       "partitions[1].key"},
      {"table and partition of one name",
       [](auto* r) {
         *r->add_partitions() = Dense("emb", 0, 3);
         auto* t = r->add_tables();
         t->set_name("emb");
         t->set_dim(4);
       },
       "tables[0].name"},
      {"empty tensor name", [](auto* r) { *r->add_partitions() = Dense("", 0, 3); },
       "partitions[0].key.tensor"},
      {"huge partition", [](auto* r) { *r->add_partitions() = Dense("x", 0, int64_t{1} << 40); },
       "partitions[0].num_elements"},
      {"huge table dim",
       [](auto* r) {
         auto* t = r->add_tables();
         t->set_name("emb");
         t->set_dim(1u << 31);
       },
       "tables[0].dim"},
      {"huge num_workers", [](auto* r) { r->mutable_config()->set_num_workers(1u << 31); },
       "config.num_workers"},
  };
  for (const BadConfigCase& c : cases) {
    SCOPED_TRACE(c.name);
    ParameterStore store;
    v1::CreateJobStateRequest r = JobRequest("j", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
    c.mutate(&r);
    auto status = store.CreateJobState(r).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(c.field));
  }
}

// --- Reference model -------------------------------------------------------------------------

// A naive optimizer in double precision, written from the formulas in kernels/optimizer.h.
struct ReferenceOptimizer {
  v1::OptimizerKind kind;
  double lr;
  double momentum = 0.5;
  double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  double init_acc = 0.1;

  struct State {
    std::vector<double> w, s0, s1;
    int64_t t = 0;
  };

  State Make(const std::vector<float>& initial) const {
    State s;
    s.w.assign(initial.begin(), initial.end());
    s.s0.assign(initial.size(), kind == v1::OPTIMIZER_KIND_ADAGRAD ? init_acc : 0.0);
    s.s1.assign(initial.size(), 0.0);
    return s;
  }

  void Apply(State& s, const std::vector<float>& g, double scale) const {
    ++s.t;
    for (size_t i = 0; i < g.size(); ++i) {
      const double gi = scale * g[i];
      switch (kind) {
        case v1::OPTIMIZER_KIND_SGD:
          s.w[i] -= lr * gi;
          break;
        case v1::OPTIMIZER_KIND_MOMENTUM:
          s.s0[i] = momentum * s.s0[i] + gi;
          s.w[i] -= lr * s.s0[i];
          break;
        case v1::OPTIMIZER_KIND_ADAGRAD:
          s.s0[i] += gi * gi;
          s.w[i] -= lr * gi / (std::sqrt(s.s0[i]) + eps_adagrad);
          break;
        case v1::OPTIMIZER_KIND_ADAM: {
          s.s0[i] = b1 * s.s0[i] + (1 - b1) * gi;
          s.s1[i] = b2 * s.s1[i] + (1 - b2) * gi * gi;
          const double mhat = s.s0[i] / (1 - std::pow(b1, s.t));
          const double vhat = s.s1[i] / (1 - std::pow(b2, s.t));
          s.w[i] -= lr * mhat / (std::sqrt(vhat) + eps);
          break;
        }
        default:
          FAIL() << "no reference for " << kind;
      }
    }
  }
  double eps_adagrad = 1e-8;
};

v1::JobConfig ReferenceConfig(const ReferenceOptimizer& ref) {
  v1::JobConfig c = Config(v1::CONSISTENCY_ASP, 1, static_cast<float>(ref.lr), ref.kind);
  if (ref.kind == v1::OPTIMIZER_KIND_MOMENTUM) {
    c.mutable_optimizer()->set_momentum(static_cast<float>(ref.momentum));
  }
  return c;
}

// One worker, a long random sequence of pushes (fp32, bf16 and fp16 payloads of small integers,
// which all three encode exactly) and pulls (in all three encodings), every pull compared with the
// reference. SGD with lr 0.5 is exact; the others agree to float rounding.
TEST(ParameterStoreTest, MatchesReferenceModelUnderRandomOperations) {
  const std::vector<ReferenceOptimizer> optimizers = {
      {v1::OPTIMIZER_KIND_SGD, 0.5},
      {v1::OPTIMIZER_KIND_MOMENTUM, 0.25},
      {v1::OPTIMIZER_KIND_ADAM, 0.01},
  };
  for (const ReferenceOptimizer& ref : optimizers) {
    SCOPED_TRACE(v1::OptimizerKind_Name(ref.kind));
    const bool exact = ref.kind == v1::OPTIMIZER_KIND_SGD;
    ParameterStore store;
    std::mt19937 rng(42);
    v1::CreateJobStateRequest job = JobRequest("ref", ReferenceConfig(ref));
    std::map<uint32_t, ReferenceOptimizer::State> model;
    for (uint32_t p = 0; p < 6; ++p) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 700);
      std::vector<float> initial(n);
      for (float& v : initial) v = static_cast<float>(static_cast<int>(rng() % 17) - 8);
      *job.add_partitions() = Dense("t", p, n, initial);
      model[p] = ref.Make(initial);
    }
    ASSERT_TRUE(store.CreateJobState(job).ok());
    const v1::Encoding encodings[] = {v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16};
    uint64_t seq = 0;
    int64_t step = 0;
    for (int op = 0; op < 400; ++op) {
      const uint32_t p = rng() % 6;
      auto& state = model[p];
      if (rng() % 3 != 0) {
        std::vector<float> g(state.w.size());
        for (float& v : g) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);
        const v1::Encoding enc = encodings[rng() % 3];
        auto ack =
            store.Push(Request("ref", 0, 1, step++, ++seq, {GradSlice("t", p, g, false, enc)}));
        ASSERT_TRUE(ack.ok()) << ack.status();
        ref.Apply(state, g, 1.0);
      } else {
        const v1::Encoding enc = encodings[rng() % 3];
        auto w = PullNow(store, "ref", {PullKey("t", p)}, enc);
        ASSERT_TRUE(w.ok()) << w.status();
        ASSERT_EQ((*w)[0].version(), state.t);
        const std::vector<float> got = Floats((*w)[0]);
        ASSERT_EQ(got.size(), state.w.size());
        for (size_t i = 0; i < got.size(); ++i) {
          const float want32 = static_cast<float>(state.w[i]);
          float want = want32;
          if (enc == v1::ENCODING_BF16) want = Bf16ToFloat(FloatToBf16(want32));
          if (enc == v1::ENCODING_FP16) want = Fp16ToFloat(FloatToFp16(want32));
          if (exact) {
            ASSERT_EQ(got[i], want) << "partition " << p << " element " << i;
          } else {
            const double tol = enc == v1::ENCODING_FP32 ? 1e-4 : 1e-2 * (1 + std::fabs(want));
            ASSERT_NEAR(got[i], state.w[i], tol) << "partition " << p << " element " << i;
          }
        }
      }
    }
  }
}

// Several workers push concurrently to overlapping partitions, with random retries and pulls;
// the final weights equal the reference exactly (integer gradients, lr 0.5, ASP) and each
// partition's version counts exactly the applied pushes.
TEST(ParameterStoreTest, ConcurrentRandomPushesMatchReferenceExactly) {
  constexpr int kWorkers = 4;
  constexpr int kPartitions = 8;
  constexpr int kOpsPerWorker = 300;
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("c", Config(v1::CONSISTENCY_ASP, kWorkers, 0.5f));
  std::vector<int64_t> sizes;
  std::mt19937 size_rng(7);
  for (int p = 0; p < kPartitions; ++p) {
    sizes.push_back(1 + size_rng() % 3000);
    *job.add_partitions() = Dense("w", p, sizes.back(), std::vector<float>(sizes.back(), 100.0f));
  }
  ASSERT_TRUE(store.CreateJobState(job).ok());

  absl::Mutex mu;
  std::vector<std::vector<double>> sums(kPartitions);
  std::vector<int64_t> applied(kPartitions, 0);
  for (int p = 0; p < kPartitions; ++p) sums[p].assign(sizes[p], 0.0);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(100 + w);
      uint64_t seq = 0;
      for (int op = 0; op < kOpsPerWorker; ++op) {
        if (rng() % 5 == 0) {
          const uint32_t p = rng() % kPartitions;
          auto pulled = PullNow(store, "c", {PullKey("w", p)});
          ASSERT_TRUE(pulled.ok()) << pulled.status();
          ASSERT_EQ(Floats((*pulled)[0]).size(), static_cast<size_t>(sizes[p]));
          continue;
        }
        // Push to 1-3 distinct partitions at once.
        std::vector<uint32_t> parts;
        const int count = 1 + rng() % 3;
        while (static_cast<int>(parts.size()) < count) {
          const uint32_t p = rng() % kPartitions;
          if (std::find(parts.begin(), parts.end(), p) == parts.end()) parts.push_back(p);
        }
        std::vector<v1::Slice> slices;
        std::vector<std::vector<float>> grads;
        for (uint32_t p : parts) {
          std::vector<float> g(sizes[p]);
          for (float& v : g) v = static_cast<float>(static_cast<int>(rng() % 7) - 3);
          slices.push_back(GradSlice("w", p, g));
          grads.push_back(std::move(g));
        }
        const auto request = Request("c", w, 1, op, ++seq, slices);
        auto ack = store.Push(request);
        ASSERT_TRUE(ack.ok()) << ack.status();
        ASSERT_EQ(ack->duplicates, 0u);
        {
          absl::MutexLock lock(&mu);
          for (size_t i = 0; i < parts.size(); ++i) {
            ++applied[parts[i]];
            for (int64_t j = 0; j < sizes[parts[i]]; ++j) sums[parts[i]][j] += grads[i][j];
          }
        }
        if (rng() % 4 == 0) {  // a retry of the same request is acknowledged, not applied
          auto retry = store.Push(request);
          ASSERT_TRUE(retry.ok()) << retry.status();
          ASSERT_EQ(retry->duplicates, parts.size());
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < kPartitions; ++p) {
    auto pulled = PullNow(store, "c", {PullKey("w", p)});
    ASSERT_TRUE(pulled.ok());
    EXPECT_EQ((*pulled)[0].version(), applied[p]);
    const std::vector<float> got = Floats((*pulled)[0]);
    for (int64_t j = 0; j < sizes[p]; ++j) {
      ASSERT_EQ(got[j], static_cast<float>(100.0 - 0.5 * sums[p][j]))
          << "partition " << p << " element " << j;
    }
  }
}

// --- Sparse tables ----------------------------------------------------------------------------

TEST(ParameterStoreTest, SparseRowsInitialiseDeterministicallyFromSeedAndRow) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("s", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_tables() = Table("u1", 8, v1::Initializer::KIND_UNIFORM, 3);
  *job.add_tables() = Table("u2", 8, v1::Initializer::KIND_UNIFORM, 3);
  *job.add_tables() = Table("u3", 8, v1::Initializer::KIND_UNIFORM, 4);
  *job.add_tables() = Table("n", 8, v1::Initializer::KIND_NORMAL, 3);
  *job.add_tables() = Table("c", 8, v1::Initializer::KIND_CONSTANT, 3);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  const std::vector<int64_t> rows = {5, -9, int64_t{1} << 40};
  const std::vector<float> a = PullRows(store, "s", "u1", rows);
  EXPECT_EQ(a, PullRows(store, "s", "u2", rows));  // same initializer, same rows
  EXPECT_EQ(a, PullRows(store, "s", "u1", rows));  // pulling twice
  EXPECT_NE(a, PullRows(store, "s", "u3", rows));  // another seed
  for (float v : a) EXPECT_LE(std::fabs(v), 0.5f);
  EXPECT_NE(std::vector<float>(a.begin(), a.begin() + 8),
            std::vector<float>(a.begin() + 8, a.begin() + 16));  // rows differ
  EXPECT_EQ(PullRows(store, "s", "c", {1}), std::vector<float>(8, 0.25f));
  double sum_sq = 0;
  const std::vector<float> normal = PullRows(store, "s", "n", {1, 2, 3, 4, 5, 6, 7, 8});
  for (float v : normal) sum_sq += v * v;
  EXPECT_GT(sum_sq / normal.size(), 0.05);  // N(0, 0.25): variance 0.25
  EXPECT_LT(sum_sq / normal.size(), 0.6);
}

// Export reads every row a table holds: ascending ids, in slices of at most 1 MiB of values, and
// only through Pull on a table without row ids.
TEST(ParameterStoreTest, AllRowsOfATableComeBackInAscendingSlices) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("x", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_tables() = Table("wide", 4096, v1::Initializer::KIND_ZEROS, 0);  // 64 rows per slice
  *job.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  v1::Slice all = PullKey("wide", 0);
  all.set_all_rows(true);
  auto empty = PullNow(store, "x", {all});
  ASSERT_TRUE(empty.ok()) << empty.status();
  ASSERT_EQ(empty->size(), 1u);
  EXPECT_EQ((*empty)[0].row_ids_size(), 0);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < 150; ++i) rows.push_back((i * 7919) % 1000 - 500);
  std::vector<float> g(rows.size() * 4096);
  for (size_t i = 0; i < rows.size(); ++i) g[i * 4096] = static_cast<float>(rows[i]);
  ASSERT_TRUE(store.Push(Request("x", 0, 1, 0, 1, {RowsSlice("wide", rows, g)})).ok());
  auto got = PullNow(store, "x", {all});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 3u) << "150 rows of 16 KiB: 64 + 64 + 22";
  std::vector<int64_t> ids;
  for (const v1::Slice& slice : *got) {
    const std::vector<float> v = Floats(slice);
    ASSERT_EQ(v.size(), static_cast<size_t>(slice.row_ids_size()) * 4096);
    for (int j = 0; j < slice.row_ids_size(); ++j) {
      ids.push_back(slice.row_ids(j));
      EXPECT_EQ(v[j * 4096], -0.5f * static_cast<float>(slice.row_ids(j)));  // SGD, lr 0.5
    }
  }
  std::vector<int64_t> want = rows;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(ids, want);
  // all_rows is for a table, without row ids.
  v1::Slice dense = PullKey("w", 0);
  dense.set_all_rows(true);
  EXPECT_EQ(PullNow(store, "x", {dense}).status().code(), absl::StatusCode::kInvalidArgument);
  v1::Slice both = PullKey("wide", 0, {1});
  both.set_all_rows(true);
  EXPECT_THAT(std::string(PullNow(store, "x", {both}).status().message()), HasSubstr("all_rows"));
}

// Random pushes of rows (with repeated ids in one push, which add up) checked against a
// reference in float: with SGD each coordinate is w - lr * g, rounded once, as in the kernel.
TEST(ParameterStoreTest, SparseTableMatchesReference) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("s", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_tables() = Table("emb", 4, v1::Initializer::KIND_UNIFORM, 11);
  v1::SparseTableDecl ada = Table("ada", 3, v1::Initializer::KIND_CONSTANT, 0);
  ada.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_ADAGRAD);
  ada.mutable_optimizer()->set_learning_rate(0.1f);
  *job.add_tables() = ada;
  ASSERT_TRUE(store.CreateJobState(job).ok());

  std::mt19937 rng(5);
  std::map<int64_t, std::vector<float>> emb;
  std::map<int64_t, ReferenceOptimizer::State> adagrad;
  ReferenceOptimizer ada_ref{v1::OPTIMIZER_KIND_ADAGRAD, 0.1};
  uint64_t seq = 0;
  for (int op = 0; op < 200; ++op) {
    std::vector<int64_t> rows;
    const int k = 1 + rng() % 6;
    for (int i = 0; i < k; ++i) rows.push_back(static_cast<int64_t>(rng() % 20) - 5);
    std::vector<float> g(rows.size() * 4);
    for (float& v : g) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);
    for (int64_t r : rows) {
      if (!emb.count(r)) emb[r] = PullRows(store, "s", "emb", {r});
    }
    std::map<int64_t, std::vector<float>> summed;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto& s = summed[rows[i]];
      s.resize(4, 0.0f);
      for (int j = 0; j < 4; ++j) s[j] += g[i * 4 + j];
    }
    for (auto& [r, s] : summed) {
      for (int j = 0; j < 4; ++j) emb[r][j] = emb[r][j] - 0.5f * s[j];
    }
    std::vector<float> g3(rows.size() * 3);
    for (float& v : g3) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
    std::map<int64_t, std::vector<float>> summed3;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto& s = summed3[rows[i]];
      s.resize(3, 0.0f);
      for (int j = 0; j < 3; ++j) s[j] += g3[i * 3 + j];
    }
    for (auto& [r, s] : summed3) {
      if (!adagrad.count(r))
        adagrad[r] = ada_ref.Make({0.25f, 0.25f, 0.25f});  // KIND_CONSTANT 0.25
      ada_ref.Apply(adagrad[r], s, 1.0);
    }
    auto ack = store.Push(
        Request("s", 0, 1, op, ++seq, {RowsSlice("emb", rows, g), RowsSlice("ada", rows, g3)}));
    ASSERT_TRUE(ack.ok()) << ack.status();
  }
  for (const auto& [r, want] : emb) {
    EXPECT_EQ(PullRows(store, "s", "emb", {r}), want) << "row " << r;
  }
  for (const auto& [r, state] : adagrad) {
    const std::vector<float> got = PullRows(store, "s", "ada", {r});
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(got[j], state.w[j], 1e-4) << "row " << r;
  }
}

// --- Exactly-once ----------------------------------------------------------------------------

// Workers push integer gradients with plain SGD while every push is delivered 1-3 times (some
// retries arrive after later pushes), and one worker restarts with a new incarnation half-way.
// The final weight is initial - lr * sum(gradients acknowledged as applied), exactly, and every
// extra delivery is counted as a duplicate.
TEST(ParameterStoreTest, ExactlyOnceUnderInjectedDuplicateDeliveries) {
  for (v1::Consistency mode : {v1::CONSISTENCY_ASP, v1::CONSISTENCY_BSP}) {
    SCOPED_TRACE(v1::Consistency_Name(mode));
    constexpr int kWorkers = 4;
    constexpr int kSteps = 40;
    constexpr int64_t kN = 33;
    ParameterStore store;
    v1::CreateJobStateRequest job = JobRequest("e", Config(mode, kWorkers, 0.5f));
    *job.add_partitions() = Dense("w", 0, kN, std::vector<float>(kN, 1000.0f));
    *job.add_partitions() = Dense("w", 1, kN, std::vector<float>(kN, -1000.0f));
    ASSERT_TRUE(store.CreateJobState(job).ok());

    std::vector<double> sum0(kN, 0.0), sum1(kN, 0.0);
    int64_t injected = 0;
    int64_t acknowledged_duplicates = 0;
    std::mt19937 rng(9);
    std::vector<uint64_t> incarnation(kWorkers, 1);
    std::vector<uint64_t> seq(kWorkers, 0);
    for (int step = 0; step < kSteps; ++step) {
      std::vector<v1::PushPullRequest> sent;
      for (int w = 0; w < kWorkers; ++w) {
        if (w == 1 && step == kSteps / 2) {  // worker 1 restarts: new incarnation, seq from 1
          ++incarnation[w];
          seq[w] = 0;
        }
        std::vector<float> g0(kN), g1(kN);
        for (float& v : g0) v = static_cast<float>(static_cast<int>(rng() % 11) - 5);
        for (float& v : g1) v = static_cast<float>(static_cast<int>(rng() % 11) - 5);
        auto r = Request("e", w, incarnation[w], step, ++seq[w],
                         {GradSlice("w", 0, g0), GradSlice("w", 1, g1)});
        auto ack = store.Push(r);
        ASSERT_TRUE(ack.ok()) << ack.status();
        ASSERT_EQ(ack->duplicates, 0u);
        for (int64_t i = 0; i < kN; ++i) {
          sum0[i] += g0[i];
          sum1[i] += g1[i];
        }
        sent.push_back(r);
        const int again = rng() % 3;  // immediate redeliveries
        for (int k = 0; k < again; ++k) {
          auto dup = store.Push(r);
          ASSERT_TRUE(dup.ok()) << dup.status();
          acknowledged_duplicates += dup->duplicates;
          injected += 2;
        }
      }
      // Late redeliveries of this step's pushes, after other pushes went through.
      for (const auto& r : sent) {
        if (rng() % 2 == 0) continue;
        auto dup = store.Push(r);
        ASSERT_TRUE(dup.ok()) << dup.status();
        acknowledged_duplicates += dup->duplicates;
        injected += 2;
      }
    }
    EXPECT_EQ(acknowledged_duplicates, injected);
    auto stats = store.GetJobStats("e");
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->duplicates, injected);
    // BSP applies the mean of the 4 gradients of a step: 1/4 and lr 0.5 keep it exact too.
    const double scale = mode == v1::CONSISTENCY_BSP ? 1.0 / kWorkers : 1.0;
    const std::vector<float> w0 = PullDense(store, "e", "w", 0);
    const std::vector<float> w1 = PullDense(store, "e", "w", 1);
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(w0[i], static_cast<float>(1000.0 - 0.5 * scale * sum0[i])) << i;
      ASSERT_EQ(w1[i], static_cast<float>(-1000.0 - 0.5 * scale * sum1[i])) << i;
    }
    EXPECT_EQ(stats->updates_applied,
              mode == v1::CONSISTENCY_BSP ? 2 * kSteps : 2 * kSteps * kWorkers);
  }
}

TEST(ParameterStoreTest, StaleIncarnationIsRefused) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("e", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  ASSERT_TRUE(store.Push(Request("e", 0, 5, 0, 1, {GradSlice("w", 0, {1, 1})})).ok());
  auto status = store.Push(Request("e", 0, 4, 1, 9, {GradSlice("w", 0, {1, 1})})).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("incarnation 4"));
  EXPECT_EQ(PullDense(store, "e", "w", 0), (std::vector<float>{-0.5f, -0.5f}));
}

// A worker restarted mid-step (new incarnation) re-pushes the step its previous incarnation
// already contributed: acknowledged as a duplicate, and so is every retry of it, also after the
// step has completed.
TEST(ParameterStoreTest, BspRetryOfNewIncarnationIsAcknowledgedAfterTheStepCompletes) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("r", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
  *job.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  ASSERT_TRUE(store.Push(Request("r", 0, 1, 0, 1, {GradSlice("w", 0, {2, 2})})).ok());
  auto again = store.Push(Request("r", 0, 2, 0, 1, {GradSlice("w", 0, {2, 2})}));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->duplicates, 1u);
  ASSERT_TRUE(store.Push(Request("r", 1, 1, 0, 1, {GradSlice("w", 0, {4, 4})})).ok());
  EXPECT_EQ(PullDense(store, "r", "w", 0), (std::vector<float>{-1.5f, -1.5f}));
  auto retry = store.Push(Request("r", 0, 2, 0, 1, {GradSlice("w", 0, {2, 2})}));
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->duplicates, 1u);
  EXPECT_EQ(PullDense(store, "r", "w", 0), (std::vector<float>{-1.5f, -1.5f}));
}

// --- Validation (all or nothing) ------------------------------------------------------------

TEST(ParameterStoreTest, RequestIsValidatedFullyBeforeAnythingIsApplied) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("v", Config(v1::CONSISTENCY_ASP, 2, 0.5f));
  *job.add_partitions() = Dense("w", 0, 2);
  *job.add_partitions() = Dense("w", 1, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  // The first slice is fine, the second has a wrong size: nothing is applied.
  auto status =
      store
          .Push(Request("v", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1}), GradSlice("w", 1, {1, 1, 1})}))
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("w/1"));
  EXPECT_THAT(status.message(), HasSubstr("12 bytes"));
  EXPECT_EQ(PullDense(store, "v", "w", 0), (std::vector<float>{0, 0}));
  // The same key twice in one request.
  status =
      store.Push(Request("v", 0, 1, 0, 2, {GradSlice("w", 0, {1, 1}), GradSlice("w", 0, {1, 1})}))
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PullDense(store, "v", "w", 0), (std::vector<float>{0, 0}));
  // A failed request does not consume its seq: the same seq applies once fixed.
  auto ack = store.Push(Request("v", 0, 1, 0, 1, {GradSlice("w", 0, {2, 2})}));
  ASSERT_TRUE(ack.ok());
  EXPECT_EQ(ack->duplicates, 0u);
  EXPECT_EQ(PullDense(store, "v", "w", 0), (std::vector<float>{-1, -1}));
}

TEST(ParameterStoreTest, NonFiniteGradientsAreRejectedOrSkipped) {
  for (auto policy : {v1::NON_FINITE_POLICY_REJECT, v1::NON_FINITE_POLICY_SKIP}) {
    ParameterStore store;
    v1::JobConfig config = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
    config.set_non_finite_policy(policy);
    v1::CreateJobStateRequest job = JobRequest("n", config);
    *job.add_partitions() = Dense("w", 0, 2);
    *job.add_partitions() = Dense("w", 1, 2);
    ASSERT_TRUE(store.CreateJobState(job).ok());
    for (v1::Encoding enc : {v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16}) {
      auto ack = store.Push(Request(
          "n", 0, 1, 0, 0, {GradSlice("w", 0, {2, 2}), GradSlice("w", 1, {1, NAN}, false, enc)}));
      if (policy == v1::NON_FINITE_POLICY_REJECT) {
        EXPECT_EQ(ack.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(ack.status().message(), HasSubstr("w/1"));
      } else {
        ASSERT_TRUE(ack.ok()) << ack.status();
        EXPECT_EQ(ack->skipped_non_finite, 1u);
        // Only the applied slice counts as pushed: w/0's two fp32 values.
        EXPECT_EQ(store.GetShardStats().bytes_pushed, 8);
        break;  // seq 0 is now applied for this worker
      }
    }
    const float expect_w0 = policy == v1::NON_FINITE_POLICY_SKIP ? -1.0f : 0.0f;
    EXPECT_EQ(PullDense(store, "n", "w", 0), (std::vector<float>{expect_w0, expect_w0}));
    EXPECT_EQ(PullDense(store, "n", "w", 1), (std::vector<float>{0, 0}));
  }
}

// The fp32 check walks large gradients block by block: one NaN or Inf anywhere (first value,
// block edges, the last partial block, the last value) is found, and a clean gradient passes.
TEST(ParameterStoreTest, OneNonFiniteValueAnywhereInALargeGradientIsFound) {
  constexpr int64_t kElements = 5000;  // 19 blocks of 256 and a partial one
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("big", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, kElements);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  uint64_t seq = 0;
  for (const int64_t at :
       {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{2047}, int64_t{4864}, kElements - 1}) {
    for (const float bad : {NAN, INFINITY, -INFINITY}) {
      SCOPED_TRACE(absl::StrCat("value ", bad, " at ", at));
      std::vector<float> grad(kElements, 1.0f);
      grad[at] = bad;
      auto ack = store.Push(Request("big", 0, 1, 0, ++seq, {GradSlice("w", 0, grad)}));
      EXPECT_EQ(ack.status().code(), absl::StatusCode::kInvalidArgument) << ack.status();
    }
  }
  EXPECT_EQ(PullDense(store, "big", "w", 0), std::vector<float>(kElements, 0.0f));
  auto ok = store.Push(
      Request("big", 0, 1, 0, ++seq, {GradSlice("w", 0, std::vector<float>(kElements, 2.0f))}));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(PullDense(store, "big", "w", 0), std::vector<float>(kElements, -1.0f));
}

// A PushPull's answer says how long its pull waited at the gate: the first worker's waited for
// the second's push, the second's not at all, and a push that wants no weights reports none.
TEST(ParameterStoreTest, AnAnswerSaysHowLongItWaitedAtTheGate) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("g", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
  *job.add_partitions() = Dense("w", 0, 2);
  *job.add_partitions() = Dense("b", 0, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  std::optional<absl::StatusOr<v1::PushPullResponse>> first, second, plain;
  store.PushPull(Request("g", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1}, true)}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { first = std::move(r); });
  ASSERT_FALSE(first.has_value());
  absl::SleepFor(absl::Milliseconds(30));
  store.PushPull(Request("g", 1, 1, 0, 1, {GradSlice("w", 0, {3, 3}, true)}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { second = std::move(r); });
  store.PushPull(Request("g", 0, 1, 0, 2, {GradSlice("b", 0, {1, 1})}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { plain = std::move(r); });
  ASSERT_TRUE(first.has_value() && second.has_value() && plain.has_value());
  ASSERT_TRUE(first->ok() && second->ok() && plain->ok());
  EXPECT_GE((*first)->gate_wait_us(), 30'000u);
  EXPECT_LT((*first)->gate_wait_us(), 60'000'000u);
  EXPECT_LT((*second)->gate_wait_us(), (*first)->gate_wait_us());
  EXPECT_EQ((*plain)->gate_wait_us(), 0u);
  ASSERT_EQ((*first)->weights_size(), 1);
  EXPECT_EQ((*first)->weights(0).key().tensor(), "w");
}

TEST(ParameterStoreTest, DropJobFailsParkedPullsAndForgetsTheJob) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("d", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
  *job.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  std::optional<absl::StatusOr<v1::PushPullResponse>> parked;
  store.PushPull(Request("d", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1}, true)}),
                 [&](absl::StatusOr<v1::PushPullResponse> r) { parked = std::move(r); });
  EXPECT_FALSE(parked.has_value());
  ASSERT_TRUE(store.DropJob("d").ok());
  ASSERT_TRUE(parked.has_value());
  EXPECT_EQ(parked->status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store.DropJob("d").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(PullNow(store, "d", {PullKey("w", 0)}).status().code(), absl::StatusCode::kNotFound);
}

// --- Hostile input: bounded memory, clear errors, the store keeps serving --------------------

ParameterStoreOptions Limits(int64_t max_memory_bytes, size_t max_message_bytes = 0) {
  ParameterStoreOptions options;
  options.max_memory_bytes = max_memory_bytes;
  options.max_message_bytes = max_message_bytes;
  return options;
}

TEST(ParameterStoreTest, MemoryBudgetRefusesOversizedDeclarationsAllOrNothing) {
  ParameterStore store(Limits(10 << 20));
  // 2 partitions of 1M fp32 values with Adam (weights + 2 slots): 24 MiB > 8 MiB.
  v1::CreateJobStateRequest big =
      JobRequest("m", Config(v1::CONSISTENCY_ASP, 1, 0.5f, v1::OPTIMIZER_KIND_ADAM));
  *big.add_partitions() = Dense("w", 0, 1 << 20);
  *big.add_partitions() = Dense("w", 1, 1 << 20);
  auto status = store.CreateJobState(big).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("max_memory_bytes"));
  // Nothing was created, not even the job: another config for the same id is accepted.
  EXPECT_EQ(store.GetJobStats("m").status().code(), absl::StatusCode::kNotFound);
  // Per-worker state is charged too: 65536 workers x 200 partitions of 1 value.
  v1::CreateJobStateRequest wide = JobRequest("many", Config(v1::CONSISTENCY_BSP, 65536, 0.5f));
  for (uint32_t i = 0; i < 200; ++i) *wide.add_partitions() = Dense("w", i, 1);
  EXPECT_EQ(store.CreateJobState(wide).status().code(), absl::StatusCode::kResourceExhausted);
  // The store keeps serving a declaration that fits, and DropJob gives the bytes back.
  v1::CreateJobStateRequest fits = JobRequest("m", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *fits.add_partitions() = Dense("w", 0, 1 << 20);
  ASSERT_TRUE(store.CreateJobState(fits).ok());
  for (int round = 0; round < 3; ++round) {
    v1::CreateJobStateRequest again = JobRequest("n", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
    *again.add_partitions() = Dense("w", 0, 1 << 20);
    ASSERT_TRUE(store.CreateJobState(again).ok()) << round;
    ASSERT_TRUE(store.DropJob("n").ok());
  }
  ASSERT_TRUE(
      store.Push(Request("m", 0, 1, 0, 1, {GradSlice("w", 0, std::vector<float>(1 << 20, 1))}))
          .ok());
  EXPECT_EQ(PullDense(store, "m", "w", 0)[7], -0.5f);
}

// Concurrent additive declarations of overlapping keys: every call succeeds, each key exists once,
// and every byte reserved (also for partitions built by a call that lost the race) comes back.
TEST(ParameterStoreTest, ConcurrentDeclarationsKeepTheBudgetExact) {
  constexpr int64_t kMiB = 1 << 20;
  ParameterStore store(Limits(100 * kMiB));
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&store, &results, t] {
      v1::CreateJobStateRequest r = JobRequest("c", Config(v1::CONSISTENCY_ASP, 2, 0.5f));
      for (uint32_t i = 0; i < 8; ++i) *r.add_partitions() = Dense("shared", i, kMiB / 4);
      *r.add_partitions() = Dense("own", static_cast<uint32_t>(t), kMiB / 4);
      results[t] = store.CreateJobState(r).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& r : results) EXPECT_TRUE(r.ok()) << r;
  v1::CreateJobStateRequest none = JobRequest("c", Config(v1::CONSISTENCY_ASP, 2, 0.5f));
  auto count = store.CreateJobState(none);
  ASSERT_TRUE(count.ok());
  EXPECT_EQ(count->partitions(), 12u);
  ASSERT_TRUE(store.DropJob("c").ok());
  // Everything came back: 95 MiB fit into the 100 MiB budget again.
  v1::CreateJobStateRequest big = JobRequest("d", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  for (uint32_t i = 0; i < 95; ++i) *big.add_partitions() = Dense("w", i, kMiB / 4);
  auto status = store.CreateJobState(big).status();
  EXPECT_TRUE(status.ok()) << status;
}

TEST(ParameterStoreTest, MemoryBudgetBoundsSparseRowsAndBspStaging) {
  ParameterStore store(Limits(4 << 20));
  v1::CreateJobStateRequest job = JobRequest("s", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_tables() = Table("emb", 1024, v1::Initializer::KIND_ZEROS, 0);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  // Each push creates 256 new rows of 4 KiB: 1 MiB. The budget runs out within a few pushes.
  absl::Status last;
  int accepted = 0;
  for (int push = 0; push < 16 && last.ok(); ++push) {
    std::vector<int64_t> rows;
    for (int r = 0; r < 256; ++r) rows.push_back(int64_t{push} * 256 + r);
    last = store
               .Push(Request("s", 0, 1, 0, static_cast<uint64_t>(push),
                             {RowsSlice("emb", rows, std::vector<float>(256 * 1024, 1))}))
               .status();
    if (last.ok()) ++accepted;
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_THAT(last.message(), HasSubstr("emb/0"));
  EXPECT_GE(accepted, 1);
  EXPECT_LT(accepted, 4);
  // Rows that exist still take updates, and pulls of any row still work.
  ASSERT_TRUE(
      store.Push(Request("s", 0, 1, 0, 100, {RowsSlice("emb", {0}, std::vector<float>(1024, 1))}))
          .ok());
  EXPECT_EQ(PullRows(store, "s", "emb", {0})[0], -1.0f);
  EXPECT_EQ(PullRows(store, "s", "emb", {1 << 30})[0], 0.0f);
  ASSERT_TRUE(store.DropJob("s").ok());

  // BSP staging: each worker's staged gradient is a full partition copy.
  ParameterStore bsp_store(Limits(12 << 20));
  v1::CreateJobStateRequest bsp = JobRequest("b", Config(v1::CONSISTENCY_BSP, 4, 0.5f));
  *bsp.add_partitions() = Dense("w", 0, 1 << 20);  // 4 MiB
  ASSERT_TRUE(bsp_store.CreateJobState(bsp).ok());
  const std::vector<float> grad(1 << 20, 1);
  ASSERT_TRUE(bsp_store.Push(Request("b", 0, 1, 0, 1, {GradSlice("w", 0, grad)})).ok());
  auto refused = bsp_store.Push(Request("b", 1, 1, 0, 1, {GradSlice("w", 0, grad)})).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("w/0"));
  // Nothing was staged for worker 1: the step still waits for it.
  auto stats = bsp_store.GetJobStats("b");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->updates_applied, 0);
}

// Staged sparse gradients count against the budget until their BSP step completes, and are given
// back then: steps over the same rows run forever within the budget, while many workers staging
// at once are refused.
TEST(ParameterStoreTest, BspSparseStagingIsChargedUntilTheStepCompletes) {
  std::vector<int64_t> rows(256);
  for (int r = 0; r < 256; ++r) rows[r] = r;
  const std::vector<float> grad(256 * 1024, 1);  // 1 MiB per worker and step
  {
    ParameterStore store(Limits(5 << 20));
    v1::CreateJobStateRequest job = JobRequest("s", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
    *job.add_tables() = Table("emb", 1024, v1::Initializer::KIND_ZEROS, 0);
    ASSERT_TRUE(store.CreateJobState(job).ok());
    for (int step = 0; step < 12; ++step) {
      for (uint32_t w = 0; w < 2; ++w) {
        auto ack = store.Push(Request("s", w, 1, step, static_cast<uint64_t>(step) + 1,
                                      {RowsSlice("emb", rows, grad)}));
        ASSERT_TRUE(ack.ok()) << "step " << step << " worker " << w << ": " << ack.status();
      }
    }
    EXPECT_EQ(PullRows(store, "s", "emb", {255})[1023], -6.0f);  // 12 steps of lr 0.5 * mean 1
  }
  ParameterStore store(Limits(5 << 20));
  v1::CreateJobStateRequest job = JobRequest("s", Config(v1::CONSISTENCY_BSP, 8, 0.5f));
  *job.add_tables() = Table("emb", 1024, v1::Initializer::KIND_ZEROS, 0);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  absl::Status last;
  uint32_t staged = 0;
  for (uint32_t w = 0; w < 8 && last.ok(); ++w) {
    last = store.Push(Request("s", w, 1, 0, 1, {RowsSlice("emb", rows, grad)})).status();
    if (last.ok()) ++staged;
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_LT(staged, 5u);
}

TEST(ParameterStoreTest, PullAnswersAreBoundedAndKeysUniqueBeforeAnythingIsRead) {
  ParameterStore store(Limits(0, 1 << 20));
  v1::CreateJobStateRequest job = JobRequest("p", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_tables() = Table("emb", 1024, v1::Initializer::KIND_ZEROS, 0);  // 4 KiB rows
  *job.add_partitions() = Dense("w", 0, 1 << 17);                          // 512 KiB
  *job.add_partitions() = Dense("w", 1, 1 << 17);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  // 10^5 row ids of 4 KiB each would be 400 MiB: refused before any of it is built.
  std::vector<int64_t> rows(100000, 7);
  auto status = PullNow(store, "p", {PullKey("emb", 0, rows)}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("emb/0"));
  // The same key many times.
  status = PullNow(store, "p", std::vector<v1::Slice>(10, PullKey("w", 0))).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("w/0"));
  // A PushPull answer is one message: 2 x 512 KiB and a row do not fit into 1 MiB.
  v1::PushPullRequest pp = Request("p", 0, 1, 0, 1, {});
  *pp.add_pull() = PullKey("w", 0);
  *pp.add_pull() = PullKey("w", 1);
  *pp.add_pull() = PullKey("emb", 0, {1});
  std::optional<absl::StatusOr<v1::PushPullResponse>> answer;
  store.PushPull(pp, [&](absl::StatusOr<v1::PushPullResponse> r) { answer = std::move(r); });
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status().code(), absl::StatusCode::kResourceExhausted) << answer->status();
  // Still serving.
  EXPECT_EQ(PullDense(store, "p", "w", 0).size(), size_t{1} << 17);
}

TEST(ParameterStoreTest, StepsBeyondTheLimitAreRefusedInEveryMode) {
  for (auto mode : {v1::CONSISTENCY_ASP, v1::CONSISTENCY_SSP, v1::CONSISTENCY_BSP}) {
    ParameterStore store;
    v1::CreateJobStateRequest job = JobRequest(
        "t", Config(mode, 1, 0.5f, v1::OPTIMIZER_KIND_SGD, mode == v1::CONSISTENCY_SSP ? 2 : 0));
    *job.add_partitions() = Dense("w", 0, 2);
    ASSERT_TRUE(store.CreateJobState(job).ok());
    const int64_t max = std::numeric_limits<int64_t>::max();
    v1::PushPullRequest r = Request("t", 0, 1, max, 1, {GradSlice("w", 0, {1, 1}, true)});
    std::optional<absl::StatusOr<v1::PushPullResponse>> answer;
    store.PushPull(r, [&](absl::StatusOr<v1::PushPullResponse> a) { answer = std::move(a); });
    ASSERT_TRUE(answer.has_value()) << v1::Consistency_Name(mode);
    EXPECT_EQ(answer->status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(answer->status().message(), HasSubstr("step"));
    EXPECT_EQ(store.Push(r).status().code(), absl::StatusCode::kInvalidArgument);
    v1::UpdateMembershipRequest m;
    m.set_job_id("t");
    m.add_live_workers(0);
    m.set_effective_step(max);
    EXPECT_EQ(store.UpdateMembership(m).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(PullDense(store, "t", "w", 0), (std::vector<float>{0, 0}));
  }
}

TEST(ParameterStoreTest, NonFiniteInitialValuesAreRefused) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("i", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 3, 2, {1, INFINITY});
  auto status = store.CreateJobState(job).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("partitions[0].initial_values"));
}

}  // namespace
}  // namespace tessera::server
