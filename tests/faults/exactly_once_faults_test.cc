// Exactly-once under injected network faults (issue #6, test 4), against 2 real tessera-server
// processes, each behind a userspace TcpProxy (tcp_proxy.h).
//
// Worker threads push integer gradients with their own ParameterClient (short call deadline, real
// retries) through the proxies while a fault schedule runs: latency longer than the deadline
// (DEADLINE_EXCEEDED, and the held originals are applied later, so the retries must be dropped as
// duplicates), random connection resets after forwarded chunks and resets of every connection
// (UNAVAILABLE, often after the shard applied the push), a partition (blackhole) and refused
// connections. Every transport call goes through a Ledger that records each request by seq and
// whether a shard acknowledged it; a request the ParameterClient gave up on has an unknown fate,
// so the worker resends it with the same seq until it is acknowledged, before its next step (as a
// worker must: the shard drops any seq <= the last applied one of that worker and partition).
//
// The optimizer is plain SGD with lr 0.5, the job ASP (no barrier interplay), and gradients and
// initial weights are small integers, so every sum is exact in fp32: for every key, the final
// weights must equal initial - lr * sum(acknowledged gradients), bit for bit. The first case also
// pushes 5 rows of a sparse table each step (PushPullSparse, one request per shard), and every row
// must equal -lr * the sum of its acknowledged gradients (issue #15).
//
// The replicated case runs the same faults with replication 2: each worker writes each push to
// both shards, one ledger per shard, and each copy must equal what it acknowledged, which must
// be every push (issue #16).
//
// The second case takes a checkpoint at step S, keeps pushing, SIGKILLs one shard, restarts it on
// the same port with the same --data_dir, restores S on both shards with a new incarnation, pushes
// more, and expects the checkpoint's weights plus exactly what was acknowledged since.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "tessera/v1/parameter.grpc.pb.h"
#include "tests/faults/shard_process.h"
#include "tests/faults/tcp_proxy.h"
#include "tests/testlib/child_process.h"
#include "tests/testlib/forwarding_shard_client.h"
#include "worker/client/grpc_shard_client.h"
#include "worker/client/parameter_client.h"

#ifndef TESSERA_SERVER_BINARY
#error "TESSERA_SERVER_BINARY must name the tessera-server binary"
#endif

namespace tessera {
namespace faults {
namespace {

using client::ParameterClient;

constexpr int kShards = 2;
constexpr int kWorkers = 3;
constexpr float kLearningRate = 0.5f;
constexpr int64_t kPartitionBytes = 256;  // 64 values: several partitions on both shards
constexpr absl::Duration kCallTimeout = absl::Milliseconds(150);

struct TensorDef {
  std::string name;
  std::vector<int64_t> shape;
  int64_t size;
};

const std::vector<TensorDef>& Tensors() {
  static const auto* tensors =
      new std::vector<TensorDef>{{"dense/w", {600}, 600}, {"dense/b", {37, 5}, 185}};
  return *tensors;
}

float Initial(size_t t, int64_t i) {
  return static_cast<float>((i * 7 + static_cast<int64_t>(t) * 3) % 19) - 9.0f;
}

// An integer in [-3, 3].
float Gradient(int worker, int64_t step, size_t t, int64_t i) {
  return static_cast<float>((worker * 5 + step * 3 + static_cast<int64_t>(t) * 11 + i + i / 7) %
                            7) -
         3.0f;
}

std::string KeyName(const std::string& tensor, uint32_t index) {
  return absl::StrCat(tensor, "#", index);
}

// The sparse table of the first test: rows of 3 values, zeros at first, the job's SGD.
constexpr char kTable[] = "emb";
constexpr uint32_t kDim = 3;
constexpr int kRowsPerPush = 5;

// The key of one row in the ledger's sums.
std::string RowKey(int64_t row) { return absl::StrCat(kTable, "@", row); }

// The distinct rows worker `worker` pushes at `step` (some shared with other workers and steps).
std::vector<int64_t> RowsOf(int worker, int64_t step) {
  std::vector<int64_t> rows;
  const int64_t base = (worker * 7 + step * 3) % 40 - 10;
  for (int j = 0; j < kRowsPerPush; ++j) rows.push_back(base + j * 9);
  return rows;
}

// An integer in [-3, 3] for value d of the j-th row worker `worker` pushes at `step`.
float RowGradient(int worker, int64_t step, int j, uint32_t d) {
  return Gradient(worker, step, 100 + static_cast<size_t>(j), d);
}

// Every PushPull request one worker (one incarnation) sent, by seq, with its fate. Sums the
// gradients of each request once, when a shard first acknowledges it. Thread-safe.
class Ledger {
 public:
  void Sent(const std::shared_ptr<const v1::PushPullRequest>& request, client::ShardClient* via) {
    absl::MutexLock lock(&mu_);
    Entry& e = entries_[request->seq()];
    if (e.sends == 0) {
      e.request = request;
      e.via = via;
    }
    ++e.sends;
    ++sends_;
  }

  void Answered(uint64_t seq, const absl::StatusOr<v1::PushPullResponse>& response) {
    absl::MutexLock lock(&mu_);
    if (!response.ok()) {
      ++errors_[response.status().code()];
      return;
    }
    if (response->status().code() != 0) {
      ++errors_[static_cast<absl::StatusCode>(response->status().code())];
      return;
    }
    duplicates_ += response->duplicates();
    Entry& e = entries_[seq];
    if (e.acked || e.request == nullptr) return;
    e.acked = true;
    ++acked_;
    for (const v1::Slice& slice : e.request->push()) {
      if (slice.row_ids_size() > 0) {  // a sparse table: per row
        const size_t dim = slice.data().size() / sizeof(float) / slice.row_ids_size();
        for (int r = 0; r < slice.row_ids_size(); ++r) {
          std::vector<double>& sum = acked_sums_[e.request->step()][RowKey(slice.row_ids(r))];
          sum.resize(dim, 0.0);
          for (size_t d = 0; d < dim; ++d) {
            float g;
            std::memcpy(&g, slice.data().data() + (r * dim + d) * sizeof(float), sizeof(float));
            sum[d] += g;
          }
        }
        continue;
      }
      std::vector<double>& sum =
          acked_sums_[e.request->step()][KeyName(slice.key().tensor(), slice.key().index())];
      const size_t n = slice.data().size() / sizeof(float);
      sum.resize(n, 0.0);
      for (size_t j = 0; j < n; ++j) {
        float g;
        std::memcpy(&g, slice.data().data() + j * sizeof(float), sizeof(float));
        sum[j] += g;
      }
    }
    e.request = nullptr;  // keeps only the fate
  }

