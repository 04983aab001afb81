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
#include "common/gradient_compression.h"
#include "common/grpc_status.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"
#include "worker/client/grpc_shard_client.h"
#include "worker/client/internal/parameter_client_calls.h"
#include "worker/client/internal/shard_probes.h"

namespace tessera {
namespace client {
namespace {

bool IsRetryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

}  // namespace

namespace internal {

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

void EncodeInto(v1::Encoding encoding, const float* in, size_t n, std::string* out) {
  if (BytesPerValue(encoding) == 4) {
    out->assign(reinterpret_cast<const char*>(in), n * sizeof(float));
  } else {
    EncodeValues(encoding, in, n, out);
  }
}

}  // namespace internal

using internal::EncodeInto;
using internal::ForEachConcurrently;

absl::StatusOr<std::unique_ptr<ParameterClient>> ParameterClient::Create(const Options& options) {
  Options with_connect = options;
  with_connect.connect =
      [streams = options.streams_per_shard, zero_copy = options.zero_copy_push,
       credentials = options.credentials](
          const std::string& address) -> absl::StatusOr<std::unique_ptr<ShardClient>> {
    GrpcShardClient::Options o;
    o.address = address;
    o.streams = streams;
    o.zero_copy_push = zero_copy;
    o.credentials = credentials;
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GrpcShardClient> shard, GrpcShardClient::Create(o));
    return std::unique_ptr<ShardClient>(std::move(shard));
  };
  std::vector<std::unique_ptr<ShardClient>> shards;
  for (const std::string& address : options.shard_addresses) {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> shard, with_connect.connect(address));
    shards.push_back(std::move(shard));
  }
  return CreateWithShards(with_connect, std::move(shards));
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
  if (BytesPerValue(options.push_encoding) == 0 && !IsCompressed(options.push_encoding)) {
    return absl::InvalidArgumentError(
        absl::StrCat("push_encoding: unknown encoding ", options.push_encoding));
  }
  if (BytesPerValue(options.pull_encoding) == 0 && !IsWeightDelta(options.pull_encoding)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull_encoding: unknown encoding ", options.pull_encoding,
                     IsCompressed(options.pull_encoding) ? " for weights (push only)" : ""));
  }
  if (!(options.topk_fraction > 0 && options.topk_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_fraction: must be in (0, 1], got ", options.topk_fraction));
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
  const int num_shards = static_cast<int>(shards.size());
  TESSERA_RETURN_IF_ERROR(ReplicaRouting::Validate(num_shards, options.replicas));
  if (options.replica_failover_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("replica_failover_timeout must be > 0");
  }
  if (options.probe_after <= absl::ZeroDuration() ||
      options.probe_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("probe_after and probe_timeout must be > 0");
  }
  std::unique_ptr<ParameterClient> client(new ParameterClient(options, std::move(shards)));
  TESSERA_RETURN_IF_ERROR(client->SetDownShards(options.down_shards));
  return client;
}

ParameterClient::ParameterClient(const Options& options,
                                 std::vector<std::unique_ptr<ShardClient>> shards)
    : options_(options),
      num_shards_(static_cast<int>(shards.size())),
      shards_(std::make_move_iterator(shards.begin()), std::make_move_iterator(shards.end())),
      routing_(num_shards_, options.replicas),
      encoder_(options.push_encoding, options.topk_fraction),
      retry_timer_(std::make_unique<RetryTimer>()) {
  if (options_.replicas < 2) return;
  probes_ = std::make_unique<ShardProbes>(
      [this](int shard) {
        const absl::Status health = Shard(shard)->CheckHealth(absl::Now() + options_.probe_timeout);
        return health.code() != absl::StatusCode::kDeadlineExceeded &&
               health.code() != absl::StatusCode::kUnavailable;
      },
      [this](int shard) {
        spdlog::warn(
            "client: job {}: shard {} ({}) answers no health check within {} while a call "
            "has waited on it for over {}",
            options_.job_id, shard, Shard(shard)->address(),
            absl::FormatDuration(options_.probe_timeout),
            absl::FormatDuration(options_.probe_after));
        absl::MutexLock lock(&mu_);
        unreachable_.insert(shard);
      });
}

ParameterClient::~ParameterClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  probes_.reset();  // its checks look shards up
  // Calls in flight end now rather than at their deadline (a pull parked at a barrier that will
  // never open, after a cancel, would otherwise hold this destructor for call_timeout times the
  // attempts); stopping_ keeps them from being retried.
  std::vector<std::shared_ptr<ShardClient>> every;
  {
    absl::MutexLock lock(&shards_mu_);
    every = shards_;
    every.insert(every.end(), retired_.begin(), retired_.end());
  }
  // Without the lock: the cancelled calls' callbacks run here and look their shards up.
  for (const std::shared_ptr<ShardClient>& shard : every) shard->CancelPending();
  every.clear();
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

std::shared_ptr<ShardClient> ParameterClient::Shard(int index) const {
  absl::MutexLock lock(&shards_mu_);
  return shards_[static_cast<size_t>(index)];
}

absl::Status ParameterClient::WithAddress(int shard, const absl::Status& status) const {
  if (status.ok()) return status;
  const std::string address = Shard(shard)->address();
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
  std::vector<std::vector<v1::CreateJobStateRequest>> batches(num_shards_);
  std::vector<int64_t> batch_bytes(num_shards_, 0);
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
      for (int shard : routing_.LiveCopies(p.shard)) {
        const int64_t bytes = t.initial_values.empty() ? 64 : p.num_elements * 4 + 64;
        if (batch_bytes[shard] > 0 && batch_bytes[shard] + bytes > options_.max_request_bytes) {
          new_batch(shard);
        }
        batch_bytes[shard] += bytes;
        v1::DensePartitionDecl* d = batches[shard].back().add_partitions();
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
  }
  return ForEachConcurrently(routing_.Live(), [&](int s) -> absl::Status {
    for (const v1::CreateJobStateRequest& r : batches[s]) {
      TESSERA_RETURN_IF_ERROR(CallWithRetries(
          s, [&](absl::Time deadline) { return Shard(s)->CreateJobState(r, deadline).status(); }));
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
  if (!routing_.IsWritable(attempt->shard, attempt->fill_write)) {
    Reroute(std::move(attempt), absl::UnavailableError("the shard is down"));
    return;
  }
  const std::shared_ptr<ShardClient> shard = Shard(attempt->shard);
  attempt->weights_written = false;
  Sent(attempt.get(), attempt->shard);
  // The same request (same seq) on every attempt, so that the shard applies it at most once.
  shard->PushPull(attempt->call, absl::Now() + options_.call_timeout,
                  [this, attempt](absl::StatusOr<v1::PushPullResponse> response) {
                    OnResponse(attempt, std::move(response));
                  });
}

void ParameterClient::OnResponse(std::shared_ptr<Attempt> attempt,
                                 absl::StatusOr<v1::PushPullResponse> response) {
  Answered(attempt.get());
  absl::Status error;
  if (!response.ok()) {
    error = response.status();
  } else if (response->status().code() != 0) {
    error = StatusFromCode(response->status().code(), response->status().message());
  }
  if (!error.ok() && !Stopping() && !routing_.IsWritable(attempt->shard, attempt->fill_write)) {
    Reroute(std::move(attempt), error);
    return;
  }
  // A shard being filled knows the job only once its fill is installed: until then its answer
  // is NOT_FOUND, and the push is sent again.
  const bool filling = attempt->fill_write && routing_.IsDown(attempt->shard);
  const bool retryable =
      IsRetryable(error.code()) || (filling && error.code() == absl::StatusCode::kNotFound);
  if (!error.ok() && retryable && !Stopping()) {
    bool again = attempt->attempts < options_.retry.max_attempts;
    if (routing_.replicas() > 1) {
      // The shard may be lost: keep trying until the coordinator says so (SetDownShards) or the
      // failover timeout passes, and name it in the next progress report.
      const absl::Time now = absl::Now();
      if (attempt->first_failure == absl::InfiniteFuture()) attempt->first_failure = now;
      again = now - attempt->first_failure < options_.replica_failover_timeout;
      // A shard being filled answers; it just does not hold the job yet. DEADLINE_EXCEEDED is no
      // sign either: a pull parked on a step that another rank holds up ends that way.
      if (!filling && error.code() == absl::StatusCode::kUnavailable) {
        absl::MutexLock lock(&mu_);
        unreachable_.insert(attempt->shard);
      }
    }
    if (again) {
      {
        absl::MutexLock lock(&attempt->op->mu);
        ++attempt->op->result.retries;
      }
      retry_timer_->After(Backoff(attempt->attempts), [this, attempt] { Send(attempt); });
      return;
    }
  }
  if (!error.ok() && filling && !Stopping()) {
    BreakFill(attempt->shard, error);
    Finish(std::move(attempt), absl::OkStatus(), nullptr);
    return;
  }
  if (error.ok() && attempt->accept && !attempt->weights_written) {
    error = attempt->accept(*response);
  }
  Finish(std::move(attempt), error, error.ok() ? &*response : nullptr);
}

void ParameterClient::Reroute(std::shared_ptr<Attempt> attempt, const absl::Status& error) {
  const v1::PushPullRequest& request = *attempt->call.request;
  bool wants = request.pull_size() > 0;
  for (const v1::Slice& slice : request.push()) wants = wants || slice.want_weights();
  // Every partition and row it carries must still have a live copy (which got the same push).
  bool held = true;
  for (int home : attempt->homes) held = held && routing_.Acting(home) >= 0;
  if (!held) {
    Finish(std::move(attempt),
           absl::UnavailableError(absl::StrCat("shard ", attempt->shard,
                                               " is down and no other copy of its data is live (",
                                               error.message(), ")")),
           nullptr);
    return;
  }
  if (!wants) {
    // A push whose other copies carry it (each was sent to every live copy): done here.
    Finish(std::move(attempt), absl::OkStatus(), nullptr);
    return;
  }
  // The weights it asked for are served by one shard now, or the request cannot move.
  std::set<int> serving;
  for (int home : attempt->want_homes) serving.insert(routing_.Acting(home));
  const int next = serving.size() == 1 ? *serving.begin() : -1;
  if (next < 0) {
    Finish(std::move(attempt),
           absl::UnavailableError(absl::StrCat("shard ", attempt->shard,
                                               " is down and the weights it was asked for have "
                                               "no single live copy (",
                                               error.message(), ")")),
           nullptr);
    return;
  }
  if (attempt->rerouted) {
    Finish(
        std::move(attempt),
        absl::UnavailableError(absl::StrCat(
            "shard ", attempt->shard, " is down after a failover already (", error.message(), ")")),
        nullptr);
    return;
  }
  // Ask the next copy for the weights only: it got this push as a copy of its own (the same seq),
  // so resending the push would be a second one under another seq there.
  std::shared_ptr<v1::PushPullRequest> pull = NewRequest(request.step());
  bool from_push = false;
  for (const v1::Slice& slice : request.push()) {
    if (!slice.want_weights()) continue;
    v1::Slice* key = pull->add_pull();
    *key->mutable_key() = slice.key();
    *key->mutable_row_ids() = slice.row_ids();
    from_push = true;
  }
  for (const v1::Slice& slice : request.pull()) *pull->add_pull() = slice;
  // Pushed slices with want_weights are answered for step + 1 (docs/data-plane.md).
  if (from_push) pull->set_step(request.step() + 1);
  spdlog::info("client: shard {} is down; asking shard {} for the weights of {}", attempt->shard,
               next, attempt->what);
  attempt->shard = next;
  attempt->rerouted = true;
  attempt->attempts = 0;
  attempt->first_failure = absl::InfiniteFuture();
  attempt->call.request = std::move(pull);
  attempt->call.lent.clear();
  Send(std::move(attempt));
}

void ParameterClient::Finish(std::shared_ptr<Attempt> attempt, absl::Status error,
                             const v1::PushPullResponse* response) {
  Op& op = *attempt->op;
  {
    absl::MutexLock lock(&op.mu);
    if (!error.ok()) {
      if (op.status.ok()) {
        error = WithAddress(attempt->shard, error);
        op.status = absl::Status(
            error.code(), absl::StrCat(attempt->what, " (seq ", attempt->call.request->seq(),
                                       ", attempt ", attempt->attempts, "): ", error.message()));
      }
    } else if (response != nullptr) {
      op.result.duplicates += response->duplicates();
      op.result.skipped_non_finite += response->skipped_non_finite();
      op.result.gate_wait_us = std::max(op.result.gate_wait_us, response->gate_wait_us());
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

absl::Status ParameterClient::SetDownShards(const std::vector<int>& down) {
  if (routing_.replicas() < 2 && !down.empty()) {
    return absl::InvalidArgumentError(
        "down shards: the job keeps one copy of each partition (replicas 1)");
  }
  std::vector<int> newly_down;
  TESSERA_RETURN_IF_ERROR(routing_.SetDown(down, &newly_down));
  if (newly_down.empty()) return absl::OkStatus();
  spdlog::info("client: job {}: shards {} are down; their copies serve their partitions",
               options_.job_id, absl::StrJoin(newly_down, ", "));
  // Calls in flight on them end now (a stopped shard would hold them until their deadline), and
  // retries waiting for their backoff go elsewhere at once.
  for (int shard : newly_down) Shard(shard)->CancelPending();
  retry_timer_->RunAllNow();
  return absl::OkStatus();
}

absl::StatusOr<ParameterClient::FillReport> ParameterClient::SetFill(int shard,
                                                                     const std::string& address,
                                                                     int64_t from_step) {
  if (shard < 0) {
    const int was = routing_.ClearFill();
    {
      absl::MutexLock lock(&mu_);
      fill_ = FillReport{};
    }
    if (was >= 0 && routing_.IsDown(was)) {
      spdlog::info("client: job {}: the fill of shard {} is over; it stays down", options_.job_id,
                   was);
      // Its writes in flight end now; their pushes stand on the other copies.
      Shard(was)->CancelPending();
      retry_timer_->RunAllNow();
    }
    return FillReport{};
  }
  if (routing_.replicas() < 2) {
    return absl::InvalidArgumentError("fill: the job keeps one copy of each partition");
  }
  if (routing_.filling() == shard && routing_.fill_from_step() == from_step) return fill_report();
  if (shard >= num_shards_) {
    return absl::InvalidArgumentError(
        absl::StrCat("fill shard ", shard, ": must be in [0, ", num_shards_, ")"));
  }
  if (!routing_.IsDown(shard)) {
    return absl::InvalidArgumentError(absl::StrCat("fill shard ", shard, ": it is not down"));
  }
  if (Shard(shard)->address() != address) {
    if (!options_.connect) {
      return absl::InvalidArgumentError(absl::StrCat("fill shard ", shard, ": it serves at ",
                                                     address,
                                                     " now, and this client cannot connect"));
    }
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> fresh, options_.connect(address));
    spdlog::info("client: job {}: shard {} serves at {} now", options_.job_id, shard, address);
    absl::MutexLock lock(&shards_mu_);
    retired_.push_back(std::move(shards_[static_cast<size_t>(shard)]));
    shards_[static_cast<size_t>(shard)] = std::move(fresh);
  }
  TESSERA_ASSIGN_OR_RETURN(const bool in_time, routing_.SetFill(shard, from_step));
  FillReport report;
  report.from_step = from_step;
  report.missed = !in_time;
  spdlog::info("client: job {}: filling shard {}: {}", options_.job_id, shard,
               in_time ? absl::StrCat("writing it every push from step ", from_step)
                       : absl::StrCat("missed: a push of step ", from_step,
                                      " or later went out without it"));
  absl::MutexLock lock(&mu_);
  fill_ = report;
  return report;
}

ParameterClient::FillReport ParameterClient::fill_report() const {
  absl::MutexLock lock(&mu_);
  return fill_;
}

void ParameterClient::BreakFill(int shard, const absl::Status& error) {
  spdlog::warn("client: job {}: a write to shard {}, being filled, failed: {}", options_.job_id,
               shard, error.ToString());
  absl::MutexLock lock(&mu_);
  if (fill_.from_step > 0) fill_.missed = true;
}

void ParameterClient::Sent(const void* key, int shard) {
  if (probes_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  unanswered_[key] = {shard, absl::Now()};
}

void ParameterClient::Answered(const void* key) {
  if (probes_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  unanswered_.erase(key);
}

std::vector<int> ParameterClient::TakeUnreachableShards() {
  std::set<int> waited_on;
  std::vector<int> shards;
  {
    absl::MutexLock lock(&mu_);
    shards.assign(unreachable_.begin(), unreachable_.end());
    unreachable_.clear();
    const absl::Time now = absl::Now();
    for (const auto& [key, sent] : unanswered_) {
      if (now - sent.second >= options_.probe_after) waited_on.insert(sent.first);
    }
  }
  // Named by a later call once a check finds the shard silent.
  for (int shard : waited_on) probes_->Probe(shard);
  return shards;
}

void ParameterClient::PushPullAsync(absl::string_view name, int64_t step,
                                    absl::Span<const float> gradient, absl::Span<float> weights_out,
                                    PushPullCallback done, bool urgent) {
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
  // One request per live copy of each partition, the acting one first (it alone wants weights).
  std::vector<std::vector<int>> copies;
  size_t requests = 0;
  for (const PartitionSpan& p : layout.partitions) {
    copies.push_back(routing_.WriteCopies(p.shard, step));
    if (copies.back().empty() || routing_.IsDown(copies.back().front())) {
      return done(absl::UnavailableError(absl::StrCat("PushPull tensor '", name, "' partition ",
                                                      p.index, ": every copy is down")));
    }
    requests += copies.back().size();
  }
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  op->remaining.store(static_cast<int>(requests));
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(requests);
  }
  OpStarted();
  const bool want = !weights_out.empty();
  for (size_t k = 0; k < layout.partitions.size(); ++k) {
    const PartitionSpan& p = layout.partitions[k];
    std::shared_ptr<v1::PushPullRequest> request = NewRequest(step);
    v1::Slice* slice = request->add_push();
    slice->mutable_key()->set_tensor(layout.name);
    slice->mutable_key()->set_index(p.index);
    slice->set_encoding(options_.push_encoding);
    slice->set_want_weights(want);
    const uint64_t held = want && DeltaPulls() ? held_.Id(layout.name, p.index) : 0;
    slice->set_weights_id(held);
    const absl::string_view lent = encoder_.Encode(layout.name, p.index, gradient.data() + p.offset,
                                                   static_cast<size_t>(p.num_elements), slice);
    // The copies: the same request (the same seq) without want_weights.
    for (size_t c = 1; c < copies[k].size(); ++c) {
      auto copy_request = std::make_shared<v1::PushPullRequest>(*request);
      copy_request->mutable_push(0)->set_want_weights(false);
      copy_request->mutable_push(0)->set_weights_id(0);
      auto copy = std::make_shared<Attempt>();
      if (!lent.empty()) copy->call.lent.push_back(lent);
      copy->op = op;
      copy->shard = copies[k][c];
      copy->fill_write = routing_.IsDown(copy->shard);
      copy->homes = {p.shard};
      copy->call.request = std::move(copy_request);
      copy->call.urgent = urgent;
      copy->what = absl::StrCat("PushPull tensor '", name, "' partition ", p.index, " step ", step,
                                " on shard ", copy->shard, " (a copy)");
      Send(std::move(copy));
    }
    auto attempt = std::make_shared<Attempt>();
    if (!lent.empty()) attempt->call.lent.push_back(lent);
    attempt->op = op;
    attempt->shard = copies[k][0];
    attempt->homes = {p.shard};
    if (want) attempt->want_homes = {p.shard};
    attempt->call.request = std::move(request);
    attempt->call.urgent = urgent;
    attempt->what = absl::StrCat("PushPull tensor '", name, "' partition ", p.index, " step ", step,
                                 " on shard ", attempt->shard);
    if (want && DeltaPulls()) {
      float* out = weights_out.data() + p.offset;
      const size_t count = static_cast<size_t>(p.num_elements);
      const uint32_t index = p.index;
      const std::string* tensor = &layout.name;
      attempt->accept = [this, out, count, index, tensor, held](const v1::PushPullResponse& r) {
        for (const v1::Slice& w : r.weights()) {
          if (w.key().index() != index || w.key().tensor() != *tensor) continue;
          return held_.Accept(*tensor, index, held, w, out, count);
        }
        return absl::InternalError(
            absl::StrCat("response has no weights for tensor '", *tensor, "' partition ", index));
      };
    } else if (want) {
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
  const absl::Time start = absl::Now();
  for (int attempt = 1;; ++attempt) {
    Sent(&status, shard);
    status = call(absl::Now() + options_.call_timeout);
    Answered(&status);
    if (status.ok() || !IsRetryable(status.code())) break;
    if (routing_.replicas() > 1 && options_.retry.max_attempts > 1) {
      // As for PushPull: the shard may be lost; retried until the coordinator says so (then the
      // caller asks the copy that serves now) or the failover timeout passes. A client without
      // retries (max_attempts 1: a caller that retries itself) keeps that.
      if (status.code() == absl::StatusCode::kUnavailable) {
        absl::MutexLock lock(&mu_);
        unreachable_.insert(shard);
      }
      if (routing_.IsDown(shard) || Stopping() ||
          absl::Now() - start >= options_.replica_failover_timeout) {
        break;
      }
    } else if (attempt >= options_.retry.max_attempts) {
      break;
    }
    absl::SleepFor(Backoff(attempt));
  }
  return WithAddress(shard, status);
}

absl::Status ParameterClient::Pull(absl::string_view name, int64_t step, absl::Span<float> out,
                                   int64_t* min_version) {
  return AgainAfterAFailover([&] { return PullOnce(name, step, out, min_version); });
}

absl::Status ParameterClient::AgainAfterAFailover(const std::function<absl::Status()>& call) {
  // A shard found down while the call ran: once more, from the copies that now serve.
  const std::vector<int> down = routing_.Down();
  absl::Status status = call();
  if (!status.ok() && routing_.Down() != down) status = call();
  return status;
}

absl::Status ParameterClient::PullOnce(absl::string_view name, int64_t step, absl::Span<float> out,
                                       int64_t* min_version) {
  TESSERA_ASSIGN_OR_RETURN(const DenseLayout* layout, Layout(name));
  if (static_cast<int64_t>(out.size()) != layout->num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("Pull tensor '", name, "': out has ", out.size(),
                                                   " values, the tensor has ",
                                                   layout->num_elements));
  }
  std::vector<v1::PullRequest> requests(num_shards_);
  std::vector<int> used;
  std::vector<int> serving(layout->partitions.size());
  for (const PartitionSpan& p : layout->partitions) {
    const int shard = routing_.Acting(p.shard);
    if (shard < 0) {
      return absl::UnavailableError(
          absl::StrCat("Pull tensor '", name, "' partition ", p.index, ": every copy is down"));
    }
    serving[p.index] = shard;
    v1::PullRequest& r = requests[shard];
    if (r.keys_size() == 0) used.push_back(shard);
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
    // A blocking pull (initial weights, evaluation, export) wants the shard's own weights.
    r.set_encoding(DeltaPulls() ? v1::ENCODING_FP32 : options_.pull_encoding);
    std::vector<v1::Slice> slices;
    TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(slices, Shard(s)->Pull(r, deadline));
      return absl::OkStatus();
    }));
    size_t received = 0;
    for (const v1::Slice& w : slices) {
      const uint32_t index = w.key().index();
      if (w.key().tensor() != layout->name || index >= layout->partitions.size() ||
          serving[index] != s) {
        return absl::InternalError(absl::StrCat(Shard(s)->address(), ": Pull tensor '", name,
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
      return absl::InternalError(absl::StrCat(Shard(s)->address(), ": Pull tensor '", name,
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

absl::Status ParameterClient::UpdateMembership(const std::vector<uint32_t>& live_workers,
                                               int64_t effective_step) {
  v1::UpdateMembershipRequest r;
  r.set_job_id(options_.job_id);
  for (uint32_t w : live_workers) r.add_live_workers(w);
  r.set_effective_step(effective_step);
  return ForEachConcurrently(routing_.Live(), [&](int s) {
    return CallWithRetries(
        s, [&](absl::Time deadline) { return Shard(s)->UpdateMembership(r, deadline); });
  });
}

absl::Status ParameterClient::DropJob() {
  v1::DropJobRequest r;
  r.set_job_id(options_.job_id);
  return ForEachConcurrently(routing_.Live(), [&](int s) {
    return CallWithRetries(s, [&](absl::Time deadline) { return Shard(s)->DropJob(r, deadline); });
  });
}

}  // namespace client
}  // namespace tessera
