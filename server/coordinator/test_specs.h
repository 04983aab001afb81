// Job specs for the coordinator's tests.
#ifndef TESSERA_SERVER_COORDINATOR_TEST_SPECS_H_
#define TESSERA_SERVER_COORDINATOR_TEST_SPECS_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"
#include "tessera/v1/job_spec.pb.h"

namespace tessera::coordinator::testing {

// The Fashion-MNIST MLP of examples/fashion_mlp.textproto for `workers` workers, with its
// dataset files under `data_dir` (which the caller creates when files are checked).
inline v1::JobSpec MlpSpec(const std::string& name, int workers, const std::string& data_dir) {
  const std::string text = absl::StrCat(R"pb(
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
  )pb");
  v1::JobSpec spec;
  google::protobuf::TextFormat::ParseFromString(text, &spec);
  spec.set_name(name);
  spec.set_num_workers(workers);
  spec.mutable_dataset()->set_train_images(data_dir + "/train-images-idx3-ubyte.gz");
  spec.mutable_dataset()->set_train_labels(data_dir + "/train-labels-idx1-ubyte.gz");
  spec.mutable_dataset()->set_test_images(data_dir + "/t10k-images-idx3-ubyte.gz");
  spec.mutable_dataset()->set_test_labels(data_dir + "/t10k-labels-idx1-ubyte.gz");
  return spec;
}

}  // namespace tessera::coordinator::testing

#endif  // TESSERA_SERVER_COORDINATOR_TEST_SPECS_H_