  struct Pending {
    std::shared_ptr<const v1::PushPullRequest> request;
    client::ShardClient* via;
  };
  std::vector<Pending> Unacknowledged() const {
    absl::MutexLock lock(&mu_);
    std::vector<Pending> out;
    for (const auto& [seq, e] : entries_) {
      if (!e.acked) out.push_back({e.request, e.via});
    }
    return out;
  }

  int64_t requests() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(entries_.size());
  }
  int64_t acked() const {
    absl::MutexLock lock(&mu_);
    return acked_;
  }
  // Sends beyond the first of each seq: the ParameterClient's retries and the worker's resends.
  int64_t retries() const {
    absl::MutexLock lock(&mu_);
    return sends_ - static_cast<int64_t>(entries_.size());
  }
  int64_t duplicates() const {
    absl::MutexLock lock(&mu_);
    return duplicates_;
  }
  int64_t errors(absl::StatusCode code) const {
    absl::MutexLock lock(&mu_);
    auto it = errors_.find(code);
    return it == errors_.end() ? 0 : it->second;
  }
  // Per key, the sum of the acknowledged gradients of steps < below_step, added to *sums.
  void AddAckedSums(int64_t below_step, std::map<std::string, std::vector<double>>* sums) const {
    absl::MutexLock lock(&mu_);
    for (const auto& [step, keys] : acked_sums_) {
      if (step >= below_step) break;
      for (const auto& [key, s] : keys) {
        std::vector<double>& sum = (*sums)[key];
        sum.resize(s.size(), 0.0);
        for (size_t j = 0; j < s.size(); ++j) sum[j] += s[j];
      }
    }
  }

 private:
  struct Entry {
    std::shared_ptr<const v1::PushPullRequest> request;  // null once acknowledged
    client::ShardClient* via = nullptr;
    int sends = 0;
    bool acked = false;
  };
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // step -> key -> sum of the acknowledged gradients, per element.
  std::map<int64_t, std::map<std::string, std::vector<double>>> acked_sums_ ABSL_GUARDED_BY(mu_);
  std::map<absl::StatusCode, int64_t> errors_ ABSL_GUARDED_BY(mu_);
  int64_t sends_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t duplicates_ ABSL_GUARDED_BY(mu_) = 0;
};

// Acknowledged pushes of one ledger, of steps < below_step.
struct AckedPart {
  const Ledger* ledger;
  int64_t below_step = std::numeric_limits<int64_t>::max();
};

std::map<std::string, std::vector<double>> SumAcked(const std::vector<AckedPart>& parts) {
  std::map<std::string, std::vector<double>> sums;
  for (const AckedPart& p : parts) p.ledger->AddAckedSums(p.below_step, &sums);
  return sums;
}

// The real gRPC transport, with every PushPull attempt and its answer written to a Ledger.
class LedgerShardClient final : public testlib::ForwardingShardClient {
 public:
  LedgerShardClient(std::unique_ptr<client::ShardClient> inner, Ledger* ledger)
      : ForwardingShardClient(std::move(inner)), ledger_(ledger) {}

  void PushPull(PushPullCall call, absl::Time deadline, PushPullCallback done) override {
    // The ledger keeps the request (its gradients) past the callback: not the caller's memory.
    call = client::WithLentDataCopied(std::move(call));
    ledger_->Sent(call.request, this);
    const uint64_t seq = call.request->seq();
    inner()->PushPull(
        std::move(call), deadline,
        [this, seq, done = std::move(done)](absl::StatusOr<v1::PushPullResponse> response) {
          ledger_->Answered(seq, response);
          done(std::move(response));
        });
  }

 private:
  Ledger* const ledger_;
};

// Resends every request of `ledger` that no shard has acknowledged, with its own seq, until each
// is acknowledged (at most 40 rounds or 30 s). What a worker does with a push whose fate is
// unknown before it pushes the same partitions again.
absl::Status ResendUntilAcknowledged(Ledger& ledger) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  absl::Status last;
  for (int round = 0; round < 40 && absl::Now() < give_up; ++round) {
    std::vector<Ledger::Pending> pending = ledger.Unacknowledged();
    if (pending.empty()) return absl::OkStatus();
    std::vector<std::future<absl::Status>> answers;
    for (const Ledger::Pending& p : pending) {
      auto promise = std::make_shared<std::promise<absl::Status>>();
      answers.push_back(promise->get_future());
      p.via->PushPull(
          {p.request}, absl::Now() + absl::Seconds(2),
          [promise](absl::StatusOr<v1::PushPullResponse> r) {
            if (!r.ok()) return promise->set_value(r.status());
            promise->set_value(r->status().code() == 0
                                   ? absl::OkStatus()
                                   : absl::Status(static_cast<absl::StatusCode>(r->status().code()),
                                                  r->status().message()));
          });
    }
    for (auto& a : answers) {
      absl::Status s = a.get();
      if (!s.ok()) last = s;
    }
    absl::SleepFor(absl::Milliseconds(20 + 20 * std::min(round, 10)));
  }
  if (ledger.Unacknowledged().empty()) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat(ledger.Unacknowledged().size(),
                   " pushes still unacknowledged; last error: ", last.ToString()));
}

class ExactlyOnceFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    work_dir_ = work_dir_owner_.path();
    ASSERT_FALSE(work_dir_.empty());
    for (int i = 0; i < kShards; ++i) {
      ShardProcess::Options o;
      o.server_path = TESSERA_SERVER_BINARY;
      o.work_dir = work_dir_;
      o.shard_index = i;
      o.extra_args = {"--threads", "2", "--log_level", "warn"};
      shards_.push_back(std::make_unique<ShardProcess>(o));
      absl::Status started = shards_.back()->Start();
      ASSERT_TRUE(started.ok()) << started;
      TcpProxy::Options po;
      po.target_port = shards_.back()->port();
      po.seed = 1000 + i;
      auto proxy = TcpProxy::Start(po);
      ASSERT_TRUE(proxy.ok()) << proxy.status();
      proxies_.push_back(*std::move(proxy));
    }
    for (size_t t = 0; t < Tensors().size(); ++t) {
      std::vector<float> v(Tensors()[t].size);
      for (int64_t i = 0; i < Tensors()[t].size; ++i) v[i] = Initial(t, i);
      initial_.push_back(std::move(v));
    }
  }

  void TearDown() override {
    for (auto& p : proxies_) p->Stop();
    for (auto& s : shards_) {
      absl::Status stopped = s->Terminate(absl::Seconds(15));
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
    if (getenv("TESSERA_KEEP_SHARD_LOGS") != nullptr) {
      work_dir_owner_.keep();
      std::cerr << "shard logs in " << work_dir_ << "\n";
    }
  }

  std::vector<std::string> ProxyAddresses() const {
    std::vector<std::string> a;
    for (const auto& p : proxies_) a.push_back(p->address());
    return a;
  }
  std::vector<std::string> ShardAddresses() const {
    std::vector<std::string> a;
    for (const auto& s : shards_) a.push_back(s->address());
    return a;
  }

  static std::vector<v1::SparseTableDecl> Tables() {
    v1::SparseTableDecl t;
    t.set_name(kTable);
    t.set_dim(kDim);
    return {t};
  }
  std::vector<client::DenseTensorSpec> Specs() const {
    std::vector<client::DenseTensorSpec> specs;
    for (size_t t = 0; t < Tensors().size(); ++t) {
      specs.push_back({Tensors()[t].name, Tensors()[t].shape, initial_[t]});
    }
    return specs;
  }

  // Straight to the shards (no proxy), as a coordinator does, with a long deadline.
  std::unique_ptr<ParameterClient> ControlClient(const std::string& job) {
    ParameterClient::Options o;
    o.shard_addresses = ShardAddresses();
    o.job_id = job;
    o.partition_bytes = kPartitionBytes;
    o.call_timeout = absl::Seconds(10);
    o.replicas = replicas_;
    if (replicas_ > 1) o.down_shards = read_down_;
    auto c = ParameterClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  void DeclareJob(const std::string& job) {
    v1::JobConfig config;
    config.set_consistency(v1::CONSISTENCY_ASP);
    config.set_num_workers(kWorkers);
    config.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
    config.mutable_optimizer()->set_learning_rate(kLearningRate);
    auto declarer = ControlClient(job);
    ASSERT_NE(declarer, nullptr);
    // The table only where the workers push it: an ASP checkpoint waits for every key's clock.
    absl::Status declared = declarer->DeclareJob(
        config, Specs(), sparse_ ? Tables() : std::vector<v1::SparseTableDecl>{});
    ASSERT_TRUE(declared.ok()) << declared;
    std::set<int32_t> shards;
    for (const TensorDef& t : Tensors()) {
      auto layout = declarer->Layout(t.name);
      ASSERT_TRUE(layout.ok());
      for (const auto& p : (*layout)->partitions) shards.insert(p.shard);
      layouts_[t.name] = **layout;
    }
    ASSERT_EQ(static_cast<int>(shards.size()), kShards) << "partitions on every shard";
  }

  // A worker's ParameterClient through the proxies, every transport call in `ledger`.
  std::unique_ptr<ParameterClient> WorkerClient(const std::string& job, uint32_t worker,
                                                uint64_t incarnation, Ledger* ledger) {
    return WorkerClient(job, worker, incarnation, std::vector<Ledger*>(kShards, ledger));
  }
  // The same with one ledger per shard (ledgers[i]: every call to shard i): a replicated client
  // sends each push to both shards, and each copy's fate is its own.
  std::unique_ptr<ParameterClient> WorkerClient(const std::string& job, uint32_t worker,
                                                uint64_t incarnation,
                                                const std::vector<Ledger*>& ledgers) {
    ParameterClient::Options o;
    o.shard_addresses = ProxyAddresses();
    o.job_id = job;
    o.worker_id = worker;
    o.incarnation = incarnation;
    o.partition_bytes = kPartitionBytes;
    o.call_timeout = kCallTimeout;
    o.streams_per_shard = 2;
    o.retry.max_attempts = 4;
    o.retry.initial_backoff = absl::Milliseconds(5);
    o.retry.max_backoff = absl::Milliseconds(80);
    o.replicas = replicas_;
    std::vector<std::unique_ptr<client::ShardClient>> transports;
    for (size_t i = 0; i < o.shard_addresses.size(); ++i) {
      const std::string& address = o.shard_addresses[i];
      client::GrpcShardClient::Options go;
      go.address = address;
      go.streams = o.streams_per_shard;
      auto g = client::GrpcShardClient::Create(go);
      EXPECT_TRUE(g.ok()) << g.status();
      if (!g.ok()) return nullptr;
      transports.push_back(std::make_unique<LedgerShardClient>(*std::move(g), ledgers[i]));
    }
    auto c = ParameterClient::CreateWithShards(o, std::move(transports));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok() || !(*c)->AttachJob(Specs(), Tables()).ok()) return nullptr;
    return *std::move(c);
  }

  // What one worker did in one run of RunWorker.
  struct WorkerRun {
    int64_t first_step = 0;
    int64_t steps = 0;            // steps pushed (all acknowledged unless stopped_by_error)
    int64_t failed_for_good = 0;  // PushPulls the ParameterClient gave up on
    int64_t client_retries = 0;   // PushPullResult.retries of the successful ones
    absl::Status error;           // why it stopped early (tolerate_errors) or failed
  };

  // Pushes steps [first_step, ...) of `worker` until `keep_going(step)` says stop (at most
  // max_steps). With resend, a step whose pushes the client gave up on is resent until every
  // request is acknowledged before the next step; without, the first failure ends the run.
  WorkerRun RunWorker(ParameterClient& pc, Ledger& ledger, int worker, int64_t first_step,
                      int64_t max_steps, bool resend,
                      const std::function<bool(int64_t steps_done)>& keep_going) {
    return RunWorker(pc, std::vector<Ledger*>{&ledger}, worker, first_step, max_steps, resend,
                     keep_going);
  }
  WorkerRun RunWorker(ParameterClient& pc, const std::vector<Ledger*>& ledgers, int worker,
                      int64_t first_step, int64_t max_steps, bool resend,
                      const std::function<bool(int64_t steps_done)>& keep_going) {
    WorkerRun run;
    run.first_step = first_step;
    std::vector<std::vector<float>> grads(Tensors().size()), weights(Tensors().size());
    for (int64_t k = 0; k < max_steps && keep_going(k); ++k) {
      const int64_t step = first_step + k;
      std::vector<std::future<absl::StatusOr<client::PushPullResult>>> futures;
      for (size_t t = 0; t < Tensors().size(); ++t) {
        grads[t].resize(Tensors()[t].size);
        weights[t].assign(Tensors()[t].size, 0.0f);
        for (int64_t i = 0; i < Tensors()[t].size; ++i) grads[t][i] = Gradient(worker, step, t, i);
        futures.push_back(
            pc.PushPull(Tensors()[t].name, step, grads[t], absl::MakeSpan(weights[t])));
      }
      std::vector<int64_t> rows;
      std::vector<float> row_grads;
      if (sparse_) {
        rows = RowsOf(worker, step);
        for (int j = 0; j < kRowsPerPush; ++j) {
          for (uint32_t d = 0; d < kDim; ++d) row_grads.push_back(RowGradient(worker, step, j, d));
        }
        futures.push_back(pc.PushPullSparse(kTable, step, rows, row_grads, {}));
      }
      absl::Status step_status;
      for (auto& f : futures) {
        absl::StatusOr<client::PushPullResult> r = f.get();
        if (r.ok()) {
          run.client_retries += r->retries;
        } else {
          ++run.failed_for_good;
          step_status = r.status();
        }
      }
      if (!step_status.ok()) {
        if (!resend) {
          run.error = step_status;
          return run;
        }
        absl::Status resent;
        for (Ledger* ledger : ledgers) {
          if (resent.ok()) resent = ResendUntilAcknowledged(*ledger);
        }
        if (!resent.ok()) {
          run.error =
              absl::Status(resent.code(), absl::StrCat("step ", step, ": ", resent.message()));
          return run;
        }
      }
      run.steps = k + 1;
    }
    return run;
  }

  // Pulls every tensor straight from the shards and compares it bit for bit with
  // initial - lr * (sum over `ledgers` of the acknowledged gradients). Returns the keys (dense
  // partitions) found exact.
  int ExpectWeightsExact(const std::string& job, const std::vector<AckedPart>& acked) {
    const std::map<std::string, std::vector<double>> sums = SumAcked(acked);
    auto reader = ControlClient(job);
    if (reader == nullptr || !reader->AttachJob(Specs(), {}).ok()) {
      ADD_FAILURE() << "no reader";
      return 0;
    }
    int keys = 0, mismatches = 0;
    for (size_t t = 0; t < Tensors().size(); ++t) {
      const TensorDef& def = Tensors()[t];
      std::vector<float> w(def.size);
      absl::Status pulled = reader->Pull(def.name, -1, absl::MakeSpan(w));
      if (!pulled.ok()) {
        ADD_FAILURE() << pulled;
        continue;
      }
      for (const client::PartitionSpan& p : layouts_[def.name].partitions) {
        const int before = mismatches;
        auto it = sums.find(KeyName(def.name, p.index));
        for (int64_t j = 0; j < p.num_elements; ++j) {
          const int64_t i = p.offset + j;
          const double sum = it == sums.end() ? 0.0 : it->second[j];
          const double expected = static_cast<double>(initial_[t][i]) - kLearningRate * sum;
          const float expected_f = static_cast<float>(expected);
          EXPECT_EQ(static_cast<double>(expected_f), expected) << "not exact in fp32";
          if (std::memcmp(&w[i], &expected_f, sizeof(float)) == 0) continue;
          if (++mismatches <= 5) {
            ADD_FAILURE() << def.name << "[" << i << "] (partition " << p.index << ") = " << w[i]
                          << ", expected " << expected_f << " = " << initial_[t][i] << " - "
                          << kLearningRate << " * " << sum;
          }
        }
        if (mismatches == before) ++keys;
      }
    }
    EXPECT_EQ(mismatches, 0);
    return keys;
  }

  // How many elements of the partitions on shard `shard` differ from
  // initial - lr * (sum over `ledgers` of the acknowledged gradients); -1 when the pull fails.
  int64_t DifferingElementsOnShard(int shard, const std::string& job,
                                   const std::vector<AckedPart>& acked) {
    client::GrpcShardClient::Options go;
    go.address = shards_[shard]->address();
    auto c = client::GrpcShardClient::Create(go);
    if (!c.ok()) return -1;
    v1::PullRequest request;
    request.set_job_id(job);
    request.set_step(-1);
    request.set_encoding(v1::ENCODING_FP32);
    for (const auto& [name, layout] : layouts_) {
      for (const client::PartitionSpan& p : layout.partitions) {
        if (p.shard != shard) continue;
        v1::Slice* key = request.add_keys();
        key->mutable_key()->set_tensor(name);
        key->mutable_key()->set_index(p.index);
      }
    }
    auto slices = (*c)->Pull(request, absl::Now() + absl::Seconds(10));
    if (!slices.ok()) {
      ADD_FAILURE() << "pull from shard " << shard << ": " << slices.status();
      return -1;
    }
    if (static_cast<int>(slices->size()) != request.keys_size()) {
      ADD_FAILURE() << "shard " << shard << " answered " << slices->size() << " slices for "
                    << request.keys_size() << " keys";
      return -1;
    }
    std::map<std::string, std::vector<double>> sums = SumAcked(acked);
    int64_t differing = 0;
    for (const v1::Slice& slice : *slices) {
      const std::string& name = slice.key().tensor();
      const size_t t = name == Tensors()[0].name ? 0 : 1;
      const client::PartitionSpan& p = layouts_[name].partitions[slice.key().index()];
      if (static_cast<int64_t>(slice.data().size()) != p.num_elements * 4) {
        ADD_FAILURE() << name << "#" << p.index << " on shard " << shard << ": "
                      << slice.data().size() << " bytes for " << p.num_elements << " values";
        return -1;
      }
      const std::vector<double>& sum = sums[KeyName(name, p.index)];
      for (int64_t j = 0; j < p.num_elements; ++j) {
        float v;
        std::memcpy(&v, slice.data().data() + j * sizeof(float), sizeof(float));
        const double expected = initial_[t][p.offset + j] - kLearningRate * sum[j];
        if (static_cast<double>(v) != expected) ++differing;
      }
    }
    return differing;
  }

  // The sum of every gradient `worker` pushes for steps [first, first + steps), per key: what the
  // ledgers must hold once everything is acknowledged.
  void AddGenerated(int worker, int64_t first, int64_t steps,
                    std::map<std::string, std::vector<double>>* sums) {
    for (size_t t = 0; t < Tensors().size(); ++t) {
      for (const client::PartitionSpan& p : layouts_[Tensors()[t].name].partitions) {
        std::vector<double>& sum = (*sums)[KeyName(Tensors()[t].name, p.index)];
        sum.resize(p.num_elements, 0.0);
        for (int64_t s = first; s < first + steps; ++s) {
          for (int64_t j = 0; j < p.num_elements; ++j) {
            sum[j] += Gradient(worker, s, t, p.offset + j);
          }
        }
      }
    }
    if (!sparse_) return;
    for (int64_t s = first; s < first + steps; ++s) {
      const std::vector<int64_t> rows = RowsOf(worker, s);
      for (int j = 0; j < kRowsPerPush; ++j) {
        std::vector<double>& sum = (*sums)[RowKey(rows[j])];
        sum.resize(kDim, 0.0);
        for (uint32_t d = 0; d < kDim; ++d) sum[d] += RowGradient(worker, s, j, d);
      }
    }
  }

  // Every row the sums name, pulled straight from the shards and compared bit for bit with
  // 0 - lr * sum. Returns the rows found exact.
  int ExpectRowsExact(const std::string& job, const std::vector<AckedPart>& acked) {
    const std::map<std::string, std::vector<double>> sums = SumAcked(acked);
    auto reader = ControlClient(job);
    if (reader == nullptr || !reader->AttachJob(Specs(), Tables()).ok()) {
      ADD_FAILURE() << "no reader";
      return 0;
    }
    std::vector<int64_t> rows;
    for (const auto& [key, sum] : sums) {
      if (absl::StartsWith(key, absl::StrCat(kTable, "@"))) {
        int64_t row = 0;
        EXPECT_TRUE(absl::SimpleAtoi(key.substr(std::strlen(kTable) + 1), &row)) << key;
        rows.push_back(row);
      }
    }
    std::vector<float> got(rows.size() * kDim);
    absl::Status pulled = reader->PullSparse(kTable, -1, rows, absl::MakeSpan(got));
    if (!pulled.ok()) {
      ADD_FAILURE() << pulled;
      return 0;
    }
    int exact = 0, mismatches = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<double>& sum = sums.at(RowKey(rows[r]));
      bool same = true;
      for (uint32_t d = 0; d < kDim; ++d) {
        const float expected = static_cast<float>(0.0 - kLearningRate * sum[d]);
        if (std::memcmp(&got[r * kDim + d], &expected, sizeof(float)) == 0) continue;
        same = false;
        if (++mismatches <= 5) {
          ADD_FAILURE() << "row " << rows[r] << "[" << d << "] = " << got[r * kDim + d]
                        << ", expected " << expected << " = -" << kLearningRate << " * " << sum[d];
        }
      }
      exact += same ? 1 : 0;
    }
    EXPECT_EQ(mismatches, 0);
    return exact;
  }

  void CutAll() {
    for (auto& p : proxies_) p->CutAll();
  }
  // RunWorker also pushes rows of the sparse table each step (the first test).
  bool sparse_ = false;
  // Copies of every partition and row (2: the replicated case), and, for the readers of a
  // replicated job, the shards they treat as down (to read the other copy).
  int replicas_ = 1;
  std::vector<int> read_down_;
  // The fault schedule, one full cycle (about 4 s), cut short once `workers_done`.
  void RunFaultCycle(const std::atomic<bool>& workers_done) {
    auto pause = [&](absl::Duration d) {
      const absl::Time end = absl::Now() + d;
      while (absl::Now() < end && !workers_done.load()) absl::SleepFor(absl::Milliseconds(5));
    };
    pause(absl::Milliseconds(200));
    // Held longer than the call deadline: DEADLINE_EXCEEDED, then the originals land.
    for (auto& p : proxies_) p->SetLatency(absl::Milliseconds(250));
    pause(absl::Milliseconds(700));
    for (auto& p : proxies_) p->SetLatency(absl::ZeroDuration());
    pause(absl::Milliseconds(200));
    // Resets after forwarded chunks: some after the shard applied a push, before its answer.
    for (auto& p : proxies_) p->SetCutProbability(0.03);
    pause(absl::Milliseconds(900));
    for (auto& p : proxies_) p->SetCutProbability(0.0);
    for (int i = 0; i < 3; ++i) {
      CutAll();
      pause(absl::Milliseconds(150));
    }
    // A partition of shard 0, then healed: what was sent during it flows on afterwards.
    proxies_[0]->SetBlackhole(true);
    pause(absl::Milliseconds(400));
    proxies_[0]->SetBlackhole(false);
    pause(absl::Milliseconds(200));
    // Shard 1 unreachable for a while: reset, and new connections refused.
    proxies_[1]->SetRefuseNewConnections(true);
    proxies_[1]->CutAll();
    pause(absl::Milliseconds(300));
    proxies_[1]->SetRefuseNewConnections(false);
    // Latency and resets together.
    for (auto& p : proxies_) {
      p->SetLatency(absl::Milliseconds(60));
      p->SetCutProbability(0.02);
    }
    pause(absl::Milliseconds(600));
    for (auto& p : proxies_) {
      p->SetLatency(absl::ZeroDuration());
      p->SetCutProbability(0.0);
    }
  }

  int64_t Cuts() const {
    int64_t n = 0;
    for (const auto& p : proxies_) n += p->counters().cuts;
    return n;
  }

  // Declared before shards_, so that it is removed after they are killed.
  testlib::ScratchDirectory work_dir_owner_{"tessera-faults"};
  std::string work_dir_;
  std::vector<std::unique_ptr<ShardProcess>> shards_;
  std::vector<std::unique_ptr<TcpProxy>> proxies_;
  std::vector<std::vector<float>> initial_;
  std::map<std::string, client::DenseLayout> layouts_;
};

