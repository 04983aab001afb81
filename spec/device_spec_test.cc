#include "spec/device_spec.h"

#include <string>

#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace tessera::spec
