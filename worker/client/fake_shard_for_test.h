// FakeShard: an in-memory ShardClient for the client's tests (parameter_client_test.cc,
// replicated_client_test.cc). Header-only; test code alone includes it.
#ifndef TESSERA_WORKER_CLIENT_FAKE_SHARD_FOR_TEST_H_
#define TESSERA_WORKER_CLIENT_FAKE_SHARD_FOR_TEST_H_

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/encoding.h"
#include "worker/client/shard_client.h"

namespace tessera {
namespace client {
namespace testing_fakes {

// An in-memory shard: plain SGD (w -= lr * g, applied at once), exactly-once per
// (worker, key) by seq, and failure injection. Answers inline on the calling thread.
class FakeShard final : public ShardClient {
 public:
  FakeShard(std::string address, float lr) : address_(std::move(address)), lr_(lr) {}

  // What a test reads after the client (which owns the fake) is gone.
  struct Tally {
    int cancel_pending_calls = 0;
    size_t push_pulls = 0;
  };
  // The destructor writes its counts to *tally, which must outlive it.
  void TallyOnDestroy(Tally* tally) { tally_ = tally; }
  ~FakeShard() override {
    if (tally_ == nullptr) return;
    absl::MutexLock lock(&mu_);
    tally_->cancel_pending_calls = cancel_pending_calls_;
    tally_->push_pulls = seqs_.size();
  }

  const std::string& address() const override { return address_; }

  // The next `n` PushPull calls fail with `code` as a transport error (no effect on the store),
  // or, when `in_response` is set, as a response whose status is `code`.
  void FailNext(int n, absl::StatusCode code, bool in_response = false) {
    absl::MutexLock lock(&mu_);
    fail_next_ = n;
    fail_code_ = code;
    fail_in_response_ = in_response;
  }
  // The next `n` PushPull calls are applied, but their response is lost (UNAVAILABLE).
  void DropResponses(int n) {
    absl::MutexLock lock(&mu_);
    drop_next_ = n;
  }

  // A shard that is gone: every call fails with UNAVAILABLE and changes nothing.
  void SetDead(bool dead) {
    absl::MutexLock lock(&mu_);
    dead_ = dead;
  }
  // How many Pull calls it answered.
  int pulls() {
    absl::MutexLock lock(&mu_);
    return pulls_;
  }

  // From now on PushPull calls are held unanswered (a pull parked at a barrier) until
  // CancelPending.
  void HoldPushPulls() {
    absl::MutexLock lock(&mu_);
    hold_ = true;
  }
  // From now on only the PushPull calls that ask for weights are held (pulls parked at a BSP
  // barrier, while pushes are answered), until CancelPending.
  void HoldWeightRequests() {
    absl::MutexLock lock(&mu_);
    hold_wanting_ = true;
  }
  // A stopped process: its health checks end at their deadline unanswered.
  void SetSilent(bool silent) {
    absl::MutexLock lock(&mu_);
    silent_ = silent;
  }
  int health_checks() {
    absl::MutexLock lock(&mu_);
    return health_checks_;
  }
  absl::Status CheckHealth(absl::Time deadline) override {
    bool silent = false;
    {
      absl::MutexLock lock(&mu_);
      ++health_checks_;
      silent = silent_;
    }
    if (!silent) return absl::OkStatus();
    absl::SleepFor(deadline - absl::Now());
    return absl::DeadlineExceededError(absl::StrCat(address_, ": health check: no answer"));
  }
  void CancelPending() override {
    std::vector<PushPullCallback> held;
    {
      absl::MutexLock lock(&mu_);
      held.swap(held_);
      ++cancel_pending_calls_;
    }
    for (PushPullCallback& done : held) done(absl::CancelledError(address_ + ": cancelled"));
  }

  // Per PushPull call, in order: whether it was marked urgent.
  std::vector<bool> urgent() {
    absl::MutexLock lock(&mu_);
    return urgent_;
  }
  std::vector<std::vector<absl::string_view>> lent() {
    absl::MutexLock lock(&mu_);
    return lent_;
  }

