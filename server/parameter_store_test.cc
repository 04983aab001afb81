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

// --- Requests by reference (PushPullView), with data in pieces -------------------------------

// `bytes` cut at random offsets into pieces that point into it.
std::vector<absl::string_view> RandomPieces(absl::string_view bytes, std::mt19937* rng) {
  std::vector<absl::string_view> pieces;
  std::uniform_int_distribution<size_t> len(1, 9000);
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::min(len(*rng), bytes.size() - at);
    pieces.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return pieces;
}

// A PushPull by reference with a sink, as the gRPC service makes it; `done` must run at once.
struct SharedAnswer {
  absl::StatusOr<v1::PushPullResponse> response = absl::InternalError("parked");
  std::shared_ptr<PushPullAnswerSink> sink = std::make_shared<PushPullAnswerSink>();
};

SharedAnswer PushPullShared(ParameterStore& store, const PushPullView& view) {
  SharedAnswer out;
  std::optional<absl::StatusOr<v1::PushPullResponse>> response;
  store.PushPull(
      view, [&response](absl::StatusOr<v1::PushPullResponse> r) { response = std::move(r); },
      nullptr, out.sink);
  if (response.has_value()) out.response = *std::move(response);
  return out;
}

// PushPullShared, with the shared data copied into the response (so it is the whole answer).
absl::StatusOr<v1::PushPullResponse> PushPullViewNow(ParameterStore& store,
                                                     const PushPullView& view) {
  SharedAnswer answer = PushPullShared(store, view);
  if (!answer.response.ok()) return answer.response;
  for (const auto& [index, weights] : answer.sink->shared) {
    if (index < 0 || index >= answer.response->weights_size() ||
        !answer.response->weights(index).data().empty()) {
      return absl::InternalError(absl::StrCat("bad shared slice index ", index));
    }
    answer.response->mutable_weights(index)->set_data(std::string(weights.bytes()));
  }
  return answer.response;
}

// The same pushes, once as protobuf requests and once by reference with the gradient cut into
// random pieces (values straddling pieces, unaligned), give bit-identical weights, for every
// dense optimizer, both fp32 and bf16, and ASP as well as BSP.
TEST(ParameterStoreTest, PiecedGradientsApplyExactlyAsContiguousOnes) {
  const std::vector<v1::OptimizerKind> kinds = {
      v1::OPTIMIZER_KIND_SGD,     v1::OPTIMIZER_KIND_MOMENTUM, v1::OPTIMIZER_KIND_NESTEROV,
      v1::OPTIMIZER_KIND_ADAGRAD, v1::OPTIMIZER_KIND_ADAM,     v1::OPTIMIZER_KIND_ADAMW};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kElements = 200003;  // several gather blocks and a partial one
  for (v1::OptimizerKind kind : kinds) {
    for (v1::Consistency mode : {v1::CONSISTENCY_ASP, v1::CONSISTENCY_BSP}) {
      for (v1::Encoding encoding : {v1::ENCODING_FP32, v1::ENCODING_BF16}) {
        SCOPED_TRACE(absl::StrCat(v1::OptimizerKind_Name(kind), " ", v1::Consistency_Name(mode),
                                  " ", v1::Encoding_Name(encoding)));
        v1::JobConfig config = Config(mode, 1, 0.01f, kind);
        if (kind == v1::OPTIMIZER_KIND_MOMENTUM || kind == v1::OPTIMIZER_KIND_NESTEROV) {
          config.mutable_optimizer()->set_momentum(0.9f);
        }
        ParameterStore contiguous;
        ParameterStore pieced;
        v1::CreateJobStateRequest job = JobRequest("j", config);
        *job.add_partitions() = Dense("w", 0, kElements);
        ASSERT_TRUE(contiguous.CreateJobState(job).ok());
        ASSERT_TRUE(pieced.CreateJobState(job).ok());
        for (int step = 0; step < 3; ++step) {
          std::vector<float> grad(kElements);
          for (float& g : grad) g = normal(rng);
          v1::PushPullRequest request = Request("j", 0, 1, step, static_cast<uint64_t>(step + 1),
                                                {GradSlice("w", 0, grad, true, encoding)});
          std::optional<absl::StatusOr<v1::PushPullResponse>> want;
          contiguous.PushPull(request,
                              [&want](absl::StatusOr<v1::PushPullResponse> r) { want = r; });
          ASSERT_TRUE(want.has_value() && want->ok());
          // Unaligned: the payload starts one byte into its buffer.
          const std::string payload = "x" + request.push(0).data();
          const std::vector<absl::string_view> cut =
              RandomPieces(absl::string_view(payload).substr(1), &rng);
          PushPullView view = ViewOf(request);
          view.push[0].data = absl::string_view();
          view.push[0].pieces = cut;
          absl::StatusOr<v1::PushPullResponse> got = PushPullViewNow(pieced, view);
          ASSERT_TRUE(got.ok()) << got.status();
          ASSERT_EQ(got->weights_size(), 1);
          // Not EXPECT_EQ: a failure would print both 800 KB strings.
          ASSERT_TRUE(got->weights(0).data() == (*want)->weights(0).data())
              << "weights differ at step " << step;
          EXPECT_EQ(got->weights(0).version(), (*want)->weights(0).version());
        }
      }
    }
  }
}

