// The rules for a sparse table's row lifecycle (v1::RowLifecycle,
// proto/tessera/v1/optimizer.proto), checked wherever a table enters: a model's tables at
// submission (InferModelShapes) and the shard's CreateJobState. kernels::SparseRows
// (kernels/sparse_rows.h) carries out one that passed.
#ifndef TESSERA_SPEC_ROW_LIFECYCLE_SPEC_H_
#define TESSERA_SPEC_ROW_LIFECYCLE_SPEC_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/optimizer.pb.h"

namespace tessera::spec {

// The most sightings admission may ask for, and the longest idle time eviction may allow.
inline constexpr uint32_t kMaxAdmitAfter = uint32_t{1} << 20;
inline constexpr int64_t kMaxEvictAfter = int64_t{1} << 40;

// INVALID_ARGUMENT naming `field` ("tables[0].lifecycle") for admit_after above kMaxAdmitAfter or
// evict_after outside [0, kMaxEvictAfter]: "tables[0].lifecycle.evict_after: must be in [0,
// 1099511627776], got -1". Pure; thread-safe.
absl::Status ValidateRowLifecycle(const v1::RowLifecycle& lifecycle, absl::string_view field);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_ROW_LIFECYCLE_SPEC_H_
