#include "server/pull_answer.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "common/encoding.h"
#include "common/gradient_compression.h"

namespace tessera::server {
namespace {

// Identifies the wait whose gate is being checked inline on this thread (see AnswerWhenOpen).
thread_local const void* inline_wait_token = nullptr;

// Every row of the table `item` names, ascending by id: the first chunk into `first`, the others
// appended to `slices`, each at most 1 MiB of values. Returns the bytes answered.
int64_t ReadAllRows(const PullItem& item, v1::Encoding encoding, v1::Slice* first,
                    std::vector<v1::Slice>* slices) {
  const Partition& p = *item.partition;
  const size_t rows_per_slice = std::max<size_t>(1, (size_t{1} << 18) / std::max(p.dim, 1u));
  absl::ReaderMutexLock lock(&p.mu);
  std::vector<int64_t> ids;
  ids.reserve(p.rows->rows().size());
  for (const auto& [id, row] : p.rows->rows()) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  int64_t bytes = 0;
  std::vector<v1::Slice> more;
  for (size_t begin = 0; begin == 0 || begin < ids.size(); begin += rows_per_slice) {
    v1::Slice* slice = first;
    if (begin > 0) {
      slice = &more.emplace_back();
      *slice->mutable_key() = item.key;
    }
    const size_t end = std::min(ids.size(), begin + rows_per_slice);
    p.ReadInto(std::vector<int64_t>(ids.begin() + static_cast<ptrdiff_t>(begin),
                                    ids.begin() + static_cast<ptrdiff_t>(end)),
               encoding, slice);
    bytes += static_cast<int64_t>(slice->data().size());
    if (ids.empty()) break;
  }
  for (v1::Slice& s : more) slices->push_back(std::move(s));
  return bytes;
}

// Reads `items` into slices (see PullAnswerer::AnswerWhenOpen); returns the bytes answered.
int64_t ReadItems(const std::vector<PullItem>& items, v1::Encoding encoding,
                  PushPullAnswerSink* sink, std::vector<v1::Slice>* slices) {
  int64_t bytes = 0;
  // Dense fp32 answers to a sink share the partition's weights instead of copying them.
  const bool share = sink != nullptr && BytesPerValue(encoding) == 4;
  // Weight deltas are for dense partitions; a table's rows go in fp32.
  const bool deltas = IsWeightDelta(encoding);
  const v1::Encoding rows_encoding = deltas ? v1::ENCODING_FP32 : encoding;
  for (size_t i = 0; i < items.size(); ++i) {
    const Partition& p = *items[i].partition;
    v1::Slice& slice = (*slices)[i];
    *slice.mutable_key() = items[i].key;
    const bool shared = share && !p.sparse;
    if (sink != nullptr && sink->take_buffer && !shared && !items[i].all_rows) {
      std::string buffer = sink->take_buffer();
      buffer.clear();
      slice.mutable_data()->swap(buffer);
    }
    if (deltas && !p.sparse) {
      SharedWeights weights;
      int64_t version = 0;
      {
        absl::ReaderMutexLock lock(&p.mu);
        version = p.version.load(std::memory_order_relaxed);
        weights = p.weights;
      }
      p.published->Answer(weights, version, items[i].held_weights, encoding,
                          items[i].delta_fraction, &slice);
      bytes += static_cast<int64_t>(slice.data().size());
      continue;
    }
    if (shared) {
      SharedWeights weights;
      {
        absl::ReaderMutexLock lock(&p.mu);
        slice.set_encoding(v1::ENCODING_FP32);
        slice.set_version(p.version.load(std::memory_order_relaxed));
        weights = p.weights;
      }
      bytes += static_cast<int64_t>(weights.bytes().size());
      sink->shared.emplace_back(static_cast<int>(i), std::move(weights));
      continue;
    }
    if (items[i].all_rows) {
      bytes += ReadAllRows(items[i], rows_encoding, &slice, slices);
      continue;
    }
    absl::ReaderMutexLock lock(&p.mu);
    p.ReadInto(items[i].row_ids, rows_encoding, &slice);
    bytes += static_cast<int64_t>(slice.data().size());
  }
  return bytes;
}

}  // namespace

PullAnswerer::PullAnswerer(Executor executor, std::shared_ptr<ShardCounters> counters)
    : executor_(std::move(executor)), counters_(std::move(counters)) {}

void PullAnswerer::AnswerWhenOpen(ConsistencyGate& gate, std::vector<PullItem> items,
                                  v1::Encoding encoding,
                                  std::shared_ptr<const std::atomic<bool>> cancelled, Done done,
                                  std::shared_ptr<PushPullAnswerSink> sink,
                                  std::function<void(int64_t)> waited) const {
  ConsistencyGate::Wait wait;
  wait.cancelled = std::move(cancelled);
  for (const PullItem& item : items) gate.AddToWait(item.partition, item.gate_step, &wait);
  // The wait at the gate, for the metrics (a pull with nothing gated is not timed).
  StoreHistogram* wait_histogram = nullptr;
  if (!wait.versions.empty()) wait_histogram = &counters_->bsp_wait_ns;
  if (!wait.clocks.empty()) wait_histogram = &counters_->ssp_wait_ns;
  const auto parked_at = std::chrono::steady_clock::now();
  auto token = std::make_shared<char>();
  auto answer = [items = std::move(items), encoding, done = std::move(done), sink = std::move(sink),
                 counters = counters_, wait_histogram, parked_at,
                 waited = std::move(waited)](absl::Status status) {
    if (!status.ok()) {
      done(status);
      return;
    }
    if (wait_histogram != nullptr) {
      const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - parked_at)
                             .count();
      wait_histogram->Observe(ns);
      if (waited) waited(ns);
    }
    std::vector<v1::Slice> slices(items.size());
    const int64_t bytes = ReadItems(items, encoding, sink.get(), &slices);
    counters->bytes_pulled.fetch_add(bytes, std::memory_order_relaxed);
    done(std::move(slices));
  };
  wait.done = [this, token, answer = std::move(answer)](absl::Status status) mutable {
    if (inline_wait_token == token.get() || !executor_) {
      answer(std::move(status));
    } else {
      executor_(
          [answer = std::move(answer), status = std::move(status)]() mutable { answer(status); });
    }
  };
  inline_wait_token = token.get();
  gate.Park(std::move(wait));
  inline_wait_token = nullptr;
}

}  // namespace tessera::server
