// Consistency gates: the whole consistency policy of a job on one shard (DESIGN.md §4): which
// pushes are admitted, how they are applied (BSP staging and completion, SSP scaling, ASP), and
// when a pull is answered.
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
//   HYBRID  dense partitions as BSP, sparse tables as SSP(k) (PERSIA's hybrid)
//
// Admission. A push for step s is refused when its worker is not live at s (FAILED_PRECONDITION),
// and when it is from the future: BSP s > version, SSP s > slowest clock + k + 1
// (INVALID_ARGUMENT), except that exactly one step past that is UNAVAILABLE (try again): a copy of
// a replicated job may lag the shard the worker read its weights from by a step (the pull limit
// below has the same step of slack). Under BSP a push for a step already applied without the worker
// is FAILED_PRECONDITION, and a second incarnation's push of a step the worker already staged
// counts as applied. BSP completion sums the staged gradients in ascending worker order (so the
// result does not depend on arrival order) and applies sum / contributors once; a push skipped for
// NaN/Inf contributes a zero gradient.
//
// Membership: the set of live workers is a history of (effective_step, workers). The set that
// applies to step s is the latest one whose effective_step <= s, so a change takes effect at a
// step boundary and a BSP step never waits for a worker removed at or before it.
//
// A pull that must wait does not block a thread: it is parked here as a Wait whose `done` runs
// once the gate opens (on the thread that opened it, or on the store's executor).
//
// Locks: the gate's own lock guards the membership and the parked waits; the "...Locked"
// functions that take a partition need that partition's lock, which is always taken before the
// gate's (Partition::mu > the gate's lock).
#ifndef TESSERA_SERVER_CONSISTENCY_GATE_H_
#define TESSERA_SERVER_CONSISTENCY_GATE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/push_pull_view.h"
#include "server/partition.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// One slice of a push, resolved to its partition and checked (ResolvePush,
// server/request_validation.h), then admitted under the partition's lock.
struct PushSlice {
  const SliceView* slice = nullptr;
  // A compressed payload that arrived in pieces, joined once to be checked: `slice` then points
  // at joined->view, whose data is joined->bytes, so that decoding it does not join it again.
  struct Joined {
    std::string bytes;
    SliceView view;
  };
  std::unique_ptr<Joined> joined;
  std::shared_ptr<Partition> partition;
  size_t data_size = 0;
  bool skip = false;          // non-finite under NON_FINITE_POLICY_SKIP
  bool duplicate = false;     // seen (worker, incarnation, seq), or already staged (BSP)
  bool record_seq = false;    // a duplicate whose (incarnation, seq) becomes the last applied
  int64_t staging_bytes = 0;  // BSP: what staging the gradient adds (reserved before it is applied)
  // SSP: step - the slowest live clock on the partition when the slice was admitted.
  std::optional<int64_t> staleness;
};

