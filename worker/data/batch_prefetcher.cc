#include "worker/data/batch_prefetcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::data {
namespace {

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, bound) without modulo bias (Lemire's multiply-and-reject).
uint64_t Below(uint64_t* state, uint64_t bound) {
  while (true) {
    const unsigned __int128 m = static_cast<unsigned __int128>(SplitMix64(state)) * bound;
    const uint64_t low = static_cast<uint64_t>(m);
    if (low >= bound || low >= (0 - bound) % bound) return static_cast<uint64_t>(m >> 64);
  }
}

}  // namespace

std::vector<int64_t> EpochOrder(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t mix = seed;
  uint64_t state = SplitMix64(&mix) ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ull);
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(Below(&state, static_cast<uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

absl::StatusOr<std::unique_ptr<BatchPrefetcher>> BatchPrefetcher::Create(
    std::shared_ptr<const Dataset> dataset, const Options& options) {
  if (options.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size: must be >= 1, got ", options.batch_size));
  }
  if (options.queue_depth < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_depth: must be >= 1, got ", options.queue_depth));
  }
  if (options.first_batch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_batch: must be >= 0, got ", options.first_batch));
  }
  if (options.epoch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("epoch: must be >= 0, got ", options.epoch));
  }
  return std::unique_ptr<BatchPrefetcher>(new BatchPrefetcher(std::move(dataset), options));
}

BatchPrefetcher::BatchPrefetcher(std::shared_ptr<const Dataset> dataset, const Options& options)
    : dataset_(std::move(dataset)), options_(options) {
  const int64_t n = dataset_->size();
  if (options_.shuffle) {
    order_ = EpochOrder(n, options_.seed, options_.epoch);
  } else {
    order_.resize(n);
    for (int64_t i = 0; i < n; ++i) order_[i] = i;
  }
  num_batches_ = options_.drop_last ? n / options_.batch_size
                                    : (n + options_.batch_size - 1) / options_.batch_size;
  thread_ = std::thread([this] { Run(); });
}

BatchPrefetcher::~BatchPrefetcher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void BatchPrefetcher::Run() {
  const int64_t n = static_cast<int64_t>(order_.size());
  for (int64_t b = options_.first_batch; b < num_batches_; ++b) {
    Batch batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BatchPrefetcher* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stop_ || static_cast<int>(p->ready_.size()) < p->options_.queue_depth;
          },
          this));
      if (stop_) break;
      if (!free_.empty()) {
        batch = std::move(free_.back());
        free_.pop_back();
      }
    }
    // Assembly runs without the lock: only this thread touches `batch` until it is queued.
    const int64_t lo = b * options_.batch_size;
    const int64_t hi = std::min(n, lo + options_.batch_size);
    dataset_->Gather(absl::MakeConstSpan(order_.data() + lo, hi - lo), &batch);
    absl::MutexLock lock(&mu_);
    ready_.push_back(std::move(batch));
  }
  absl::MutexLock lock(&mu_);
  producer_done_ = true;
}

std::optional<Batch> BatchPrefetcher::Next() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](BatchPrefetcher* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
        return !p->ready_.empty() || p->producer_done_;
      },
      this));
  if (ready_.empty()) return std::nullopt;
  Batch batch = std::move(ready_.front());
  ready_.pop_front();
  return batch;
}

void BatchPrefetcher::Recycle(Batch batch) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(free_.size()) < options_.queue_depth) free_.push_back(std::move(batch));
}

}  // namespace tessera::data
