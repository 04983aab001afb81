#include "worker/client/parameter_client.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/encoding.h"
#include "common/grpc_status.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "worker/client/grpc_shard_client.h"

namespace tessera {
namespace client {
namespace {

bool IsRetryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

// Runs fn(i) for every i in `items`, concurrently when there is more than one, and returns the
// first error.
absl::Status ForEachConcurrently(const std::vector<int>& items,
                                 const std::function<absl::Status(int)>& fn) {
  if (items.size() == 1) return fn(items[0]);
  std::vector<absl::Status> results(items.size());
  std::vector<std::thread> threads;
  threads.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = fn(items[i]); });
  }
  for (auto& t : threads) t.join();
  for (auto& s : results) TESSERA_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// EncodeValues, except that fp32 is one copy straight into the bytes field (resize() would
// zero-fill the buffer first: a whole extra pass over a 4 MiB partition).
void EncodeInto(v1::Encoding encoding, const float* in, size_t n, std::string* out) {
  if (BytesPerValue(encoding) == 4) {
    out->assign(reinterpret_cast<const char*>(in), n * sizeof(float));
  } else {
    EncodeValues(encoding, in, n, out);
  }
}

// The push data of values [in, in + n): lent from the caller's memory when fp32 (the wire format
// is the caller's floats), else encoded into `slice`. Returns the lent view (empty: encoded).
absl::string_view LendOrEncode(v1::Encoding encoding, const float* in, size_t n, v1::Slice* slice) {
  if (BytesPerValue(encoding) == 4 && n > 0) {
    return absl::string_view(reinterpret_cast<const char*>(in), n * sizeof(float));
  }
  EncodeInto(encoding, in, n, slice->mutable_data());
  return absl::string_view();
}

}  // namespace

// One multi-request operation (a PushPull over several partitions or shards). Completes when
// every request has finished, successfully or not.
struct ParameterClient::Op {
  PushPullCallback done;
  std::atomic<int> remaining{0};
  absl::Mutex mu;
  absl::Status status ABSL_GUARDED_BY(mu);
  PushPullResult result ABSL_GUARDED_BY(mu);
  bool have_version ABSL_GUARDED_BY(mu) = false;
};

// One request of an Op, with its retry state. `accept` decodes the weights of a successful
// response into the caller's buffer; it is empty when no weights were asked for.
struct ParameterClient::Attempt {
  std::shared_ptr<Op> op;
  int shard = 0;
  // What every attempt sends: the request, the fp32 push data lent from the caller's gradient
  // (entry i is the data of request->push(i), whose own data is empty) and, for dense partitions,
  // where the transport may decode the weights in place (then it sets `weights_written` and
  // `accept` is skipped).
  ShardClient::PushPullCall call;
  int attempts = 0;
  std::string what;
  std::function<absl::Status(const v1::PushPullResponse&)> accept;
  bool weights_written = false;
};

// Runs retries after their backoff on one thread.
class ParameterClient::RetryTimer {
 public:
  RetryTimer() : thread_([this] { Run(); }) {}
  ~RetryTimer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  void After(absl::Duration delay, std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    tasks_.emplace(absl::Now() + delay, std::move(fn));
    changed_ = true;
  }

 private:
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || changed_; }

  void Run() {
    for (;;) {
      std::function<void()> fn;
      {
        absl::MutexLock lock(&mu_);
        for (;;) {
          if (stop_) return;
          if (!tasks_.empty() && tasks_.begin()->first <= absl::Now()) {
            fn = std::move(tasks_.begin()->second);
            tasks_.erase(tasks_.begin());
            break;
          }
          const absl::Time next = tasks_.empty() ? absl::InfiniteFuture() : tasks_.begin()->first;
          changed_ = false;
          mu_.AwaitWithDeadline(absl::Condition(this, &RetryTimer::Woken), next);
        }
      }
      fn();
    }
  }

  absl::Mutex mu_;
  std::multimap<absl::Time, std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<ParameterClient>> ParameterClient::Create(const Options& options) {
  std::vector<std::unique_ptr<ShardClient>> shards;
  for (const std::string& address : options.shard_addresses) {
    GrpcShardClient::Options o;
    o.address = address;
    o.streams = options.streams_per_shard;
    o.zero_copy_push = options.zero_copy_push;
    o.credentials = options.credentials;
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GrpcShardClient> shard, GrpcShardClient::Create(o));
    shards.push_back(std::move(shard));
  }
  return CreateWithShards(options, std::move(shards));
}

