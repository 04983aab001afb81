// Epoch order and background batch assembly (DESIGN.md §5, "Data").
#ifndef TESSERA_WORKER_DATA_BATCH_PREFETCHER_H_
#define TESSERA_WORKER_DATA_BATCH_PREFETCHER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/data/batch.h"
#include "worker/data/dataset.h"

namespace tessera::data {

// The order of n examples in `epoch`: a permutation of [0, n) that depends only on (n, seed,
// epoch), identical on every platform (own SplitMix64 generator and Fisher-Yates shuffle).
std::vector<int64_t> EpochOrder(int64_t n, uint64_t seed, int64_t epoch);

// Assembles the batches of one epoch of a Dataset on a background thread, up to `queue_depth`
// ahead of the consumer.
//
// Life cycle: Create() starts the thread (kRunning); it stops by itself once the epoch's batches
// are queued, and the destructor stops it early and joins it. Next() and Recycle() are for one
// consumer thread.
class BatchPrefetcher {
 public:
  struct Options {
    int64_t batch_size = 64;
    // Shuffle with EpochOrder(size, seed, epoch); otherwise the examples come in file order.
    bool shuffle = true;
    uint64_t seed = 0;
    int64_t epoch = 0;
    // Drop the last batch when it holds fewer than batch_size examples.
    bool drop_last = false;
    // Start at this batch of the epoch: the earlier ones are skipped without being assembled (a
    // resumed run takes the same batches from here on as one that drew the earlier ones).
    int64_t first_batch = 0;
    int queue_depth = 4;
  };

  // INVALID_ARGUMENT naming the field for batch_size < 1, queue_depth < 1, epoch < 0 or
  // first_batch < 0 (a first_batch at or past the epoch's end gives no batch).
  static absl::StatusOr<std::unique_ptr<BatchPrefetcher>> Create(
      std::shared_ptr<const Dataset> dataset, const Options& options);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // Blocks until the next batch is ready. Returns nullopt after the epoch's last batch.
  std::optional<Batch> Next();
  // Hands a used batch back so that its buffers are reused for a later batch.
  void Recycle(Batch batch);

  // Batches in this epoch, the skipped ones (first_batch) included.
  int64_t num_batches() const { return num_batches_; }

 private:
  BatchPrefetcher(std::shared_ptr<const Dataset> dataset, const Options& options);
  void Run();

  const std::shared_ptr<const Dataset> dataset_;
  const Options options_;
  std::vector<int64_t> order_;
  int64_t num_batches_ = 0;

  absl::Mutex mu_;
  std::deque<Batch> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<Batch> free_ ABSL_GUARDED_BY(mu_);
  bool producer_done_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tessera::data

#endif  // TESSERA_WORKER_DATA_BATCH_PREFETCHER_H_
