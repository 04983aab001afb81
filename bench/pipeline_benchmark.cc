// Model parallelism in one worker (worker/trainer/internal/pipeline_stages.h): the same model
// on one device and cut into two stages over cpu:2 (one OpenMP thread per stage), batch 64, a
// step as the distributed trainer runs it (forward, backward, the batch's gradients on the host).
//
// Models (first argument): 0 the Fashion-MNIST CNN (examples/fashion_cnn) cut before conv2d_2
// (stage 0: conv 1 and its pool; stage 1: conv 2, the dense layers), 1 the CNN cut before
// flatten_1 (both convolutions on stage 0), 2 an MLP 784-1024-1024 | 1024-1024-10 cut before
// dense_3, whose stages cost about the same.
// Modes (second argument): 0 unsplit on one device with 1 thread, 1 unsplit with 2 threads (the
// whole machine on one device), 2 the pipeline over cpu:2 with `micro` micro-batches (third).
//
//   samples/s         examples trained per second
//   bubble_predicted  (S - 1) / (M + S - 1), the GPipe schedule's idle share with equal stages
//   wait0, wait1      the share of the step stage s waited for an input or a gradient
//   compute0/1        the share of the step stage s computed
//   balance           the lighter stage's compute over the heavier's (1: equal)
//   copy_ms           the gradients to the host at the end of the step
//
// Run: pipeline_benchmark --benchmark_repetitions=3 (docs/benchmarks.md). The speed-up of a
// split is its samples/s over mode 0's of the same model.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "google/protobuf/text_format.h"
#include "kernels/backend.h"
#include "spec/pipeline_spec.h"
#include "spec/testing/example_models.h"
#include "worker/engine/model.h"
#include "worker/trainer/internal/pipeline_stages.h"

