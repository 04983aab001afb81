// End to end: 3 real tessera-server processes on ports picked at run time, 4 worker threads, each
// with its own ParameterClient (worker_id 0..3), pushing for 50 steps under BSP, SSP and ASP, and
// with injected duplicate deliveries and lost responses.
//
// Gradients are small integers and the optimizer is plain SGD with a power-of-two learning rate,
// so every update is exact in fp32 and the final weights can be compared with == against a
// reference computed in double precision: BSP averages each step once (w -= lr * sum / 4),
// SSP applies each push scaled by 1/num_workers (w -= lr * g / 4), ASP applies each push as is
// (w -= lr * g). Since these updates commute, SSP and ASP end exactly where the reference does,
// whatever the interleaving.
#include <algorithm>
#include <cmath>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "common/placement.h"
#include "gtest/gtest.h"
#include "tests/e2e/faulty_shard_client.h"
#include "worker/client/grpc_shard_client.h"
#include "worker/client/local_shards.h"
#include "worker/client/parameter_client.h"

#ifndef TESSERA_SERVER_BINARY
#error "TESSERA_SERVER_BINARY must name the tessera-server binary"
#endif

namespace tessera {
namespace {

using client::LocalShards;
using client::ParameterClient;

constexpr int kShards = 3;
constexpr int kWorkers = 4;
constexpr int kSteps = 50;
constexpr float kLearningRate = 0.5f;
constexpr int64_t kPartitionBytes = 256;  // 64 values: every tensor spans several partitions

struct TensorDef {
  std::string name;
  std::vector<int64_t> shape;
  int64_t size;
};

const std::vector<TensorDef>& Tensors() {
  static const auto* tensors =
      new std::vector<TensorDef>{{"dense/w", {1000}, 1000}, {"dense/b", {37, 11}, 407}};
  return *tensors;
}

float Initial(int t, int64_t i) { return static_cast<float>((i * 7 + t * 3) % 19) - 9.0f; }

// An integer in [-3, 3].
float Gradient(int worker, int step, int t, int64_t i) {
  return static_cast<float>((worker * 5 + step * 3 + t * 11 + i + i / 7) % 7) - 3.0f;
}

class PushPullE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LocalShards::Options o;
    o.server_path = TESSERA_SERVER_BINARY;
    o.num_shards = kShards;
    o.max_message_bytes = 16 << 20;
    o.extra_args = {"--threads", "2", "--log_level", "warn"};
    auto shards = LocalShards::Start(o);
    ASSERT_TRUE(shards.ok()) << shards.status();
    shards_ = *std::move(shards);
  }

  void TearDown() override {
    if (shards_ == nullptr) return;
    // Every shard must shut down cleanly on SIGTERM.
    absl::Status stopped = shards_->Stop(absl::Seconds(15));
    EXPECT_TRUE(stopped.ok()) << stopped;
  }

  ParameterClient::Options ClientOptions(const std::string& job, uint32_t worker) {
    ParameterClient::Options o;
    o.shard_addresses = shards_->addresses();
    o.job_id = job;
    o.worker_id = worker;
    o.incarnation = 1;
    o.partition_bytes = kPartitionBytes;
    o.call_timeout = absl::Seconds(20);
    o.streams_per_shard = 2;  // several streams per shard, as a tuned worker would use
    o.retry.max_attempts = 10;
    o.retry.initial_backoff = absl::Milliseconds(5);
    o.retry.max_backoff = absl::Milliseconds(100);
    o.pull_encoding = pull_encoding_;
    return o;
  }

  // Called from the worker threads at once: `initial_` is filled once and only read after that
  // (clearing and refilling it here raced, and aborted with a double free).
  std::vector<client::DenseTensorSpec> Specs() {
    {
      absl::MutexLock lock(&initial_mu_);
      if (initial_.empty()) {
        for (size_t t = 0; t < Tensors().size(); ++t) {
          std::vector<float> v(Tensors()[t].size);
          for (int64_t i = 0; i < Tensors()[t].size; ++i) v[i] = Initial(t, i);
          initial_.push_back(std::move(v));
        }
      }
    }
    std::vector<client::DenseTensorSpec> specs;
    for (size_t t = 0; t < Tensors().size(); ++t) {
      specs.push_back({Tensors()[t].name, Tensors()[t].shape, initial_[t]});
    }
    return specs;
  }

