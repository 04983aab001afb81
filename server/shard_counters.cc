#include "server/shard_counters.h"

#include <vector>

namespace tessera::server {
namespace {

// 10 us .. 60 s, for gate waits in nanoseconds.
std::vector<int64_t> WaitBoundsNs() {
  std::vector<int64_t> bounds;
  for (int64_t us :
       {10,    50,     100,    250,    500,     1000,    2500,    5000,     10000,    25000,
        50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 30000000, 60000000}) {
    bounds.push_back(us * 1000);
  }
  return bounds;
}

}  // namespace

ShardCounters::ShardCounters()
    : bsp_wait_ns(WaitBoundsNs()),
      ssp_wait_ns(WaitBoundsNs()),
      ssp_staleness({0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100}) {}

}  // namespace tessera::server
