// Memory bandwidth of the server-side optimizer kernels against a STREAM-style triad in the same
// binary, over the same number of elements, with 1 and 2 OpenMP threads (the benchmark argument).
//
//   GB/s        bytes moved per second (1e9), counting each array read or written once:
//               triad a = b + s * c: 12 B/element, SGD-momentum 20 B (reads g, w, v; writes w, v),
//               Adam 28 B (reads g, w, m, v; writes w, m, v).
//   triad_GB/s  in the optimizer benchmarks, a triad over separate arrays of the same size run
//               after every update, so that both see the same load from other processes.
//   vs_triad    GB/s / triad_GB/s. The target is >= 0.8.
// The optimizer benchmarks' time column is the update alone (manual timing).
//
// Run: optimizer_benchmark --benchmark_repetitions=3 (see docs/benchmarks.md). Each array holds
// 64M floats (256 MiB), so Adam touches 1 GiB, plus 768 MiB for its interleaved triad.
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/optimizer.h"

namespace tessera::kernels {
namespace {

constexpr int64_t kParameters = int64_t{64} << 20;

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

double GigabytesPerSecond(double bytes_per_element, int64_t iterations, double seconds) {
  return bytes_per_element * static_cast<double>(kParameters) * static_cast<double>(iterations) /
         seconds / 1e9;
}

void Triad(const float* __restrict__ b, const float* __restrict__ c, float* __restrict__ a,
           int64_t n, float s) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

struct TriadArrays {
  TriadArrays() : a(kParameters, 0.0f), b(kParameters, 1.0f), c(kParameters, 2.0f) {}
  void Run() {
    Triad(b.data(), c.data(), a.data(), kParameters, 3.0f);
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  std::vector<float> a, b, c;
};

void BM_Triad(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  omp_set_num_threads(threads);
  TriadArrays triad;
  const Clock::time_point start = Clock::now();
  for (auto _ : state) triad.Run();
  state.counters["GB/s"] =
      GigabytesPerSecond(12.0, state.iterations(), Seconds(start, Clock::now()));
  state.counters["threads"] = threads;
}

// One update per iteration with the production kernel (t counting up), each followed by a triad.
void RunOptimizer(benchmark::State& state, v1::OptimizerConfig config, double bytes_per_element) {
  const int threads = static_cast<int>(state.range(0));
  omp_set_num_threads(threads);
  config.set_learning_rate(1e-4f);
  const OptimizerParams params = MakeOptimizerParams(config);
  std::vector<float> g(kParameters, 0.01f), w(kParameters, 0.5f);
  std::vector<std::vector<float>> slots;
  std::vector<float*> slot_ptrs;
  for (int s = 0; s < NumSlots(params.kind); ++s) {
    slots.emplace_back(kParameters, SlotInitialValue(params, s));
  }
  for (auto& s : slots) slot_ptrs.push_back(s.data());
  TriadArrays triad;
  int64_t t = 0;
  double update_seconds = 0.0;
  double triad_seconds = 0.0;
  for (auto _ : state) {
    const Clock::time_point t0 = Clock::now();
    ApplyUpdateCpu(params, params.learning_rate, ++t, 1.0f, g.data(), w.data(), slot_ptrs.data(),
                   kParameters);
    benchmark::DoNotOptimize(w.data());
    benchmark::ClobberMemory();
    const Clock::time_point t1 = Clock::now();
    triad.Run();
    const Clock::time_point t2 = Clock::now();
    update_seconds += Seconds(t0, t1);
    triad_seconds += Seconds(t1, t2);
    state.SetIterationTime(Seconds(t0, t1));
  }
  const double gbps = GigabytesPerSecond(bytes_per_element, state.iterations(), update_seconds);
  const double triad_gbps = GigabytesPerSecond(12.0, state.iterations(), triad_seconds);
  state.counters["GB/s"] = gbps;
  state.counters["triad_GB/s"] = triad_gbps;
  state.counters["vs_triad"] = gbps / triad_gbps;
  state.counters["threads"] = threads;
}

void BM_SgdMomentum(benchmark::State& state) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
  config.set_momentum(0.9f);
  RunOptimizer(state, config, 20.0);
}

void BM_Adam(benchmark::State& state) {
  v1::OptimizerConfig config;
  config.set_kind(v1::OPTIMIZER_KIND_ADAM);
  RunOptimizer(state, config, 28.0);
}

BENCHMARK(BM_Triad)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SgdMomentum)->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Adam)->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tessera::kernels

BENCHMARK_MAIN();