  // Declares the job through a separate client, as a coordinator would.
  void DeclareJob(const std::string& job, v1::Consistency mode, uint32_t staleness,
                  double pull_topk_fraction = 0) {
    v1::JobConfig config;
    config.set_pull_topk_fraction(pull_topk_fraction);
    config.set_consistency(mode);
    config.set_staleness(staleness);
    config.set_num_workers(kWorkers);
    config.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
    config.mutable_optimizer()->set_learning_rate(kLearningRate);
    auto declarer = ParameterClient::Create(ClientOptions(job, 0));
    ASSERT_TRUE(declarer.ok()) << declarer.status();
    absl::Status declared = (*declarer)->DeclareJob(config, Specs(), {});
    ASSERT_TRUE(declared.ok()) << declared;
    for (const TensorDef& t : Tensors()) {
      auto layout = (*declarer)->Layout(t.name);
      ASSERT_TRUE(layout.ok());
      std::set<int32_t> shards;
      for (const auto& p : (*layout)->partitions) shards.insert(p.shard);
      ASSERT_GT((*layout)->partitions.size(), 1u) << t.name;
      ASSERT_GT(shards.size(), 1u) << t.name << " must span several shards";
    }
  }

  // The reference after all workers' steps [0, steps): initial - scale * sum of gradients,
  // in double precision.
  std::vector<double> Reference(int t, int steps, double scale) {
    std::vector<double> ref(Tensors()[t].size);
    for (int64_t i = 0; i < Tensors()[t].size; ++i) {
      double sum = 0;
      for (int s = 0; s < steps; ++s) {
        for (int w = 0; w < kWorkers; ++w) sum += Gradient(w, s, t, i);
      }
      ref[i] = Initial(t, i) - scale * sum;
    }
    return ref;
  }

  void ExpectFinalWeights(const std::string& job, double scale) {
    auto reader = ParameterClient::Create(ClientOptions(job, 0));
    ASSERT_TRUE(reader.ok());
    ASSERT_TRUE((*reader)->AttachJob(Specs(), {}).ok());
    for (size_t t = 0; t < Tensors().size(); ++t) {
      std::vector<float> w(Tensors()[t].size);
      absl::Status pulled = (*reader)->Pull(Tensors()[t].name, -1, absl::MakeSpan(w));
      ASSERT_TRUE(pulled.ok()) << pulled;
      const std::vector<double> ref = Reference(t, kSteps, scale);
      int mismatches = 0;
      for (size_t i = 0; i < w.size(); ++i) {
        if (static_cast<double>(w[i]) != ref[i] && ++mismatches <= 5) {
          ADD_FAILURE() << Tensors()[t].name << "[" << i << "] = " << w[i] << ", reference "
                        << ref[i];
        }
      }
      EXPECT_EQ(mismatches, 0) << Tensors()[t].name;
    }
  }

  // What one worker checks after PushPull of tensor t at step s returned `weights` and `result`.
  using StepCheck = std::function<void(int worker, int step, int t, const std::vector<float>&,
                                       const client::PushPullResult&)>;