// Validation reads the pieces too: the byte count is their total, and a NaN that straddles two
// pieces is found.
TEST(ParameterStoreTest, PiecedGradientsAreValidatedLikeContiguousOnes) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 4);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  v1::PushPullRequest request = Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, NAN, 2, 3}, true)});
  const std::string& data = request.push(0).data();
  // The NaN is bytes [4, 8): cut at 6.
  const std::vector<absl::string_view> nan_pieces = {absl::string_view(data.data(), 6),
                                                     absl::string_view(data.data() + 6, 10)};
  PushPullView view = ViewOf(request);
  view.push[0].data = absl::string_view();
  view.push[0].pieces = nan_pieces;
  absl::StatusOr<v1::PushPullResponse> r = PushPullViewNow(store, view);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("NaN"));

  const std::vector<absl::string_view> short_pieces = {absl::string_view(data.data(), 6),
                                                       absl::string_view(data.data() + 6, 7)};
  view.push[0].pieces = short_pieces;
  r = PushPullViewNow(store, view);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("16 bytes"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("got 13 bytes"));

  // A good pieced push (values straddling) applies: w = -0.5 * g.
  v1::PushPullRequest good = Request("j", 0, 1, 0, 2, {GradSlice("w", 0, {2, 4, 6, 8}, true)});
  const std::string& g = good.push(0).data();
  const std::vector<absl::string_view> good_pieces = {
      absl::string_view(g.data(), 3), absl::string_view(g.data() + 3, 1),
      absl::string_view(g.data() + 4, 9), absl::string_view(g.data() + 13, 3)};
  PushPullView good_view = ViewOf(good);
  good_view.push[0].data = absl::string_view();
  good_view.push[0].pieces = good_pieces;
  r = PushPullViewNow(store, good_view);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->weights_size(), 1);
  EXPECT_EQ(Floats(r->weights(0)), (std::vector<float>{-1, -2, -3, -4}));
}

// --- Answers by reference (copy-on-write weights) --------------------------------------------

std::vector<float> Values(const SharedWeights& w) {
  return std::vector<float>(w.data(), w.data() + w.size());
}