absl::StatusOr<std::unique_ptr<ParameterClient>> ParameterClient::CreateWithShards(
    const Options& options, std::vector<std::unique_ptr<ShardClient>> shards) {
  if (options.shard_addresses.empty()) {
    return absl::InvalidArgumentError("shard_addresses is empty");
  }
  if (shards.size() != options.shard_addresses.size()) {
    return absl::InvalidArgumentError(absl::StrCat("got ", shards.size(), " shard clients for ",
                                                   options.shard_addresses.size(), " addresses"));
  }
  if (options.job_id.empty()) return absl::InvalidArgumentError("job_id is empty");
  if (options.partition_bytes < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition_bytes must be >= 4, got ", options.partition_bytes));
  }
  if (BytesPerValue(options.push_encoding) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("push_encoding: unknown encoding ", options.push_encoding));
  }
  if (BytesPerValue(options.pull_encoding) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull_encoding: unknown encoding ", options.pull_encoding));
  }
  if (options.retry.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.max_attempts must be >= 1, got ", options.retry.max_attempts));
  }
  if (options.retry.initial_backoff < absl::ZeroDuration() ||
      options.retry.max_backoff < absl::ZeroDuration() || options.retry.multiplier < 1.0 ||
      options.retry.jitter < 0.0 || options.retry.jitter > 1.0) {
    return absl::InvalidArgumentError(
        "retry: backoffs must be >= 0, multiplier >= 1 and jitter in [0, 1]");
  }
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("call_timeout must be > 0, got ", absl::FormatDuration(options.call_timeout)));
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("shard client ", i, " is null"));
    }
  }
  return std::unique_ptr<ParameterClient>(new ParameterClient(options, std::move(shards)));
}

ParameterClient::ParameterClient(const Options& options,
                                 std::vector<std::unique_ptr<ShardClient>> shards)
    : options_(options), shards_(std::move(shards)), retry_timer_(std::make_unique<RetryTimer>()) {}

ParameterClient::~ParameterClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  // Calls in flight end now rather than at their deadline (a pull parked at a barrier that will
  // never open, after a cancel, would otherwise hold this destructor for call_timeout times the
  // attempts); stopping_ keeps them from being retried.
  for (const std::unique_ptr<ShardClient>& shard : shards_) shard->CancelPending();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &ops_in_flight_));
}

bool ParameterClient::Stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void ParameterClient::OpStarted() {
  absl::MutexLock lock(&mu_);
  ++ops_in_flight_;
}

void ParameterClient::OpFinished() {
  absl::MutexLock lock(&mu_);
  --ops_in_flight_;
}

absl::Status ParameterClient::WithAddress(int shard, const absl::Status& status) const {
  if (status.ok()) return status;
  const std::string& address = shards_[shard]->address();
  if (absl::StrContains(status.message(), address)) return status;
  return absl::Status(status.code(), absl::StrCat(address, ": ", status.message()));
}

absl::Duration RetryBackoff(const RetryPolicy& policy, int retry, double unit_random) {
  absl::Duration d = policy.initial_backoff;
  for (int i = 1; i < retry && d < policy.max_backoff; ++i) d = d * policy.multiplier;
  d = std::min(d, policy.max_backoff);
  return d * (1.0 - policy.jitter + 2.0 * policy.jitter * unit_random);
}

absl::Duration ParameterClient::Backoff(int retry) const {
  thread_local absl::BitGen gen;
  return RetryBackoff(options_.retry, retry, absl::Uniform(gen, 0.0, 1.0));
}

absl::Status ParameterClient::RecordLayouts(const std::vector<DenseTensorSpec>& tensors,
                                            const std::vector<v1::SparseTableDecl>& tables) {
  std::vector<DenseLayout> layouts;
  for (const DenseTensorSpec& t : tensors) {
    TESSERA_ASSIGN_OR_RETURN(DenseLayout layout,
                             LayoutDenseTensor(options_.job_id, t.name, t.shape,
                                               options_.partition_bytes, num_shards()));
    if (!t.initial_values.empty() &&
        static_cast<int64_t>(t.initial_values.size()) != layout.num_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': initial_values has ", t.initial_values.size(),
                       " values, the shape has ", layout.num_elements));
    }
    layouts.push_back(std::move(layout));
  }
  for (const v1::SparseTableDecl& t : tables) {
    if (t.name().empty()) return absl::InvalidArgumentError("sparse table name is empty");
    if (t.dim() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse table '", t.name(), "': dim must be >= 1, got 0"));
    }
  }
  absl::MutexLock lock(&mu_);
  for (DenseLayout& layout : layouts) {
    auto it = layouts_.find(layout.name);
    if (it != layouts_.end()) {
      if (it->second.shape != layout.shape) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor '", layout.name, "' is already declared with another shape"));
      }
      continue;
    }
    std::string name = layout.name;
    layouts_.emplace(std::move(name), std::move(layout));
  }
  for (const v1::SparseTableDecl& t : tables) {
    tables_[t.name()] = SparseTable{t.name(), t.dim()};
  }
  return absl::OkStatus();
}

absl::Status ParameterClient::AttachJob(const std::vector<DenseTensorSpec>& tensors,
                                        const std::vector<v1::SparseTableDecl>& tables) {
  return RecordLayouts(tensors, tables);
}