  // Runs kWorkers threads for kSteps. With fault percentages, each worker's shard clients are
  // wrapped in a FaultyShardClient.
  void RunWorkers(const std::string& job, const StepCheck& check, int duplicate_pct = 0,
                  int drop_pct = 0) {
    std::vector<std::thread> threads;
    absl::Mutex mu;
    std::vector<std::string> errors;
    // Nobody pushes before everyone has read the initial weights (ASP and SSP would otherwise
    // let a fast worker change them under a slow one's initial pull).
    absl::Barrier* started = new absl::Barrier(kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        bool waited = false;
        auto fail = [&](const std::string& e) {
          {
            absl::MutexLock lock(&mu);
            errors.push_back(absl::StrCat("worker ", w, ": ", e));
          }
          if (!waited && started->Block()) delete started;
        };
        ParameterClient::Options o = ClientOptions(job, w);
        std::vector<std::unique_ptr<client::ShardClient>> transports;
        std::vector<e2e::FaultyShardClient*> faulty;
        for (const std::string& address : o.shard_addresses) {
          client::GrpcShardClient::Options go;
          go.address = address;
          go.streams = o.streams_per_shard;
          auto g = client::GrpcShardClient::Create(go);
          if (!g.ok()) return fail(g.status().ToString());
          if (duplicate_pct > 0 || drop_pct > 0) {
            auto f = std::make_unique<e2e::FaultyShardClient>(*std::move(g), 1000 + w,
                                                              duplicate_pct, drop_pct);
            faulty.push_back(f.get());
            transports.push_back(std::move(f));
          } else {
            transports.push_back(*std::move(g));
          }
        }
        auto c = ParameterClient::CreateWithShards(o, std::move(transports));
        if (!c.ok()) return fail(c.status().ToString());
        ParameterClient& pc = **c;
        if (absl::Status s = pc.AttachJob(Specs(), {}); !s.ok()) return fail(s.ToString());
        // Initial weights, ungated.
        for (size_t t = 0; t < Tensors().size(); ++t) {
          std::vector<float> w0(Tensors()[t].size);
          if (absl::Status s = pc.Pull(Tensors()[t].name, -1, absl::MakeSpan(w0)); !s.ok()) {
            return fail(s.ToString());
          }
          if (w0 != initial_[t]) return fail("initial weights differ");
        }
        waited = true;
        if (started->Block()) delete started;
        std::vector<std::vector<float>> grads(Tensors().size()), weights(Tensors().size());
        for (int step = 0; step < kSteps + zero_steps_; ++step) {
          std::vector<std::future<absl::StatusOr<client::PushPullResult>>> futures;
          for (size_t t = 0; t < Tensors().size(); ++t) {
            grads[t].resize(Tensors()[t].size);
            weights[t].assign(Tensors()[t].size, std::nanf(""));
            for (int64_t i = 0; i < Tensors()[t].size; ++i) {
              grads[t][i] = step < kSteps ? Gradient(w, step, t, i) : 0.0f;
            }
            futures.push_back(
                pc.PushPull(Tensors()[t].name, step, grads[t], absl::MakeSpan(weights[t])));
          }
          for (size_t t = 0; t < Tensors().size(); ++t) {
            absl::StatusOr<client::PushPullResult> r = futures[t].get();
            if (!r.ok()) return fail(absl::StrCat("step ", step, ": ", r.status().ToString()));
            check(w, step, t, weights[t], *r);
            absl::MutexLock lock(&mu);
            retries_ += r->retries;
            duplicates_ += r->duplicates;
          }
        }
        for (e2e::FaultyShardClient* f : faulty) {
          absl::MutexLock lock(&mu);
          injected_duplicates_ += f->duplicated();
          injected_drops_ += f->dropped();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const std::string& e : errors) ADD_FAILURE() << e;
  }

  std::unique_ptr<LocalShards> shards_;
  // The workers' pull encoding, and the steps with zero gradients they run after kSteps.
  v1::Encoding pull_encoding_ = v1::ENCODING_FP32;
  int zero_steps_ = 0;
  absl::Mutex initial_mu_;
  std::vector<std::vector<float>> initial_;  // filled once by Specs(), then read only
  int64_t retries_ = 0;
  int64_t duplicates_ = 0;
  int injected_duplicates_ = 0;
  int injected_drops_ = 0;
};

TEST_F(PushPullE2eTest, BspAveragesEachStepOnceAndMatchesTheReferenceExactly) {
  DeclareJob("bsp", v1::CONSISTENCY_BSP, 0);
  // Reference weights after each step, per tensor: scale lr / num_workers on the sum.
  std::vector<std::vector<std::vector<double>>> refs(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t t = 0; t < Tensors().size(); ++t) {
      refs[s].push_back(Reference(t, s + 1, kLearningRate / kWorkers));
    }
  }
  absl::Mutex mu;
  int bad = 0;
  RunWorkers("bsp", [&](int w, int step, int t, const std::vector<float>& weights,
                        const client::PushPullResult& r) {
    // The answer for step s comes once step s is applied, and before step s + 1 can be.
    EXPECT_EQ(r.min_version, step + 1) << "worker " << w << " step " << step;
    EXPECT_EQ(r.max_version, step + 1) << "worker " << w << " step " << step;
    for (size_t i = 0; i < weights.size(); ++i) {
      if (static_cast<double>(weights[i]) != refs[step][t][i]) {
        absl::MutexLock lock(&mu);
        if (++bad <= 5) {
          ADD_FAILURE() << "worker " << w << " step " << step << " " << Tensors()[t].name << "["
                        << i << "] = " << weights[i] << ", reference " << refs[step][t][i];
        }
      }
    }
  });
  EXPECT_EQ(bad, 0);
  ExpectFinalWeights("bsp", kLearningRate / kWorkers);
}