// A dense fp32 answer to a sink shares the partition's weights. While it is held, an update
// copies them first (the held answer keeps its values bit for bit, later answers see the new
// ones); once nothing holds them, updates write in place again.
TEST(ParameterStoreTest, SharedAnswersKeepTheirWeightsAndTheStoreCopiesOnWrite) {
  constexpr int kN = 5000;
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  std::vector<float> initial(kN);
  for (int i = 0; i < kN; ++i) initial[i] = static_cast<float>(i);
  *job.add_partitions() = Dense("w", 0, kN, initial);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  const std::vector<float> ones(kN, 1.0f);
  // w after k updates of g = 1 with SGD at 0.5 (exact in fp32).
  auto after = [&](int k) {
    std::vector<float> w = initial;
    for (float& v : w) v -= 0.5f * static_cast<float>(k);
    return w;
  };

  const v1::PushPullRequest first = Request("j", 0, 1, 0, 1, {GradSlice("w", 0, ones, true)});
  SharedAnswer a = PushPullShared(store, ViewOf(first));
  ASSERT_TRUE(a.response.ok()) << a.response.status();
  ASSERT_EQ(a.response->weights_size(), 1);
  EXPECT_TRUE(a.response->weights(0).data().empty());
  EXPECT_EQ(a.response->weights(0).encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(a.response->weights(0).version(), 1);
  EXPECT_EQ(a.response->weights(0).key().tensor(), "w");
  ASSERT_EQ(a.sink->shared.size(), 1u);
  EXPECT_EQ(a.sink->shared[0].first, 0);
  SharedWeights held = std::move(a.sink->shared[0].second);
  EXPECT_EQ(Values(held), after(1));
  const std::string held_bytes(held.bytes());
  ShardStats stats = store.GetShardStats();
  EXPECT_EQ(stats.weight_copies_on_write, 0);  // nothing held the weights at the update
  EXPECT_EQ(stats.bytes_pulled, kN * 4);

  // An update while the answer is held: copied first.
  absl::StatusOr<PushAck> pushed = store.Push(Request("j", 0, 1, 1, 2, {GradSlice("w", 0, ones)}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_TRUE(held.bytes() == held_bytes) << "the held answer changed under the update";
  EXPECT_EQ(PullDense(store, "j", "w", 0), after(2));
  // A second update finds the copy unshared: in place.
  pushed = store.Push(Request("j", 0, 1, 2, 3, {GradSlice("w", 0, ones)}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_TRUE(held.bytes() == held_bytes) << "the held answer changed under the update";

  // A pull by reference now shares the partition's new buffer, not the held one.
  v1::PushPullRequest pull = Request("j", 0, 1, 3, 4, {}, {PullKey("w", 0)});
  pull.set_pull_encoding(v1::ENCODING_FP32);
  SharedAnswer b = PushPullShared(store, ViewOf(pull));
  ASSERT_TRUE(b.response.ok()) << b.response.status();
  ASSERT_EQ(b.sink->shared.size(), 1u);
  EXPECT_NE(b.sink->shared[0].second.data(), held.data());
  EXPECT_EQ(Values(b.sink->shared[0].second), after(3));
  EXPECT_EQ(b.response->weights(0).version(), 3);
  EXPECT_EQ(store.GetShardStats().bytes_pulled, 2 * kN * 4 + kN * 4);  // PullDense, both shares

  // Both released: the next update writes in place, no copy.
  held.reset();
  b.sink->shared.clear();
  pushed = store.Push(Request("j", 0, 1, 3, 5, {GradSlice("w", 0, ones)}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_EQ(PullDense(store, "j", "w", 0), after(4));
}

// Only dense fp32 answers are shared: bf16 answers and sparse rows are encoded into the sink's
// buffers (capacity reused), as the typed overload answers them.
TEST(ParameterStoreTest, EncodedAndSparseAnswersToASinkAreCopiedIntoItsBuffers) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 4, {1, 2, 3, 4});
  auto* table = job.add_tables();
  table->set_name("emb");
  table->set_dim(2);
  table->mutable_initializer()->set_kind(v1::Initializer::KIND_CONSTANT);
  table->mutable_initializer()->set_value(0.25f);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  for (v1::Encoding encoding : {v1::ENCODING_BF16, v1::ENCODING_FP32}) {
    SCOPED_TRACE(v1::Encoding_Name(encoding));
    v1::PushPullRequest request =
        Request("j", 0, 1, 0, 1, {}, {PullKey("w", 0), PullKey("emb", 0, {3, 9})});
    request.set_pull_encoding(encoding);
    int taken = 0;
    auto sink = std::make_shared<PushPullAnswerSink>();
    sink->take_buffer = [&taken] {
      ++taken;
      std::string s;
      s.reserve(1 << 16);
      return s;
    };
    std::optional<absl::StatusOr<v1::PushPullResponse>> got;
    store.PushPull(
        ViewOf(request), [&got](absl::StatusOr<v1::PushPullResponse> r) { got = std::move(r); },
        nullptr, sink);
    ASSERT_TRUE(got.has_value() && got->ok());
    std::optional<absl::StatusOr<v1::PushPullResponse>> want;
    store.PushPull(request, [&want](absl::StatusOr<v1::PushPullResponse> r) { want = r; });
    ASSERT_TRUE(want.has_value() && want->ok());
    ASSERT_EQ((*got)->weights_size(), 2);
    EXPECT_EQ((*got)->weights(1).SerializeAsString(), (*want)->weights(1).SerializeAsString());
    EXPECT_GE((*got)->weights(1).data().capacity(), size_t{1} << 16);
    EXPECT_EQ(Floats((*got)->weights(1)), (std::vector<float>{0.25f, 0.25f, 0.25f, 0.25f}));
    if (encoding == v1::ENCODING_BF16) {
      EXPECT_EQ(taken, 2);
      EXPECT_TRUE(sink->shared.empty());
      EXPECT_EQ((*got)->weights(0).SerializeAsString(), (*want)->weights(0).SerializeAsString());
    } else {
      EXPECT_EQ(taken, 1);  // the sparse rows only
      ASSERT_EQ(sink->shared.size(), 1u);
      EXPECT_EQ(sink->shared[0].first, 0);
      EXPECT_TRUE((*got)->weights(0).data().empty());
      EXPECT_EQ(sink->shared[0].second.bytes(), (*want)->weights(0).data());
    }
  }
}

// Pushes on several threads while other threads hold answers by reference and release them
// after reading: every answer still has exactly the weights of its version (SGD of g = 1 at 0.5
// from 0: every value is -0.5 * version), however the releases and updates interleave.
TEST(ParameterStoreTest, SharedAnswersStayExactUnderConcurrentUpdates) {
  constexpr int kN = 1 << 16;
  constexpr int kThreads = 2;
  constexpr int kPushes = 150;
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, kThreads, 0.5f));
  *job.add_partitions() = Dense("w", 0, kN);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  absl::Mutex mu;
  std::deque<std::pair<int64_t, SharedWeights>> held;  // guarded by mu
  int pushers_left = kThreads;                         // guarded by mu
  std::atomic<int> bad{0};
  std::atomic<int> checked{0};
  auto check = [&](int64_t version, const SharedWeights& w) {
    const float want = -0.5f * static_cast<float>(version);
    for (size_t i = 0; i < w.size(); ++i) {
      if (w.data()[i] != want) {
        bad.fetch_add(1);
        return;
      }
    }
    checked.fetch_add(1);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const v1::PushPullRequest request =
          Request("j", static_cast<uint32_t>(t), 1, 0, 0,
                  {GradSlice("w", 0, std::vector<float>(kN, 1.0f), true)});
      for (int i = 0; i < kPushes; ++i) {
        PushPullView view = ViewOf(request);
        view.seq = static_cast<uint64_t>(i + 1);
        SharedAnswer a = PushPullShared(store, view);
        if (!a.response.ok() || a.sink->shared.size() != 1) {
          bad.fetch_add(1);
          continue;
        }
        absl::MutexLock lock(&mu);
        held.emplace_back(a.response->weights(0).version(), std::move(a.sink->shared[0].second));
      }
      absl::MutexLock lock(&mu);
      --pushers_left;
    });
  }
  // Two releasers: read each held answer, then drop it (on a thread other than its pusher's).
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&] {
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      for (;;) {
        std::pair<int64_t, SharedWeights> answer;
        {
          absl::MutexLock lock(&mu);
          auto ready = [&] { return !held.empty() || pushers_left == 0; };
          if (!mu.AwaitWithDeadline(absl::Condition(&ready), deadline)) return;
          if (held.empty()) return;
          answer = std::move(held.front());
          held.pop_front();
        }
        check(answer.first, answer.second);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(checked.load(), kThreads * kPushes);
  const std::vector<float> final_weights = PullDense(store, "j", "w", 0);
  ASSERT_EQ(final_weights.size(), static_cast<size_t>(kN));
  EXPECT_EQ(final_weights[0], -0.5f * kThreads * kPushes);
  // Each copy-on-write is one update that found an answer still held.
  EXPECT_LE(store.GetShardStats().weight_copies_on_write, kThreads * kPushes);
}

// --- Shard-wide counters (metrics) ----------------------------------------------------------

// The number of observations in `h` at or below `bound` (a bound of the histogram).
uint64_t AtOrBelow(const StoreHistogram::Snapshot& h, int64_t bound) {
  uint64_t n = 0;
  for (size_t i = 0; i < h.bounds.size() && h.bounds[i] <= bound; ++i) n += h.counts[i];
  return n;
}

TEST(ParameterStoreStatsTest, CountsBytesUpdatesDuplicatesAndBspWaits) {
  ParameterStore store;
  v1::CreateJobStateRequest r = JobRequest("j", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
  *r.add_partitions() = Dense("w", 0, 4);
  ASSERT_TRUE(store.CreateJobState(r).ok());
  EXPECT_EQ(store.GetShardStats().jobs, 1);

  // Worker 0 pushes step 0 (staged) and pulls for step 1, which waits for worker 1.
  ASSERT_TRUE(store.Push(Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})})).ok());
  v1::PullRequest pull;
  pull.set_job_id("j");
  pull.set_step(1);
  pull.set_encoding(v1::ENCODING_FP32);
  *pull.add_keys() = PullKey("w", 0);
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> pulled;
  store.Pull(pull, [&pulled](absl::StatusOr<std::vector<v1::Slice>> w) { pulled = std::move(w); });
  ASSERT_FALSE(pulled.has_value());
  ShardStats stats = store.GetShardStats();
  EXPECT_EQ(stats.bytes_pushed, 16);
  EXPECT_EQ(stats.updates_applied, 0);
  EXPECT_EQ(stats.parked_pulls, 1);
  EXPECT_EQ(stats.bsp_wait_ns.count, 0u);
  EXPECT_EQ(stats.bytes_pulled, 0);

  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(store.Push(Request("j", 1, 1, 0, 1, {GradSlice("w", 0, {3, 3, 3, 3})})).ok());
  ASSERT_TRUE(pulled.has_value());
  ASSERT_TRUE(pulled->ok()) << pulled->status();
  stats = store.GetShardStats();
  EXPECT_EQ(stats.bytes_pushed, 32);
  EXPECT_EQ(stats.updates_applied, 1);
  EXPECT_EQ(stats.parked_pulls, 0);
  EXPECT_EQ(stats.bytes_pulled, 16);
  ASSERT_EQ(stats.bsp_wait_ns.count, 1u);
  EXPECT_GE(stats.bsp_wait_ns.sum, 20'000'000);  // it waited at least the 20 ms sleep
  EXPECT_LT(stats.bsp_wait_ns.sum, 60'000'000'000);
  EXPECT_EQ(AtOrBelow(stats.bsp_wait_ns, 10'000'000), 0u);
  EXPECT_EQ(stats.ssp_wait_ns.count, 0u);
  EXPECT_EQ(stats.ssp_staleness.count, 0u);

  // A retry of worker 0's push is a duplicate: counted, not applied, its bytes not counted.
  auto ack = store.Push(Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})}));
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->duplicates, 1u);
  stats = store.GetShardStats();
  EXPECT_EQ(stats.duplicates, 1);
  EXPECT_EQ(stats.bytes_pushed, 32);
  EXPECT_EQ(stats.updates_applied, 1);

  // An ungated pull is answered at once and not timed; its bytes count.
  ASSERT_TRUE(PullNow(store, "j", {PullKey("w", 0)}).ok());
  stats = store.GetShardStats();
  EXPECT_EQ(stats.bytes_pulled, 32);
  EXPECT_EQ(stats.bsp_wait_ns.count, 1u);

  // The counters are the shard's: they outlive the job.
  ASSERT_TRUE(store.DropJob("j").ok());
  stats = store.GetShardStats();
  EXPECT_EQ(stats.jobs, 0);
  EXPECT_EQ(stats.updates_applied, 1);
  EXPECT_EQ(stats.duplicates, 1);
}

