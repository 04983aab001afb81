// BufferPool: strings whose capacity is kept for reuse, so that 4 MiB message buffers are not
// allocated (and their pages faulted in) for every message (docs/benchmarks.md, "reusing
// buffers"). The PushPull codec sends pooled strings as grpc::Slices that give them back once gRPC
// releases them.
#ifndef TESSERA_COMMON_BUFFER_POOL_H_
#define TESSERA_COMMON_BUFFER_POOL_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/slice.h"

namespace tessera {

// Thread-safe. Held through a shared_ptr, because the slices that return strings to it may
// outlive whoever made them (a stream, a call).
class BufferPool {
 public:
  // Keeps at most `max_buffers` strings and `max_bytes` of capacity; beyond that, returned strings
  // are freed.
  BufferPool(size_t max_buffers, size_t max_bytes)
      : max_buffers_(max_buffers), max_bytes_(max_bytes) {}

  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // An empty string, with the capacity of an earlier one when the pool holds one.
  std::string Take();

  // Gives `s` back for reuse (strings under 64 KiB of capacity are not kept).
  void Give(std::string s);

  // Capacity held for reuse now.
  size_t held_bytes() const;

  // A grpc::Slice over the bytes of `data` that gives `data` back to `pool` once gRPC releases the
  // slice (on any thread, possibly after its stream is gone).
  static grpc::Slice MakeSlice(std::shared_ptr<BufferPool> pool, std::string data);

 private:
  // Strings smaller than this are not worth keeping.
  static constexpr size_t kMinPooledBytes = 64 << 10;

  const size_t max_buffers_;
  const size_t max_bytes_;
  mutable absl::Mutex mu_;
  std::vector<std::string> free_ ABSL_GUARDED_BY(mu_);
  size_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_BUFFER_POOL_H_