TEST_F(ExactlyOnceFaultsTest, EveryAcknowledgedPushIsAppliedExactlyOnceUnderFaults) {
  const std::string job = "eo-faults";
  sparse_ = true;  // dense partitions and sparse rows, each under the same faults
  DeclareJob(job);
  constexpr int64_t kMinSteps = 30;
  constexpr int64_t kMaxSteps = 400;

  // The fault schedule while the workers push.
  std::atomic<bool> cycle_done{false};
  std::atomic<bool> workers_done{false};
  std::thread faults([&] {
    RunFaultCycle(workers_done);
    cycle_done.store(true);
  });

  const absl::Time start = absl::Now();
  std::vector<std::unique_ptr<Ledger>> ledgers;
  std::vector<WorkerRun> runs(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) ledgers.push_back(std::make_unique<Ledger>());
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      auto pc = WorkerClient(job, w, /*incarnation=*/1, ledgers[w].get());
      if (pc == nullptr) {
        runs[w].error = absl::InternalError("no client");
        return;
      }
      runs[w] = RunWorker(*pc, *ledgers[w], w, 0, kMaxSteps, /*resend=*/true,
                          [&](int64_t k) { return k < kMinSteps || !cycle_done.load(); });
    });
  }
  for (auto& t : threads) t.join();
  workers_done.store(true);
  faults.join();
  const absl::Duration took = absl::Now() - start;

  int64_t pushes = 0, acked = 0, retries = 0, dups = 0, failed = 0, deadline = 0, unavailable = 0,
          client_retries = 0;
  std::map<std::string, std::vector<double>> generated;
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_TRUE(runs[w].error.ok()) << "worker " << w << ": " << runs[w].error;
    EXPECT_GE(runs[w].steps, kMinSteps);
    pushes += ledgers[w]->requests();
    acked += ledgers[w]->acked();
    retries += ledgers[w]->retries();
    dups += ledgers[w]->duplicates();
    failed += runs[w].failed_for_good;
    client_retries += runs[w].client_retries;
    deadline += ledgers[w]->errors(absl::StatusCode::kDeadlineExceeded);
    unavailable += ledgers[w]->errors(absl::StatusCode::kUnavailable);
    EXPECT_TRUE(ledgers[w]->Unacknowledged().empty()) << "worker " << w;
    AddGenerated(w, 0, runs[w].steps, &generated);
  }
  // Every push was acknowledged in the end, so the acknowledged sums are every gradient pushed.
  const std::vector<AckedPart> all = {{ledgers[0].get()}, {ledgers[1].get()}, {ledgers[2].get()}};
  EXPECT_TRUE(SumAcked(all) == generated) << "the ledger holds every pushed gradient once";

  const int keys = ExpectWeightsExact(job, all);
  const int rows = ExpectRowsExact(job, all);
  EXPECT_GE(rows, 40) << "every row the workers pushed";
  const int64_t cuts = Cuts();
  std::cout << "exactly-once: " << pushes << " pushes, " << retries << " retries, " << dups
            << " duplicates dropped by the shards, " << cuts << " connection cuts, " << keys
            << " keys and " << rows << " sparse rows exact\n"
            << "  (" << acked << " acknowledged; " << deadline << " DEADLINE_EXCEEDED, "
            << unavailable << " UNAVAILABLE answers; " << client_retries
            << " retries inside acknowledged PushPulls; " << failed
            << " PushPulls given up by the client and resent; steps per worker " << runs[0].steps
            << "/" << runs[1].steps << "/" << runs[2].steps << "; " << absl::FormatDuration(took)
            << ")\n";
  EXPECT_EQ(acked, pushes);
  EXPECT_GT(retries, 0);
  EXPECT_GT(client_retries, 0) << "the ParameterClient itself must have retried";
  EXPECT_LE(client_retries, retries);
  EXPECT_GT(dups, 0) << "retries of applied pushes must have been acknowledged as duplicates";
  EXPECT_GT(cuts, 0);
  EXPECT_GT(deadline, 0) << "the latency phase must have produced DEADLINE_EXCEEDED";
  EXPECT_GT(unavailable, 0) << "the resets must have produced UNAVAILABLE";
  EXPECT_EQ(keys, static_cast<int>(layouts_["dense/w"].partitions.size() +
                                   layouts_["dense/b"].partitions.size()));
}