namespace tessera::trainer::internal {
namespace {

constexpr int64_t kBatch = 64;
using Clock = std::chrono::steady_clock;

constexpr char kDeepMlp[] = R"pb(
  input_shape: [ 784 ]
  layers { dense { units: 1024 } }
  layers { relu {} }
  layers { dense { units: 1024 } }
  layers { relu {} }
  layers { dense { units: 1024 } }
  layers { relu {} }
  layers { dense { units: 1024 } }
  layers { relu {} }
  layers { dense { units: 10 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

bool ModelSpec(int model, int micro_batches, v1::ModelSpec* spec) {
  const char* text = model == 2 ? kDeepMlp : spec::examples::kFashionCnn;
  if (!google::protobuf::TextFormat::ParseFromString(text, spec)) return false;
  const char* cut = model == 0 ? "conv2d_2" : model == 1 ? "flatten_1" : "dense_3";
  spec->mutable_pipeline()->add_stage_starts(cut);
  spec->mutable_pipeline()->set_micro_batches(micro_batches);
  return true;
}

struct Data {
  std::vector<float> features;
  std::vector<int32_t> labels;
  engine::BatchView view;
};

Data MakeBatch() {
  Data d;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  d.features.resize(kBatch * 784);
  for (float& x : d.features) x = pixel(rng);
  d.labels.resize(kBatch);
  for (int32_t& y : d.labels) y = static_cast<int32_t>(rng() % 10);
  d.view.size = kBatch;
  d.view.features = d.features;
  d.view.labels = d.labels;
  return d;
}

void Unsplit(benchmark::State& state, const v1::ModelSpec& spec, int threads) {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  o.num_threads = threads;
  auto backend = kernels::CreateBackend(o);
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  auto model = engine::Model::Create(spec, backend->get(), 1);
  if (!model.ok()) {
    state.SkipWithError(std::string(model.status().message()).c_str());
    return;
  }
  const Data data = MakeBatch();
  std::vector<std::vector<float>> grads((*model)->parameters().size());
  double seconds = 0;
  for (auto _ : state) {
    const Clock::time_point t0 = Clock::now();
    bool ok = (*model)->TrainStep(data.view).ok();
    for (size_t k = 0; k < grads.size() && ok; ++k) {
      const engine::Parameter& p = (*model)->parameters()[k];
      if (p.trainable) ok = (*model)->CopyGradToHost(p.name, &grads[k]).ok();
    }
    if (!ok) {
      state.SkipWithError("the step failed");
      return;
    }
    const double s = Seconds(t0, Clock::now());
    state.SetIterationTime(s);
    seconds += s;
  }
  state.counters["samples/s"] =
      static_cast<double>(kBatch) * static_cast<double>(state.iterations()) / seconds;
}

void Pipelined(benchmark::State& state, const v1::ModelSpec& spec) {
  LocalDevices::Options o;
  o.devices = 2;
  o.threads = 1;
  auto made = PipelineStages::Create(spec, 1, o);
  if (!made.ok()) {
    state.SkipWithError(std::string(made.status().message()).c_str());
    return;
  }
  PipelineStages& p = **made;
  std::vector<std::string> names;
  std::vector<bool> is_state;
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < p.size(); ++s) {
    for (const engine::Parameter& param : p.model(s).parameters()) {
      names.push_back(param.name);
      is_state.push_back(!param.trainable);
      grads.emplace_back(static_cast<size_t>(kernels::NumElements(param.shape)));
    }
  }
  const Data data = MakeBatch();
  double seconds = 0, copy = 0;
  std::vector<double> wait(2, 0.0), compute(2, 0.0);
  uint64_t seed = 0;
  for (auto _ : state) {
    const Clock::time_point t0 = Clock::now();
    if (!p.TrainStep(data.view, ++seed, names, is_state, &grads).ok()) {
      state.SkipWithError("the step failed");
      return;
    }
    const double s = Seconds(t0, Clock::now());
    state.SetIterationTime(s);
    seconds += s;
    const PipelineStages::Profile& profile = p.last_profile();
    for (int k = 0; k < 2; ++k) {
      wait[k] += profile.stages[k].wait;
      compute[k] += profile.stages[k].compute;
    }
    copy += std::max(profile.stages[0].copy, profile.stages[1].copy);
  }
  const double steps = static_cast<double>(state.iterations());
  const int micro = static_cast<int>(std::min<int64_t>(p.micro_batches(), kBatch));
  state.counters["samples/s"] = static_cast<double>(kBatch) * steps / seconds;
  state.counters["bubble_predicted"] = spec::PipelineBubble(2, micro);
  state.counters["wait0"] = wait[0] / seconds;
  state.counters["wait1"] = wait[1] / seconds;
  state.counters["compute0"] = compute[0] / seconds;
  state.counters["compute1"] = compute[1] / seconds;
  state.counters["balance"] = std::min(compute[0], compute[1]) / std::max(compute[0], compute[1]);
  state.counters["copy_ms"] = copy / steps * 1e3;
}

// Arguments: model, mode, micro-batches (mode 2).
void BM_PipelineStep(benchmark::State& state) {
  const int model = static_cast<int>(state.range(0));
  const int mode = static_cast<int>(state.range(1));
  v1::ModelSpec spec;
  if (!ModelSpec(model, static_cast<int>(state.range(2)), &spec)) {
    state.SkipWithError("the spec does not parse");
    return;
  }
  if (mode == 2) {
    Pipelined(state, spec);
  } else {
    Unsplit(state, spec, mode == 0 ? 1 : 2);
  }
}

void Arguments(benchmark::internal::Benchmark* b) {
  for (int model : {0, 1, 2}) {
    b->Args({model, 0, 0});
    b->Args({model, 1, 0});
    for (int micro : {1, 2, 4, 8}) b->Args({model, 2, micro});
  }
}

BENCHMARK(BM_PipelineStep)
    ->Apply(Arguments)
    ->ArgNames({"model", "mode", "micro"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);

}  // namespace
}  // namespace tessera::trainer::internal

BENCHMARK_MAIN();
