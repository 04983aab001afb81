#include "kernels/row_table.h"

#include <algorithm>
#include <cmath>
#include <utility>

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

RowTable::RowTable(uint32_t dim, v1::Initializer initializer, OptimizerParams params)
    : dim_(dim),
      initializer_(std::move(initializer)),
      params_(params),
      num_slots_(NumSlots(params.kind)) {}

int64_t RowTable::RowBytes() const {
  return static_cast<int64_t>(sizeof(float)) * dim_ * (1 + num_slots_) +
         static_cast<int64_t>(sizeof(Row) + sizeof(int64_t));
}

void RowTable::Gather(absl::Span<const int64_t> ids, absl::Span<float> out) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    float* dst = out.data() + i * dim_;
    auto it = rows_.find(ids[i]);
    if (it != rows_.end()) {
      std::copy_n(it->second.values.data(), dim_, dst);
    } else {
      InitializeRow(initializer_, ids[i], dst, dim_);
    }
  }
}

RowTable::Row& RowTable::RowOf(int64_t id) {
  auto [it, inserted] = rows_.try_emplace(id);
  if (inserted) {
    it->second.values.resize(static_cast<size_t>(dim_) * (1 + num_slots_));
    InitializeRow(initializer_, id, it->second.values.data(), dim_);
    for (int s = 0; s < num_slots_; ++s) {
      float* slot = it->second.values.data() + static_cast<size_t>(dim_) * (1 + s);
      std::fill(slot, slot + dim_, SlotInitialValue(params_, s));
    }
  }
  return it->second;
}

void RowTable::Apply(float lr, float grad_scale, absl::Span<const int64_t> ids,
                     absl::Span<const float> grads) {
  for (size_t i = 0; i < ids.size(); ++i) {
    Row& row = RowOf(ids[i]);
    float* slots[4] = {nullptr, nullptr, nullptr, nullptr};
    for (int s = 0; s < num_slots_; ++s) {
      slots[s] = row.values.data() + static_cast<size_t>(dim_) * (1 + s);
    }
    ++row.updates;
    ApplyUpdateCpu(params_, lr, row.updates, grad_scale, grads.data() + i * dim_, row.values.data(),
                   slots, dim_);
  }
}

void RowTable::ForEach(
    const std::function<void(int64_t id, absl::Span<const float> weights)>& f) const {
  for (const auto& [id, row] : rows_) f(id, absl::MakeConstSpan(row.values.data(), dim_));
}

}  // namespace tessera::kernels
