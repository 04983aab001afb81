// Test helpers for the devices of one worker (internal/local_replicas.h, pipeline_stages.h):
// random batches, and the model on one device with one thread that a split must reproduce.
#ifndef TESSERA_WORKER_TRAINER_TESTING_ONE_DEVICE_H_
#define TESSERA_WORKER_TRAINER_TESTING_ONE_DEVICE_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tessera/v1/model.pb.h"
#include "worker/engine/model.h"

namespace tessera::trainer::testing_devices {

// Convolution, pooling, a view, dense: every layer kind whose gradient a split must reproduce.
inline constexpr char kSmallCnn[] = R"pb(
  input_shape: [ 1, 6, 6 ]
  layers { conv2d { filters: 4 kernel_h: 3 kernel_w: 3 padding_h: 1 padding_w: 1 } }
  layers { relu {} }
  layers { max_pool2d { pool_h: 2 pool_w: 2 } }
  layers { flatten {} }
  layers { dense { units: 5 } }
  layers { tanh {} }
  layers { dense { units: 3 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

inline v1::ModelSpec Parse(const std::string& text) {
  v1::ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

// Class labels, or (when labels is empty) 2 regression targets per example.
struct Batch {
  std::vector<float> features;
  std::vector<int32_t> labels;
  std::vector<float> targets;
  engine::BatchView View() const {
    engine::BatchView v;
    v.size = static_cast<int64_t>(labels.empty() ? targets.size() / 2 : labels.size());
    v.features = features;
    v.labels = labels;
    v.targets = targets;
    return v;
  }
};

inline Batch RandomBatch(int64_t size, int64_t width, int classes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> x(0.5f, 1.0f);
  Batch b;
  for (int64_t i = 0; i < size * width; ++i) b.features.push_back(x(rng));
  for (int64_t i = 0; i < size; ++i) b.labels.push_back(static_cast<int32_t>(rng() % classes));
  return b;
}

// The batch's labels replaced by 2 normal targets per example.
inline Batch WithTargets(Batch b, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> t(0.0f, 1.0f);
  for (size_t i = 0; i < 2 * b.labels.size(); ++i) b.targets.push_back(t(rng));
  b.labels.clear();
  return b;
}

struct Reference {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<engine::Model> model;
};

// The model of `spec` (seed 11, as the tests' devices) on one CPU device with one thread.
inline Reference OneDevice(const v1::ModelSpec& spec) {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  o.num_threads = 1;
  Reference r;
  auto backend = kernels::CreateBackend(o);
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return r;
  r.backend = std::move(*backend);
  auto model = engine::Model::Create(spec, r.backend.get(), 11);
  EXPECT_TRUE(model.ok()) << model.status();
  if (model.ok()) r.model = std::move(*model);
  return r;
}

// The trainable tensors' names, in parameter order.
inline std::vector<std::string> TrainableNames(const engine::Model& m) {
  std::vector<std::string> out;
  for (const engine::Parameter& p : m.parameters()) {
    if (p.trainable) out.push_back(p.name);
  }
  return out;
}

}  // namespace tessera::trainer::testing_devices

#endif  // TESSERA_WORKER_TRAINER_TESTING_ONE_DEVICE_H_
