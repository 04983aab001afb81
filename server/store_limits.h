// The bounds the store puts on what requests and checkpoint files may declare.
#ifndef TESSERA_SERVER_STORE_LIMITS_H_
#define TESSERA_SERVER_STORE_LIMITS_H_

#include <cstdint>

namespace tessera::server {

inline constexpr int64_t kMaxPartitionElements = int64_t{1} << 28;  // 1 GiB of fp32
inline constexpr uint32_t kMaxSparseDim = 1u << 20;
inline constexpr uint32_t kMaxWorkers = 1u << 16;
// Steps and effective steps beyond this are refused, so that step + 1 and the gates' arithmetic
// never overflow.
inline constexpr int64_t kMaxStep = int64_t{1} << 62;

}  // namespace tessera::server

#endif  // TESSERA_SERVER_STORE_LIMITS_H_