// Thread-safe.
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
    // Set by Park(): when it was parked (SteadyNowNs), for the stall inspector.
    int64_t parked_ns = 0;
  };

  // What applying one push slice (or completing a step) did to a partition.
  struct Applied {
    bool version_changed = false;  // pulls waiting for the version may open
    bool updated = false;          // the optimizer ran once (an update applied)
    // The partition's step boundary may have moved (BSP: a step completed; SSP, ASP: a clock
    // moved), so a checkpoint capture may be due.
    bool boundary_moved = false;
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

  // --- Pushes. The store resolves a push (ResolvePush), then, holding the locks of its
  // partitions, calls AdmitLocked and StagingBytesLocked per slice, then ApplyPushLocked per
  // slice, and NotifyAfterPush once the locks are released.

  // Admission of a push of `worker` for `step` to job `job_id`, before its slices:
  // FAILED_PRECONDITION when the worker is not live at that step.
  absl::Status AdmitPusher(uint32_t worker, int64_t step, absl::string_view job_id) const;
  // Admission of one slice to `p` before its lock is taken: SSP's staleness bound
  // (CheckSspPushStep, naming `key`; clocks only grow, so it still holds when the push is
  // applied), which also sets *staleness. OK at once for BSP and ASP.
  absl::Status AdmitSlice(absl::string_view key, const Partition& p, int64_t step,
                          std::optional<int64_t>* staleness) const;
  // Admission of a slice that is not a duplicate under p's lock. BSP: the step must be p's
  // version (INVALID_ARGUMENT from the future, FAILED_PRECONDITION when already applied without
  // the worker); true when an earlier incarnation of the worker staged this step already (the
  // slice then counts as a duplicate whose seq is recorded). False for SSP and ASP.
  absl::StatusOr<bool> AdmitLocked(const Partition& p, uint32_t worker, int64_t step) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // Bytes of state that staging `slice` of `worker` adds to p (BSP: a dense partition's buffer
  // the first time, which is kept for later steps; a table's rows until the step completes); 0
  // for SSP and ASP.
  int64_t StagingBytesLocked(const Partition& p, uint32_t worker, const SliceView& slice) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // The gradient scale of a push for `step` to `p`: SSP 1 / live workers at `step`; 1 for BSP
  // (which divides at completion) and ASP. An averaging partition (DENSE_UPDATE_AVERAGE) outside
  // BSP: 1 / live workers, the weight each push gets (Partition::ApplyDenseLocked).
  float PushScale(const Partition& p, int64_t step) const;
  // Applies one admitted slice of `request` to item.partition: advances the worker's clock to
  // step + 1, records the (incarnation, seq), and then BSP stages the gradient and completes the
  // step when it can; SSP and ASP apply it at once, scaled by `scale` (PushScale), and count an
  // update. A duplicate only advances the clock (and records its seq when item.record_seq).
  Applied ApplyPushLocked(const PushPullView& request, float scale, const PushSlice& item,
                          std::vector<float>* scratch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(item.partition->mu);
  // BSP: when every worker live at the staged step has pushed p, applies sum / contributors once
  // (the sum in ascending worker order) and moves p to the next step. SSP and ASP: nothing to
  // complete, but a clock's worker may have left (boundary_moved).
  Applied CompleteStepLocked(Partition& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // After a push was applied and its partitions' locks released: releases the pulls it may have
  // opened (BSP: when a version changed; SSP: the clocks moved; ASP: none wait).
  void NotifyAfterPush(bool version_changed);

  // --- Pulls.

  // BSP: INVALID_ARGUMENT when a pull of p for `gate_step` (>= 0) can never open in order (more
  // than one step ahead of p's version); the message starts with `field` and the key's name.
  absl::Status CheckPullStep(absl::string_view field, const SliceView& key, const Partition& p,
                             int64_t gate_step) const;
  // Adds what a pull of p for `gate_step` waits for to `wait` (BSP: p's version; SSP: p's clocks;
  // nothing for ASP or a negative gate_step). `wait` holds p while it is parked.
  void AddToWait(const std::shared_ptr<Partition>& p, int64_t gate_step, Wait* wait) const;

  // Runs wait.done inline (OK) when the gate is already open, with the Close() status when the
  // gate is closed, with CANCELLED when wait.cancelled is set, and otherwise parks it. Never
  // blocks.
  void Park(Wait wait);
  // Re-checks the parked waits (call after a version or clock changed) and runs those now open.
  void Notify();
  // Fails every parked wait and every later Park() with `status`.
  void Close(const absl::Status& status);

  // --- Step boundaries, for checkpoints (docs/checkpoints.md).

  // The steps p has completed as a capture of `step` counts them: BSP its version; SSP and ASP
  // the slowest clock of the workers live at `step`.
  int64_t StepsCompletedLocked(const Partition& p, int64_t step) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // The most steps any worker completed on p: BSP its version; SSP and ASP the largest clock of
  // the workers with live[w] (every worker when `live` is null).
  int64_t FurthestStepLocked(const Partition& p, const std::vector<bool>* live) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // Worker w's clock on p as of p's step boundary (BSP: a worker that already staged step S has
  // clock S + 1, but S at the boundary).
  int64_t BoundaryClockLocked(const Partition& p, size_t worker) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // p's exactly-once table as of its step boundary (BSP mid-step: as the step began).
  const std::vector<AppliedSeq>& BoundarySeqsLocked(const Partition& p) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);

  // --- The stall inspector (issue #16; v1::ShardStall in job.proto).

  // What the job waits for on this shard, if it has waited at least `min_wait_ns` by `now_ns`
  // (steady clock): BSP, the oldest step of `partitions` (the job's, all of them) that a live
  // worker has pushed somewhere and another live worker has not pushed everywhere, counted from
  // its first push, with per live worker the partitions it has not pushed; SSP, the oldest parked
  // pull, with the live workers further behind on its partitions than the staleness allows; ASP
  // never waits. `partitions` is the number given; job_id is left empty. Takes the partitions'
  // locks one at a time (never two at once) and the gate's after each.
  std::optional<v1::ShardStall> FindStall(const std::vector<std::shared_ptr<Partition>>& partitions,
                                          int64_t now_ns, int64_t min_wait_ns) const;

  // Largest SSP staleness ever served: the step pulled - the slowest clock at release.
  int64_t MaxStalenessServed() const;
  size_t NumParked() const;

 private:
  struct Membership {
    int64_t effective_step;
    std::vector<bool> live;
  };

  // The job's mode has BSP (SSP) partitions: every one, or (hybrid) its dense (sparse) ones.
  bool bsp() const { return mode_ == v1::CONSISTENCY_BSP || mode_ == v1::CONSISTENCY_HYBRID; }
  bool ssp() const { return mode_ == v1::CONSISTENCY_SSP || mode_ == v1::CONSISTENCY_HYBRID; }
  // How partition `p` is gated: hybrid gates dense partitions as BSP and sparse tables as SSP.
  bool bsp(const Partition& p) const {
    return mode_ == v1::CONSISTENCY_BSP || (mode_ == v1::CONSISTENCY_HYBRID && !p.sparse);
  }
  bool ssp(const Partition& p) const {
    return mode_ == v1::CONSISTENCY_SSP || (mode_ == v1::CONSISTENCY_HYBRID && p.sparse);
  }
  const Membership& MembershipAt(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int64_t SlowestClockLocked(const WorkerClocks& clocks, int64_t step) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsOpenLocked(const Wait& wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<v1::ShardStall> FindBspStall(
      const std::vector<std::shared_ptr<Partition>>& partitions, int64_t now_ns,
      int64_t min_wait_ns) const;
  std::optional<v1::ShardStall> FindSspStall(int64_t now_ns, int64_t min_wait_ns) const;
  // Moves the open waits out of parked_ into *ready, and the cancelled ones into *cancelled.
  void CollectOpenLocked(std::vector<Wait>* ready, std::vector<Wait>* cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the cancelled waits out of parked_ into *cancelled.
  void CollectCancelledLocked(std::vector<Wait>* cancelled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // BSP: stages item's gradient as worker's contribution to p's step.
  void StageLocked(Partition& p, uint32_t worker, const PushSlice& item)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // BSP: true when every worker live at p's staged step has pushed it.
  bool StepStagedLocked(const Partition& p) const ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // BSP completion of a dense partition (true when an update ran) or a table.
  bool ApplyStagedDenseLocked(Partition& p, int64_t step, float scale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  bool ApplyStagedRowsLocked(Partition& p, int64_t step, float scale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);

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