absl::Status ParameterClient::DeclareJob(const v1::JobConfig& config,
                                         const std::vector<DenseTensorSpec>& tensors,
                                         const std::vector<v1::SparseTableDecl>& tables) {
  TESSERA_RETURN_IF_ERROR(RecordLayouts(tensors, tables));
  // Per shard, batches of partition declarations, each under max_request_bytes.
  std::vector<std::vector<v1::CreateJobStateRequest>> batches(shards_.size());
  std::vector<int64_t> batch_bytes(shards_.size(), 0);
  auto new_batch = [&](int shard) {
    v1::CreateJobStateRequest r;
    r.set_job_id(options_.job_id);
    *r.mutable_config() = config;
    if (batches[shard].empty()) {
      for (const v1::SparseTableDecl& t : tables) *r.add_tables() = t;
    }
    batches[shard].push_back(std::move(r));
    batch_bytes[shard] = 0;
  };
  for (int s = 0; s < num_shards(); ++s) new_batch(s);
  for (const DenseTensorSpec& t : tensors) {
    TESSERA_ASSIGN_OR_RETURN(const DenseLayout* layout, Layout(t.name));
    for (const PartitionSpan& p : layout->partitions) {
      const int64_t bytes = t.initial_values.empty() ? 64 : p.num_elements * 4 + 64;
      if (batch_bytes[p.shard] > 0 && batch_bytes[p.shard] + bytes > options_.max_request_bytes) {
        new_batch(p.shard);
      }
      batch_bytes[p.shard] += bytes;
      v1::DensePartitionDecl* d = batches[p.shard].back().add_partitions();
      d->mutable_key()->set_tensor(t.name);
      d->mutable_key()->set_index(p.index);
      d->set_num_elements(p.num_elements);
      d->set_update(t.update);
      if (!t.initial_values.empty()) {
        EncodeValues(v1::ENCODING_FP32, t.initial_values.data() + p.offset,
                     static_cast<size_t>(p.num_elements), d->mutable_initial_values());
      }
    }
  }
  std::vector<int> all(shards_.size());
  for (int s = 0; s < num_shards(); ++s) all[s] = s;
  return ForEachConcurrently(all, [&](int s) -> absl::Status {
    for (const v1::CreateJobStateRequest& r : batches[s]) {
      TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) {
        return shards_[s]->CreateJobState(r, deadline).status();
      }));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<const DenseLayout*> ParameterClient::Layout(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = layouts_.find(name);
  if (it == layouts_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is not declared"));
  }
  return &it->second;
}

absl::StatusOr<ParameterClient::SparseTable> ParameterClient::FindTable(
    absl::string_view table) const {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(table);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("sparse table '", table, "' is not declared"));
  }
  return it->second;
}

std::shared_ptr<v1::PushPullRequest> ParameterClient::NewRequest(int64_t step) {
  auto r = std::make_shared<v1::PushPullRequest>();
  r->set_job_id(options_.job_id);
  r->set_worker_id(options_.worker_id);
  r->set_incarnation(options_.incarnation);
  r->set_step(step);
  r->set_seq(next_seq_.fetch_add(1, std::memory_order_relaxed));
  r->set_pull_encoding(options_.pull_encoding);
  return r;
}

void ParameterClient::Send(std::shared_ptr<Attempt> attempt) {
  ++attempt->attempts;
  if (Stopping()) {  // a retry that fired during shutdown
    OnResponse(attempt, absl::CancelledError("the client is shutting down"));
    return;
  }
  ShardClient* shard = shards_[attempt->shard].get();
  attempt->weights_written = false;
  // The same request (same seq) on every attempt, so that the shard applies it at most once.
  shard->PushPull(attempt->call, absl::Now() + options_.call_timeout,
                  [this, attempt](absl::StatusOr<v1::PushPullResponse> response) {
                    OnResponse(attempt, std::move(response));
                  });
}

