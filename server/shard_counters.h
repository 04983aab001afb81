// ShardCounters: the shard-wide counters of the store (ParameterStore::GetShardStats), shared by
// the store, its jobs, their partitions and parked pulls, which may outlive a call.
#ifndef TESSERA_SERVER_SHARD_COUNTERS_H_
#define TESSERA_SERVER_SHARD_COUNTERS_H_

#include <atomic>
#include <cstdint>

#include "server/store_histogram.h"

namespace tessera::server {

// Relaxed atomics only: the push/pull path updates them without a lock. Thread-safe.
struct ShardCounters {
  ShardCounters();

  std::atomic<int64_t> bytes_pushed{0};
  std::atomic<int64_t> bytes_pulled{0};
  std::atomic<int64_t> updates_applied{0};
  std::atomic<int64_t> duplicates{0};
  std::atomic<int64_t> skipped_non_finite{0};
  std::atomic<int64_t> weight_copies_on_write{0};
  StoreHistogram bsp_wait_ns;    // 10 us .. 60 s
  StoreHistogram ssp_wait_ns;    // 10 us .. 60 s
  StoreHistogram ssp_staleness;  // 0 .. 100 steps
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_SHARD_COUNTERS_H_
