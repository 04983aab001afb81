// Consistency gates: when a shard answers a pull (DESIGN.md §4).
//
// Steps and clocks. A worker computes step s with the weights it pulled "for step s", then pushes
// its gradient "for step s". Its clock on a partition (or sparse table) of this shard is the number
// of steps it has completed there: its last pushed step + 1 (0 before its first push). Clocks are
// kept per partition because a worker's step reaches a shard as several requests (one or more per
// partition); a sparse table's clock advances with every push to it, rows or not. One gate exists
// per job on each shard.
//
//   mode    a push for step s                       a pull of partition P for step s is answered
//   BSP     staged until every live worker pushed;   when P's version >= s (version = steps
//           then averaged and applied once            applied, so step s-1 is in)
//   SSP(k)  applied at once, scaled by 1/num_live     when the slowest live worker's clock on P
//                                                     >= s - k
//   ASP     applied at once                           at once
//
// Membership: the set of live workers is a history of (effective_step, workers). The set that
// applies to step s is the latest one whose effective_step <= s, so a change takes effect at a
// step boundary and a BSP step never waits for a worker removed at or before it.
//
// A pull that must wait does not block a thread: it is parked here as a Wait whose `done` runs
// once the gate opens (on the thread that opened it, or on the store's executor).
#ifndef TESSERA_SERVER_CONSISTENCY_GATE_H_
#define TESSERA_SERVER_CONSISTENCY_GATE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// Per-worker clocks of one partition: clocks[w] = steps worker w has completed on it. Written by
// the store under the partition's lock, read here without it.
using WorkerClocks = std::vector<std::atomic<int64_t>>;

class ConsistencyGate {
 public:
  // A parked pull. It is released when every versions[i].first >= versions[i].second (BSP) and
  // when, for every clocks[i], the slowest live worker's clock >= clocks[i].second - staleness
  // (SSP).
  struct Wait {
    std::vector<std::pair<std::shared_ptr<const std::atomic<int64_t>>, int64_t>> versions;
    std::vector<std::pair<std::shared_ptr<const WorkerClocks>, int64_t>> clocks;
    // Runs exactly once: OK when the gate opened, the status given to Close(), or CANCELLED once
    // `cancelled` (optional) is set.
    std::function<void(absl::Status)> done;
    // Set by the caller when nobody wants the answer any more (the call was cancelled). The gate
    // drops such a wait at its next Notify(), or at a later Park() (amortised), so cancelled
    // pulls that never open do not pile up.
    std::shared_ptr<const std::atomic<bool>> cancelled;
  };

  // REQUIRES: num_workers >= 1. CONSISTENCY_UNSPECIFIED is treated as BSP.
  ConsistencyGate(v1::Consistency mode, uint32_t staleness, uint32_t num_workers);
  ~ConsistencyGate();

  ConsistencyGate(const ConsistencyGate&) = delete;
  ConsistencyGate& operator=(const ConsistencyGate&) = delete;

  v1::Consistency mode() const { return mode_; }
  uint32_t staleness() const { return staleness_; }
  uint32_t num_workers() const { return num_workers_; }

  // Makes `live` the live set for steps >= effective_step (later entries of the history are
  // replaced). A worker that becomes live counts as having completed effective_step steps on
  // every partition, so a joining worker does not hold SSP back. Releases the waits this opens.
  // INVALID_ARGUMENT for an empty set, a worker id >= num_workers, or a negative step.
  absl::Status UpdateMembership(const std::vector<uint32_t>& live, int64_t effective_step);

  bool IsLive(uint32_t worker, int64_t step) const;
  // live[w] for every worker at `step`.
  std::vector<bool> LiveSet(int64_t step) const;
  uint32_t NumLive(int64_t step) const;

  // Minimum clock over the workers live at `step` (a joined worker's clock counts from its join
  // step).
  int64_t SlowestClock(const WorkerClocks& clocks, int64_t step) const;

  // SSP admission of a push for `step` to a partition with `clocks`: INVALID_ARGUMENT naming
  // `key` when step > slowest clock + k + 1. When `slowest` is set, it receives the slowest
  // clock it checked against (for the staleness metric).
  absl::Status CheckSspPushStep(absl::string_view key, const WorkerClocks& clocks, int64_t step,
                                int64_t* slowest = nullptr) const;

  // Runs wait.done inline (OK) when the gate is already open, with the Close() status when the
  // gate is closed, with CANCELLED when wait.cancelled is set, and otherwise parks it. Never
  // blocks.
  void Park(Wait wait);
  // Re-checks the parked waits (call after a version or clock changed) and runs those now open.
  void Notify();
  // Fails every parked wait and every later Park() with `status`.
  void Close(const absl::Status& status);

  // Largest SSP staleness ever served: the step pulled - the slowest clock at release.
  int64_t MaxStalenessServed() const;
  size_t NumParked() const;

 private:
  struct Membership {
    int64_t effective_step;
    std::vector<bool> live;
  };

  const Membership& MembershipAt(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int64_t SlowestClockLocked(const WorkerClocks& clocks, int64_t step) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsOpenLocked(const Wait& wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the open waits out of parked_ into *ready, and the cancelled ones into *cancelled.
  void CollectOpenLocked(std::vector<Wait>* ready, std::vector<Wait>* cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the cancelled waits out of parked_ into *cancelled.
  void CollectCancelledLocked(std::vector<Wait>* cancelled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::Consistency mode_;
  const uint32_t staleness_;
  const uint32_t num_workers_;

  mutable absl::Mutex mu_;
  std::vector<Membership> history_ ABSL_GUARDED_BY(mu_);  // sorted by effective_step
  // The step from which each worker's clocks count (its latest join), else 0.
  std::vector<int64_t> clock_floor_ ABSL_GUARDED_BY(mu_);
  std::list<Wait> parked_ ABSL_GUARDED_BY(mu_);
  // Park() sweeps out cancelled waits when parked_ reaches this size.
  size_t sweep_at_ ABSL_GUARDED_BY(mu_) = 64;
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  int64_t max_staleness_served_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_CONSISTENCY_GATE_H_
