// MemoryBudget: the bytes of state the whole shard holds, against --max_memory_bytes
// (docs/data-plane.md, "Validation and limits").
//
// Everything that holds state reserves its bytes here first and gives them back when it is
// destroyed: a job's bookkeeping (JobState), a partition's weights, slots, sparse rows and BSP
// staging (Partition::charged), a checkpoint's copies until they are written (Capture).
#ifndef TESSERA_SERVER_MEMORY_BUDGET_H_
#define TESSERA_SERVER_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tessera::server {

// Lock-free (one atomic); shared by reference (std::shared_ptr) by the store and everything that
// holds bytes of it. Thread-safe.
class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}

  // Reserves `bytes` unless the total would pass the limit; false then (nothing reserved).
  bool TryReserve(int64_t bytes) {
    int64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (bytes > limit_ - used) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  // For growth that was checked beforehand (sparse rows created when a BSP step completes).
  void ForceReserve(int64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  int64_t used() const { return used_.load(std::memory_order_relaxed); }

  // RESOURCE_EXHAUSTED: `what` needs `bytes` more bytes (the message names the limit).
  absl::Status Exhausted(absl::string_view what, int64_t bytes) const;

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Three quarters of the physical memory, or of the cgroup (v2) limit when that is lower: the
// budget when max_memory_bytes is 0. Reads /sys/fs/cgroup/memory.max.
int64_t DefaultMemoryLimit();

}  // namespace tessera::server

#endif  // TESSERA_SERVER_MEMORY_BUDGET_H_