// The same faults with replication 2 (issue #16): every partition and row lives on both shards,
// each worker writes each push to both, and each copy must end exactly at its own acknowledged
// pushes, which must be every push: both copies bit-identical to the unreplicated expectation.
TEST_F(ExactlyOnceFaultsTest, ReplicatedCopiesBothApplyEveryAcknowledgedPushExactlyOnce) {
  const std::string job = "eo-faults-replicated";
  sparse_ = true;
  replicas_ = 2;
  DeclareJob(job);
  constexpr int64_t kMinSteps = 30;
  constexpr int64_t kMaxSteps = 400;
  std::atomic<bool> cycle_done{false};
  std::atomic<bool> workers_done{false};
  std::thread faults([&] {
    RunFaultCycle(workers_done);
    cycle_done.store(true);
  });
  // ledgers[w][s]: worker w's calls to shard s.
  std::vector<std::vector<std::unique_ptr<Ledger>>> ledgers(kWorkers);
  std::vector<WorkerRun> runs(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    for (int s = 0; s < kShards; ++s) ledgers[w].push_back(std::make_unique<Ledger>());
  }
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::vector<Ledger*> mine;
      for (auto& l : ledgers[w]) mine.push_back(l.get());
      auto pc = WorkerClient(job, w, /*incarnation=*/1, mine);
      if (pc == nullptr) {
        runs[w].error = absl::InternalError("no client");
        return;
      }
      runs[w] = RunWorker(*pc, mine, w, 0, kMaxSteps, /*resend=*/true,
                          [&](int64_t k) { return k < kMinSteps || !cycle_done.load(); });
    });
  }
  for (auto& t : threads) t.join();
  workers_done.store(true);
  faults.join();

  std::map<std::string, std::vector<double>> generated;
  int64_t pushes = 0, dups = 0, retries = 0;
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_TRUE(runs[w].error.ok()) << "worker " << w << ": " << runs[w].error;
    EXPECT_GE(runs[w].steps, kMinSteps);
    AddGenerated(w, 0, runs[w].steps, &generated);
    for (auto& l : ledgers[w]) {
      EXPECT_TRUE(l->Unacknowledged().empty()) << "worker " << w;
      pushes += l->requests();
      dups += l->duplicates();
      retries += l->retries();
    }
  }
  int keys = 0, rows = 0;
  for (int s = 0; s < kShards; ++s) {
    std::vector<AckedPart> acked;
    for (int w = 0; w < kWorkers; ++w) acked.push_back({ledgers[w][s].get()});
    // Two shards, two copies: each holds every partition and row, so each acknowledged all.
    EXPECT_TRUE(SumAcked(acked) == generated) << "shard " << s << " holds every pushed gradient";
    // Read shard s's copy of everything: the other shard counts as down for the reader.
    read_down_ = {1 - s};
    keys += ExpectWeightsExact(job, acked);
    rows += ExpectRowsExact(job, acked);
  }
  const int per_copy = static_cast<int>(layouts_["dense/w"].partitions.size() +
                                        layouts_["dense/b"].partitions.size());
  EXPECT_EQ(keys, 2 * per_copy);
  EXPECT_GE(rows, 2 * 40);
  std::cout << "exactly-once, replicated: " << pushes << " requests over both copies, " << retries
            << " resends, " << dups << " duplicates dropped, " << Cuts() << " connection cuts; "
            << keys << " keys and " << rows << " rows exact over the two copies\n";
  EXPECT_GT(dups, 0);
  EXPECT_GT(Cuts(), 0);
}