  // Records what each call lent (per push slice: where the bytes lie, empty when in the request),
  // then copies it into the request, and answers (weights in the response: it ignores targets).
  void PushPull(PushPullCall call, absl::Time deadline, PushPullCallback done) override {
    bool dead = false;
    {
      absl::MutexLock lock(&mu_);
      lent_.push_back(call.lent);
      urgent_.push_back(call.urgent);
      dead = dead_;
    }
    if (dead) {
      done(absl::UnavailableError(absl::StrCat(address_, ": connection refused")));
      return;
    }
    const std::shared_ptr<const v1::PushPullRequest> request =
        WithLentDataCopied(std::move(call)).request;
    absl::StatusOr<v1::PushPullResponse> result;
    bool drop = false;
    {
      absl::MutexLock lock(&mu_);
      seqs_.push_back(request->seq());
      bool wants = request->pull_size() > 0;
      for (const v1::Slice& slice : request->push()) wants = wants || slice.want_weights();
      if (hold_ || (hold_wanting_ && wants)) {
        held_.push_back(std::move(done));
        return;
      }
      if (fail_next_ > 0) {
        --fail_next_;
        if (fail_in_response_) {
          v1::PushPullResponse r;
          r.set_seq(request->seq());
          r.mutable_status()->set_code(static_cast<int>(fail_code_));
          r.mutable_status()->set_message("injected response failure");
          result = std::move(r);
        } else {
          result = absl::Status(fail_code_, absl::StrCat(address_, ": injected transport failure"));
        }
      } else {
        result = ApplyLocked(*request);
        if (drop_next_ > 0) {
          --drop_next_;
          drop = true;
        }
      }
    }
    if (drop) result = absl::UnavailableError(absl::StrCat(address_, ": response dropped"));
    done(std::move(result));
  }

  absl::StatusOr<std::vector<v1::Slice>> Pull(const v1::PullRequest& request,
                                              absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    if (dead_) return absl::UnavailableError(absl::StrCat(address_, ": connection refused"));
    ++pulls_;
    std::vector<v1::Slice> out;
    for (const v1::Slice& k : request.keys()) {
      if (k.all_rows()) {  // every row it holds, ids ascending
        v1::Slice all = k;
        all.clear_all_rows();
        for (const auto& [row, values] : sparse_) all.add_row_ids(row);
        out.push_back(WeightsLocked(all, request.encoding()));
        continue;
      }
      out.push_back(WeightsLocked(k, request.encoding()));
      if (out.back().key().tensor().empty()) {
        return absl::NotFoundError(absl::StrCat("no key ", k.key().tensor()));
      }
    }
    return out;
  }

  absl::StatusOr<v1::CreateJobStateResponse> CreateJobState(
      const v1::CreateJobStateRequest& request, absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    create_calls_.push_back(request);
    for (const v1::DensePartitionDecl& d : request.partitions()) {
      std::vector<float>& w = dense_[Key(d.key().tensor(), d.key().index())];
      if (!w.empty()) continue;
      w.assign(d.num_elements(), 0.0f);
      if (!d.initial_values().empty()) {
        absl::Status s = DecodeValues(v1::ENCODING_FP32, d.initial_values(), w.data(), w.size());
        if (!s.ok()) return s;
      }
    }
    for (const v1::SparseTableDecl& t : request.tables()) dims_[t.name()] = t.dim();
    v1::CreateJobStateResponse r;
    r.set_partitions(static_cast<uint32_t>(dense_.size()));
    return r;
  }
  absl::Status UpdateMembership(const v1::UpdateMembershipRequest&, absl::Time) override {
    return absl::OkStatus();
  }
  absl::Status DropJob(const v1::DropJobRequest&, absl::Time) override {
    absl::MutexLock lock(&mu_);
    dense_.clear();
    return absl::OkStatus();
  }

  std::vector<uint64_t> seqs() {
    absl::MutexLock lock(&mu_);
    return seqs_;
  }
  std::map<std::pair<std::string, uint32_t>, std::vector<float>> dense() {
    absl::MutexLock lock(&mu_);
    return dense_;
  }
  std::map<int64_t, std::vector<float>> sparse_rows() {
    absl::MutexLock lock(&mu_);
    return sparse_;
  }
  std::vector<v1::CreateJobStateRequest> create_calls() {
    absl::MutexLock lock(&mu_);
    return create_calls_;
  }

 private:
  using Key = std::pair<std::string, uint32_t>;

