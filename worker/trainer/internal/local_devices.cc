#include "worker/trainer/internal/local_devices.h"

#include <algorithm>

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
  if (!batch.fields.empty()) {
    fields->clear();
    for (const engine::SparseFieldView& f : batch.fields) {
      fields->push_back({f.offsets.subspan(begin, n + 1), f.ids, f.values});
    }
    part.fields = *fields;
  }
  return part;
}

absl::StatusOr<std::unique_ptr<kernels::Backend>> CpuBackend(const LocalDevices::Options& options) {
  kernels::BackendOptions b;
  b.device = kernels::DeviceChoice::kCpu;
  b.num_threads = options.threads;
  b.memory_limit_bytes = options.memory_limit_bytes;
  return kernels::CreateBackend(b);
}

}  // namespace tessera::trainer::internal