// Checkpoint and Restore straight to one shard (the coordinator's calls).
absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& address,
                                                  const std::string& job, int64_t step) {
  auto stub = v1::ParameterService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::CheckpointRequest request;
  request.set_job_id(job);
  request.set_step(step);
  v1::CheckpointResponse response;
  grpc::Status s = stub->Checkpoint(&context, request, &response);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  return response;
}

absl::StatusOr<v1::RestoreResponse> Restore(const std::string& address, const std::string& job,
                                            int64_t step, uint64_t min_incarnation) {
  auto stub = v1::ParameterService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::RestoreRequest request;
  request.set_job_id(job);
  request.set_step(step);
  request.set_min_incarnation(min_incarnation);
  v1::RestoreResponse response;
  grpc::Status s = stub->Restore(&context, request, &response);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  return response;
}

TEST_F(ExactlyOnceFaultsTest, AfterAShardRestartWeightsAreTheCheckpointPlusWhatWasAckedSince) {
  const std::string job = "eo-restart";
  DeclareJob(job);
  constexpr int64_t kCheckpointStep = 12;  // S
  constexpr int64_t kAfterRestore = 15;    // steps S .. S+14 pushed again, new incarnation

  // Register the capture of S ahead of time on both shards. In ASP a partition is captured when
  // the slowest worker's clock on it reaches S; every worker stops after step S-1 until all
  // have, so the snapshot holds exactly the pushes of steps < S.
  std::vector<std::future<absl::StatusOr<v1::CheckpointResponse>>> checkpoints;
  for (const std::string& address : ShardAddresses()) {
    checkpoints.push_back(std::async(
        std::launch::async, [address, job] { return Checkpoint(address, job, kCheckpointStep); }));
  }

  // Phase A: steps [0, S), with resets and latency; everything acknowledged.
  for (auto& p : proxies_) {
    p->SetCutProbability(0.02);
    p->SetLatency(absl::Milliseconds(2));
  }
  // One client per worker for incarnation 1 (phases A and B): a new client of the same
  // incarnation would start again at seq 1, and the shard would rightly drop its pushes as
  // duplicates.
  std::vector<std::unique_ptr<Ledger>> before;
  std::vector<std::unique_ptr<ParameterClient>> clients;
  for (int w = 0; w < kWorkers; ++w) {
    before.push_back(std::make_unique<Ledger>());
    clients.push_back(WorkerClient(job, w, 1, before[w].get()));
    ASSERT_NE(clients.back(), nullptr);
  }
  {
    std::vector<std::thread> threads;
    std::vector<WorkerRun> runs(kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        runs[w] = RunWorker(*clients[w], *before[w], w, 0, kCheckpointStep, true,
                            [](int64_t) { return true; });
      });
    }
    for (auto& t : threads) t.join();
    for (int w = 0; w < kWorkers; ++w) {
      ASSERT_TRUE(runs[w].error.ok()) << runs[w].error;
      ASSERT_EQ(runs[w].steps, kCheckpointStep);
      ASSERT_TRUE(before[w]->Unacknowledged().empty());
    }
  }
  for (auto& p : proxies_) {
    p->SetCutProbability(0.0);
    p->SetLatency(absl::ZeroDuration());
  }
  for (int i = 0; i < kShards; ++i) {
    absl::StatusOr<v1::CheckpointResponse> c = checkpoints[i].get();
    if (c.status().code() == absl::StatusCode::kUnimplemented) {
      GTEST_SKIP() << "the shard has no Checkpoint RPC yet: " << c.status();
    }
    ASSERT_TRUE(c.ok()) << "shard " << i << ": " << c.status();
    EXPECT_EQ(c->step(), kCheckpointStep);
    EXPECT_GT(c->bytes(), 0u);
    EXPECT_TRUE(std::filesystem::exists(c->path())) << c->path();
  }

  // Phase B: steps from S on with incarnation 1; shard 1 is SIGKILLed while they run. These pushes
  // are lost by the rewind, whether acknowledged or not (the contract: back to the checkpoint).
  std::atomic<int64_t> phase_b_steps{0};
  std::atomic<bool> killed{false};
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        RunWorker(*clients[w], *before[w], w, kCheckpointStep, 200, /*resend=*/false,
                  [&](int64_t k) {
                    if (k > 0) phase_b_steps.fetch_add(1);
                    return !killed.load() || k < 3;
                  });
      });
    }
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (phase_b_steps.load() < 3 * kWorkers && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    shards_[1]->Kill();
    killed.store(true);
    for (auto& t : threads) t.join();
    EXPECT_GE(phase_b_steps.load(), 3 * kWorkers) << "pushes after the checkpoint";
  }
  clients.clear();
  // What the checkpoint holds: the acknowledged pushes of steps < S.
  const std::vector<AckedPart> checkpointed = {{before[0].get(), kCheckpointStep},
                                               {before[1].get(), kCheckpointStep},
                                               {before[2].get(), kCheckpointStep}};

  // Shard 0 lived through it and applied pushes of steps >= S: the restore must undo them.
  const int64_t rolled_back = DifferingElementsOnShard(0, job, checkpointed);
  EXPECT_GT(rolled_back, 0) << "shard 0 applied nothing after the checkpoint";

  // Phase C: restart shard 1 on its port with its --data_dir; restore S on both shards with a new
  // incarnation floor, as the coordinator does.
  const int port = shards_[1]->port();
  absl::Status restarted = shards_[1]->Start(port);
  ASSERT_TRUE(restarted.ok()) << restarted;
  ASSERT_EQ(shards_[1]->port(), port);
  constexpr uint64_t kNewIncarnation = 2;
  for (int i = 0; i < kShards; ++i) {
    absl::StatusOr<v1::RestoreResponse> r =
        Restore(shards_[i]->address(), job, kCheckpointStep, kNewIncarnation);
    ASSERT_TRUE(r.ok()) << "shard " << i << ": " << r.status();
    EXPECT_EQ(r->step(), kCheckpointStep);
    EXPECT_GT(r->partitions(), 0u);
  }
  // The restored state is exactly the checkpoint: the pushes of steps < S.
  ExpectWeightsExact(job, checkpointed);
  {
    // A straggler of the old incarnation is refused and changes nothing.
    Ledger straggler;
    auto old = WorkerClient(job, 0, 1, &straggler);
    ASSERT_NE(old, nullptr);
    std::vector<float> g(Tensors()[0].size, 1.0f);
    auto r = old->PushPull(Tensors()[0].name, kCheckpointStep, g, {}).get();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  }

  // Phase D: steps [S, S + kAfterRestore) with the new incarnation, under resets and latency.
  for (auto& p : proxies_) {
    p->SetCutProbability(0.02);
    p->SetLatency(absl::Milliseconds(2));
  }
  std::vector<std::unique_ptr<Ledger>> after;
  std::vector<WorkerRun> runs(kWorkers);
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < kWorkers; ++w) after.push_back(std::make_unique<Ledger>());
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        auto pc = WorkerClient(job, w, kNewIncarnation, after[w].get());
        if (pc == nullptr) return;
        runs[w] = RunWorker(*pc, *after[w], w, kCheckpointStep, kAfterRestore, true,
                            [](int64_t) { return true; });
      });
    }
    for (auto& t : threads) t.join();
  }
  for (auto& p : proxies_) {
    p->SetCutProbability(0.0);
    p->SetLatency(absl::ZeroDuration());
  }
  std::vector<AckedPart> acked = checkpointed;
  for (const auto& l : after) acked.push_back({l.get()});
  std::map<std::string, std::vector<double>> generated;
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(runs[w].error.ok()) << runs[w].error;
    ASSERT_EQ(runs[w].steps, kAfterRestore);
    EXPECT_TRUE(after[w]->Unacknowledged().empty());
    AddGenerated(w, 0, kCheckpointStep, &generated);
    AddGenerated(w, kCheckpointStep, kAfterRestore, &generated);
  }
  EXPECT_TRUE(SumAcked(acked) == generated)
      << "every push of steps < S and since the restore, once";
  const int keys = ExpectWeightsExact(job, acked);
  int64_t retries = 0, dups = 0;
  for (int w = 0; w < kWorkers; ++w) {
    retries += before[w]->retries() + after[w]->retries();
    dups += before[w]->duplicates() + after[w]->duplicates();
  }
  std::cout << "exactly-once after restart: checkpoint at step " << kCheckpointStep << ", "
            << phase_b_steps.load() << " worker-steps after it rolled back by the restore ("
            << rolled_back << " values on the surviving shard), " << kAfterRestore
            << " steps per worker since, " << retries << " retries, " << dups << " duplicates, "
            << Cuts() << " connection cuts, " << keys << " keys exact\n";
}