void ParameterClient::OnResponse(std::shared_ptr<Attempt> attempt,
                                 absl::StatusOr<v1::PushPullResponse> response) {
  absl::Status error;
  if (!response.ok()) {
    error = response.status();
  } else if (response->status().code() != 0) {
    error = StatusFromCode(response->status().code(), response->status().message());
  }
  Op& op = *attempt->op;
  if (!error.ok() && IsRetryable(error.code()) && attempt->attempts < options_.retry.max_attempts &&
      !Stopping()) {
    {
      absl::MutexLock lock(&op.mu);
      ++op.result.retries;
    }
    retry_timer_->After(Backoff(attempt->attempts), [this, attempt] { Send(attempt); });
    return;
  }
  if (error.ok() && attempt->accept && !attempt->weights_written) {
    error = attempt->accept(*response);
  }
  {
    absl::MutexLock lock(&op.mu);
    if (!error.ok()) {
      if (op.status.ok()) {
        error = WithAddress(attempt->shard, error);
        op.status = absl::Status(
            error.code(), absl::StrCat(attempt->what, " (seq ", attempt->call.request->seq(),
                                       ", attempt ", attempt->attempts, "): ", error.message()));
      }
    } else {
      op.result.duplicates += response->duplicates();
      op.result.skipped_non_finite += response->skipped_non_finite();
      for (const v1::Slice& w : response->weights()) {
        if (!op.have_version || w.version() < op.result.min_version) {
          op.result.min_version = w.version();
        }
        if (!op.have_version || w.version() > op.result.max_version) {
          op.result.max_version = w.version();
        }
        op.have_version = true;
      }
    }
  }
  if (op.remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  absl::StatusOr<PushPullResult> result;
  {
    absl::MutexLock lock(&op.mu);
    if (op.status.ok()) {
      result = op.result;
    } else {
      result = op.status;
    }
  }
  PushPullCallback done = std::move(op.done);
  attempt.reset();
  done(std::move(result));
  OpFinished();
}

void ParameterClient::PushPullAsync(absl::string_view name, int64_t step,
                                    absl::Span<const float> gradient, absl::Span<float> weights_out,
                                    PushPullCallback done) {
  absl::StatusOr<const DenseLayout*> found = Layout(name);
  if (!found.ok()) return done(found.status());
  const DenseLayout& layout = **found;
  if (static_cast<int64_t>(gradient.size()) != layout.num_elements) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPull tensor '", name, "': gradient has ", gradient.size(),
                     " values, the tensor has ", layout.num_elements)));
  }
  if (!weights_out.empty() && static_cast<int64_t>(weights_out.size()) != layout.num_elements) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPull tensor '", name, "': weights_out has ", weights_out.size(),
                     " values, the tensor has ", layout.num_elements)));
  }
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPull tensor '", name, "': step must be >= 0, got ", step)));
  }
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  op->remaining.store(static_cast<int>(layout.partitions.size()));
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(layout.partitions.size());
  }
  OpStarted();
  const bool want = !weights_out.empty();
  for (const PartitionSpan& p : layout.partitions) {
    std::shared_ptr<v1::PushPullRequest> request = NewRequest(step);
    v1::Slice* slice = request->add_push();
    slice->mutable_key()->set_tensor(layout.name);
    slice->mutable_key()->set_index(p.index);
    slice->set_encoding(options_.push_encoding);
    slice->set_want_weights(want);
    const absl::string_view lent = LendOrEncode(options_.push_encoding, gradient.data() + p.offset,
                                                static_cast<size_t>(p.num_elements), slice);
    auto attempt = std::make_shared<Attempt>();
    if (!lent.empty()) attempt->call.lent.push_back(lent);
    attempt->op = op;
    attempt->shard = p.shard;
    attempt->call.request = std::move(request);
    attempt->what = absl::StrCat("PushPull tensor '", name, "' partition ", p.index, " step ", step,
                                 " on shard ", p.shard);
    if (want) {
      float* out = weights_out.data() + p.offset;
      const size_t count = static_cast<size_t>(p.num_elements);
      const uint32_t index = p.index;
      const std::string* tensor = &layout.name;
      attempt->call.target.tensor = layout.name;
      attempt->call.target.index = index;
      attempt->call.target.out = out;
      attempt->call.target.count = count;
      attempt->call.target.written = &attempt->weights_written;
      attempt->accept = [out, count, index, tensor](const v1::PushPullResponse& r) {
        for (const v1::Slice& w : r.weights()) {
          if (w.key().index() != index || w.key().tensor() != *tensor) continue;
          return DecodeValues(w.encoding(), w.data(), out, count);
        }
        return absl::InternalError(
            absl::StrCat("response has no weights for tensor '", *tensor, "' partition ", index));
      };
    }
    Send(std::move(attempt));
  }
}