TEST(ParameterStoreStatsTest, SspStalenessAndWaits) {
  ParameterStore store;
  v1::CreateJobStateRequest r =
      JobRequest("j", Config(v1::CONSISTENCY_SSP, 2, 0.5f, v1::OPTIMIZER_KIND_SGD, 2));
  *r.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(r).ok());
  // Worker 0 runs ahead: steps 0, 1, 2 while worker 1's clock is 0 (staleness 0, 1, 2).
  for (int64_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(store.Push(Request("j", 0, 1, step, step + 1, {GradSlice("w", 0, {1, 1})})).ok());
  }
  ShardStats stats = store.GetShardStats();
  EXPECT_EQ(stats.updates_applied, 3);
  ASSERT_EQ(stats.ssp_staleness.count, 3u);
  EXPECT_EQ(stats.ssp_staleness.sum, 0 + 1 + 2);
  EXPECT_EQ(AtOrBelow(stats.ssp_staleness, 0), 1u);
  EXPECT_EQ(AtOrBelow(stats.ssp_staleness, 1), 2u);
  EXPECT_EQ(AtOrBelow(stats.ssp_staleness, 2), 3u);

  // Worker 0 pulls for step 3: it needs the slowest clock >= 1, so it waits for worker 1.
  v1::PullRequest pull;
  pull.set_job_id("j");
  pull.set_step(3);
  *pull.add_keys() = PullKey("w", 0);
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> pulled;
  store.Pull(pull, [&pulled](absl::StatusOr<std::vector<v1::Slice>> w) { pulled = std::move(w); });
  ASSERT_FALSE(pulled.has_value());
  EXPECT_EQ(store.GetShardStats().parked_pulls, 1);
  ASSERT_TRUE(store.Push(Request("j", 1, 1, 0, 1, {GradSlice("w", 0, {1, 1})})).ok());
  ASSERT_TRUE(pulled.has_value());
  stats = store.GetShardStats();
  EXPECT_EQ(stats.ssp_staleness.count, 4u);
  EXPECT_EQ(stats.ssp_staleness.sum, 3);  // worker 1's push at the slowest clock: 0
  EXPECT_EQ(stats.ssp_wait_ns.count, 1u);
  EXPECT_EQ(stats.bsp_wait_ns.count, 0u);
  EXPECT_EQ(stats.bytes_pushed, 4 * 8);
  EXPECT_EQ(stats.bytes_pulled, 8);
}

TEST(StoreHistogramTest, BucketsAreInclusiveUpperBounds) {
  StoreHistogram h({1, 10, 100});
  for (int64_t v : {0, 1, 2, 10, 11, 100, 101, 5000}) h.Observe(v);
  const StoreHistogram::Snapshot s = h.snapshot();
  EXPECT_EQ(s.counts, (std::vector<uint64_t>{2, 2, 2, 2}));
  EXPECT_EQ(s.count, 8u);
  EXPECT_EQ(s.sum, 0 + 1 + 2 + 10 + 11 + 100 + 101 + 5000);
}

// --- Checkpoint and Restore (issue #6) --------------------------------------------------------

