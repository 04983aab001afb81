#include "common/buffer_pool.h"

#include <utility>

namespace tessera {
namespace {

// What a pooled slice holds until gRPC releases it.
struct PooledSliceHolder {
  std::shared_ptr<BufferPool> pool;
  std::string data;

  static void Release(void* p) {
    auto* holder = static_cast<PooledSliceHolder*>(p);
    holder->pool->Give(std::move(holder->data));
    delete holder;
  }
};

}  // namespace

std::string BufferPool::Take() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) return std::string();
  std::string s = std::move(free_.back());
  free_.pop_back();
  held_bytes_ -= s.capacity();
  s.clear();
  return s;
}

void BufferPool::Give(std::string s) {
  if (s.capacity() < kMinPooledBytes) return;
  absl::MutexLock lock(&mu_);
  if (free_.size() >= max_buffers_ || held_bytes_ + s.capacity() > max_bytes_) return;
  held_bytes_ += s.capacity();
  free_.push_back(std::move(s));
}

size_t BufferPool::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

grpc::Slice BufferPool::MakeSlice(std::shared_ptr<BufferPool> pool, std::string data) {
  auto* holder = new PooledSliceHolder{std::move(pool), std::move(data)};
  return grpc::Slice(holder->data.data(), holder->data.size(), &PooledSliceHolder::Release, holder);
}

}  // namespace tessera