// Weight deltas (pull encodings TOPK and INT8, server/published_weights.h): every worker holds
// the same published weights after every step, bit for bit, whatever the injected duplicates and
// lost responses; the pushes apply as with whole weights; and once the gradients stop, the
// shards' error feedback sends what the deltas left out: under TOPK, 1 / fraction steps later the
// workers hold the shards' weights exactly; under INT8, each step leaves 1/254 of the last miss,
// so 4 steps later they are within 1e-6 of them.
TEST_F(PushPullE2eTest, BspWeightDeltasGiveEveryWorkerTheSameWeightsAndCatchUp) {
  constexpr double kFraction = 0.25;  // 16 of each partition's 64 values per TOPK delta
  for (const v1::Encoding encoding : {v1::ENCODING_TOPK, v1::ENCODING_INT8}) {
    for (const bool faults : {false, true}) {
      SCOPED_TRACE(
          absl::StrCat(v1::Encoding_Name(encoding),
                       faults ? " with duplicates and lost responses" : " without faults"));
      const std::string job = absl::StrCat(encoding == v1::ENCODING_TOPK ? "delta" : "delta-int8",
                                           faults ? "-faults" : "");
      pull_encoding_ = encoding;
      zero_steps_ = 4;
      DeclareJob(job, v1::CONSISTENCY_BSP, 0, kFraction);
      std::vector<std::vector<double>> final_ref;
      for (size_t t = 0; t < Tensors().size(); ++t) {
        final_ref.push_back(Reference(t, kSteps, kLearningRate / kWorkers));
      }
      absl::Mutex mu;
      std::map<std::pair<int, int>, std::vector<float>> first;  // (step, tensor): first answer
      int differ = 0, behind = 0, caught_up = 0;
      RunWorkers(
          job,
          [&](int w, int step, int t, const std::vector<float>& weights,
              const client::PushPullResult& r) {
            EXPECT_EQ(r.min_version, step + 1) << "worker " << w << " step " << step;
            absl::MutexLock lock(&mu);
            auto [it, fresh] = first.emplace(std::make_pair(step, t), weights);
            if (!fresh && it->second != weights && ++differ <= 3) {
              ADD_FAILURE() << "worker " << w << " step " << step << " " << Tensors()[t].name
                            << ": other weights than another worker's";
            }
            int off = 0;
            double farthest = 0;
            for (size_t i = 0; i < weights.size(); ++i) {
              off += static_cast<double>(weights[i]) != final_ref[t][i] ? 1 : 0;
              farthest = std::max(farthest, std::fabs(weights[i] - final_ref[t][i]));
            }
            if (step == kSteps - 1 && off > 0) ++behind;
            if (step == kSteps + zero_steps_ - 1) {
              if (encoding == v1::ENCODING_TOPK) {
                EXPECT_EQ(off, 0) << "worker " << w << " " << Tensors()[t].name;
              } else {
                EXPECT_LE(farthest, 1e-6) << "worker " << w << " " << Tensors()[t].name;
              }
              ++caught_up;
            }
          },
          faults ? 5 : 0, faults ? 5 : 0);
      EXPECT_EQ(differ, 0);
      // At the last gradient step the workers trail the shards (TOPK deltas carry a quarter of
      // the values, INT8 ones round each), and every worker caught up with every tensor.
      EXPECT_EQ(behind, kWorkers * static_cast<int>(Tensors().size()));
      EXPECT_EQ(caught_up, kWorkers * static_cast<int>(Tensors().size()));
      ExpectFinalWeights(job, kLearningRate / kWorkers);
      if (faults) {
        EXPECT_GT(injected_drops_, 0);
        EXPECT_GT(injected_duplicates_, 0);
      }
    }
  }
}

