// Training-step throughput of the two example models (DESIGN.md §10) on the CPU backend: forward,
// loss, backward and an Adam update of every parameter, at batch 64, on random data.
// Run: OMP_NUM_THREADS=1 build/bin/tessera_engine_benchmark (items_per_second = samples/s).
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "google/protobuf/text_format.h"
#include "kernels/backend.h"
#include "spec/testing/example_models.h"
#include "worker/engine/model.h"

namespace tessera::engine {
namespace {

using spec::examples::kFashionCnn;
using spec::examples::kFashionMlp;

void TrainSteps(benchmark::State& state, const char* text) {
  v1::ModelSpec spec;
  if (!google::protobuf::TextFormat::ParseFromString(text, &spec)) {
    state.SkipWithError("bad spec");
    return;
  }
  kernels::BackendOptions options;
  options.device = kernels::DeviceChoice::kCpu;
  auto backend = kernels::CreateBackend(options);
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  auto model = Model::Create(spec, backend->get(), 1);
  if (!model.ok()) {
    state.SkipWithError(std::string(model.status().message()).c_str());
    return;
  }
  const int64_t n = 64;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(n * (*model)->input_dim());
  for (float& f : x) f = unit(rng);
  std::vector<int32_t> labels(n);
  for (int32_t& l : labels) l = static_cast<int32_t>(rng() % 10);
  BatchView batch;
  batch.size = n;
  batch.features = x;
  batch.labels = labels;

  kernels::OptimizerParams adam;
  adam.kind = v1::OPTIMIZER_KIND_ADAM;
  adam.learning_rate = 1e-3f;
  std::vector<std::vector<kernels::Tensor>> slots;
  for (const Parameter& p : (*model)->parameters()) {
    std::vector<kernels::Tensor> s;
    for (int i = 0; i < kernels::NumSlots(adam.kind); ++i) {
      kernels::Tensor t = *(*backend)->Allocate(p.shape);
      (void)(*backend)->Fill(t, 0.0f);
      s.push_back(t);
    }
    slots.push_back(std::move(s));
  }
  int64_t t = 0;
  for (auto _ : state) {
    auto r = (*model)->TrainStep(batch);
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      return;
    }
    ++t;
    const auto& params = (*model)->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].trainable) continue;
      (void)(*backend)->ApplyUpdate(adam, adam.learning_rate, t, 1.0f, params[i].grad,
                                    params[i].value, slots[i]);
    }
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetLabel((*backend)->Description());
}

void BM_MlpTrainStep(benchmark::State& state) { TrainSteps(state, kFashionMlp); }
void BM_CnnTrainStep(benchmark::State& state) { TrainSteps(state, kFashionCnn); }

BENCHMARK(BM_MlpTrainStep)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CnnTrainStep)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace tessera::engine

BENCHMARK_MAIN();
