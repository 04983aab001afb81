// The shard's sparse update against a STREAM-style triad in the same binary (issue #15): pushes of
// 4096 distinct rows (width 16, Adagrad) through ParameterStore::Push, the path a worker's push
// takes on a shard (validation, locks, exactly-once check, merge, one optimizer update per row),
// into a table already holding N rows, for N = 10^5, 10^6 and 10^7. The rows pushed are drawn
// uniformly from the N, so the larger tables miss the caches as a real table does.
//
//   rows/s      rows updated per second (the push's time alone, manual timing).
//   GB/s        bytes the updates touch per second, counting each array once: the gradient read
//               (64 B), the weights and the accumulator read and written (4 x 64 B): 320 B a row.
//   triad_GB/s  a triad a = b + s * c over arrays of the table's weights' size, run after every
//               push, so both see the same load from other processes.
//   vs_triad    GB/s / triad_GB/s.
//   ns/row      the cost per row, which should stay flat as the table grows.
//
// Run: sparse_update_benchmark --benchmark_repetitions=3 (docs/benchmarks.md). 10^7 rows take
// about 1.9 GB.
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "server/parameter_store.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {
namespace {

constexpr uint32_t kDim = 16;
constexpr int kRowsPerPush = 4096;
constexpr double kBytesPerRow = 5.0 * kDim * sizeof(float);

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

v1::PushPullRequest Push(uint64_t seq, const std::vector<int64_t>& rows,
                         const std::vector<float>& grads) {
  v1::PushPullRequest r;
  r.set_job_id("bench");
  r.set_worker_id(0);
  r.set_incarnation(1);
  r.set_step(static_cast<int64_t>(seq));
  r.set_seq(seq);
  v1::Slice* s = r.add_push();
  s->mutable_key()->set_tensor("emb");
  s->set_encoding(v1::ENCODING_FP32);
  for (int64_t id : rows) s->add_row_ids(id);
  s->set_data(reinterpret_cast<const char*>(grads.data()), grads.size() * sizeof(float));
  return r;
}

void BM_SparseUpdate(benchmark::State& state) {
  const int64_t table_rows = state.range(0);
  ParameterStore store;
  v1::CreateJobStateRequest job;
  job.set_job_id("bench");
  job.mutable_config()->set_consistency(v1::CONSISTENCY_ASP);
  job.mutable_config()->set_num_workers(1);
  job.mutable_config()->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_ADAGRAD);
  job.mutable_config()->mutable_optimizer()->set_learning_rate(0.01f);
  v1::SparseTableDecl* t = job.add_tables();
  t->set_name("emb");
  t->set_dim(kDim);
  t->mutable_initializer()->set_kind(v1::Initializer::KIND_NORMAL);
  t->mutable_initializer()->set_scale(0.01f);
  if (!store.CreateJobState(job).ok()) {
    state.SkipWithError("CreateJobState failed");
    return;
  }
  std::vector<float> grads(static_cast<size_t>(kRowsPerPush) * kDim, 0.001f);
  uint64_t seq = 0;
  // Fill the table: every row created once (ids spread over the int64 range, as hashed ids are).
  const auto id_of = [](int64_t i) {
    return static_cast<int64_t>((i * 0x9E3779B97F4A7C15ULL) >> 1);
  };
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < table_rows; i += kRowsPerPush) {
    rows.clear();
    for (int64_t j = i; j < std::min(table_rows, i + kRowsPerPush); ++j) rows.push_back(id_of(j));
    grads.resize(rows.size() * kDim, 0.001f);
    if (!store.Push(Push(++seq, rows, grads)).ok()) {
      state.SkipWithError("filling the table failed");
      return;
    }
  }
  grads.assign(static_cast<size_t>(kRowsPerPush) * kDim, 0.001f);
  std::vector<float> a(static_cast<size_t>(table_rows) * kDim, 0.0f);
  std::vector<float> b(a.size(), 1.0f), c(a.size(), 2.0f);
  std::mt19937_64 rng(7);
  double push_seconds = 0, triad_seconds = 0;
  for (auto _ : state) {
    // 4096 distinct rows drawn uniformly from the table.
    rows.clear();
    const int64_t start = static_cast<int64_t>(rng() % static_cast<uint64_t>(table_rows));
    const int64_t stride = 1 + static_cast<int64_t>(rng() % 1000) * 2 + 1;
    for (int j = 0; j < kRowsPerPush; ++j) rows.push_back(id_of((start + j * stride) % table_rows));
    v1::PushPullRequest request = Push(++seq, rows, grads);
    const Clock::time_point t0 = Clock::now();
    const bool ok = store.Push(request).ok();
    const Clock::time_point t1 = Clock::now();
    for (size_t i = 0; i < a.size(); ++i) a[i] = b[i] + 3.0f * c[i];
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
    const Clock::time_point t2 = Clock::now();
    if (!ok) {
      state.SkipWithError("push failed");
      return;
    }
    push_seconds += Seconds(t0, t1);
    triad_seconds += Seconds(t1, t2);
    state.SetIterationTime(Seconds(t0, t1));
  }
  const double pushed = static_cast<double>(state.iterations()) * kRowsPerPush;
  const double gbps = pushed * kBytesPerRow / push_seconds / 1e9;
  const double triad_gbps = 12.0 * static_cast<double>(a.size()) *
                            static_cast<double>(state.iterations()) / triad_seconds / 1e9;
  state.counters["rows/s"] = pushed / push_seconds;
  state.counters["ns/row"] = push_seconds / pushed * 1e9;
  state.counters["GB/s"] = gbps;
  state.counters["triad_GB/s"] = triad_gbps;
  state.counters["vs_triad"] = gbps / triad_gbps;
}

BENCHMARK(BM_SparseUpdate)
    ->Arg(100000)
    ->Arg(1000000)
    ->Arg(10000000)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tessera::server

BENCHMARK_MAIN();