void ParameterClient::PushPullManyAsync(int64_t step, std::vector<TensorUpdate> tensors,
                                        PushPullCallback done) {
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPull of ", tensors.size(), " tensors: step must be >= 0, got ", step)));
  }
  // Per shard: its request and, for each pushed slice that wants weights, where they go.
  struct Target {
    std::string tensor;
    uint32_t index = 0;
    float* out = nullptr;
    size_t count = 0;
  };
  struct ShardPart {
    std::shared_ptr<v1::PushPullRequest> request;
    std::vector<absl::string_view> lent;  // per push slice, as PushPullCall::lent
    bool lends = false;
    std::vector<Target> targets;
    std::vector<std::string> names;
    size_t bytes = 0;
  };
  std::map<int, ShardPart> parts;
  std::set<std::string, std::less<>> seen;
  for (const TensorUpdate& t : tensors) {
    absl::StatusOr<const DenseLayout*> found = Layout(t.name);
    if (!found.ok()) return done(found.status());
    const DenseLayout& layout = **found;
    if (!seen.insert(t.name).second) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull of ", tensors.size(), " tensors: '", t.name, "' appears twice")));
    }
    if (static_cast<int64_t>(t.gradient.size()) != layout.num_elements) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull tensor '", t.name, "': gradient has ", t.gradient.size(),
                       " values, the tensor has ", layout.num_elements)));
    }
    if (!t.weights_out.empty() &&
        static_cast<int64_t>(t.weights_out.size()) != layout.num_elements) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull tensor '", t.name, "': weights_out has ", t.weights_out.size(),
                       " values, the tensor has ", layout.num_elements)));
    }
    const bool want = !t.weights_out.empty();
    for (const PartitionSpan& p : layout.partitions) {
      ShardPart& part = parts[p.shard];
      if (part.request == nullptr) part.request = NewRequest(step);
      v1::Slice* slice = part.request->add_push();
      slice->mutable_key()->set_tensor(layout.name);
      slice->mutable_key()->set_index(p.index);
      slice->set_encoding(options_.push_encoding);
      slice->set_want_weights(want);
      const absl::string_view lent =
          LendOrEncode(options_.push_encoding, t.gradient.data() + p.offset,
                       static_cast<size_t>(p.num_elements), slice);
      part.lent.push_back(lent);
      part.lends = part.lends || !lent.empty();
      part.bytes += lent.empty() ? slice->data().size() : lent.size();
      if (want) {
        part.targets.push_back(Target{layout.name, p.index, t.weights_out.data() + p.offset,
                                      static_cast<size_t>(p.num_elements)});
      }
      if (part.names.empty() || part.names.back() != t.name) part.names.push_back(t.name);
    }
  }
  for (const auto& [shard, part] : parts) {
    if (static_cast<int64_t>(part.bytes) > options_.max_request_bytes) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull of ", tensors.size(), " tensors: ", part.bytes,
                       " bytes for shard ", shard, " exceed max_request_bytes ",
                       options_.max_request_bytes, "; push large tensors with PushPullAsync")));
    }
  }
  if (parts.empty()) return done(PushPullResult{});
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  op->remaining.store(static_cast<int>(parts.size()));
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(parts.size());
  }
  OpStarted();
  for (auto& [shard, part] : parts) {
    auto attempt = std::make_shared<Attempt>();
    attempt->op = op;
    attempt->shard = shard;
    attempt->call.request = std::move(part.request);
    if (part.lends) attempt->call.lent = std::move(part.lent);
    attempt->what = absl::StrCat("PushPull of tensors ", absl::StrJoin(part.names, ", "), " step ",
                                 step, " on shard ", shard);
    if (!part.targets.empty()) {
      attempt->accept = [targets = std::move(part.targets)](const v1::PushPullResponse& r) {
        for (const Target& t : targets) {
          const v1::Slice* found = nullptr;
          for (const v1::Slice& w : r.weights()) {
            if (w.key().index() == t.index && w.key().tensor() == t.tensor) {
              found = &w;
              break;
            }
          }
          if (found == nullptr) {
            return absl::InternalError(absl::StrCat("response has no weights for tensor '",
                                                    t.tensor, "' partition ", t.index));
          }
          TESSERA_RETURN_IF_ERROR(DecodeValues(found->encoding(), found->data(), t.out, t.count));
        }
        return absl::OkStatus();
      };
    }
    Send(std::move(attempt));
  }
}

std::future<absl::StatusOr<PushPullResult>> ParameterClient::PushPull(
    absl::string_view name, int64_t step, absl::Span<const float> gradient,
    absl::Span<float> weights_out) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<PushPullResult>>>();
  std::future<absl::StatusOr<PushPullResult>> future = promise->get_future();
  PushPullAsync(name, step, gradient, weights_out,
                [promise](absl::StatusOr<PushPullResult> r) { promise->set_value(std::move(r)); });
  return future;
}

absl::Status ParameterClient::CallWithRetries(int shard,
                                              const std::function<absl::Status(absl::Time)>& call) {
  absl::Status status;
  for (int attempt = 1;; ++attempt) {
    status = call(absl::Now() + options_.call_timeout);
    if (status.ok() || !IsRetryable(status.code()) || attempt >= options_.retry.max_attempts) {
      break;
    }
    absl::SleepFor(Backoff(attempt));
  }
  return WithAddress(shard, status);
}

