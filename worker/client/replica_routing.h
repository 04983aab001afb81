// Which shards hold the copies of a partition or sparse row, and which of them answers
// (DESIGN.md §7, docs/data-plane.md "Replication").
//
// A job with `replicas` copies keeps each partition and row on its placement's shard (its home,
// common/placement.h) and on the next replicas - 1 shard indices, wrapping around. The worker
// writes every push to every live copy with the same seq, so each copy applies it exactly once;
// the first live copy in that order (the acting primary) also answers the pulls. When the
// coordinator says a shard is down, the next copy acts for it: nothing is rewound, because it
// holds every push the worker was told was applied.
//
// Thread-safety: all methods may be called from any thread concurrently.
#ifndef TESSERA_WORKER_CLIENT_REPLICA_ROUTING_H_
#define TESSERA_WORKER_CLIENT_REPLICA_ROUTING_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace client {

class ReplicaRouting {
 public:
  // REQUIRES: num_shards >= 1, 1 <= replicas <= num_shards (Check them with Validate first).
  ReplicaRouting(int num_shards, int replicas);

  // INVALID_ARGUMENT naming `replicas` unless 1 <= replicas <= num_shards.
  static absl::Status Validate(int num_shards, int replicas);

  int num_shards() const { return num_shards_; }
  int replicas() const { return replicas_; }

  // The copies of what lives at `home`, home first: home, home + 1, ... (mod num_shards).
  std::vector<int> Copies(int home) const;
  // The live copies (not down), in the same order; the first one is the acting primary.
  std::vector<int> LiveCopies(int home) const;
  // Where a write (a push) of `step` goes: LiveCopies(home), then the shard being filled when it
  // is a copy of home and step >= its fill's from_step. Records `step` as routed (see SetFill).
  std::vector<int> WriteCopies(int home, int64_t step);
  // Every shard a write of `step` reaches: Live(), and the shard being filled when step >= its
  // from_step; ascending. Records `step` as routed.
  std::vector<int> WriteShards(int64_t step);
  // The acting primary of `home`'s partitions: its first live copy; -1 when every copy is down.
  int Acting(int home) const;
  // True when `shard` is a copy of `home` (its own index included).
  bool IsCopy(int home, int shard) const;

  // Replaces the set of down shards. INVALID_ARGUMENT for an index outside [0, num_shards).
  // Returns the shards that are down now and were not before.
  absl::Status SetDown(const std::vector<int>& down, std::vector<int>* newly_down = nullptr);
  bool IsDown(int shard) const;
  // Not down, or (for a write routed to the fill, `fill_write`) down and being filled: requests
  // to it are not rerouted.
  bool IsWritable(int shard, bool fill_write) const;

  // A down shard being filled from `from_step` on (docs/reliability.md "Filling a new copy"):
  // every write of that step or later goes to it too (WriteCopies, WriteShards); reads do not
  // until it is no longer down. False when a write of from_step or later was routed already
  // (without it: the fill missed this client); the fill is set either way. INVALID_ARGUMENT for
  // a shard that is not down.
  absl::StatusOr<bool> SetFill(int shard, int64_t from_step);
  // No fill any more; the shard that was being filled, or -1.
  int ClearFill();
  // The shard being filled (-1: none) and its from_step.
  int filling() const;
  int64_t fill_from_step() const;
  std::vector<int> Down() const;
  // The shards that are not down, ascending.
  std::vector<int> Live() const;

 private:
  std::vector<int> Where(bool down) const;

  const int num_shards_;
  const int replicas_;
  mutable absl::Mutex mu_;
  std::vector<bool> down_ ABSL_GUARDED_BY(mu_);
  int filling_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t fill_from_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_write_step_ ABSL_GUARDED_BY(mu_) = -1;  // the largest step routed for a write
};

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_REPLICA_ROUTING_H_
