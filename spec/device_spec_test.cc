#include "spec/device_spec.h"

#include <string>

#include "absl/strings/str_cat.h"
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

TEST(DeviceSpecTest, CpuReplicas) {
  EXPECT_EQ(*ParseCpuReplicas(""), 1);
  EXPECT_EQ(*ParseCpuReplicas("cpu:1"), 1);
  EXPECT_EQ(*ParseCpuReplicas("CPU:4"), 4);
  EXPECT_EQ(*ParseCpuReplicas("cpu:256"), 256);
  for (const char* bad : {"cpu:0", "cpu:-2", "cpu:257", "cpu", "cpu:two", "4", "cpu:2,cpu:3"}) {
    EXPECT_EQ(ParseCpuReplicas(bad).status(),
              absl::InvalidArgumentError(
                  absl::StrCat("devices: must be cpu:N with N in [1, 256]; got \"", bad, "\"")))
        << bad;
  }
  const absl::Status gpus = ParseCpuReplicas("cuda:0,cuda:1").status();
  EXPECT_EQ(gpus.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(gpus.message().find("several GPUs in one worker are not supported yet"),
            std::string::npos)
      << gpus;
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
}

}  // namespace
}  // namespace tessera::spec