// A partition during a large push whose gradient is lent to gRPC, not copied (the client's
// callback may run only once gRPC has let go of the caller's memory, and bytes already written to
// a connection the peer no longer reads are let go only when that connection closes): the push
// still ends within a bound after its deadline, a client shut down in the partition does too, and
// once the partition heals the shards serve a new client.
TEST_F(ExactlyOnceFaultsTest, APartitionDuringALargeLentPushEndsWithinABound) {
  constexpr int64_t kValues = int64_t{8} << 20;  // 32 MiB: far more than TCP's buffers hold
  v1::JobConfig config;
  config.set_consistency(v1::CONSISTENCY_ASP);
  config.set_num_workers(1);
  config.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
  config.mutable_optimizer()->set_learning_rate(1.0f);
  const std::vector<client::DenseTensorSpec> specs = {{"big", {kValues}, {}}};  // zeros
  auto make_client = [&](absl::Duration timeout) {
    ParameterClient::Options o;
    o.shard_addresses = ProxyAddresses();
    o.job_id = "lent";
    o.partition_bytes = 4 << 20;
    o.call_timeout = timeout;
    o.retry.max_attempts = 1;
    auto c = ParameterClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  auto pc = make_client(absl::Seconds(2));
  ASSERT_NE(pc, nullptr);
  ASSERT_TRUE(pc->DeclareJob(config, specs, {}).ok());
  std::vector<float> grad(kValues, 1.0f), weights(kValues, 0.0f);
  auto warm = pc->PushPull("big", 0, grad, absl::MakeSpan(weights)).get();
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_EQ(weights[kValues - 1], -1.0f);

  for (auto& p : proxies_) p->SetBlackhole(true);
  absl::Time start = absl::Now();
  auto cut_future = pc->PushPull("big", 1, grad, absl::MakeSpan(weights));
  // The bound is keepalive's (2 x 5 s): it closes a connection whose peer stopped reading, and
  // with it gRPC lets go of the lent bytes queued there.
  ASSERT_EQ(cut_future.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "the push in the partition did not end: its lent bytes were never released";
  auto cut = cut_future.get();
  const absl::Duration push_took = absl::Now() - start;
  ASSERT_FALSE(cut.ok());
  EXPECT_TRUE(cut.status().code() == absl::StatusCode::kDeadlineExceeded ||
              cut.status().code() == absl::StatusCode::kUnavailable)
      << cut.status();
  EXPECT_LT(push_took, absl::Seconds(30)) << cut.status();
  std::cerr << "push in the partition ended after " << push_took << ": " << cut.status() << "\n";

  // A push in flight when its client is destroyed, still in the partition.
  auto second = std::async(std::launch::async, [&] {
    return pc->PushPull("big", 2, grad, absl::MakeSpan(weights)).get();
  });
  absl::SleepFor(absl::Milliseconds(300));
  start = absl::Now();
  pc.reset();  // waits for its calls
  const absl::Duration shutdown_took = absl::Now() - start;
  EXPECT_LT(shutdown_took, absl::Seconds(30));
  std::cerr << "shutdown in the partition took " << shutdown_took << "\n";
  EXPECT_FALSE(second.get().ok());

  for (auto& p : proxies_) p->SetBlackhole(false);
  auto healed = make_client(absl::Seconds(20));
  ASSERT_NE(healed, nullptr);
  ASSERT_TRUE(healed->AttachJob(specs, {}).ok());
  auto after = healed->PushPull("big", 3, grad, absl::MakeSpan(weights)).get();
  ASSERT_TRUE(after.ok()) << after.status();
}

}  // namespace
}  // namespace faults
}  // namespace tessera
