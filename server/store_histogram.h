// StoreHistogram: lock-free histograms of the shard's push/pull path (gate waits, SSP staleness).
#ifndef TESSERA_SERVER_STORE_HISTOGRAM_H_
#define TESSERA_SERVER_STORE_HISTOGRAM_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace tessera::server {

// A histogram of integer observations (nanoseconds, steps) over fixed upper bounds, whose
// Observe is relaxed atomic adds only, so the push/pull path takes no lock for it. Thread-safe.
class StoreHistogram {
 public:
  struct Snapshot {
    std::vector<int64_t> bounds;  // inclusive upper bounds, ascending
    // counts[i]: observations <= bounds[i] and > bounds[i - 1]; counts.back(): above them all.
    std::vector<uint64_t> counts;
    uint64_t count = 0;
    int64_t sum = 0;
  };

  // REQUIRES: `bounds` ascending.
  explicit StoreHistogram(std::vector<int64_t> bounds);
  void Observe(int64_t value);
  // The counts may be a few observations apart from `count` while others observe.
  Snapshot snapshot() const;

 private:
  const std::vector<int64_t> bounds_;
  const std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<uint64_t> count_{0};
  std::atomic<int64_t> sum_{0};
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_STORE_HISTOGRAM_H_
