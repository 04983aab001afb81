#include "spec/device_spec.h"

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

}  // namespace
}  // namespace tessera::spec
