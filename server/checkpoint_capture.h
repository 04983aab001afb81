// The bookkeeping of one job's checkpoints on this shard (docs/checkpoints.md): the copies taken
// at a step boundary, the Checkpoint calls waiting for them, and what was written. Data only:
// CheckpointWriter (server/checkpoint_writer.h) runs it; each job holds one JobCheckpoints.
#ifndef TESSERA_SERVER_CHECKPOINT_CAPTURE_H_
#define TESSERA_SERVER_CHECKPOINT_CAPTURE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/memory_budget.h"
#include "server/shared_weights.h"
#include "tessera/v1/checkpoint.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

struct Partition;

// A partition's next capture step when none is due.
inline constexpr int64_t kNoCapture = std::numeric_limits<int64_t>::max();

using CheckpointDone = std::function<void(absl::StatusOr<v1::CheckpointResponse>)>;

// One partition's state copied at its step boundary. The dense weights are a reference, not a
// copy (the partition copies them before its next update while this holds them; the capture is
// charged for them all the same, as the copy may then exist).
struct PartitionSnapshot {
  v1::PartitionCheckpoint meta;  // everything but the ranges, filled when the file is laid out
  SharedWeights weights;
  std::vector<std::vector<float>> slots;
  std::vector<int64_t> row_ids;
  std::vector<int64_t> row_updates;
  std::vector<int64_t> row_last_clocks;
  std::vector<float> row_values;
  std::vector<int64_t> pending_ids;
  std::vector<uint32_t> pending_sightings;
  std::vector<int64_t> pending_last_clocks;

  // What a copy holds per row of a sparse table with `width` values a row (weights and slots),
  // and per pending id: the checkpoint's memory charge (CheckpointWriter::ReserveCopy).
  static int64_t BytesPerRow(size_t width) {
    return static_cast<int64_t>(sizeof(row_ids[0]) + sizeof(row_updates[0]) +
                                sizeof(row_last_clocks[0]) + width * sizeof(row_values[0]));
  }
  static int64_t BytesPerPendingId() {
    return static_cast<int64_t>(sizeof(pending_ids[0]) + sizeof(pending_sightings[0]) +
                                sizeof(pending_last_clocks[0]));
  }
};

// A Checkpoint call waiting for its capture; `cancelled` (optional) is set once nobody wants the
// answer (the RPC was cancelled), and such a waiter is answered CANCELLED and dropped.
struct CheckpointWaiter {
  CheckpointDone done;
  std::shared_ptr<const std::atomic<bool>> cancelled;

  bool is_cancelled() const {
    return cancelled != nullptr && cancelled->load(std::memory_order_acquire);
  }
  void operator()(absl::StatusOr<v1::CheckpointResponse> result) const { done(std::move(result)); }
};

// The checkpoint of one step of a job: copied partition by partition (kCapturing), then written
// by the writer thread (kWriting), then answered (kDone). Guarded by its job's JobCheckpoints::mu,
// except `snapshots` while kWriting, which only the writer thread touches.
struct Capture {
  enum class State { kCapturing, kWriting, kDone };

  Capture(int64_t s, std::shared_ptr<MemoryBudget> b) : step(s), budget(std::move(b)) {}
  ~Capture() { ReleaseMemory(); }
  // Drops the copies and gives their bytes back.
  void ReleaseMemory() {
    budget->Release(charged);
    charged = 0;
    snapshots.clear();
    snapshots.shrink_to_fit();
  }

  const int64_t step;
  const std::shared_ptr<MemoryBudget> budget;
  State state = State::kCapturing;
  absl::Status status;  // the first error; a failed capture is answered with it
  int64_t retain_from_step = 0;
  // Created by a Checkpoint call for a step that is not automatic: it exists only for its waiters
  // and is dropped when the last one is cancelled. Only these count against the pending bound.
  bool registered = false;
  int64_t charged = 0;  // bytes of the copies, reserved in `budget`
  absl::flat_hash_set<const Partition*> captured;
  std::vector<PartitionSnapshot> snapshots;
  v1::CheckpointResponse response;
  std::vector<CheckpointWaiter> waiters;
};

// A job's checkpoints on this shard. Lock order: Partition::mu > mu > the writer's queue lock;
// nothing takes a partition's lock while holding mu.
struct JobCheckpoints {
  absl::Mutex mu;
  // Captures by step: pending, being written, and the few newest written ones.
  std::map<int64_t, std::shared_ptr<Capture>> captures ABSL_GUARDED_BY(mu);
  // Set when the job is dropped or replaced: later captures are refused.
  bool retired ABSL_GUARDED_BY(mu) = false;
  // Set by DropJob: captures of the job still queued for the writer are not written.
  bool dropped ABSL_GUARDED_BY(mu) = false;
  // The largest step a Checkpoint call named (0: none). Automatic files above it were never asked
  // for, so none of them can be committed; the writer keeps only the newest few of them.
  int64_t max_requested_step ABSL_GUARDED_BY(mu) = 0;
  // Automatic steps this job wrote that no Checkpoint call named (all > max_requested_step).
  std::set<int64_t> unrequested_files ABSL_GUARDED_BY(mu);
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_CHECKPOINT_CAPTURE_H_