absl::Status ParameterClient::Pull(absl::string_view name, int64_t step, absl::Span<float> out,
                                   int64_t* min_version) {
  TESSERA_ASSIGN_OR_RETURN(const DenseLayout* layout, Layout(name));
  if (static_cast<int64_t>(out.size()) != layout->num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("Pull tensor '", name, "': out has ", out.size(),
                                                   " values, the tensor has ",
                                                   layout->num_elements));
  }
  std::vector<v1::PullRequest> requests(shards_.size());
  std::vector<int> used;
  for (const PartitionSpan& p : layout->partitions) {
    v1::PullRequest& r = requests[p.shard];
    if (r.keys_size() == 0) used.push_back(p.shard);
    v1::Slice* key = r.add_keys();
    key->mutable_key()->set_tensor(layout->name);
    key->mutable_key()->set_index(p.index);
  }
  absl::Mutex version_mu;
  int64_t smallest = std::numeric_limits<int64_t>::max();
  TESSERA_RETURN_IF_ERROR(ForEachConcurrently(used, [&](int s) -> absl::Status {
    v1::PullRequest& r = requests[s];
    r.set_job_id(options_.job_id);
    r.set_worker_id(options_.worker_id);
    r.set_step(step);
    r.set_encoding(options_.pull_encoding);
    std::vector<v1::Slice> slices;
    TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(slices, shards_[s]->Pull(r, deadline));
      return absl::OkStatus();
    }));
    size_t received = 0;
    for (const v1::Slice& w : slices) {
      const uint32_t index = w.key().index();
      if (w.key().tensor() != layout->name || index >= layout->partitions.size() ||
          layout->partitions[index].shard != s) {
        return absl::InternalError(absl::StrCat(shards_[s]->address(), ": Pull tensor '", name,
                                                "' returned unexpected key '", w.key().tensor(),
                                                "' partition ", index));
      }
      const PartitionSpan& p = layout->partitions[index];
      TESSERA_RETURN_IF_ERROR(
          WithAddress(s, DecodeValues(w.encoding(), w.data(), out.data() + p.offset,
                                      static_cast<size_t>(p.num_elements))));
      {
        absl::MutexLock lock(&version_mu);
        smallest = std::min(smallest, w.version());
      }
      ++received;
    }
    if (received != static_cast<size_t>(r.keys_size())) {
      return absl::InternalError(absl::StrCat(shards_[s]->address(), ": Pull tensor '", name,
                                              "' returned ", received, " of ", r.keys_size(),
                                              " partitions"));
    }
    return absl::OkStatus();
  }));
  if (min_version != nullptr) {
    *min_version = smallest == std::numeric_limits<int64_t>::max() ? 0 : smallest;
  }
  return absl::OkStatus();
}

void ParameterClient::PushPullSparseAsync(absl::string_view table, int64_t step,
                                          absl::Span<const int64_t> rows,
                                          absl::Span<const float> gradient,
                                          absl::Span<float> weights_out, PushPullCallback done) {
  absl::StatusOr<SparseTable> found = FindTable(table);
  if (!found.ok()) return done(found.status());
  const SparseTable t = *std::move(found);
  const size_t dim = t.dim;
  if (gradient.size() != rows.size() * dim) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPullSparse table '", table, "': gradient has ", gradient.size(),
                     " values, ", rows.size(), " rows of dim ", dim, " need ", rows.size() * dim)));
  }
  if (!weights_out.empty() && weights_out.size() != rows.size() * dim) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPullSparse table '", table, "': weights_out has ", weights_out.size(),
                     " values, ", rows.size(), " rows of dim ", dim, " need ", rows.size() * dim)));
  }
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPullSparse table '", table, "': step must be >= 0, got ", step)));
  }
  // One request per shard, rows or none: a table's clock on a shard advances with every push to
  // it, so under BSP and SSP a worker whose batch touches no row there still counts for the step.
  // The shard deduplicates per (worker, table), so two requests for the same table on one shard
  // must never be in flight at once.
  std::vector<std::vector<size_t>> positions(shards_.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    positions[ShardOfSparseRow(options_.job_id, t.name, rows[i], num_shards())].push_back(i);
  }
  const size_t bpv = BytesPerValue(options_.push_encoding);
  for (const auto& pos : positions) {
    if (static_cast<int64_t>(pos.size() * dim * bpv) > options_.max_request_bytes) {
      return done(absl::InvalidArgumentError(absl::StrCat(
          "PushPullSparse table '", table, "': ", pos.size(), " rows for one shard exceed ",
          "max_request_bytes ", options_.max_request_bytes, "; push fewer rows at once")));
    }
  }
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  const int used = num_shards();
  op->remaining.store(used);
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(used);
  }
  OpStarted();
  const bool want = !weights_out.empty();
  for (int s = 0; s < num_shards(); ++s) {
    auto pos = std::make_shared<std::vector<size_t>>(std::move(positions[s]));
    std::shared_ptr<v1::PushPullRequest> request = NewRequest(step);
    v1::Slice* slice = request->add_push();
    slice->mutable_key()->set_tensor(t.name);
    slice->mutable_key()->set_index(0);
    slice->set_encoding(options_.push_encoding);
    slice->set_want_weights(want);
    std::vector<float> gathered(pos->size() * dim);
    for (size_t j = 0; j < pos->size(); ++j) {
      slice->add_row_ids(rows[(*pos)[j]]);
      std::copy_n(gradient.data() + (*pos)[j] * dim, dim, gathered.data() + j * dim);
    }
    EncodeInto(options_.push_encoding, gathered.data(), gathered.size(), slice->mutable_data());
    auto attempt = std::make_shared<Attempt>();
    attempt->op = op;
    attempt->shard = s;
    attempt->call.request = std::move(request);
    attempt->what = absl::StrCat("PushPullSparse table '", table, "' step ", step, " (",
                                 pos->size(), " rows) on shard ", s);
    if (want) {
      float* out = weights_out.data();
      const std::string name = t.name;
      attempt->accept = [out, dim, pos, name](const v1::PushPullResponse& r) -> absl::Status {
        for (const v1::Slice& w : r.weights()) {
          if (w.key().tensor() != name) continue;
          std::vector<float> values(pos->size() * dim);
          TESSERA_RETURN_IF_ERROR(
              DecodeValues(w.encoding(), w.data(), values.data(), values.size()));
          for (size_t j = 0; j < pos->size(); ++j) {
            std::copy_n(values.data() + j * dim, dim, out + (*pos)[j] * dim);
          }
          return absl::OkStatus();
        }
        return absl::InternalError(
            absl::StrCat("response has no weights for sparse table '", name, "'"));
      };
    }
    Send(std::move(attempt));
  }
}

