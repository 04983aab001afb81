#include "server/partition.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/encoding.h"
#include "kernels/schedule.h"

namespace tessera::server {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// The fields every partition sets the same way.
std::shared_ptr<Partition> NewPartition(const kernels::OptimizerParams& params,
                                        const PartitionSetup& setup, int64_t charged) {
  auto p = std::make_shared<Partition>();
  p->budget = setup.budget;
  p->counters = setup.counters;
  p->charged = charged;
  p->params = params;
  p->num_slots = kernels::NumSlots(params.kind);
  p->schedule = setup.schedule;
  p->clocks = WorkerClocks(setup.workers);
  return p;
}

}  // namespace

std::string KeyName(const v1::PartitionKey& key) {
  return absl::StrCat(key.tensor(), "/", key.index());
}

std::string KeyName(const SliceView& s) { return absl::StrCat(s.tensor, "/", s.index); }

std::shared_ptr<Partition> Partition::Dense(const v1::DensePartitionDecl& decl,
                                            const kernels::OptimizerParams& params,
                                            const PartitionSetup& setup, int64_t charged) {
  std::shared_ptr<Partition> p = NewPartition(params, setup, charged);
  p->name = KeyName(decl.key());
  p->tensor = decl.key().tensor();
  p->index = decl.key().index();
  p->num_elements = decl.num_elements();
  p->average = decl.update() == v1::DENSE_UPDATE_AVERAGE;
  if (p->average) p->num_slots = 0;
  p->published = std::make_unique<PublishedWeights>(setup.budget);
  absl::MutexLock lock(&p->mu);
  p->last_applied.resize(setup.workers);
  p->staging.contributed.assign(setup.workers, 0);
  p->staging.skipped.assign(setup.workers, 0);
  p->staging.dense.resize(setup.workers);
  p->next_capture = setup.next_capture;
  p->weights = SharedWeights(std::vector<float>(static_cast<size_t>(decl.num_elements()), 0.0f));
  if (!decl.initial_values().empty()) {
    std::memcpy(p->MutableWeightsLocked(), decl.initial_values().data(),
                decl.initial_values().size());
  }
  for (int s = 0; s < p->num_slots; ++s) {
    p->slots.emplace_back(static_cast<size_t>(decl.num_elements()),
                          kernels::SlotInitialValue(p->params, s));
  }
  return p;
}

std::shared_ptr<Partition> Partition::Table(const v1::SparseTableDecl& decl,
                                            const kernels::OptimizerParams& params,
                                            const PartitionSetup& setup, int64_t charged) {
  std::shared_ptr<Partition> p = NewPartition(params, setup, charged);
  p->name = absl::StrCat(decl.name(), "/0");
  p->tensor = decl.name();
  p->sparse = true;
  p->dim = decl.dim();
  p->table_decl = decl.SerializeAsString();
  absl::MutexLock lock(&p->mu);
  p->rows.emplace(decl.dim(), decl.initializer(), params, decl.lifecycle());
  p->last_applied.resize(setup.workers);
  p->staging.contributed.assign(setup.workers, 0);
  p->staging.skipped.assign(setup.workers, 0);
  p->staging.rows.resize(setup.workers);
  p->staging.rows_bytes.assign(setup.workers, 0);
  p->next_capture = setup.next_capture;
  return p;
}

Partition::~Partition() {
  if (budget != nullptr) budget->Release(charged.load(std::memory_order_relaxed));
}

int64_t Partition::FixedBytes(uint32_t workers, size_t name_size) {
  return static_cast<int64_t>(sizeof(Partition) + name_size) +
         int64_t{workers} * static_cast<int64_t>(sizeof(AppliedSeq) + 2 + sizeof(SparseGrad) +
                                                 sizeof(int64_t) + sizeof(std::atomic<int64_t>));
}

int64_t Partition::RowBytes() const { return kernels::SparseRows::RowBytes(dim, num_slots); }

int64_t Partition::NewRowsBound(const SliceView& slice) const {
  if (!sparse) return 0;
  return static_cast<int64_t>(slice.row_ids.size()) * RowBytes();
}

void Partition::ReleaseCharge(int64_t bytes) {
  budget->Release(bytes);
  charged.fetch_sub(bytes, std::memory_order_relaxed);
}

absl::StatusOr<bool> Partition::IsAppliedLocked(uint32_t worker, uint64_t incarnation,
                                                uint64_t seq) const {
  const AppliedSeq& last = last_applied[worker];
  if (last.seen && incarnation < last.incarnation) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", name, ": worker ", worker, " incarnation ", incarnation,
                     " is older than incarnation ", last.incarnation, " already applied"));
  }
  return last.seen && incarnation == last.incarnation && seq <= last.seq;
}

