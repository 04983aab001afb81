#include "worker/trainer/job_spec.h"

#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

TEST(JobSpecTest, ReadOptionsFillDefaults) {
  v1::DatasetSpec d;
  data::ReadOptions o = MakeReadOptions(d, 1, 4);
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world, 4);
  EXPECT_EQ(o.normalization.divide_by, 1.0f);
  EXPECT_EQ(o.normalization.stddev, 1.0f);
  EXPECT_EQ(o.delimiter, ',');
  d.mutable_normalization()->set_divide_by(255);
  d.set_delimiter(";");
  o = MakeReadOptions(d, 0, 1);
  EXPECT_EQ(o.normalization.divide_by, 255.0f);
  EXPECT_EQ(o.delimiter, ';');
}

TEST(JobSpecTest, DeviceNamesTheBackend) {
  EXPECT_EQ(*ParseDeviceChoice(""), kernels::DeviceChoice::kAuto);
  EXPECT_EQ(*ParseDeviceChoice("auto"), kernels::DeviceChoice::kAuto);
  EXPECT_EQ(*ParseDeviceChoice("CPU"), kernels::DeviceChoice::kCpu);
  EXPECT_EQ(*ParseDeviceChoice("cuda"), kernels::DeviceChoice::kCuda);
  EXPECT_EQ(*ParseDeviceChoice("gpu"), kernels::DeviceChoice::kCuda);
  EXPECT_EQ(ParseDeviceChoice("tpu").status(),
            absl::InvalidArgumentError("device: must be one of auto, cpu, cuda; got \"tpu\""));
}

}  // namespace
}  // namespace tessera::trainer