// A BSP job with two dense partitions (Adam: two slots) and an Adagrad table, two workers.
v1::CreateJobStateRequest CheckpointJob(const std::string& id, int64_t every = 0) {
  v1::JobConfig config = Config(v1::CONSISTENCY_BSP, 2, 0.01f, v1::OPTIMIZER_KIND_ADAM);
  config.set_checkpoint_every_steps(every);
  v1::CreateJobStateRequest r = JobRequest(id, config);
  std::vector<float> init(1000);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.001f * static_cast<float>(i);
  *r.add_partitions() = Dense("w", 0, 1000, init);
  *r.add_partitions() = Dense("w", 1, 37);
  v1::SparseTableDecl* t = r.add_tables();
  t->set_name("emb");
  t->set_dim(4);
  t->mutable_initializer()->set_kind(v1::Initializer::KIND_UNIFORM);
  t->mutable_initializer()->set_scale(0.1f);
  t->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.05f);
  return r;
}

std::vector<float> StepGrad(size_t n, int64_t step, uint32_t worker, uint32_t salt) {
  std::mt19937 rng(static_cast<uint32_t>(step * 131 + worker * 7 + salt));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) x = d(rng);
  return g;
}

// Both workers push step `step` of the deterministic gradient stream.
void PushStep(ParameterStore& store, const std::string& job, int64_t step, uint64_t incarnation,
              uint64_t seq) {
  for (uint32_t w = 0; w < 2; ++w) {
    std::vector<int64_t> rows = {static_cast<int64_t>(step % 5), 7, static_cast<int64_t>(w) + 20};
    auto pushed = store.Push(Request(
        job, w, incarnation, step, seq,
        {GradSlice("w", 0, StepGrad(1000, step, w, 1)), GradSlice("w", 1, StepGrad(37, step, w, 2)),
         RowsSlice("emb", rows, StepGrad(12, step, w, 3))}));
    ASSERT_TRUE(pushed.ok()) << "step " << step << " worker " << w << ": " << pushed.status();
  }
}

std::vector<float> AllWeights(ParameterStore& store, const std::string& job) {
  std::vector<float> out = PullDense(store, job, "w", 0);
  std::vector<float> w1 = PullDense(store, job, "w", 1);
  out.insert(out.end(), w1.begin(), w1.end());
  auto rows = PullNow(store, job, {PullKey("emb", 0, {0, 1, 2, 3, 4, 7, 20, 21, 99})});
  EXPECT_TRUE(rows.ok()) << rows.status();
  if (rows.ok()) {
    std::vector<float> r = Floats((*rows)[0]);
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ParameterStoreCheckpointTest, RestoreThenReplayGivesTheSameWeightsBitForBit) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir, 3));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-a")).ok());
  constexpr int64_t kSteps = 12;
  constexpr int64_t kAt = 5;
  // Registered ahead: captured when the job reaches boundary 5, answered once written.
  v1::CheckpointRequest ask;
  ask.set_job_id("job-a");
  ask.set_step(kAt);
  absl::Notification written;
  absl::StatusOr<v1::CheckpointResponse> response = absl::UnknownError("unanswered");
  store.Checkpoint(ask, [&](absl::StatusOr<v1::CheckpointResponse> r) {
    response = std::move(r);
    written.Notify();
  });
  for (int64_t s = 0; s < kSteps; ++s) PushStep(store, "job-a", s, 1, static_cast<uint64_t>(s + 1));
  ASSERT_TRUE(written.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->step(), kAt);
  EXPECT_EQ(response->path(), dir + "/job-a/ckpt-5/shard-3");
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(response->path());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(response->bytes(), 28 + file->header.ByteSizeLong() + file->data.size());
  EXPECT_EQ(file->header.partitions_size(), 3);
  for (const v1::PartitionCheckpoint& p : file->header.partitions()) {
    EXPECT_EQ(p.version(), kAt) << p.key().tensor();
    EXPECT_EQ(p.last_applied_size(), 2);
  }
  const std::vector<float> uninterrupted = AllWeights(store, "job-a");

  // A parked pull of the state being replaced fails with ABORTED.
  v1::PullRequest parked;
  parked.set_job_id("job-a");
  parked.set_step(kSteps + 1);
  *parked.add_keys() = PullKey("w", 1);
  std::optional<absl::Status> parked_result;
  store.Pull(parked, [&](absl::StatusOr<std::vector<v1::Slice>> r) { parked_result = r.status(); });
  EXPECT_FALSE(parked_result.has_value());

  v1::RestoreRequest restore;
  restore.set_job_id("job-a");
  restore.set_step(kAt);
  restore.set_min_incarnation(100);
  absl::StatusOr<v1::RestoreResponse> restored = store.Restore(restore);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), kAt);
  EXPECT_EQ(restored->partitions(), 2u);
  EXPECT_EQ(restored->tables(), 1u);
  ASSERT_TRUE(parked_result.has_value());
  EXPECT_EQ(parked_result->code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(BitEqual(AllWeights(store, "job-a"), uninterrupted));

  // A straggler of the old incarnation is refused; the rewound workers replay steps 5..11.
  auto straggler =
      store.Push(Request("job-a", 0, 1, kAt, 99, {GradSlice("w", 1, StepGrad(37, kAt, 0, 2))}));
  EXPECT_EQ(straggler.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(straggler.status().message(), HasSubstr("incarnation"));
  // A pull for step 5 is open at once (version 5), one for 6 is not.
  EXPECT_TRUE(PullNow(store, "job-a", {PullKey("w", 0)}).ok());
  for (int64_t s = kAt; s < kSteps; ++s) {
    PushStep(store, "job-a", s, 100, static_cast<uint64_t>(s + 1));
  }
  EXPECT_TRUE(BitEqual(AllWeights(store, "job-a"), uninterrupted));
}

TEST(ParameterStoreCheckpointTest, AutomaticCapturesAndRetention) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-b", /*every=*/3)).ok());
  for (int64_t s = 0; s < 10; ++s) PushStep(store, "job-b", s, 1, static_cast<uint64_t>(s + 1));
  // Step 9 was captured by itself: this call only waits for its file and applies retention.
  absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(store, "job-b", 9, 6);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step(), 9);
  EXPECT_EQ(*ListCheckpointSteps(dir + "/job-b", 0), (std::vector<int64_t>{6, 9}));
  // The capture at 6 is complete and holds version 6 everywhere.
  absl::StatusOr<CheckpointContents> six = ReadCheckpointFile(dir + "/job-b/ckpt-6/shard-0");
  ASSERT_TRUE(six.ok()) << six.status();
  for (const v1::PartitionCheckpoint& p : six->header.partitions()) EXPECT_EQ(p.version(), 6);
}