float* Partition::MutableWeightsLocked() {
  if (!weights.unique()) {
    weights = SharedWeights(std::vector<float>(weights.data(), weights.data() + weights.size()));
    counters->weight_copies_on_write.fetch_add(1, std::memory_order_relaxed);
  }
  return weights.mutable_data();
}

namespace {

// w += scale * (values - w), the values read as fp32 bytes at any alignment; scale 1 copies them.
void BlendValues(float scale, const char* values, float* w, int64_t n) {
  if (scale == 1.0f) {
    std::memcpy(w, values, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, values + i * 4, 4);
    w[i] += scale * (v - w[i]);
  }
}

}  // namespace

void Partition::ApplyDenseLocked(int64_t step, float scale, const float* g, int64_t begin,
                                 int64_t count) {
  const int64_t n_values = count < 0 ? num_elements : count;
  if (average) {
    BlendValues(scale, reinterpret_cast<const char*>(g), MutableWeightsLocked() + begin, n_values);
    return;
  }
  const int64_t v = version.load(std::memory_order_relaxed);
  const float lr = kernels::ScheduledLearningRate(schedule, params.learning_rate, step);
  float* slot_ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int s = 0; s < num_slots; ++s) slot_ptrs[s] = slots[s].data() + begin;
  float* const w = MutableWeightsLocked() + begin;
  kernels::ApplyUpdateCpu(params, lr, v + 1, scale, g, w, slot_ptrs, n_values);
}

void Partition::ApplyDenseBytesLocked(int64_t step, float scale, const char* g, int64_t begin,
                                      int64_t count) {
  if (average) {
    BlendValues(scale, g, MutableWeightsLocked() + begin, count);
    return;
  }
  const int64_t v = version.load(std::memory_order_relaxed);
  const float lr = kernels::ScheduledLearningRate(schedule, params.learning_rate, step);
  float* slot_ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int s = 0; s < num_slots; ++s) slot_ptrs[s] = slots[s].data() + begin;
  float* const w = MutableWeightsLocked() + begin;
  kernels::ApplyUpdateCpuUnaligned(params, lr, v + 1, scale, g, w, slot_ptrs, count);
}

void Partition::ApplySparseLocked(int64_t step, float scale, const SparseGrad& grad) {
  const float lr = kernels::ScheduledLearningRate(schedule, params.learning_rate, step);
  const int64_t clock = version.load(std::memory_order_relaxed) + 1;
  const int64_t added = rows->Apply(clock, lr, scale, grad.ids, grad.values.data());
  if (added > 0) {
    budget->ForceReserve(added);
    charged.fetch_add(added, std::memory_order_relaxed);
  } else if (added < 0) {
    ReleaseCharge(-added);
  }
}

bool Partition::ApplySliceLocked(int64_t step, float scale, const SliceView& slice,
                                 std::vector<float>* scratch) {
  if (sparse) {
    if (slice.row_ids.empty()) return false;
    ApplySparseLocked(step, scale, MergeRows(slice, dim));
    return true;
  }
  ForEachGradientRun(
      slice, static_cast<size_t>(num_elements), scratch,
      [&](const float* g, size_t begin, size_t count) {
        mu.AssertHeld();
        ApplyDenseLocked(step, scale, g, static_cast<int64_t>(begin), static_cast<int64_t>(count));
      },
      [&](const char* g, size_t begin, size_t count) {
        mu.AssertHeld();
        ApplyDenseBytesLocked(step, scale, g, static_cast<int64_t>(begin),
                              static_cast<int64_t>(count));
      });
  return true;
}

void Partition::ReadInto(const std::vector<int64_t>& row_ids, v1::Encoding encoding,
                         v1::Slice* slice) const {
  slice->set_encoding(encoding == v1::ENCODING_UNSPECIFIED ? v1::ENCODING_FP32 : encoding);
  slice->set_version(version.load(std::memory_order_relaxed));
  if (!sparse) {
    if (BytesPerValue(encoding) == 4) {
      // One copy, without the zero fill of a resize.
      slice->mutable_data()->assign(weights.bytes().data(), weights.bytes().size());
    } else {
      EncodeValues(encoding, weights.data(), weights.size(), slice->mutable_data());
    }
    return;
  }
  std::vector<float> out(row_ids.size() * dim);
  rows->Gather(row_ids, out.data());
  for (int64_t id : row_ids) slice->add_row_ids(id);
  EncodeValues(encoding, out.data(), out.size(), slice->mutable_data());
}

PartitionLocks::PartitionLocks(absl::InlinedVector<Partition*, 8> partitions)
    : locks_(partitions.size()) {
  std::sort(partitions.begin(), partitions.end());
  for (size_t i = 0; i < partitions.size(); ++i) locks_[i].emplace(&partitions[i]->mu);
}

}  // namespace tessera::server
