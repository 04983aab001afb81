// SharedWeights: a dense partition's fp32 weights, shared by reference count between the partition
// and the answers and checkpoints that still read them (copy-on-write, docs/data-plane.md).
#ifndef TESSERA_SERVER_SHARED_WEIGHTS_H_
#define TESSERA_SERVER_SHARED_WEIGHTS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace tessera::server {

// A dense partition's fp32 weights, shared by reference count between the store and the answers
// that still send them (copy-on-write). A holder only reads the values; the partition writes them
// in place only while it holds the one reference, and otherwise writes a fresh copy
// (Partition::MutableWeightsLocked, server/partition.h), so a reference taken for an answer or a
// checkpoint sees the values of the moment it was taken, however long it is held. Copying,
// moving and destroying handles to one buffer is thread-safe (an atomic count, like
// std::shared_ptr); one handle is not to be used from two threads at once.
class SharedWeights {
 public:
  SharedWeights() = default;  // holds nothing
  explicit SharedWeights(std::vector<float> values) : rep_(new Rep{{1}, std::move(values)}) {}
  SharedWeights(const SharedWeights& other) noexcept : rep_(other.rep_) {
    // Relaxed: a new reference is made from one already held, which keeps the count above 0.
    if (rep_ != nullptr) rep_->refs.fetch_add(1, std::memory_order_relaxed);
  }
  SharedWeights(SharedWeights&& other) noexcept : rep_(other.rep_) { other.rep_ = nullptr; }
  SharedWeights& operator=(SharedWeights other) noexcept {
    std::swap(rep_, other.rep_);
    return *this;
  }
  ~SharedWeights() { reset(); }

  // Drops this reference (the buffer is freed with the last one).
  void reset() noexcept {
    // Release: this holder's reads of the values happen before the decrement, which a later
    // unique() (acquire) reads, so a writer that sees itself alone writes after them. Acquire: the
    // last holder frees the buffer after every other holder's reads.
    if (rep_ != nullptr && rep_->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete rep_;
    rep_ = nullptr;
  }

  explicit operator bool() const { return rep_ != nullptr; }
  const float* data() const { return rep_ != nullptr ? rep_->values.data() : nullptr; }
  size_t size() const { return rep_ != nullptr ? rep_->values.size() : 0; }
  // The values as little-endian fp32 bytes (the wire's ENCODING_FP32).
  absl::string_view bytes() const {
    return absl::string_view(reinterpret_cast<const char*>(data()), size() * sizeof(float));
  }

  // True when this handle holds the only reference to its buffer. The count is loaded with
  // acquire, which synchronises with every earlier holder's release decrement (all changes of
  // the count are read-modify-writes, so they form one release sequence): once this returns true,
  // every read of the values by a holder that has let go happens before what the caller writes
  // next. Only the caller can make another reference then, so the answer stays true until it
  // does.
  bool unique() const { return rep_ != nullptr && rep_->refs.load(std::memory_order_acquire) == 1; }
  // The values to write. REQUIRES: unique().
  float* mutable_data() { return rep_->values.data(); }

 private:
  struct Rep {
    std::atomic<int64_t> refs;
    std::vector<float> values;
  };
  Rep* rep_ = nullptr;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_SHARED_WEIGHTS_H_
