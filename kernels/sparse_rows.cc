#include "kernels/sparse_rows.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"

namespace tessera::kernels {
namespace {

constexpr double kPi = 3.14159265358979323846;

// SplitMix64: a small, portable generator so row r of a table initialises the same everywhere.
uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) with 24 random bits.
float UnitFloat(uint64_t* state) {
  return static_cast<float>(SplitMix(state) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace

void InitializeRow(const v1::Initializer& init, int64_t row, float* out, uint32_t dim) {
  uint64_t state = init.seed() ^ (static_cast<uint64_t>(row) * 0xd1b54a32d192ed03ull);
  switch (init.kind()) {
    case v1::Initializer::KIND_CONSTANT:
      std::fill(out, out + dim, init.value());
      return;
    case v1::Initializer::KIND_UNIFORM:
      for (uint32_t i = 0; i < dim; ++i) out[i] = (2.0f * UnitFloat(&state) - 1.0f) * init.scale();
      return;
    case v1::Initializer::KIND_NORMAL:
      for (uint32_t i = 0; i < dim; i += 2) {
        // Box-Muller; 1 - u keeps the logarithm finite.
        const double u1 = 1.0 - UnitFloat(&state);
        const double u2 = UnitFloat(&state);
        const double r = std::sqrt(-2.0 * std::log(u1));
        out[i] = static_cast<float>(r * std::cos(2.0 * kPi * u2)) * init.scale();
        if (i + 1 < dim) {
          out[i + 1] = static_cast<float>(r * std::sin(2.0 * kPi * u2)) * init.scale();
        }
      }
      return;
    default:
      std::fill(out, out + dim, 0.0f);
  }
}

SparseRows::SparseRows(uint32_t dim, v1::Initializer initializer, OptimizerParams params,
                       v1::RowLifecycle lifecycle)
    : dim_(dim),
      initializer_(std::move(initializer)),
      params_(params),
      lifecycle_(std::move(lifecycle)),
      num_slots_(NumSlots(params.kind)) {}

int64_t SparseRows::RowBytes(uint32_t dim, int num_slots) {
  // The weights and slots, the row's bookkeeping, its key, and about the hash map's control byte
  // and free space (flat_hash_map keeps at least 1/8 of its slots empty) plus the allocator's
  // header of the values.
  return static_cast<int64_t>(sizeof(float)) * dim * (1 + num_slots) +
         static_cast<int64_t>(sizeof(Row) + sizeof(int64_t) + 16);
}

int64_t SparseRows::PendingBytes() {
  return static_cast<int64_t>(sizeof(Pending) + sizeof(int64_t) + 8);
}

void SparseRows::Gather(absl::Span<const int64_t> ids, float* out) const {
  const bool zeros = admission();
  for (size_t i = 0; i < ids.size(); ++i) {
    float* dst = out + i * dim_;
    auto it = rows_.find(ids[i]);
    if (it != rows_.end()) {
      std::copy_n(it->second.values.data(), dim_, dst);
    } else if (zeros) {
      std::fill(dst, dst + dim_, 0.0f);
    } else {
      InitializeRow(initializer_, ids[i], dst, dim_);
    }
  }
}

const SparseRows::Row* SparseRows::Find(int64_t id) const {
  auto it = rows_.find(id);
  return it == rows_.end() ? nullptr : &it->second;
}

SparseRows::Row& SparseRows::CreateRow(int64_t id) {
  Row& row = rows_[id];
  row.values.resize(static_cast<size_t>(dim_) * (1 + num_slots_));
  InitializeRow(initializer_, id, row.values.data(), dim_);
  for (int s = 0; s < num_slots_; ++s) {
    float* slot = row.values.data() + static_cast<size_t>(dim_) * (1 + s);
    std::fill(slot, slot + dim_, SlotInitialValue(params_, s));
  }
  counts_.set_admitted(counts_.admitted() + 1);
  return row;
}

int64_t SparseRows::Apply(int64_t clock, float lr, float grad_scale, absl::Span<const int64_t> ids,
                          const float* grads) {
  const int64_t before = BytesHeld();
  const uint32_t admit_after = lifecycle_.admit_after();
  // Two passes, so that the rows' cache misses overlap instead of following one another: find
  // (or create) every row first, with room reserved so that no insertion moves the others, then
  // update them, prefetching a few rows ahead. found[i] is null for an id still pending.
  const size_t n = ids.size();
  rows_.reserve(rows_.size() + n);
  absl::InlinedVector<Row*, 64> found(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    auto it = rows_.find(ids[i]);
    if (it != rows_.end()) {
      found[i] = &it->second;
    } else if (admit_after <= 1) {
      found[i] = &CreateRow(ids[i]);
    } else {
      Pending& p = pending_[ids[i]];
      ++p.sightings;
      p.last_clock = clock;
      if (p.sightings < admit_after) {
        counts_.set_dropped_gradients(counts_.dropped_gradients() + 1);
        continue;
      }
      pending_.erase(ids[i]);
      found[i] = &CreateRow(ids[i]);
    }
  }
  constexpr size_t kAhead = 4;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && found[i + kAhead] != nullptr) {
      const float* next = found[i + kAhead]->values.data();
      for (int s = 0; s <= num_slots_; ++s) {
        __builtin_prefetch(next + static_cast<size_t>(dim_) * s, 1);
      }
    }
    if (found[i] == nullptr) continue;
    Row& row = *found[i];
    float* slots[4] = {nullptr, nullptr, nullptr, nullptr};
    for (int s = 0; s < num_slots_; ++s) {
      slots[s] = row.values.data() + static_cast<size_t>(dim_) * (1 + s);
    }
    ++row.updates;
    row.last_clock = clock;
    ApplyUpdateCpu(params_, lr, row.updates, grad_scale, grads + i * dim_, row.values.data(), slots,
                   dim_);
  }
  const int64_t every = lifecycle_.evict_after();
  if (every > 0 && clock / every > counts_.last_sweep_clock() / every) Evict(clock);
  return BytesHeld() - before;
}

int64_t SparseRows::Evict(int64_t clock) {
  const int64_t idle = lifecycle_.evict_after();
  const int64_t before = BytesHeld();
  const int64_t rows_before = size(), pending_before = pending_size();
  absl::erase_if(rows_, [&](const auto& entry) { return clock - entry.second.last_clock >= idle; });
  absl::erase_if(pending_,
                 [&](const auto& entry) { return clock - entry.second.last_clock >= idle; });
  counts_.set_evicted(counts_.evicted() + rows_before - size());
  counts_.set_pending_evicted(counts_.pending_evicted() + pending_before - pending_size());
  counts_.set_last_sweep_clock(clock);
  return before - BytesHeld();
}

absl::Status SparseRows::RestoreRow(int64_t id, int64_t updates, int64_t last_clock,
                                    absl::Span<const float> values) {
  const size_t width = static_cast<size_t>(dim_) * (1 + num_slots_);
  if (values.size() != width) {
    return absl::InvalidArgumentError(
        absl::StrCat("row ", id, ": ", values.size(), " values, expected ", width));
  }
  if (pending_.contains(id)) {
    return absl::InvalidArgumentError(absl::StrCat("row ", id, ": both a row and pending"));
  }
  auto [it, inserted] = rows_.try_emplace(id);
  if (!inserted) return absl::InvalidArgumentError(absl::StrCat("row ", id, " twice"));
  it->second.values.assign(values.begin(), values.end());
  it->second.updates = updates;
  it->second.last_clock = last_clock;
  return absl::OkStatus();
}

absl::Status SparseRows::RestorePending(int64_t id, uint32_t sightings, int64_t last_clock) {
  if (sightings == 0 || sightings >= std::max<uint32_t>(lifecycle_.admit_after(), 1)) {
    return absl::InvalidArgumentError(absl::StrCat("pending id ", id, ": ", sightings,
                                                   " sightings with admit_after ",
                                                   lifecycle_.admit_after()));
  }
  if (rows_.contains(id)) {
    return absl::InvalidArgumentError(absl::StrCat("pending id ", id, ": both a row and pending"));
  }
  auto [it, inserted] = pending_.try_emplace(id, Pending{sightings, last_clock});
  if (!inserted) return absl::InvalidArgumentError(absl::StrCat("pending id ", id, " twice"));
  return absl::OkStatus();
}

}  // namespace tessera::kernels
