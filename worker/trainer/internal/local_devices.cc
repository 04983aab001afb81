#include "worker/trainer/internal/local_devices.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "spec/device_spec.h"
#include "worker/trainer/internal/local_replicas.h"
#include "worker/trainer/internal/pipeline_stages.h"
#include "worker/trainer/job_spec.h"

namespace tessera::trainer::internal {

absl::StatusOr<std::unique_ptr<LocalDevices>> LocalDevices::Create(const v1::ModelSpec& spec,
                                                                   uint64_t seed,
                                                                   const Options& options) {
  if (!options.cuda_devices.empty() &&
      options.cuda_devices.size() != static_cast<size_t>(options.devices)) {
    return absl::InternalError(absl::StrCat("LocalDevices: ", options.devices, " devices but ",
                                            options.cuda_devices.size(), " GPUs named"));
  }
  if (spec.has_pipeline()) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<PipelineStages> p,
                             PipelineStages::Create(spec, seed, options));
    return std::unique_ptr<LocalDevices>(std::move(p));
  }
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<LocalReplicas> r,
                           LocalReplicas::Create(spec, seed, options));
  return std::unique_ptr<LocalDevices>(std::move(r));
}

absl::StatusOr<DevicePlan> PlanDevices(absl::string_view device, int cpu_devices,
                                       const std::vector<int>& cuda_devices, int threads,
                                       int64_t memory_limit_bytes, const v1::ModelSpec& model) {
  DevicePlan plan;
  kernels::BackendOptions& trainer = plan.trainer;
  TESSERA_ASSIGN_OR_RETURN(trainer.device, ParseDeviceChoice(device.empty() ? "auto" : device));
  const std::vector<int>& gpus = cuda_devices;
  if (!gpus.empty() && cpu_devices > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: cpu:", cpu_devices, " and GPUs at once; name one or the other"));
  }
  plan.devices = gpus.empty() ? cpu_devices : static_cast<int>(gpus.size());
  TESSERA_RETURN_IF_ERROR(spec::CheckDevicesFitModel(plan.devices, model));
  if (!gpus.empty()) {
    if (trainer.device == kernels::DeviceChoice::kCpu) {
      return absl::InvalidArgumentError(
          absl::StrCat("devices: GPUs were named, but device is \"", device, "\" (the CPU)"));
    }
    trainer.device = kernels::DeviceChoice::kCuda;
    trainer.cuda_device = gpus[0];
  } else if (cpu_devices > 1) {
    if (trainer.device == kernels::DeviceChoice::kCuda) {
      return absl::InvalidArgumentError(absl::StrCat(
          "devices: cpu:", cpu_devices, " trains on the CPU, but device is \"", device, "\""));
    }
    trainer.device = kernels::DeviceChoice::kCpu;
  }
  trainer.num_threads = threads;
  trainer.memory_limit_bytes = memory_limit_bytes;
  if (plan.devices > 1) {
    plan.local.devices = plan.devices;
    if (gpus.size() > 1) plan.local.cuda_devices = gpus;
    // One thread per device unless --threads says otherwise: the devices are the parallelism.
    plan.local.threads = threads > 0 ? threads : 1;
    plan.local.memory_limit_bytes = memory_limit_bytes;
  }
  return plan;
}

std::vector<int64_t> SplitExamples(int64_t size, int parts) {
  std::vector<int64_t> begin(static_cast<size_t>(parts) + 1);
  for (int i = 0; i <= parts; ++i) begin[i] = size / parts * i + std::min<int64_t>(i, size % parts);
  return begin;
}

engine::BatchView SliceBatch(const engine::BatchView& batch, int64_t begin, int64_t end,
                             std::vector<engine::SparseFieldView>* fields) {
  const int64_t n = end - begin;
  const auto slice = [&](auto span) {
    const int64_t per = static_cast<int64_t>(span.size()) / batch.size;
    return span.empty() ? span : span.subspan(begin * per, n * per);
  };
  engine::BatchView part;
  part.size = n;
  part.features = slice(batch.features);
  part.labels = slice(batch.labels);
  part.targets = slice(batch.targets);
  // Bags: offsets [begin, end] of the batch's, over its ids and values as they are.
  if (!batch.sparse_offsets.empty()) {
    part.sparse_offsets = batch.sparse_offsets.subspan(begin, n + 1);
    part.sparse_ids = batch.sparse_ids;
    part.sparse_values = batch.sparse_values;
  }
  if (!batch.fields.empty() && fields != nullptr) {  // without storage the engine refuses it
    fields->clear();
    for (const engine::SparseFieldView& f : batch.fields) {
      fields->push_back({f.offsets.subspan(begin, n + 1), f.ids, f.values});
    }
    part.fields = *fields;
  }
  return part;
}

absl::StatusOr<std::unique_ptr<kernels::Backend>> DeviceBackend(
    const LocalDevices::Options& options, int i) {
  kernels::BackendOptions b;
  if (!options.cuda_devices.empty()) {
    if (i < 0 || static_cast<size_t>(i) >= options.cuda_devices.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("devices: device ", i, " of ", options.cuda_devices.size(), " GPUs"));
    }
    b.device = kernels::DeviceChoice::kCuda;
    b.cuda_device = options.cuda_devices[static_cast<size_t>(i)];
    return kernels::CreateBackend(b);
  }
  b.device = kernels::DeviceChoice::kCpu;
  b.num_threads = options.threads;
  b.memory_limit_bytes = options.memory_limit_bytes;
  return kernels::CreateBackend(b);
}

std::string DescribeDevices(const LocalDevices::Options& options, absl::string_view noun) {
  if (options.cuda_devices.empty()) return absl::StrCat(options.devices, " CPU ", noun);
  return absl::StrCat(
      options.cuda_devices.size(), " GPU ", noun, " (",
      absl::StrJoin(options.cuda_devices, ",",
                    [](std::string* out, int d) { absl::StrAppend(out, "cuda:", d); }),
      ")");
}

}  // namespace tessera::trainer::internal
