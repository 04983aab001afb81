#include "server/fill_journal.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tessera::server {
namespace {

// Bytes a kept push holds: its data and row ids, plus the protobuf's own keep.
int64_t BytesOf(const v1::PushPullRequest& request) {
  int64_t bytes = static_cast<int64_t>(sizeof(v1::PushPullRequest)) +
                  static_cast<int64_t>(request.job_id().size());
  for (const v1::Slice& s : request.push()) {
    bytes += static_cast<int64_t>(sizeof(v1::Slice) + s.key().tensor().size() + s.data().size() +
                                  s.row_ids_size() * sizeof(int64_t));
  }
  return bytes;
}

bool OnlyPushes(const PushPullView& view) {
  if (!view.pull.empty()) return false;
  for (const SliceView& s : view.push) {
    if (s.want_weights) return false;
  }
  return true;
}

}  // namespace

v1::PushPullRequest OwnedPush(const PushPullView& view) {
  v1::PushPullRequest request;
  request.set_job_id(std::string(view.job_id));
  request.set_worker_id(view.worker_id);
  request.set_incarnation(view.incarnation);
  request.set_step(view.step);
  request.set_seq(view.seq);
  request.set_pull_encoding(view.pull_encoding);
  for (const SliceView& v : view.push) {
    v1::Slice* s = request.add_push();
    s->mutable_key()->set_tensor(std::string(v.tensor));
    s->mutable_key()->set_index(v.index);
    s->set_encoding(v.encoding);
    if (v.pieces.empty()) {
      s->set_data(std::string(v.data));
    } else {
      std::string* data = s->mutable_data();
      size_t size = 0;
      for (absl::string_view piece : v.pieces) size += piece.size();
      data->reserve(size);
      for (absl::string_view piece : v.pieces) data->append(piece.data(), piece.size());
    }
    s->mutable_row_ids()->Add(v.row_ids.begin(), v.row_ids.end());
    s->set_want_weights(v.want_weights);
  }
  return request;
}

FillJournal::~FillJournal() {
  absl::MutexLock lock(&mu_);
  for (auto& [job_id, journal] : journals_) ReleaseLocked(journal);
}

void FillJournal::ReleaseLocked(Journal& journal) {
  budget_->Release(journal.bytes);
  kept_bytes_ -= journal.bytes;
  journal.bytes = 0;
  journal.entries.clear();
}

absl::Status FillJournal::Open(const std::string& job_id, int64_t from_step) {
  absl::MutexLock lock(&mu_);
  auto it = journals_.find(job_id);
  if (it != journals_.end()) {
    ReleaseLocked(it->second);
    journals_.erase(it);
  }
  if (journals_.size() >= kMaxOpen) {
    open_.store(journals_.size(), std::memory_order_release);
    return absl::ResourceExhaustedError(
        absl::StrCat("job_id: this shard already keeps the pushes of ", journals_.size(),
                     " jobs being filled (at most ", kMaxOpen, "); fill job '", job_id,
                     "' with its ranks paused"));
  }
  Journal& journal = journals_[job_id];
  journal.from_step = from_step;
  journal.generation = ++next_generation_;
  open_.store(journals_.size(), std::memory_order_release);
  return absl::OkStatus();
}

FillJournal::Kept FillJournal::Keep(const PushPullView& request) {
  if (open_.load(std::memory_order_acquire) == 0) return Kept::kNotOpen;
  {
    absl::MutexLock lock(&mu_);
    auto it = journals_.find(request.job_id);
    if (it == journals_.end() || request.step < it->second.from_step || !OnlyPushes(request) ||
        request.push.empty()) {
      return Kept::kNotOpen;
    }
  }
  // Copied without the lock; the journal may have changed meanwhile (looked up again).
  auto owned = std::make_shared<const v1::PushPullRequest>(OwnedPush(request));
  const int64_t bytes = BytesOf(*owned);
  absl::MutexLock lock(&mu_);
  auto it = journals_.find(request.job_id);
  if (it == journals_.end()) return Kept::kNotOpen;
  Journal& journal = it->second;
  if (journal.bytes + bytes > kMaxBytesPerJob || !budget_->TryReserve(bytes)) return Kept::kFull;
  journal.bytes += bytes;
  kept_bytes_ += bytes;
  journal.entries.push_back(Entry{std::move(owned), bytes, next_order_++});
  return Kept::kKept;
}

absl::StatusOr<bool> FillJournal::Install(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&mu_);
  auto it = journals_.find(job_id);
  if (it == journals_.end()) return false;
  Journal& journal = it->second;
  if (journal.from_step != step) {
    const int64_t opened_for = journal.from_step;
    ReleaseLocked(journal);
    journals_.erase(it);
    open_.store(journals_.size(), std::memory_order_release);
    return absl::FailedPreconditionError(
        absl::StrCat("step: the fill of job '", job_id, "' is installed at step ", step,
                     ", but its journal of pushes was opened for step ", opened_for,
                     "; its pushes belong to another fill"));
  }
  journal.installed = true;
  return true;
}

