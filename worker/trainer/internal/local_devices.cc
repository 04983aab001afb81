#include "worker/trainer/internal/local_devices.h"

#include "common/status_macros.h"
#include "worker/trainer/internal/local_replicas.h"
#include "worker/trainer/internal/pipeline_stages.h"

namespace tessera::trainer::internal {

absl::StatusOr<std::unique_ptr<LocalDevices>> LocalDevices::Create(const v1::ModelSpec& spec,
                                                                   uint64_t seed,
                                                                   const Options& options) {
  if (spec.has_pipeline()) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<PipelineStages> p,
                             PipelineStages::Create(spec, seed, options));
    return std::unique_ptr<LocalDevices>(std::move(p));
  }
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<LocalReplicas> r,
                           LocalReplicas::Create(spec, seed, options));
  return std::unique_ptr<LocalDevices>(std::move(r));
}

absl::StatusOr<std::unique_ptr<kernels::Backend>> CpuBackend(const LocalDevices::Options& options) {
  kernels::BackendOptions b;
  b.device = kernels::DeviceChoice::kCpu;
  b.num_threads = options.threads;
  b.memory_limit_bytes = options.memory_limit_bytes;
  return kernels::CreateBackend(b);
}

}  // namespace tessera::trainer::internal