TEST_F(PushPullE2eTest, SspServesNothingStalerThanKAndEndsExact) {
  constexpr int kStaleness = 2;
  DeclareJob("ssp", v1::CONSISTENCY_SSP, kStaleness);
  RunWorkers("ssp", [&](int w, int step, int t, const std::vector<float>& weights,
                        const client::PushPullResult& r) {
    // Answered for step s + 1: every worker has pushed steps [0, s + 1 - k), each one update of
    // every partition; and our own s + 1 pushes are in.
    const int64_t floor = std::max<int64_t>(kWorkers * (step + 1 - kStaleness), step + 1);
    EXPECT_GE(r.min_version, floor) << "worker " << w << " step " << step;
    EXPECT_LE(r.max_version, kWorkers * kSteps);
    for (float v : weights) ASSERT_FALSE(std::isnan(v));
    if (w == 3) absl::SleepFor(absl::Microseconds(300));  // a slow worker keeps the gate busy
  });
  ExpectFinalWeights("ssp", kLearningRate / kWorkers);
}

TEST_F(PushPullE2eTest, AspNeverWaitsForOthersAndEndsExact) {
  DeclareJob("asp", v1::CONSISTENCY_ASP, 0);
  RunWorkers("asp", [&](int w, int step, int t, const std::vector<float>& weights,
                        const client::PushPullResult& r) {
    EXPECT_GE(r.min_version, step + 1) << "worker " << w << " step " << step;
    EXPECT_LE(r.max_version, kWorkers * kSteps);
    for (float v : weights) ASSERT_FALSE(std::isnan(v));
  });
  ExpectFinalWeights("asp", kLearningRate);
}