absl::Status FillJournal::Drain(
    const std::string& job_id, const std::function<absl::Status(const v1::PushPullRequest&)>& apply,
    absl::Duration stall, int64_t* applied) {
  uint64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = journals_.find(job_id);
    if (it == journals_.end() || !it->second.installed) return absl::OkStatus();
    generation = it->second.generation;
  }
  // The pushes taken out that the gate did not admit yet. Their bytes, and those of the pushes
  // being applied, still count in the journal's until they are applied.
  std::vector<Entry> waiting;
  absl::Time last_applied = absl::Now();
  bool progress = true;
  int64_t count = 0;
  // The journal as this drain started it, or null (forgotten or opened again meanwhile: every
  // byte of it was given back then).
  auto find = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Journal* {
    auto it = journals_.find(job_id);
    return it == journals_.end() || it->second.generation != generation ? nullptr : &it->second;
  };
  auto drop = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ReleaseLocked(*find());
    journals_.erase(journals_.find(job_id));
    open_.store(journals_.size(), std::memory_order_release);
  };
  auto done = [&](absl::Status status) {
    if (applied != nullptr) *applied += count;
    return status;
  };
  auto forgotten = [&] {
    return done(absl::AbortedError(
        absl::StrCat("job '", job_id, "' was dropped or restored while its journal drained")));
  };
  while (true) {
    std::vector<Entry> entries;
    {
      absl::MutexLock lock(&mu_);
      if (find() == nullptr) return forgotten();
      if (!progress) {
        // Nothing applied on the last pass: wait for a push to come in (or a membership change
        // to admit a waiting one).
        auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          const Journal* j = find();
          return j == nullptr || !j->entries.empty();
        };
        mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Milliseconds(20));
        if (find() == nullptr) return forgotten();
      }
      Journal& journal = *find();
      if (waiting.empty() && journal.entries.empty()) {
        drop();  // caught up: the job's pushes go the ordinary way from now on
        return done(absl::OkStatus());
      }
      entries.swap(journal.entries);
    }
    for (Entry& e : waiting) entries.push_back(std::move(e));
    waiting.clear();
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return std::make_tuple(a.request->step(), a.order) <
             std::make_tuple(b.request->step(), b.order);
    });
    int64_t released = 0;
    absl::Status error;
    progress = false;
    for (Entry& entry : entries) {
      if (!error.ok()) break;
      const absl::Status status = apply(*entry.request);
      if (status.code() == absl::StatusCode::kUnavailable) {
        waiting.push_back(std::move(entry));
      } else if (!status.ok()) {
        // Behind a step still incomplete (its pushes wait above), a later one is refused as from
        // the future: a rank's pushes of that step were never kept here.
        const bool incomplete = !waiting.empty() &&
                                status.code() == absl::StatusCode::kInvalidArgument &&
                                waiting.front().request->step() < entry.request->step();
        error = absl::Status(
            incomplete ? absl::StatusCode::kFailedPrecondition : status.code(),
            absl::StrCat("replaying the push of worker ", entry.request->worker_id(), " of step ",
                         entry.request->step(), " kept while job '", job_id,
                         "' was filled: ", status.message(),
                         incomplete ? "; an earlier step stays incomplete here: a rank that "
                                      "missed the fill never wrote its pushes of it to this shard"
                                    : ""));
      } else {
        released += entry.bytes;
        ++count;
        progress = true;
      }
    }
    const absl::Time now = absl::Now();
    if (progress) last_applied = now;
    if (error.ok() && now - last_applied > stall) {
      error = absl::DeadlineExceededError(
          absl::StrCat("the journal of job '", job_id, "' kept ", waiting.size(),
                       " pushes that could not apply for ", absl::FormatDuration(stall),
                       " (the first of step ", waiting.front().request->step(), " from worker ",
                       waiting.front().request->worker_id(), "): a push they wait for never came"));
    }
    absl::MutexLock lock(&mu_);
    Journal* journal = find();
    if (journal == nullptr) return forgotten();
    budget_->Release(released);
    kept_bytes_ -= released;
    journal->bytes -= released;
    if (!error.ok()) {
      drop();  // what is left (the waiting pushes too) is given back with it
      return done(error);
    }
  }
}

void FillJournal::Forget(absl::string_view job_id) {
  absl::MutexLock lock(&mu_);
  auto it = journals_.find(job_id);
  if (it == journals_.end()) return;
  ReleaseLocked(it->second);
  journals_.erase(it);
  open_.store(journals_.size(), std::memory_order_release);
}

int64_t FillJournal::kept_bytes() const {
  absl::MutexLock lock(&mu_);
  return kept_bytes_;
}

}  // namespace tessera::server