absl::Status ParameterClient::PullAllRows(absl::string_view table, std::vector<int64_t>* ids,
                                          std::vector<float>* values) {
  TESSERA_ASSIGN_OR_RETURN(SparseTable t, FindTable(table));
  const size_t dim = t.dim;
  std::vector<std::vector<int64_t>> shard_ids(shards_.size());
  std::vector<std::vector<float>> shard_values(shards_.size());
  std::vector<int> all(shards_.size());
  for (size_t s = 0; s < all.size(); ++s) all[s] = static_cast<int>(s);
  TESSERA_RETURN_IF_ERROR(ForEachConcurrently(all, [&](int s) -> absl::Status {
    v1::PullRequest r;
    r.set_job_id(options_.job_id);
    r.set_worker_id(options_.worker_id);
    r.set_step(-1);
    r.set_encoding(v1::ENCODING_FP32);
    v1::Slice* key = r.add_keys();
    key->mutable_key()->set_tensor(t.name);
    key->mutable_key()->set_index(0);
    key->set_all_rows(true);
    std::vector<v1::Slice> slices;
    TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(slices, shards_[s]->Pull(r, deadline));
      return absl::OkStatus();
    }));
    for (const v1::Slice& w : slices) {
      if (w.key().tensor() != t.name) continue;
      const size_t n = static_cast<size_t>(w.row_ids_size());
      const size_t at = shard_values[s].size();
      shard_values[s].resize(at + n * dim);
      TESSERA_RETURN_IF_ERROR(WithAddress(
          s, DecodeValues(w.encoding(), w.data(), shard_values[s].data() + at, n * dim)));
      shard_ids[s].insert(shard_ids[s].end(), w.row_ids().begin(), w.row_ids().end());
    }
    return absl::OkStatus();
  }));
  ids->clear();
  values->clear();
  for (size_t s = 0; s < shards_.size(); ++s) {
    ids->insert(ids->end(), shard_ids[s].begin(), shard_ids[s].end());
    values->insert(values->end(), shard_values[s].begin(), shard_values[s].end());
  }
  return absl::OkStatus();
}

void ParameterClient::PullSparseAsync(absl::string_view table, int64_t step,
                                      absl::Span<const int64_t> rows, absl::Span<float> out,
                                      PushPullCallback done) {
  absl::StatusOr<SparseTable> found = FindTable(table);
  if (!found.ok()) return done(found.status());
  const SparseTable t = *std::move(found);
  const size_t dim = t.dim;
  if (out.size() != rows.size() * dim) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PullSparseAsync table '", table, "': out has ", out.size(), " values, ",
                     rows.size(), " rows of dim ", dim, " need ", rows.size() * dim)));
  }
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PullSparseAsync table '", table, "': step must be >= 0, got ", step)));
  }
  std::vector<std::vector<size_t>> positions(shards_.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    positions[ShardOfSparseRow(options_.job_id, t.name, rows[i], num_shards())].push_back(i);
  }
  int used = 0;
  for (const auto& pos : positions) used += pos.empty() ? 0 : 1;
  if (used == 0) return done(PushPullResult{});
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  op->remaining.store(used);
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(used);
  }
  OpStarted();
  for (int s = 0; s < num_shards(); ++s) {
    if (positions[s].empty()) continue;
    auto pos = std::make_shared<std::vector<size_t>>(std::move(positions[s]));
    // A request without push slices: only its pull, gated for `step`.
    std::shared_ptr<v1::PushPullRequest> request = NewRequest(step);
    v1::Slice* key = request->add_pull();
    key->mutable_key()->set_tensor(t.name);
    key->mutable_key()->set_index(0);
    for (size_t i : *pos) key->add_row_ids(rows[i]);
    auto attempt = std::make_shared<Attempt>();
    attempt->op = op;
    attempt->shard = s;
    attempt->call.request = std::move(request);
    attempt->what = absl::StrCat("PullSparse table '", table, "' step ", step, " (", pos->size(),
                                 " rows) on shard ", s);
    float* dst = out.data();
    const std::string name = t.name;
    attempt->accept = [dst, dim, pos, name](const v1::PushPullResponse& r) -> absl::Status {
      for (const v1::Slice& w : r.weights()) {
        if (w.key().tensor() != name) continue;
        if (static_cast<size_t>(w.row_ids_size()) != pos->size()) {
          return absl::InternalError(absl::StrCat("sparse table '", name, "': ", w.row_ids_size(),
                                                  " rows came back for ", pos->size(), " asked"));
        }
        std::vector<float> values(pos->size() * dim);
        TESSERA_RETURN_IF_ERROR(DecodeValues(w.encoding(), w.data(), values.data(), values.size()));
        for (size_t j = 0; j < pos->size(); ++j) {
          std::copy_n(values.data() + j * dim, dim, dst + (*pos)[j] * dim);
        }
        return absl::OkStatus();
      }
      return absl::InternalError(
          absl::StrCat("response has no rows for sparse table '", name, "'"));
    };
    Send(std::move(attempt));
  }
}