TEST(ParameterStoreCheckpointTest, PassedStepIsFailedPreconditionWithTheCompletedSteps) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-c")).ok());
  for (int64_t s = 0; s < 4; ++s) PushStep(store, "job-c", s, 1, static_cast<uint64_t>(s + 1));
  absl::StatusOr<v1::CheckpointResponse> late = CheckpointAndWait(store, "job-c", 2);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("completed 4 steps"));
  // The boundary the job sits at is captured at once.
  absl::StatusOr<v1::CheckpointResponse> now = CheckpointAndWait(store, "job-c", 4);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->step(), 4);
  // Mid-step (worker 0 staged step 4): the capture still holds the boundary's state.
  ASSERT_TRUE(
      store.Push(Request("job-c", 0, 1, 4, 5, {GradSlice("w", 1, StepGrad(37, 4, 0, 2))})).ok());
  v1::UpdateMembershipRequest m;
  m.set_job_id("job-c");
  m.add_live_workers(0);
  m.add_live_workers(1);
  m.set_effective_step(0);
  absl::StatusOr<v1::UpdateMembershipResponse> membership = store.UpdateMembership(m);
  ASSERT_TRUE(membership.ok()) << membership.status();
  EXPECT_EQ(membership->completed_steps(), 4);
}

TEST(ParameterStoreCheckpointTest, ValidatesEveryField) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-d")).ok());
  struct Case {
    std::string job;
    int64_t step;
    int64_t retain;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"../etc", 5, 0, absl::StatusCode::kInvalidArgument, "job_id:"},
      {"a/b", 5, 0, absl::StatusCode::kInvalidArgument, "job_id:"},
      {"", 5, 0, absl::StatusCode::kInvalidArgument, "job_id:"},
      {"job-d", 0, 0, absl::StatusCode::kInvalidArgument, "step:"},
      {"job-d", -3, 0, absl::StatusCode::kInvalidArgument, "step:"},
      {"job-d", std::numeric_limits<int64_t>::max(), 0, absl::StatusCode::kInvalidArgument,
       "step:"},
      {"job-d", 5, -1, absl::StatusCode::kInvalidArgument, "retain_from_step:"},
      {"job-d", 5, 6, absl::StatusCode::kInvalidArgument, "retain_from_step:"},
      {"nope", 5, 0, absl::StatusCode::kNotFound, "nope"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(store, c.job, c.step, c.retain);
    EXPECT_EQ(r.status().code(), c.code) << c.job << " " << c.step << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
  v1::RestoreRequest restore;
  restore.set_job_id("job-d");
  restore.set_step(7);
  EXPECT_EQ(store.Restore(restore).status().code(), absl::StatusCode::kNotFound);
  restore.set_step(-1);
  EXPECT_EQ(store.Restore(restore).status().code(), absl::StatusCode::kInvalidArgument);
  restore.set_step(7);
  restore.set_job_id("..");
  EXPECT_EQ(store.Restore(restore).status().code(), absl::StatusCode::kInvalidArgument);
  // CreateJobState refuses a job id that could not become a directory.
  EXPECT_EQ(store.CreateJobState(CheckpointJob("x/../../y")).status().code(),
            absl::StatusCode::kInvalidArgument);

  ParameterStore no_dir;
  ASSERT_TRUE(no_dir.CreateJobState(CheckpointJob("job-d")).ok());
  absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(no_dir, "job-d", 5);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("--data_dir not set"));
  restore.set_job_id("job-d");
  EXPECT_EQ(no_dir.Restore(restore).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ParameterStoreCheckpointTest, WaitingCheckpointsEndWithDropAndShutdown) {
  const std::string dir = MakeCheckpointDir();
  std::optional<absl::Status> dropped;
  std::optional<absl::Status> shut;
  int exhausted = 0;
  int answered = 0;
  {
    ParameterStore store(CheckpointOptions(dir));
    ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-e")).ok());
    ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-f")).ok());
    v1::CheckpointRequest r;
    r.set_job_id("job-e");
    r.set_step(100);
    store.Checkpoint(r, [&](absl::StatusOr<v1::CheckpointResponse> c) { dropped = c.status(); });
    r.set_job_id("job-f");
    store.Checkpoint(r, [&](absl::StatusOr<v1::CheckpointResponse> c) { shut = c.status(); });
    EXPECT_FALSE(dropped.has_value());
    ASSERT_TRUE(store.DropJob("job-e").ok());
    ASSERT_TRUE(dropped.has_value());
    EXPECT_EQ(dropped->code(), absl::StatusCode::kAborted);
    EXPECT_FALSE(shut.has_value());
    // Calls waiting for far-away steps are bounded.
    for (int64_t step = 200; step < 240; ++step) {
      r.set_step(step);
      store.Checkpoint(r, [&](absl::StatusOr<v1::CheckpointResponse> c) {
        ++answered;
        if (c.status().code() == absl::StatusCode::kResourceExhausted) ++exhausted;
      });
    }
    EXPECT_EQ(exhausted, 40 - 15);  // step 100 already waits: 15 more fit
    EXPECT_EQ(answered, exhausted);
  }
  ASSERT_TRUE(shut.has_value());
  EXPECT_EQ(shut->code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(answered, 40);  // the 15 that waited end with the shutdown
}

// A step far ahead of the job is refused (it would hold a registration for the life of the job),
// and cancelled calls stop counting: their registrations are forgotten and new ones fit again.
TEST(ParameterStoreCheckpointTest, FarStepsAreRefusedAndCancelledWaitersAreDropped) {
  const std::string dir = MakeCheckpointDir();
  // Declared before the store, which may still answer into them when it is destroyed.
  std::vector<std::optional<absl::Status>> answers(16);
  std::vector<std::optional<absl::Status>> later(16);
  int exhausted = 0;
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-x")).ok());
  for (int64_t s = 0; s < 3; ++s) PushStep(store, "job-x", s, 1, static_cast<uint64_t>(s + 1));
  const int64_t ahead = int64_t{1} << 20;
  absl::StatusOr<v1::CheckpointResponse> far = CheckpointAndWait(store, "job-x", 3 + ahead + 1);
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument) << far.status();
  EXPECT_THAT(far.status().message(), HasSubstr("step:"));
  EXPECT_THAT(far.status().message(), HasSubstr("completed 3 steps"));
  far = CheckpointAndWait(store, "job-x", int64_t{1000000000000});
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument) << far.status();

  // 16 registrations (the last at the bound itself) fill the job's slots.
  std::vector<std::shared_ptr<std::atomic<bool>>> flags;
  for (int i = 0; i < 16; ++i) {
    flags.push_back(std::make_shared<std::atomic<bool>>(false));
    v1::CheckpointRequest r;
    r.set_job_id("job-x");
    r.set_step(i == 15 ? 3 + ahead : 100 + i);
    store.Checkpoint(
        r, [&answers, i](absl::StatusOr<v1::CheckpointResponse> c) { answers[i] = c.status(); },
        flags.back());
  }
  for (int i = 0; i < 16; ++i) EXPECT_FALSE(answers[i].has_value()) << i << ": " << *answers[i];
  absl::StatusOr<v1::CheckpointResponse> refused = CheckpointAndWait(store, "job-x", 50);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  // Their callers go away: the next call answers them CANCELLED, forgets their steps, and fits.
  for (const auto& f : flags) f->store(true);
  absl::StatusOr<v1::CheckpointResponse> now = CheckpointAndWait(store, "job-x", 3);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->step(), 3);
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(answers[i].has_value()) << i;
    EXPECT_EQ(answers[i]->code(), absl::StatusCode::kCancelled) << i << ": " << *answers[i];
  }
  // The forgotten steps are not captured: only step 3 has a file after the job passes 100..114.
  for (int64_t s = 3; s < 120; ++s) PushStep(store, "job-x", s, 1, static_cast<uint64_t>(s + 1));
  absl::StatusOr<v1::CheckpointResponse> passed = CheckpointAndWait(store, "job-x", 105);
  EXPECT_EQ(passed.status().code(), absl::StatusCode::kFailedPrecondition) << passed.status();
  EXPECT_EQ(*ListCheckpointSteps(dir + "/job-x", 0), (std::vector<int64_t>{3}));
  // 16 new registrations fit again.
  for (int i = 0; i < 16; ++i) {
    v1::CheckpointRequest r;
    r.set_job_id("job-x");
    r.set_step(200 + i);
    store.Checkpoint(r, [&later, &exhausted, i](absl::StatusOr<v1::CheckpointResponse> c) {
      later[i] = c.status();
      if (c.status().code() == absl::StatusCode::kResourceExhausted) ++exhausted;
    });
  }
  EXPECT_EQ(exhausted, 0);
  ASSERT_TRUE(store.DropJob("job-x").ok());
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(later[i].has_value()) << i;
    EXPECT_EQ(later[i]->code(), absl::StatusCode::kAborted) << i << ": " << *later[i];
  }
}

