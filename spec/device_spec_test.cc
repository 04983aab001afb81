#include "spec/device_spec.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace tessera::spec {
namespace {

TEST(DeviceSpecTest, DeviceChoice) {
  EXPECT_EQ(*ParseDeviceChoice("cpu"), DeviceChoice::kCpu);
  EXPECT_EQ(*ParseDeviceChoice("CUDA"), DeviceChoice::kCuda);
  EXPECT_EQ(ParseDeviceChoice("tpu").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceSpecTest, EveryNameAndTheMessage) {
  EXPECT_EQ(*ParseDeviceChoice(""), DeviceChoice::kAuto);
  EXPECT_EQ(*ParseDeviceChoice("Auto"), DeviceChoice::kAuto);
  EXPECT_EQ(*ParseDeviceChoice("GPU"), DeviceChoice::kCuda);
  EXPECT_EQ(ParseDeviceChoice("tpu").status(),
            absl::InvalidArgumentError("device: must be one of auto, cpu, cuda; got \"tpu\""));
}

TEST(DeviceSpecTest, CpuDevices) {
  for (const auto& [text, n] : {std::pair{"", 1}, {"cpu:1", 1}, {"CPU:4", 4}, {"cpu:256", 256}}) {
    absl::StatusOr<DeviceList> list = ParseDevices(text, 0);
    ASSERT_TRUE(list.ok()) << text << ": " << list.status();
    EXPECT_EQ(list->cpu, n) << text;
    EXPECT_TRUE(list->cuda.empty()) << text;
    EXPECT_EQ(list->count(), n) << text;
  }
  EXPECT_EQ(ParseDevices("cpu:3", 0)->Name(), "cpu:3");
  for (const char* bad : {"cpu:0", "cpu:-2", "cpu:257", "cpu", "cpu:two", "4", "cpu:2,cpu:3"}) {
    EXPECT_EQ(ParseDevices(bad, 2).status(),
              absl::InvalidArgumentError(absl::StrCat(
                  "devices: must be cpu:N with N in [1, 256], cuda:I,cuda:J,... or cuda; got \"",
                  bad, "\"")))
        << bad;
  }
}

TEST(DeviceSpecTest, CudaDevices) {
  absl::StatusOr<DeviceList> two = ParseDevices("cuda:1, CUDA:0", 2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->cuda, (std::vector<int>{1, 0}));
  EXPECT_EQ(two->count(), 2);
  EXPECT_EQ(two->Name(), "cuda:1,cuda:0");
  // Every visible GPU.
  EXPECT_EQ(ParseDevices("cuda", 3)->cuda, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(ParseDevices("gpu", 1)->Name(), "cuda:0");
  EXPECT_EQ(ParseDevices("gpu:0", 1)->Name(), "cuda:0");
  EXPECT_EQ(ParseDevices("cuda", 0).status(),
            absl::InvalidArgumentError(
                "devices: \"cuda\" asks for every visible GPU, but none is visible here"));
  EXPECT_EQ(ParseDevices("cuda:0,cuda:1", 1).status(),
            absl::InvalidArgumentError(
                "devices: \"cuda:0,cuda:1\" names cuda:1, but 1 GPU is visible (cuda:0)"));
  EXPECT_EQ(ParseDevices("cuda:2", 0).status(),
            absl::InvalidArgumentError("devices: \"cuda:2\" names cuda:2, but 0 GPUs are visible"));
  EXPECT_EQ(ParseDevices("cuda:0,cuda:0", 2).status(),
            absl::InvalidArgumentError("devices: \"cuda:0,cuda:0\" names cuda:0 twice"));
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:0,cpu:1", "cuda:x", "cuda:0,,cuda:1"}) {
    const absl::Status s = ParseDevices(bad, 4).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("must be cuda:I,cuda:J")) << bad;
  }
}

TEST(DeviceSpecTest, DevicesFitTheModel) {
  v1::ModelSpec dense, pipelined, sparse;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(
        input_shape: [ 4 ]
        layers { dense { units: 3 } }
        layers { relu {} }
        layers { dense { units: 2 } }
        loss: LOSS_SOFTMAX_CROSS_ENTROPY
      )pb",
      &dense));
  pipelined = dense;
  pipelined.mutable_pipeline()->add_stage_starts("relu_1");
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(
        layers { embedding_bag { num_rows: 10 dim: 2 } }
        layers { dense { units: 2 } }
        loss: LOSS_SOFTMAX_CROSS_ENTROPY
      )pb",
      &sparse));
  for (int n : {1, 2, 3, 256}) EXPECT_TRUE(CheckDevicesFitModel(n, dense).ok()) << n;
  EXPECT_TRUE(CheckDevicesFitModel(1, pipelined).ok());
  EXPECT_TRUE(CheckDevicesFitModel(2, pipelined).ok());
  EXPECT_EQ(CheckDevicesFitModel(3, pipelined),
            absl::InvalidArgumentError(
                "devices: the model's pipeline has 2 stages, one per device, but the worker "
                "drives 3 (use --devices cpu:2, or one device to train the model unsplit)"));
  // Sparse tables train on replicas too: the batch's rows go to every replica.
  for (int n : {1, 2, 4}) EXPECT_TRUE(CheckDevicesFitModel(n, sparse).ok()) << n;
  EXPECT_EQ(CheckDevicesFitModel(0, dense),
            absl::InvalidArgumentError("devices: cpu:N needs N in [1, 256], got 0"));
  EXPECT_EQ(CheckDevicesFitModel(257, dense).code(), absl::StatusCode::kInvalidArgument);
  // As registered by a worker.
  for (const char* fits : {"cpu", "cuda:0", "cpu:1", "CPU:2"}) {
    EXPECT_TRUE(CheckWorkerFitsModel(fits, pipelined).ok()) << fits;
  }
  EXPECT_EQ(CheckWorkerFitsModel("cpu:3", pipelined).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckWorkerFitsModel("cpu:2", sparse).ok());
  EXPECT_TRUE(CheckWorkerFitsModel("cpu:2", dense).ok());
  // Two GPUs run the two stages; three do not.
  EXPECT_TRUE(CheckWorkerFitsModel("cuda:0,cuda:1", pipelined).ok());
  EXPECT_EQ(CheckWorkerFitsModel("cuda:0,cuda:1,cuda:2", pipelined).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::spec