  v1::Slice WeightsLocked(const v1::Slice& k, v1::Encoding encoding)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::Slice w;
    if (k.row_ids_size() > 0) {
      const uint32_t dim = dims_[k.key().tensor()];
      std::vector<float> values;
      for (int64_t row : k.row_ids()) {
        std::vector<float>& r = sparse_[row];
        r.resize(dim, 0.0f);
        values.insert(values.end(), r.begin(), r.end());
        w.add_row_ids(row);
      }
      *w.mutable_key() = k.key();
      w.set_encoding(encoding);
      EncodeValues(encoding, values.data(), values.size(), w.mutable_data());
      return w;
    }
    auto it = dense_.find(Key(k.key().tensor(), k.key().index()));
    if (it == dense_.end()) return w;
    *w.mutable_key() = k.key();
    w.set_encoding(encoding);
    w.set_version(versions_[it->first]);
    EncodeValues(encoding, it->second.data(), it->second.size(), w.mutable_data());
    return w;
  }

  v1::PushPullResponse ApplyLocked(const v1::PushPullRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::PushPullResponse r;
    r.set_seq(request.seq());
    for (const v1::Slice& s : request.push()) {
      const Key key(s.key().tensor(), s.key().index());
      uint64_t& last = last_seq_[{request.worker_id(), key}];
      const bool sparse = s.row_ids_size() > 0;
      if (!sparse && dense_.count(key) == 0) {
        r.mutable_status()->set_code(static_cast<int>(absl::StatusCode::kNotFound));
        r.mutable_status()->set_message(absl::StrCat("unknown key ", key.first));
        return r;
      }
      if (request.seq() <= last) {
        r.set_duplicates(r.duplicates() + 1);
      } else {
        last = request.seq();
        if (sparse) {
          const uint32_t dim = dims_[key.first];
          std::vector<float> g(s.row_ids_size() * dim);
          if (!DecodeValues(s.encoding(), s.data(), g.data(), g.size()).ok()) std::abort();
          for (int i = 0; i < s.row_ids_size(); ++i) {
            std::vector<float>& row = sparse_[s.row_ids(i)];
            row.resize(dim, 0.0f);
            for (uint32_t j = 0; j < dim; ++j) row[j] -= lr_ * g[i * dim + j];
          }
        } else {
          std::vector<float>& w = dense_[key];
          std::vector<float> g(w.size());
          absl::Status st = DecodeValues(s.encoding(), s.data(), g.data(), g.size());
          if (!st.ok()) {
            r.mutable_status()->set_code(static_cast<int>(st.code()));
            r.mutable_status()->set_message(std::string(st.message()));
            return r;
          }
          for (size_t j = 0; j < w.size(); ++j) w[j] -= lr_ * g[j];
          ++versions_[key];
        }
      }
      if (s.want_weights()) {
        v1::Slice k;
        *k.mutable_key() = s.key();
        *k.mutable_row_ids() = s.row_ids();
        *r.add_weights() = WeightsLocked(k, request.pull_encoding());
      }
    }
    for (const v1::Slice& k : request.pull()) {  // pull-only slices (ungated here)
      *r.add_weights() = WeightsLocked(k, request.pull_encoding());
    }
    return r;
  }

  const std::string address_;
  const float lr_;
  absl::Mutex mu_;
  std::map<Key, std::vector<float>> dense_ ABSL_GUARDED_BY(mu_);
  std::map<Key, int64_t> versions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint32_t> dims_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::vector<float>> sparse_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint32_t, Key>, uint64_t> last_seq_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> seqs_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::CreateJobStateRequest> create_calls_ ABSL_GUARDED_BY(mu_);
  int fail_next_ ABSL_GUARDED_BY(mu_) = 0;
  absl::StatusCode fail_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  bool fail_in_response_ ABSL_GUARDED_BY(mu_) = false;
  int drop_next_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_wanting_ ABSL_GUARDED_BY(mu_) = false;
  bool silent_ ABSL_GUARDED_BY(mu_) = false;
  int health_checks_ ABSL_GUARDED_BY(mu_) = 0;
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
  int pulls_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<PushPullCallback> held_ ABSL_GUARDED_BY(mu_);
  int cancel_pending_calls_ ABSL_GUARDED_BY(mu_) = 0;
  Tally* tally_ = nullptr;
  std::vector<std::vector<absl::string_view>> lent_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> urgent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace testing_fakes
}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_FAKE_SHARD_FOR_TEST_H_