// A shard process that restarted holds no job in memory, but the checkpoint files of an ended job
// are still on disk: DropJob (NOT_FOUND, which settles the coordinator's owed drop) removes them.
TEST(ParameterStoreCheckpointTest, DropJobOfAJobNotInMemoryRemovesItsFiles) {
  const std::string dir = MakeCheckpointDir();
  {
    ParameterStore store(CheckpointOptions(dir));
    ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-z")).ok());
    PushStep(store, "job-z", 0, 1, 1);
    const absl::StatusOr<v1::CheckpointResponse> written = CheckpointAndWait(store, "job-z", 1);
    ASSERT_TRUE(written.ok()) << written.status();
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/job-z"));
  {
    ParameterStore restarted(CheckpointOptions(dir));
    EXPECT_EQ(restarted.DropJob("job-z").code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(restarted.DropJob("..").code(), absl::StatusCode::kNotFound);  // no file name
  }  // the writer thread has run the removal
  EXPECT_FALSE(std::filesystem::exists(dir + "/job-z"));
  EXPECT_TRUE(std::filesystem::exists(dir));
}

// A refused Checkpoint is answered with no store lock held: its callback may call the store again
// (before the fix it ran under the job's checkpoint lock, and this deadlocked).
TEST(ParameterStoreCheckpointTest, RefusalsAreAnsweredWithoutStoreLocks) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-y")).ok());
  v1::CheckpointRequest r;
  r.set_job_id("job-y");
  for (int64_t step = 100; step < 116; ++step) {
    r.set_step(step);
    store.Checkpoint(r, [](absl::StatusOr<v1::CheckpointResponse>) {});
  }
  auto first = std::make_shared<std::optional<absl::Status>>();
  auto second = std::make_shared<std::optional<absl::Status>>();
  auto done = std::make_shared<absl::Notification>();
  std::thread caller([&store, first, second, done] {
    v1::CheckpointRequest again;
    again.set_job_id("job-y");
    again.set_step(50);
    store.Checkpoint(
        again, [&store, first, second, done, again](absl::StatusOr<v1::CheckpointResponse> c) {
          *first = c.status();
          store.Checkpoint(again, [second, done](absl::StatusOr<v1::CheckpointResponse> c2) {
            *second = c2.status();
            done->Notify();
          });
        });
  });
  if (!done->WaitForNotificationWithTimeout(absl::Seconds(10))) {
    // The caller is stuck on a store lock: nothing can end this process cleanly.
    ADD_FAILURE() << "a Checkpoint callback that calls the store again deadlocked";
    std::_Exit(1);
  }
  caller.join();
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ((*first)->code(), absl::StatusCode::kResourceExhausted) << **first;
  ASSERT_TRUE(second->has_value());
  EXPECT_EQ((*second)->code(), absl::StatusCode::kResourceExhausted) << **second;
}

// A dropped job's files are deleted (by the writer, after its queued writes), and automatic files
// nobody asked for are bounded: the oldest beyond 8 go, never one at or below a requested step.
TEST(ParameterStoreCheckpointTest, DroppedJobsAndUnrequestedAutomaticFilesAreDeleted) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-g", /*every=*/1)).ok());
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-h")).ok());
  // The writer runs its tasks in order: a checkpoint of job-h answered means every earlier write
  // (and deletion) is done.
  int64_t h_step = 0;
  auto flush = [&] {
    PushStep(store, "job-h", h_step, 1, static_cast<uint64_t>(h_step + 1));
    ++h_step;
    absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(store, "job-h", h_step);
    ASSERT_TRUE(r.ok()) << r.status();
  };
  for (int64_t s = 0; s < 4; ++s) PushStep(store, "job-g", s, 1, static_cast<uint64_t>(s + 1));
  flush();
  absl::StatusOr<v1::CheckpointResponse> four = CheckpointAndWait(store, "job-g", 4);
  ASSERT_TRUE(four.ok()) << four.status();
  for (int64_t s = 4; s < 20; ++s) PushStep(store, "job-g", s, 1, static_cast<uint64_t>(s + 1));
  flush();
  EXPECT_EQ(*ListCheckpointSteps(dir + "/job-g", 0),
            (std::vector<int64_t>{1, 2, 3, 4, 13, 14, 15, 16, 17, 18, 19, 20}));
  // A deleted step is not answered from memory with its old path.
  absl::StatusOr<v1::CheckpointResponse> gone = CheckpointAndWait(store, "job-g", 6);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  absl::StatusOr<v1::CheckpointResponse> kept = CheckpointAndWait(store, "job-g", 14);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->path(), dir + "/job-g/ckpt-14/shard-0");

  ASSERT_TRUE(store.DropJob("job-g").ok());
  flush();
  EXPECT_EQ(::access((dir + "/job-g").c_str(), F_OK), -1);
  EXPECT_EQ(::access((dir + "/job-h/ckpt-1/shard-0").c_str(), F_OK), 0);
}

