// cpu:N replicas in one worker (worker/trainer/internal/local_replicas.h) on the Fashion-MNIST
// CNN examples (fashion_cnn, and fashion_cnn_bn: bn:1), batch 64, one OpenMP thread per replica: a
// worker's step as the distributed trainer runs it (every replica's part, the host reduce, then
// Install of the fresh weights in every replica), against cpu:1 in the same binary and a
// STREAM-style triad in the same run.
//
//   samples/s        examples trained per second (the batch over the step's wall time)
//   reduce_fraction  the reduce's share of the step (target < 0.1)
//   reduce_GB/s      bytes the reduce moves per second: N replica gradients read, one result
//                    written, 4 B per value each
//   triad_GB/s       a triad a = b + s * c over separate arrays of the model's size, run after
//                    every step, so both see the same load from other processes
//   install_ms       the broadcast of the weights into every replica, per step
//
// Run: replicas_benchmark --benchmark_repetitions=3 (docs/benchmarks.md). The ratio cpu:2 /
// cpu:1 of samples/s is the speed-up (target >= 1.6 on 2 cores).
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "google/protobuf/text_format.h"
#include "spec/testing/example_models.h"
#include "worker/trainer/internal/local_replicas.h"

namespace tessera::trainer::internal {
namespace {

constexpr int64_t kBatch = 64;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

void Triad(const float* __restrict__ b, const float* __restrict__ c, float* __restrict__ a,
           int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// Arguments: replicas, then the model (0: examples/fashion_cnn, 1: examples/fashion_cnn_bn).
void BM_ReplicaStep(benchmark::State& state) {
  const int replicas = static_cast<int>(state.range(0));
  v1::ModelSpec spec;
  const char* text =
      state.range(1) == 0 ? spec::examples::kFashionCnn : spec::examples::kFashionCnnBn;
  if (!google::protobuf::TextFormat::ParseFromString(text, &spec)) {
    state.SkipWithError("the CNN spec does not parse");
    return;
  }
  LocalReplicas::Options o;
  o.devices = replicas;
  o.threads = 1;
  auto made = LocalReplicas::Create(spec, 1, o);
  if (!made.ok()) {
    state.SkipWithError(std::string(made.status().message()).c_str());
    return;
  }
  LocalReplicas& r = **made;
  std::vector<std::string> names;
  std::vector<bool> is_state;
  std::vector<std::vector<float>> grads, weights;
  int64_t values = 0;
  for (const engine::Parameter& p : r.model(0).parameters()) {
    names.push_back(p.name);
    is_state.push_back(!p.trainable);
    std::vector<float> w;
    if (!r.model(0).CopyValueToHost(p.name, &w).ok()) {
      state.SkipWithError("cannot read the weights");
      return;
    }
    values += static_cast<int64_t>(w.size());
    grads.emplace_back(w.size());
    weights.push_back(std::move(w));
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  std::vector<float> features(kBatch * 784);
  for (float& x : features) x = pixel(rng);
  std::vector<int32_t> labels(kBatch);
  for (int32_t& y : labels) y = static_cast<int32_t>(rng() % 10);
  engine::BatchView batch;
  batch.size = kBatch;
  batch.features = features;
  batch.labels = labels;
  std::vector<float> ta(values), tb(values, 1.0f), tc(values, 2.0f);

  double step_seconds = 0, reduce_seconds = 0, install_seconds = 0, triad_seconds = 0;
  uint64_t seed = 0;
  for (auto _ : state) {
    const Clock::time_point t0 = Clock::now();
    auto result = r.TrainStep(batch, ++seed, names, is_state, &grads);
    const Clock::time_point t1 = Clock::now();
    if (!result.ok() || !r.Install(names, weights).ok()) {
      state.SkipWithError("the step failed");
      return;
    }
    const Clock::time_point t2 = Clock::now();
    state.SetIterationTime(Seconds(t0, t2));
    step_seconds += Seconds(t0, t2);
    reduce_seconds += r.last_reduce_seconds();
    install_seconds += Seconds(t1, t2);
    const Clock::time_point t3 = Clock::now();
    Triad(tb.data(), tc.data(), ta.data(), values, 0.5f);
    benchmark::DoNotOptimize(ta.data());
    triad_seconds += Seconds(t3, Clock::now());
  }
  const double steps = static_cast<double>(state.iterations());
  const double reduce_bytes = static_cast<double>(values) * 4.0 * (replicas + 1);
  state.counters["samples/s"] = static_cast<double>(kBatch) * steps / step_seconds;
  state.counters["reduce_fraction"] = reduce_seconds / step_seconds;
  state.counters["reduce_GB/s"] = reduce_bytes * steps / reduce_seconds / 1e9;
  state.counters["triad_GB/s"] = 12.0 * static_cast<double>(values) * steps / triad_seconds / 1e9;
  state.counters["install_ms"] = install_seconds / steps * 1e3;
  state.counters["parameters"] = static_cast<double>(values);
}

BENCHMARK(BM_ReplicaStep)
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->ArgNames({"replicas", "bn"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(5.0);

}  // namespace
}  // namespace tessera::trainer::internal

BENCHMARK_MAIN();