std::future<absl::StatusOr<PushPullResult>> ParameterClient::PushPullSparse(
    absl::string_view table, int64_t step, absl::Span<const int64_t> rows,
    absl::Span<const float> gradient, absl::Span<float> weights_out) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<PushPullResult>>>();
  std::future<absl::StatusOr<PushPullResult>> future = promise->get_future();
  PushPullSparseAsync(
      table, step, rows, gradient, weights_out,
      [promise](absl::StatusOr<PushPullResult> r) { promise->set_value(std::move(r)); });
  return future;
}

absl::Status ParameterClient::PullSparse(absl::string_view table, int64_t step,
                                         absl::Span<const int64_t> rows, absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(SparseTable t, FindTable(table));
  const size_t dim = t.dim;
  if (out.size() != rows.size() * dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("PullSparse table '", table, "': out has ", out.size(), " values, ",
                     rows.size(), " rows of dim ", dim, " need ", rows.size() * dim));
  }
  std::vector<std::vector<size_t>> positions(shards_.size());
  std::vector<int> used;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int s = ShardOfSparseRow(options_.job_id, t.name, rows[i], num_shards());
    if (positions[s].empty()) used.push_back(s);
    positions[s].push_back(i);
  }
  return ForEachConcurrently(used, [&](int s) -> absl::Status {
    v1::PullRequest r;
    r.set_job_id(options_.job_id);
    r.set_worker_id(options_.worker_id);
    r.set_step(step);
    r.set_encoding(options_.pull_encoding);
    v1::Slice* key = r.add_keys();
    key->mutable_key()->set_tensor(t.name);
    key->mutable_key()->set_index(0);
    for (size_t i : positions[s]) key->add_row_ids(rows[i]);
    std::vector<v1::Slice> slices;
    TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(slices, shards_[s]->Pull(r, deadline));
      return absl::OkStatus();
    }));
    // The rows may come back in several slices, in request order.
    std::vector<float> values(positions[s].size() * dim);
    size_t filled = 0;
    for (const v1::Slice& w : slices) {
      if (w.key().tensor() != t.name) continue;
      const size_t n = static_cast<size_t>(w.row_ids_size()) * dim;
      const size_t count = w.row_ids_size() > 0 ? n : values.size() - filled;
      if (filled + count > values.size()) {
        return absl::InternalError(absl::StrCat(shards_[s]->address(), ": PullSparse table '",
                                                table, "' returned too many rows"));
      }
      TESSERA_RETURN_IF_ERROR(
          WithAddress(s, DecodeValues(w.encoding(), w.data(), values.data() + filled, count)));
      filled += count;
    }
    if (filled != values.size()) {
      return absl::InternalError(absl::StrCat(shards_[s]->address(), ": PullSparse table '", table,
                                              "' returned ", filled / dim, " of ",
                                              positions[s].size(), " rows"));
    }
    for (size_t j = 0; j < positions[s].size(); ++j) {
      std::copy_n(values.data() + j * dim, dim, out.data() + positions[s][j] * dim);
    }
    return absl::OkStatus();
  });
}

absl::Status ParameterClient::UpdateMembership(const std::vector<uint32_t>& live_workers,
                                               int64_t effective_step) {
  v1::UpdateMembershipRequest r;
  r.set_job_id(options_.job_id);
  for (uint32_t w : live_workers) r.add_live_workers(w);
  r.set_effective_step(effective_step);
  std::vector<int> all(shards_.size());
  for (int s = 0; s < num_shards(); ++s) all[s] = s;
  return ForEachConcurrently(all, [&](int s) {
    return CallWithRetries(
        s, [&](absl::Time deadline) { return shards_[s]->UpdateMembership(r, deadline); });
  });
}

absl::Status ParameterClient::DropJob() {
  v1::DropJobRequest r;
  r.set_job_id(options_.job_id);
  std::vector<int> all(shards_.size());
  for (int s = 0; s < num_shards(); ++s) all[s] = s;
  return ForEachConcurrently(all, [&](int s) {
    return CallWithRetries(s,
                           [&](absl::Time deadline) { return shards_[s]->DropJob(r, deadline); });
  });
}

}  // namespace client
}  // namespace tessera