// The restore path checks every header field against the data before it reads: mutated headers
// (with a valid CRC, as a fuzzer would make them) are OK or DATA_LOSS, never a crash.
TEST(ParameterStoreCheckpointTest, MutatedHeadersAreRefusedWithDataLoss) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-g")).ok());
  for (int64_t s = 0; s < 3; ++s) PushStep(store, "job-g", s, 1, static_cast<uint64_t>(s + 1));
  absl::StatusOr<v1::CheckpointResponse> c = CheckpointAndWait(store, "job-g", 3);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(c->path());
  ASSERT_TRUE(file.ok());
  const std::string header = file->header.SerializeAsString();
  std::mt19937 rng(7);
  int restored = 0;
  int refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string mutated = header;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      mutated[rng() % mutated.size()] = static_cast<char>(rng());
    }
    CheckpointContents contents;
    if (!contents.header.ParseFromString(mutated)) continue;
    contents.data = file->data;
    ParameterStoreOptions options;
    options.max_memory_bytes = int64_t{64} << 20;
    ParameterStore target(options);
    absl::StatusOr<v1::RestoreResponse> r = target.RestoreJobFromCheckpoint(contents, 1);
    if (r.ok()) {
      ++restored;
    } else {
      ++refused;
      EXPECT_TRUE(r.status().code() == absl::StatusCode::kDataLoss ||
                  r.status().code() == absl::StatusCode::kResourceExhausted)
          << r.status();
    }
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(restored, 0);  // some flips land in values that do not matter (weights, times)
}

TEST(ParameterStoreCheckpointTest, SspCapturesWhenTheSlowestWorkerReachesTheStep) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  v1::JobConfig config = Config(v1::CONSISTENCY_SSP, 2, 1.0f, v1::OPTIMIZER_KIND_SGD, 2);
  config.set_checkpoint_every_steps(2);
  v1::CreateJobStateRequest r = JobRequest("ssp", config);
  *r.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(r).ok());
  // Worker 0 runs ahead to clock 3; worker 1 reaches 2 last: then step 2 is captured, holding
  // worker 0's third push too (its seq is in the table).
  for (int64_t s = 0; s < 3; ++s) {
    ASSERT_TRUE(store.Push(Request("ssp", 0, 1, s, s + 1, {GradSlice("w", 0, {1, 1})})).ok());
  }
  for (int64_t s = 0; s < 2; ++s) {
    ASSERT_TRUE(store.Push(Request("ssp", 1, 1, s, s + 1, {GradSlice("w", 0, {2, 2})})).ok());
  }
  absl::StatusOr<v1::CheckpointResponse> c = CheckpointAndWait(store, "ssp", 2);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(c->path());
  ASSERT_TRUE(file.ok());
  const v1::PartitionCheckpoint& p = file->header.partitions(0);
  EXPECT_EQ(p.version(), 5);
  EXPECT_EQ(p.clocks(0), 3);
  EXPECT_EQ(p.clocks(1), 2);
  // w = -(3 * 1 + 2 * 2) / 2 per element (SSP scales by 1 / num_live).
  float w[2];
  std::memcpy(w, file->data.data() + p.weights().offset(), 8);
  EXPECT_EQ(w[0], -3.5f);
  EXPECT_EQ(w[1], -3.5f);
}

}  // namespace
}  // namespace tessera::server
