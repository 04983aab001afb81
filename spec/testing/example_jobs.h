// The small example jobs that the tests of the trainer, the worker daemon and the coordinator
// run, with the data they train on: one home, so that a change of the spec format is made once.
// Header-only; tests include it and link nothing more.
#ifndef TESSERA_SPEC_TESTING_EXAMPLE_JOBS_H_
#define TESSERA_SPEC_TESTING_EXAMPLE_JOBS_H_

#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"
#include "tessera/v1/job_spec.pb.h"

namespace tessera::spec::examples {

// Writes `n` rows of three Gaussian blobs in 2-D as CSV, label first: row i is of class i % 3,
// centred at angle 2 pi k / 3 on a circle of radius 3, noise sd 0.7. The same `seed`, the same
// file.
inline void WriteBlobsCsv(const std::string& path, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> noise(0.0, 0.7);
  std::ofstream out(path);
  for (int i = 0; i < n; ++i) {
    const int k = i % 3;
    const double angle = 2 * M_PI * k / 3;
    out << k << "," << 3 * std::cos(angle) + noise(rng) << "," << 3 * std::sin(angle) + noise(rng)
        << "\n";
  }
}

// A hashed-id CTR-like task in LIBSVM form (0-based): each example holds 3 to 6 of 400 ids
// spread over the int64 range; its label is 1 when it holds more "positive" ids (a fixed half
// of them) than not. The same `seed`, the same file; every seed draws from the same 400 ids.
inline void WriteHashedLibsvm(const std::string& path, int examples, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> vocabulary(400);
  std::mt19937_64 ids(99);  // the same vocabulary in every file
  for (int64_t& id : vocabulary) id = static_cast<int64_t>(ids() >> 2);
  std::ofstream out(path);
  for (int e = 0; e < examples; ++e) {
    const int count = 3 + static_cast<int>(rng() % 4);
    std::set<int64_t> chosen;
    int positive = 0;
    while (static_cast<int>(chosen.size()) < count) {
      const size_t k = rng() % vocabulary.size();
      if (chosen.insert(vocabulary[k]).second) positive += k % 2 == 0 ? 1 : -1;
    }
    out << (positive > 0 ? 1 : 0);
    for (int64_t id : chosen) out << " " << id << ":1";
    out << "\n";
  }
}

// The JobSpec text of a hashed embedding table (dim 4, sum) -> 8 -> tanh -> 1 model with sigmoid
// cross-entropy on `dir`/train.svm and `dir`/test.svm (WriteHashedLibsvm), on the CPU: name,
// model, dataset and device only.
inline std::string HashedJobText(const std::string& dir) {
  return absl::StrCat("name: \"hashed\"\n",                       //
                      "model {\n",                                //
                      "  layers { embedding_bag { dim: 4 } }\n",  //
                      "  layers { dense { units: 8 } }\n",        //
                      "  layers { tanh {} }\n",                   //
                      "  layers { dense { units: 1 } }\n",        //
                      "  loss: LOSS_SIGMOID_CROSS_ENTROPY\n",     //
                      "}\n",                                      //
                      "dataset {\n",                              //
                      "  format: FORMAT_LIBSVM\n",                //
                      "  zero_based: true\n",                     //
                      "  train_path: \"", dir, "/train.svm\"\n",  //
                      "  test_path: \"", dir, "/test.svm\"\n",    //
                      "}\n",                                      //
                      "device: \"cpu\"\n");
}

// The JobSpec text of an MLP 2 -> `hidden_units` -> 3 (ReLU, softmax cross-entropy) on the blobs
// in `dir`/train.csv and `dir`/test.csv, on the CPU. It sets name, model, dataset and device
// only: the caller appends the optimizer, batch size, seed, epochs and the rest.
inline std::string BlobsJobText(const std::string& dir, int hidden_units) {
  return absl::StrCat("name: \"blobs\"\n",                                   //
                      "model {\n",                                           //
                      "  input_shape: [2]\n",                                //
                      "  layers { dense { units: ", hidden_units, " } }\n",  //
                      "  layers { relu {} }\n",                              //
                      "  layers { dense { units: 3 } }\n",                   //
                      "  loss: LOSS_SOFTMAX_CROSS_ENTROPY\n",                //
                      "}\n",                                                 //
                      "dataset {\n",                                         //
                      "  format: FORMAT_CSV\n",                              //
                      "  train_path: \"", dir, "/train.csv\"\n",             //
                      "  test_path: \"", dir, "/test.csv\"\n",               //
                      "  num_classes: 3\n",                                  //
                      "}\n",                                                 //
                      "device: \"cpu\"\n");
}

// A small Fashion-MNIST MLP (784-32-10, Adam, BSP, 2 epochs) for `workers` workers, its dataset
// files under `data_dir` (which the caller creates when files are checked).
inline v1::JobSpec FashionMlpJob(const std::string& name, int workers,
                                 const std::string& data_dir) {
  constexpr char kText[] = R"pb(
    model {
      input_shape: [ 784 ]
      layers { dense { units: 32 } }
      layers { relu {} }
      layers { dense { units: 10 } }
      loss: LOSS_SOFTMAX_CROSS_ENTROPY
    }
    dataset {
      format: FORMAT_IDX
      normalization { divide_by: 255 }
      num_classes: 10
    }
    optimizer { kind: OPTIMIZER_KIND_ADAM learning_rate: 0.001 }
    batch_size: 64
    epochs: 2
    seed: 1
    consistency: "bsp"
  )pb";
  v1::JobSpec spec;
  google::protobuf::TextFormat::ParseFromString(kText, &spec);
  spec.set_name(name);
  spec.set_num_workers(workers);
  spec.mutable_dataset()->set_train_images(data_dir + "/train-images-idx3-ubyte.gz");
  spec.mutable_dataset()->set_train_labels(data_dir + "/train-labels-idx1-ubyte.gz");
  spec.mutable_dataset()->set_test_images(data_dir + "/t10k-images-idx3-ubyte.gz");
  spec.mutable_dataset()->set_test_labels(data_dir + "/t10k-labels-idx1-ubyte.gz");
  return spec;
}

}  // namespace tessera::spec::examples

#endif  // TESSERA_SPEC_TESTING_EXAMPLE_JOBS_H_
