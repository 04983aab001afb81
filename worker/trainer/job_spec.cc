#include "worker/trainer/job_spec.h"

#include "common/status_macros.h"
#include "spec/device_spec.h"

namespace tessera::trainer {

data::ReadOptions MakeReadOptions(const v1::DatasetSpec& dataset, int rank, int world) {
  data::ReadOptions o;
  o.rank = rank;
  o.world = world;
  const v1::Normalization& n = dataset.normalization();
  o.normalization.divide_by = n.divide_by() == 0.0f ? 1.0f : n.divide_by();
  o.normalization.mean = n.mean();
  o.normalization.stddev = n.stddev() == 0.0f ? 1.0f : n.stddev();
  o.num_classes = dataset.num_classes();
  o.num_features = dataset.num_features();
  o.zero_based = dataset.zero_based();
  o.label_column = dataset.label_column();
  o.has_header = dataset.has_header();
  o.delimiter = dataset.delimiter().empty() ? ',' : dataset.delimiter()[0];
  return o;
}

absl::StatusOr<kernels::DeviceChoice> ParseDeviceChoice(absl::string_view device) {
  TESSERA_ASSIGN_OR_RETURN(const spec::DeviceChoice choice, spec::ParseDeviceChoice(device));
  switch (choice) {
    case spec::DeviceChoice::kCpu:
      return kernels::DeviceChoice::kCpu;
    case spec::DeviceChoice::kCuda:
      return kernels::DeviceChoice::kCuda;
    case spec::DeviceChoice::kAuto:
      break;
  }
  return kernels::DeviceChoice::kAuto;
}

}  // namespace tessera::trainer
