// The pushes a shard being filled takes until it has caught up (docs/reliability.md "Filling a
// new copy"), so that the ranks train on while the neighbours' files are copied and installed.
//
// The coordinator opens a job's journal (FillRequest.open) before it has the neighbours snapshot
// step S. From then on, the ranks' pushes of S and later to this shard are copied here (in memory,
// against the shard's memory budget) and acknowledged: the acting copy holds each of them too.
// Once the fill is installed at S, the call that installed it drains the journal: it applies the
// pushes through the ordinary push path by step, each step's in the order they came, keeps a
// push that the gate cannot admit yet (a rank's push of S+1 that came before another rank's push
// of S) for the next pass, and goes on while the ranks' new pushes still come into the journal,
// until it is empty; then it is closed and the job's pushes go the ordinary way. The ranks never
// wait for the install or the drain (only for room in the journal). Its bytes are given back as
// its pushes are applied.
#ifndef TESSERA_SERVER_FILL_JOURNAL_H_
#define TESSERA_SERVER_FILL_JOURNAL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/push_pull_view.h"
#include "server/memory_budget.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// Thread-safe.
class FillJournal {
 public:
  // What Keep did with a push.
  enum class Kept {
    kNotOpen,  // no journal takes it: the push goes the ordinary way
    kKept,     // copied; acknowledge it
    kFull,     // the journal may hold no more: refuse it, so that it is sent again later
  };

  // The journal's share of one job: at most this many bytes of pushes are kept per job (and
  // never more than the budget allows); past it a push is refused until the drain makes room.
  static constexpr int64_t kMaxBytesPerJob = int64_t{1} << 30;
  // Journals open at once (one per fill; the coordinator runs one per job at a time): Open
  // refuses another one beyond this (the coordinator then fills that job with the ranks paused).
  static constexpr size_t kMaxOpen = 4;

  explicit FillJournal(std::shared_ptr<MemoryBudget> budget) : budget_(std::move(budget)) {}
  ~FillJournal();
  FillJournal(const FillJournal&) = delete;
  FillJournal& operator=(const FillJournal&) = delete;

  // Opens the job's journal for pushes of `from_step` and later, dropping one it had.
  // RESOURCE_EXHAUSTED when kMaxOpen journals of other jobs are open (none is dropped: each may
  // hold pushes that were acknowledged).
  absl::Status Open(const std::string& job_id, int64_t from_step);

  // Copies `request` when its job's journal is open, the request only pushes (no pull slices,
  // no want_weights) and its step is from_step or later.
  Kept Keep(const PushPullView& request);

  // The fill of the job is installed at `step`: its journal may drain. False when none is open
  // (nothing was kept); FAILED_PRECONDITION when it was opened for another step (it is dropped:
  // its pushes belong to another fill).
  absl::StatusOr<bool> Install(const std::string& job_id, int64_t step);

  // Applies the installed job's kept pushes with `apply` (the store's push path) by step and then
  // arrival, pass after pass, as pushes keep coming in, until the journal is empty; then closes
  // it. A push answered UNAVAILABLE (its step is not admitted yet) waits for the next pass. When
  // a pass applies nothing, the next one waits for a new push, 20 ms at most. Another error, or
  // `stall` without a push applied, stops the drain and is returned (DEADLINE_EXCEEDED for the
  // stall), and the journal is dropped: the copy would lack a push that the acting copy holds.
  // The number of pushes applied is added to `*applied` (optional). One drain per job at a time
  // (the call that installed it).
  absl::Status Drain(const std::string& job_id,
                     const std::function<absl::Status(const v1::PushPullRequest&)>& apply,
                     absl::Duration stall, int64_t* applied = nullptr);

  // Drops the job's journal (the job dropped or restored, the fill given up).
  void Forget(absl::string_view job_id);

  // Bytes kept over all jobs.
  int64_t kept_bytes() const;
  // Journals open now (jobs being filled here).
  int64_t open_journals() const {
    return static_cast<int64_t>(open_.load(std::memory_order_relaxed));
  }

 private:
  struct Entry {
    std::shared_ptr<const v1::PushPullRequest> request;
    int64_t bytes = 0;
    uint64_t order = 0;  // arrival
  };
  struct Journal {
    int64_t from_step = 0;
    bool installed = false;
    int64_t bytes = 0;
    std::vector<Entry> entries;
    uint64_t generation = 0;  // tells a journal opened again from the one a drain started on
  };

  void ReleaseLocked(Journal& journal) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<MemoryBudget> budget_;
  mutable absl::Mutex mu_;
  std::map<std::string, Journal, std::less<>> journals_ ABSL_GUARDED_BY(mu_);
  int64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // journals_.size(), read without the lock: a push to a shard filling nothing takes no lock.
  std::atomic<size_t> open_{0};
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// An owned copy of a push-only view (its pieces joined).
v1::PushPullRequest OwnedPush(const PushPullView& view);

}  // namespace tessera::server

#endif  // TESSERA_SERVER_FILL_JOURNAL_H_