TEST_F(PushPullE2eTest, SparseRowsRouteToTheirShardsAndEndExact) {
  constexpr uint32_t kDim = 4;
  constexpr int kSparseSteps = 20;
  v1::JobConfig config;
  config.set_consistency(v1::CONSISTENCY_ASP);
  config.set_num_workers(kWorkers);
  config.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
  config.mutable_optimizer()->set_learning_rate(kLearningRate);
  v1::SparseTableDecl table;
  table.set_name("emb");
  table.set_dim(kDim);
  {
    auto declarer = ParameterClient::Create(ClientOptions("sparse", 0));
    ASSERT_TRUE(declarer.ok());
    absl::Status declared = (*declarer)->DeclareJob(config, {}, {table});
    ASSERT_TRUE(declared.ok()) << declared;
  }
  auto rows_of = [](int w, int s) {
    return std::vector<int64_t>{(w * 3 + s) % 17, 100 + w, 1000003LL * (s % 3) + 7, -5 - s % 2};
  };
  auto grad_of = [](int w, int s, size_t j, uint32_t d) {
    return static_cast<float>((w + 2 * s + 3 * static_cast<int>(j) + static_cast<int>(d)) % 5) -
           2.0f;
  };
  std::map<int64_t, std::vector<double>> reference;
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::vector<std::string> errors;
  for (int w = 0; w < kWorkers; ++w) {
    for (int s = 0; s < kSparseSteps; ++s) {
      const std::vector<int64_t> rows = rows_of(w, s);
      for (size_t j = 0; j < rows.size(); ++j) {
        std::vector<double>& r = reference[rows[j]];
        r.resize(kDim, 0.0);
        for (uint32_t d = 0; d < kDim; ++d) r[d] -= kLearningRate * grad_of(w, s, j, d);
      }
    }
    threads.emplace_back([&, w] {
      auto c = ParameterClient::Create(ClientOptions("sparse", w));
      absl::Status s = c.ok() ? (*c)->AttachJob({}, {table}) : c.status();
      for (int step = 0; s.ok() && step < kSparseSteps; ++step) {
        const std::vector<int64_t> rows = rows_of(w, step);
        std::vector<float> grad(rows.size() * kDim), out(rows.size() * kDim, std::nanf(""));
        for (size_t j = 0; j < rows.size(); ++j) {
          for (uint32_t d = 0; d < kDim; ++d) grad[j * kDim + d] = grad_of(w, step, j, d);
        }
        auto r = (*c)->PushPullSparse("emb", step, rows, grad, absl::MakeSpan(out)).get();
        s = r.status();
        for (float v : out) {
          if (s.ok() && std::isnan(v)) s = absl::InternalError("a row came back unwritten");
        }
      }
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        errors.push_back(absl::StrCat("worker ", w, ": ", s.ToString()));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) ADD_FAILURE() << e;

  auto reader = ParameterClient::Create(ClientOptions("sparse", 0));
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE((*reader)->AttachJob({}, {table}).ok());
  std::vector<int64_t> rows;
  for (const auto& [row, values] : reference) rows.push_back(row);
  std::vector<float> got(rows.size() * kDim);
  absl::Status pulled = (*reader)->PullSparse("emb", -1, rows, absl::MakeSpan(got));
  ASSERT_TRUE(pulled.ok()) << pulled;
  std::set<int> shards_used;
  for (size_t j = 0; j < rows.size(); ++j) {
    shards_used.insert(ShardOfSparseRow("sparse", "emb", rows[j], kShards));
    for (uint32_t d = 0; d < kDim; ++d) {
      EXPECT_EQ(static_cast<double>(got[j * kDim + d]), reference[rows[j]][d])
          << "row " << rows[j] << " dim " << d;
    }
  }
  EXPECT_EQ(static_cast<int>(shards_used.size()), kShards) << "rows spread over every shard";
}

class ExactlyOnceE2eTest : public PushPullE2eTest,
                           public ::testing::WithParamInterface<v1::Consistency> {};

TEST_P(ExactlyOnceE2eTest, DuplicatesAndLostResponsesApplyEachPushOnce) {
  const v1::Consistency mode = GetParam();
  const std::string job = absl::StrCat("exactly-once-", mode);
  DeclareJob(job, mode, 0);
  RunWorkers(
      job,
      [&](int w, int step, int t, const std::vector<float>&, const client::PushPullResult& r) {
        if (mode == v1::CONSISTENCY_BSP) {
          EXPECT_EQ(r.min_version, step + 1);
        }
      },
      /*duplicate_pct=*/20, /*drop_pct=*/15);
  // Every push was acknowledged (none failed: RunWorkers reports failures), so the final weights
  // are initial - lr * (sum of all gradients) (ASP), or with 1/num_workers (BSP), exactly.
  EXPECT_GT(injected_duplicates_, 0);
  EXPECT_GT(injected_drops_, 0);
  EXPECT_GE(retries_, injected_drops_) << "every lost response is retried";
  EXPECT_GT(duplicates_, 0) << "the shards acknowledged retries as duplicates";
  ExpectFinalWeights(job, mode == v1::CONSISTENCY_ASP ? kLearningRate : kLearningRate / kWorkers);
}

INSTANTIATE_TEST_SUITE_P(Modes, ExactlyOnceE2eTest,
                         ::testing::Values(v1::CONSISTENCY_ASP, v1::CONSISTENCY_BSP),
                         [](const auto& info) {
                           return info.param == v1::CONSISTENCY_ASP ? std::string("Asp")
                                                                    : std::string("Bsp");
                         });

}  // namespace
}  // namespace tessera
