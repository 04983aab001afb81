#include "server/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace tessera::server {

absl::Status MemoryBudget::Exhausted(absl::string_view what, int64_t bytes) const {
  return absl::ResourceExhaustedError(
      absl::StrCat(what, " needs ", bytes, " more bytes of state, but the shard already holds ",
                   used_.load(std::memory_order_relaxed), " of its max_memory_bytes ", limit_));
}

int64_t DefaultMemoryLimit() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  int64_t memory =
      pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : int64_t{16} << 30;
  if (std::FILE* f = std::fopen("/sys/fs/cgroup/memory.max", "r")) {
    long long cgroup = 0;
    if (std::fscanf(f, "%lld", &cgroup) == 1 && cgroup > 0) {
      memory = std::min<int64_t>(memory, cgroup);
    }
    std::fclose(f);
  }
  return memory / 4 * 3;
}

}  // namespace tessera::server
