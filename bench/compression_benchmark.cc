// The worker's and the shard's wire encoders (common/gradient_compression.h, common/encoding.h) on
// one partition of the MLP example's size (200,704 values, normal random), against references
// timed in the same binary:
//
//   BM_TopK          ErrorFeedback::Encode, TOPK at a fraction of 0.1 (what a topk push costs);
//                    reference: the selection it replaced, std::nth_element over a copy of every
//                    magnitude (BM_TopKFullSelection); docs/benchmarks.md gives the ratio.
//   BM_Int8Delta     EncodeInt8 plus AddInt8 (a shard's publish of a delta_int8 pull);
//   BM_Bf16Encode /  EncodeValues / DecodeValues in BF16;
//   BM_Bf16Decode    reference for all three: memcpy of the fp32 values (BM_Copy), the floor of
//                    any pass that reads them once and writes its output.
//
// Run: compression_benchmark --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/encoding.h"
#include "common/gradient_compression.h"

namespace tessera {
namespace {

constexpr size_t kValues = 200704;

const std::vector<float>& Gradient() {
  static const std::vector<float> g = [] {
    std::vector<float> v(kValues);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : v) x = normal(rng);
    return v;
  }();
  return g;
}

void BM_TopK(benchmark::State& state) {
  ErrorFeedback feedback;
  std::string out;
  const size_t k = TopKCount(kValues, 0.1);
  for (auto _ : state) {
    feedback.Encode(v1::ENCODING_TOPK, Gradient().data(), kValues, k, &out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_TopK);

void BM_TopKFullSelection(benchmark::State& state) {
  const size_t k = TopKCount(kValues, 0.1);
  std::vector<float> rank(kValues);
  for (auto _ : state) {
    for (size_t i = 0; i < kValues; ++i) rank[i] = std::fabs(Gradient()[i]);
    std::nth_element(rank.begin(), rank.begin() + static_cast<ptrdiff_t>(k - 1), rank.end(),
                     std::greater<float>());
    benchmark::DoNotOptimize(rank[k - 1]);
  }
}
BENCHMARK(BM_TopKFullSelection);

void BM_Int8Delta(benchmark::State& state) {
  std::vector<float> copy(kValues, 0.0f);
  std::string out;
  for (auto _ : state) {
    benchmark::DoNotOptimize(EncodeInt8(Gradient().data(), kValues, &out));
    AddInt8(out, copy.data(), kValues);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_Int8Delta);

void BM_Bf16Encode(benchmark::State& state) {
  std::string out;
  for (auto _ : state) {
    EncodeValues(v1::ENCODING_BF16, Gradient().data(), kValues, &out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_Bf16Encode);

void BM_Bf16Decode(benchmark::State& state) {
  std::string in;
  EncodeValues(v1::ENCODING_BF16, Gradient().data(), kValues, &in);
  std::vector<float> out(kValues);
  for (auto _ : state) {
    benchmark::DoNotOptimize(DecodeValues(v1::ENCODING_BF16, in, out.data(), kValues).ok());
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_Bf16Decode);

void BM_Copy(benchmark::State& state) {
  std::vector<float> out(kValues);
  for (auto _ : state) {
    std::memcpy(out.data(), Gradient().data(), kValues * sizeof(float));
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_Copy);

}  // namespace
}  // namespace tessera

BENCHMARK_MAIN();
