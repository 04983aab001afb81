#include "worker/trainer/distributed_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/failpoint.h"
#include "common/status_macros.h"
#include "kernels/schedule.h"
#include "spec/device_spec.h"
#include "spec/job_spec.h"
#include "worker/data/batch_prefetcher.h"
#include "worker/trainer/internal/row_exchange.h"
#include "worker/trainer/internal/splits.h"
#include "worker/trainer/job_spec.h"

namespace tessera::trainer {
namespace {

using internal::EvalBatchSize;
using internal::EvaluateSplit;
using internal::HasTestSplit;
using internal::ReadSplit;
using internal::ViewOf;

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

absl::Status Prefixed(absl::string_view prefix, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// Sums over a run's steps, for the means a progress report carries (v1::StepTimes).
struct StepSums {
  double compute = 0, exchange = 0, install = 0, data = 0;
  // The request each step saw answered last: its wait at the shards' gate and its round trip,
  // over the steps whose answers were all in (`answered`).
  double gate_wait = 0, round_trip = 0;
  int64_t answered = 0;
};

void SetStepTimes(const StepSums& t, int64_t steps, v1::StepTimes* out) {
  if (steps <= 0) return;
  const double n = static_cast<double>(steps);
  out->set_compute(t.compute / n);
  out->set_exchange(t.exchange / n);
  out->set_install(t.install / n);
  out->set_data(t.data / n);
  if (t.answered > 0) {
    const double a = static_cast<double>(t.answered);
    out->set_gate_wait(t.gate_wait / a);
    out->set_round_trip(t.round_trip / a);
  }
}

// The payload that marks a data-plane error (IsShardError).
constexpr char kShardErrorPayload[] = "type.tessera.dev/tessera.worker.ShardError";

bool IsDataPlaneCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kFailedPrecondition:
      return true;
    default:
      return false;
  }
}

// An error of a ParameterClient call: prefixed "shards: ", and marked as a data-plane error when
// its code says the shard was unreachable, restarted or refused a stale incarnation.
absl::Status ShardStatus(const absl::Status& s) {
  absl::Status out = Prefixed("shards: ", s);
  if (!out.ok() && IsDataPlaneCode(out.code())) {
    out.SetPayload(kShardErrorPayload, absl::Cord("1"));
  }
  return out;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

std::string PositionString(const v1::DataPosition& p) {
  return absl::StrCat("epoch ", p.epoch(), ", batch_offset ", p.batch_offset(), ", pass ", p.pass(),
                      ", seed ", p.seed());
}

}  // namespace

v1::DataPosition DataPositionAt(int64_t step, int64_t steps_per_epoch, int64_t batches_per_pass,
                                uint64_t spec_seed) {
  v1::DataPosition p;
  const int64_t offset = step % steps_per_epoch;
  const int64_t pass = offset / batches_per_pass;
  p.set_epoch(static_cast<int32_t>(step / steps_per_epoch));
  p.set_batch_offset(offset);
  p.set_pass(static_cast<int32_t>(pass));
  p.set_seed(spec_seed + static_cast<uint64_t>(pass));
  return p;
}

bool IsShardError(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kShardErrorPayload).has_value();
}

v1::DataPosition DistributedTrainer::DataPosition(int64_t step) const {
  return DataPositionAt(step, steps_per_epoch_, std::max<int64_t>(batches_per_pass_, 1),
                        options_.task.spec().seed());
}

absl::StatusOr<std::unique_ptr<DistributedTrainer>> DistributedTrainer::Create(
    DistributedOptions options) {
  std::unique_ptr<DistributedTrainer> t(new DistributedTrainer(std::move(options)));
  TESSERA_RETURN_IF_ERROR(t->Init());
  return t;
}

DistributedTrainer::~DistributedTrainer() = default;

void DistributedTrainer::Cancel() { cancelled_.store(true, std::memory_order_release); }

absl::Status DistributedTrainer::CheckCancelled() const {
  if (cancelled()) return absl::CancelledError("cancelled");
  return absl::OkStatus();
}

absl::Status DistributedTrainer::Init() {
  const v1::Task& task = options_.task;
  v1::JobSpec& spec = *options_.task.mutable_spec();
  if (!options_.device.empty()) spec.set_device(options_.device);
  if (task.job_id().empty()) return absl::InvalidArgumentError("task.job_id: must not be empty");
  if (options_.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: must be >= 0, got ", options_.num_threads));
  }
  spec::ValidateOptions validate;
  validate.distributed = true;
  validate.dataset_roots = options_.dataset_roots;
  TESSERA_RETURN_IF_ERROR(spec::ValidateJobSpec(spec, validate));
  world_ = task.world_size();
  rank_ = task.rank();
  failpoint_ = absl::StrCat("trainer.rank", rank_, ".step");
  if (world_ != spec::NumWorkers(spec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "task.world_size: ", world_, " does not match spec.num_workers ", spec::NumWorkers(spec)));
  }
  if (rank_ < 0 || rank_ >= world_) {
    return absl::InvalidArgumentError(
        absl::StrCat("task.rank: must be in [0, ", world_, "), got ", rank_));
  }
  if (task.shard_addresses().empty()) {
    return absl::InvalidArgumentError("task.shard_addresses: the task names no shard");
  }
  for (int i = 0; i < task.shard_addresses_size(); ++i) {
    if (task.shard_addresses(i).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("task.shard_addresses[", i, "]: must not be empty"));
    }
  }
  // Data first: it is the most likely to fail, and it fails before any device work.
  {
    auto train = ReadSplit(spec, /*train=*/true, rank_, world_);
    if (!train.ok()) return Prefixed("data: ", train.status());
    train_ = *std::move(train);
  }
  if (rank_ == 0 && HasTestSplit(spec.dataset())) {
    // Every example of the test split: evaluation is rank 0's alone.
    auto test = ReadSplit(spec, /*train=*/false, 0, 1);
    if (!test.ok()) return Prefixed("data: ", test.status());
    test_ = *std::move(test);
  }

  TESSERA_ASSIGN_OR_RETURN(
      internal::DevicePlan plan,
      internal::PlanDevices(spec.device(), options_.cpu_devices, options_.cuda_devices,
                            options_.num_threads, options_.memory_limit_bytes, spec.model()));
  TESSERA_ASSIGN_OR_RETURN(backend_, kernels::CreateBackend(plan.trainer));
  // The spec's seed on every rank: identical starting weights everywhere.
  TESSERA_ASSIGN_OR_RETURN(model_,
                           engine::Model::Create(spec.model(), backend_.get(), spec.seed()));
  if (plan.devices > 1) {
    TESSERA_ASSIGN_OR_RETURN(devices_,
                             internal::LocalDevices::Create(spec.model(), spec.seed(), plan.local));
  }
  // With several devices each runs its own threads; the evaluation model keeps the default.
  tuner_ = std::make_unique<internal::ThreadTuner>(backend_.get(),
                                                   devices_ != nullptr ? 1 : options_.num_threads);
  // Dropout masks must differ between ranks, or every rank drops the same units; each step's
  // derive from this base and the step alone (SetDropoutSeed).
  dropout_base_ = model_->dropout_seed() + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(rank_);
  for (const auto& split : {train_, test_}) {
    if (split == nullptr) continue;
    TESSERA_RETURN_IF_ERROR(internal::CheckDataFitsModel(*model_, *split, split == train_));
    if (model_->multi_input()) continue;
    // A sparse model takes ids below its table's bound (any id when hashed, input_dim 0).
    const bool fits = model_->sparse_input()
                          ? model_->input_dim() == 0 || split->feature_dim() <= model_->input_dim()
                          : split->feature_dim() == model_->input_dim();
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.input_shape: ", kernels::ShapeString(model_->input_shape()), " takes ",
          model_->input_dim(), " features but the ", split == train_ ? "training" : "test",
          " data has ", split->feature_dim(), " features per example"));
    }
  }
  int64_t largest_batch = std::min<int64_t>(spec.batch_size(), train_->size());
  if (test_ != nullptr) {
    largest_batch =
        std::max<int64_t>(largest_batch, std::min<int64_t>(EvalBatchSize(spec), test_->size()));
  }
  TESSERA_RETURN_IF_ERROR(model_->CheckMemory(std::max<int64_t>(largest_batch, 1), 0));

  const std::vector<engine::Parameter>& params = model_->parameters();
  slot_of_.assign(params.size(), -1);
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    // Sparse tables travel by row (rows_). Non-trainable state (BatchNorm moving statistics)
    // travels as values the shards average (DENSE_UPDATE_AVERAGE); it has no gradient slot.
    if (params[i].sparse) continue;
    if (params[i].trainable) slot_of_[i] = static_cast<int>(dense_.size());
    averaged_.push_back(!params[i].trainable);
    dense_.push_back(i);
    dense_names_.push_back(params[i].name);
    const size_t n = static_cast<size_t>(kernels::NumElements(params[i].shape));
    grads_.emplace_back(n);
    weights_.emplace_back(n);
  }
  // Overlap needs the one device's forward pass (replicas and pipeline stages install the
  // weights together) and no rows (their fetch for the step is gated on their own push).
  overlap_ = devices_ == nullptr && model_->sparse_tables().empty();
  awaited_.assign(dense_.size(), false);
  {
    absl::MutexLock lock(&exchange_mu_);
    arrived_.assign(dense_.size(), false);
  }
  read_at_.assign(std::max<size_t>(model_->layers().size(), 1), {});
  size_t first = read_at_.size();
  for (size_t k = 0; k < dense_.size(); ++k) {
    const size_t position =
        std::min(static_cast<size_t>(model_->ForwardPosition(dense_[k])), read_at_.size() - 1);
    read_at_[position].push_back(k);
    first = std::min(first, position);
  }
  urgent_.assign(dense_.size(), false);
  // Urgent only when some tensor is read later (a multi-input model reads all at position 0).
  if (overlap_ && first < read_at_.size() && read_at_[first].size() < dense_.size()) {
    for (size_t k : read_at_[first]) urgent_[k] = true;
  }

  // Every rank runs the same number of steps (see the header).
  const int64_t n_train = train_->total_examples();
  const int64_t batch = spec.batch_size();
  steps_per_epoch_ = (n_train / world_ + batch - 1) / batch;
  if (steps_per_epoch_ == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers: ", world_, " workers share ", n_train,
                     " training examples, fewer than one per worker"));
  }
  epochs_ = spec.epochs();
  total_steps_ = static_cast<int64_t>(epochs_) * steps_per_epoch_;
  if (spec.max_steps() > 0 && (epochs_ == 0 || spec.max_steps() < total_steps_)) {
    total_steps_ = spec.max_steps();
    const int64_t needed = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
    if (needed > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_steps: ", total_steps_, " steps of ", steps_per_epoch_, " per epoch take ", needed,
          " epochs, more than ", std::numeric_limits<int>::max()));
    }
    epochs_ = static_cast<int>(needed);
  }
  batches_per_pass_ = (train_->size() + batch - 1) / batch;
  return CheckStart();
}

absl::Status DistributedTrainer::CheckStart() {
  const v1::Task& task = options_.task;
  start_step_ = task.start_step();
  if (start_step_ < 0 || start_step_ > total_steps_) {
    return absl::InvalidArgumentError(absl::StrCat("task.start_step: must be in [0, ", total_steps_,
                                                   "] (the job's total steps), got ", start_step_));
  }
  if (start_step_ == 0) return absl::OkStatus();
  const v1::DataPosition want = DataPosition(start_step_);
  const std::string context =
      absl::StrCat(" at start_step ", start_step_, " of rank ", rank_, " (", steps_per_epoch_,
                   " steps per epoch, ", batches_per_pass_, " batches per pass; expected ",
                   PositionString(want), ")");
  if (!task.has_data_position()) {
    return absl::InvalidArgumentError(absl::StrCat("data_position: unset", context));
  }
  const v1::DataPosition& got = task.data_position();
  if (got.epoch() != want.epoch()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_position: epoch ", got.epoch(), " differs", context));
  }
  if (got.batch_offset() != want.batch_offset()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_position: batch_offset ", got.batch_offset(), " differs", context));
  }
  // The coordinator does not know how many batches the rank's split holds: it may send pass 0
  // with seed spec.seed (or nothing) and leave the pass to the trainer.
  const uint64_t spec_seed = task.spec().seed();
  const bool unknown_pass = got.pass() == 0 && (got.seed() == 0 || got.seed() == spec_seed);
  if (!unknown_pass) {
    if (got.pass() != want.pass()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data_position: pass ", got.pass(), " differs", context));
    }
    if (got.seed() != 0 && got.seed() != want.seed()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data_position: seed ", got.seed(), " differs", context));
    }
  }
  return absl::OkStatus();
}

void DistributedTrainer::SetDropoutSeed(int64_t step) {
  model_->set_dropout_seed(
      SplitMix64(dropout_base_ ^ SplitMix64(static_cast<uint64_t>(step) + 0xD20)));
}

absl::Status DistributedTrainer::Connect() {
  const v1::JobSpec& spec = options_.task.spec();
  client::ParameterClient::Options o;
  o.shard_addresses.assign(options_.task.shard_addresses().begin(),
                           options_.task.shard_addresses().end());
  o.job_id = options_.task.job_id();
  o.worker_id = static_cast<uint32_t>(rank_);
  o.incarnation = options_.task.incarnation();
  o.partition_bytes = spec::PartitionBytes(spec);
  o.push_encoding = spec::PushEncoding(spec);
  o.pull_encoding = spec::PullEncoding(spec);
  o.topk_fraction = spec::TopKFraction(spec);
  o.call_timeout = options_.call_timeout;
  o.retry.max_attempts = options_.max_attempts;
  o.credentials = options_.credentials;
  o.replicas = spec::Replicas(spec);
  {
    absl::MutexLock lock(&replica_mu_);
    down_shards_.insert(down_shards_.end(), options_.task.down_shards().begin(),
                        options_.task.down_shards().end());
    std::sort(down_shards_.begin(), down_shards_.end());
    down_shards_.erase(std::unique(down_shards_.begin(), down_shards_.end()), down_shards_.end());
    if (o.replicas > 1) o.down_shards = down_shards_;
  }
  TESSERA_ASSIGN_OR_RETURN(client_, client::ParameterClient::Create(o));
  {
    absl::MutexLock lock(&replica_mu_);
    connected_ = client_.get();
  }

  const std::vector<engine::Parameter>& params = model_->parameters();
  std::vector<std::vector<float>> initial(dense_.size());
  std::vector<client::DenseTensorSpec> tensors;
  for (size_t k = 0; k < dense_.size(); ++k) {
    const engine::Parameter& p = params[dense_[k]];
    TESSERA_RETURN_IF_ERROR(model_->CopyValueToHost(p.name, &initial[k]));
    client::DenseTensorSpec t;
    t.name = p.name;
    t.shape.assign(p.shape.begin(), p.shape.end());
    t.initial_values = initial[k];
    if (averaged_[k]) t.update = v1::DENSE_UPDATE_AVERAGE;
    tensors.push_back(std::move(t));
  }
  // Additive and idempotent on the shards: whichever rank comes first declares, and the others'
  // initial values (identical anyway) change nothing. A resumed rank declares too: the state the
  // shards hold (restored or trained on) is left as it is.
  tables_ = internal::SparseTableDecls(*model_, spec);
  TESSERA_RETURN_IF_ERROR(
      ShardStatus(client_->DeclareJob(spec::MakeJobConfig(spec), tensors, tables_)));
  if (!tables_.empty()) {
    rows_ = std::make_unique<internal::RowExchange>(client_.get(), model_.get(), devices_.get());
  }
  TESSERA_RETURN_IF_ERROR(CheckCancelled());
  if (start_step_ > 0) return PullGated(start_step_);
  return PullAll();
}

void DistributedTrainer::SetDownShards(const std::vector<int>& down) {
  absl::MutexLock lock(&replica_mu_);
  if (down == down_shards_) return;
  down_shards_ = down;
  if (connected_ == nullptr) return;
  const absl::Status s = connected_->SetDownShards(down);
  if (!s.ok() && options_.on_note) {
    options_.on_note(absl::StrCat("ignores the coordinator's down shards: ", s.message()));
  }
}

void DistributedTrainer::SetFill(const v1::ShardFill* fill) {
  absl::MutexLock lock(&replica_mu_);
  if (connected_ == nullptr) return;
  const absl::StatusOr<client::ParameterClient::FillReport> s =
      fill == nullptr ? connected_->SetFill(-1, "", 0)
                      : connected_->SetFill(fill->shard(), fill->address(), fill->from_step());
  if (!s.ok() && options_.on_note) {
    options_.on_note(absl::StrCat("ignores the coordinator's fill: ", s.status().message()));
  }
}

client::ParameterClient::FillReport DistributedTrainer::FillReport() {
  absl::MutexLock lock(&replica_mu_);
  if (connected_ == nullptr) return {};
  return connected_->fill_report();
}

std::vector<int> DistributedTrainer::TakeUnreachableShards() {
  absl::MutexLock lock(&replica_mu_);
  if (connected_ == nullptr) return {};
  return connected_->TakeUnreachableShards();
}

absl::Status DistributedTrainer::PullAll() {
  const std::vector<engine::Parameter>& params = model_->parameters();
  for (size_t k = 0; k < dense_.size(); ++k) {
    TESSERA_RETURN_IF_ERROR(CheckCancelled());
    TESSERA_RETURN_IF_ERROR(
        ShardStatus(client_->Pull(params[dense_[k]].name, -1, absl::MakeSpan(weights_[k]))));
  }
  return InstallWeights();
}

absl::Status DistributedTrainer::PullGated(int64_t step) {
  // The pull parks on the shards until the gate for `step` opens, which may take as long as the
  // other ranks need to get there. Two limits shape it:
  // - the blocking Pull cannot be interrupted, so it is made with a short deadline and no
  //   retries, and made again after a DEADLINE_EXCEEDED: a Cancel() is seen within a slice;
  // - a BSP shard parks a pull at most one step ahead of a partition's version (a pull further
  //   ahead is refused as from the future), so under BSP the rank climbs: an ungated pull reads
  //   the versions, then gated pulls for version + 1 until every partition has reached `step`.
  //   No one can apply step `step` without this rank (it is live from `step` on), so the
  //   weights it ends with are exactly the state at `step`.
  constexpr absl::Duration kSlice = absl::Seconds(1);
  // Hybrid gates the dense partitions, which the climb reads, as BSP.
  const v1::Consistency mode = spec::MakeJobConfig(options_.task.spec()).consistency();
  const bool bsp = mode == v1::CONSISTENCY_BSP || mode == v1::CONSISTENCY_HYBRID;
  client::ParameterClient::Options o = client_->options();
  o.down_shards = client_->routing().Down();
  o.call_timeout = std::min(options_.call_timeout, kSlice);
  o.retry.max_attempts = 1;
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<client::ParameterClient> gate,
                           client::ParameterClient::Create(o));
  const std::vector<engine::Parameter>& params = model_->parameters();
  std::vector<client::DenseTensorSpec> tensors;
  for (int index : dense_) {
    const engine::Parameter& p = params[index];
    tensors.push_back({p.name, std::vector<int64_t>(p.shape.begin(), p.shape.end()), {}});
  }
  TESSERA_RETURN_IF_ERROR(gate->AttachJob(tensors, tables_));
  for (size_t k = 0; k < dense_.size(); ++k) {
    // BSP: -1 first (ungated, reads the versions); then one step above the smallest version.
    int64_t gate_step = bsp ? -1 : step;
    // An unreachable shard is retried for as long as one ordinary call may take.
    std::optional<absl::Time> unavailable_since;
    for (;;) {
      TESSERA_RETURN_IF_ERROR(CheckCancelled());
      // A replicated job's shard found down meanwhile: the gate reads its copy instead.
      if (o.replicas > 1) TESSERA_RETURN_IF_ERROR(gate->SetDownShards(client_->routing().Down()));
      int64_t version = 0;
      const absl::Status s =
          gate->Pull(tensors[k].name, gate_step, absl::MakeSpan(weights_[k]), &version);
      if (s.ok()) {
        unavailable_since.reset();
        if (!bsp || version >= step) break;
        gate_step = version + 1;
        continue;
      }
      if (s.code() == absl::StatusCode::kDeadlineExceeded) {
        unavailable_since.reset();
        continue;
      }
      if (s.code() == absl::StatusCode::kUnavailable) {
        if (!unavailable_since.has_value()) unavailable_since = absl::Now();
        if (absl::Now() - *unavailable_since < options_.call_timeout) {
          absl::SleepFor(absl::Milliseconds(100));
          continue;
        }
      }
      return ShardStatus(Prefixed(absl::StrCat("gated Pull for start_step ", step, ": "), s));
    }
  }
  return InstallWeights();
}

absl::Status DistributedTrainer::InstallWeights() {
  const std::vector<engine::Parameter>& params = model_->parameters();
  for (size_t k = 0; k < dense_.size(); ++k) {
    TESSERA_RETURN_IF_ERROR(model_->CopyValueFromHost(params[dense_[k]].name, weights_[k]));
  }
  if (devices_ != nullptr) return devices_->Install(dense_names_, weights_);
  return absl::OkStatus();
}

absl::Status DistributedTrainer::WaitExchange() {
  absl::MutexLock lock(&exchange_mu_);
  while (!exchange_mu_.AwaitWithTimeout(absl::Condition(this, &DistributedTrainer::ExchangeDone),
                                        absl::Milliseconds(20))) {
    // The calls still in flight read grads_ (lent to the transport, not copied) and write
    // weights_; both outlive them (see the header), and no later step runs after an early return.
    if (cancelled()) return absl::CancelledError("cancelled");
  }
  if (cancelled()) return absl::CancelledError("cancelled");
  return ShardStatus(exchange_error_);
}

bool DistributedTrainer::ExchangeDone() const {
  // The first error ends the wait: under BSP a partition that failed may leave the others parked.
  return pending_ == 0 || !exchange_error_.ok();
}

client::ParameterClient::PushPullCallback DistributedTrainer::ExchangeDoneFor(
    int64_t step, std::vector<size_t> slots) {
  {
    absl::MutexLock lock(&exchange_mu_);
    ++pending_;
  }
  if (!overlap_) slots.clear();
  for (size_t k : slots) awaited_[k] = true;
  const Clock::time_point sent = Clock::now();
  return [this, step, sent, slots = std::move(slots)](absl::StatusOr<client::PushPullResult> r) {
    const Clock::time_point now = Clock::now();
    absl::MutexLock lock(&exchange_mu_);
    if (!r.ok() && exchange_error_.ok()) exchange_error_ = r.status();
    if (r.ok()) {
      for (size_t k : slots) arrived_[k] = true;
      LastAnswer& last = last_answer_[step & 1];
      if (!last.any || now >= last.at) {
        last =
            LastAnswer{now, static_cast<double>(r->gate_wait_us) * 1e-6, Seconds(now - sent), true};
      }
    }
    --pending_;
  };
}

DistributedTrainer::LastAnswer DistributedTrainer::TakeLastAnswer(int64_t step) {
  absl::MutexLock lock(&exchange_mu_);
  LastAnswer last = last_answer_[step & 1];
  last_answer_[step & 1] = LastAnswer();
  return last;
}

absl::Status DistributedTrainer::AwaitWeights(int position) {
  if (position < 0 || static_cast<size_t>(position) >= read_at_.size()) return absl::OkStatus();
  const std::vector<engine::Parameter>& params = model_->parameters();
  for (size_t k : read_at_[position]) {
    if (!awaited_[k]) continue;
    const Clock::time_point t0 = Clock::now();
    {
      absl::MutexLock lock(&exchange_mu_);
      const auto here = [this, k]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(exchange_mu_) {
        return arrived_[k] || !exchange_error_.ok();
      };
      while (!exchange_mu_.AwaitWithTimeout(absl::Condition(&here), absl::Milliseconds(20))) {
        if (cancelled()) return absl::CancelledError("cancelled");
      }
      if (!exchange_error_.ok()) return ShardStatus(exchange_error_);
      arrived_[k] = false;
    }
    const Clock::time_point t1 = Clock::now();
    awaited_[k] = false;
    TESSERA_RETURN_IF_ERROR(model_->CopyValueFromHost(params[dense_[k]].name, weights_[k]));
    forward_wait_ += Seconds(t1 - t0);
    forward_install_ += Seconds(Clock::now() - t1);
  }
  return absl::OkStatus();
}

absl::Status DistributedTrainer::AwaitAllWeights() {
  for (size_t position = 0; position < read_at_.size(); ++position) {
    TESSERA_RETURN_IF_ERROR(AwaitWeights(static_cast<int>(position)));
  }
  return absl::OkStatus();
}

namespace {
// Gradients that fit in one partition are batched, and a batch leaves once it holds this many
// bytes (or at the end of backward).
// A batched tensor holds at most kBatchBytes too, so a request stays under 2 * kBatchBytes, well
// inside the client's max_request_bytes (16 MiB).
constexpr size_t kBatchBytes = size_t{4} << 20;
}  // namespace

absl::StatusOr<engine::StepResult> DistributedTrainer::Step(const engine::BatchView& batch,
                                                            int64_t step) {
  const v1::JobSpec& spec = options_.task.spec();
  const bool clip = spec.clipping().max_global_norm() > 0;
  const std::vector<engine::Parameter>& params = model_->parameters();
  absl::Status copy_error;
  // A round trip per tensor costs more than the bytes of most of them (measured: sending every
  // MLP gradient in one request per shard gave 5 to 15% more samples per second than one request
  // per tensor), so gradients that fit in one partition (and in kBatchBytes) are batched, one
  // request per shard; a batch leaves as soon as it holds kBatchBytes (overlapping the rest of
  // backward) or backward ends. A larger tensor leaves on its own as soon as it is produced.
  const size_t batch_values = std::min(
      static_cast<size_t>(spec::PartitionBytes(spec) / sizeof(float)), kBatchBytes / sizeof(float));
  std::vector<client::ParameterClient::TensorUpdate> small;
  std::vector<size_t> small_slots;
  size_t small_bytes = 0;
  bool small_urgent = false;
  const auto push_small = [&] {
    if (small.empty()) return;
    client_->PushPullManyAsync(step, std::move(small),
                               ExchangeDoneFor(step, std::move(small_slots)), small_urgent);
    small.clear();
    small_slots.clear();
    small_bytes = 0;
    small_urgent = false;
  };
  const auto push = [&](size_t k) {
    const std::string& name = params[dense_[k]].name;
    if (grads_[k].size() <= batch_values) {
      small.push_back({name, grads_[k], absl::MakeSpan(weights_[k])});
      small_slots.push_back(k);
      small_urgent = small_urgent || urgent_[k];
      small_bytes += grads_[k].size() * sizeof(float);
      if (small_bytes >= kBatchBytes) push_small();
      return;
    }
    client_->PushPullAsync(name, step, grads_[k], absl::MakeSpan(weights_[k]),
                           ExchangeDoneFor(step, {k}), urgent_[k]);
  };
  const auto on_grad_ready = [&](int p) {
    if (!copy_error.ok() || p < 0 || static_cast<size_t>(p) >= slot_of_.size()) return;
    const int k = slot_of_[p];
    if (k < 0) return;  // a sparse table: pushed by rows below
    copy_error = model_->CopyGradToHost(params[p].name, &grads_[k]);
    if (copy_error.ok() && !clip) push(static_cast<size_t>(k));
  };
  if (devices_ != nullptr) return DevicesStep(batch, step, push, push_small);
  tuner_->BeforeStep();
  forward_wait_ = 0;
  forward_install_ = 0;
  const Clock::time_point compute_start = Clock::now();
  // Overlap: the last step's weights are installed layer by layer as this forward pass reaches
  // them; without it they were all installed before this step.
  absl::StatusOr<engine::StepResult> r = model_->TrainStep(
      batch, on_grad_ready,
      overlap_ ? engine::Model::BeforeLayer([this](int position) { return AwaitWeights(position); })
               : engine::Model::BeforeLayer());
  if (r.ok()) {
    // The thread count is chosen on compute alone, not on the time spent waiting for weights.
    std::optional<std::string> note =
        tuner_->AfterStep(Seconds(Clock::now() - compute_start) - forward_wait_ - forward_install_);
    if (note.has_value() && options_.on_note) options_.on_note(*note);
  }
  if (!r.ok() || !copy_error.ok()) {
    // Pushes already under way still complete on their own; wait for them so that nothing
    // writes into the buffers of a later step.
    WaitExchange().IgnoreError();
    return r.ok() ? copy_error : r.status();
  }
  double row_norm = 0;
  if (rows_ != nullptr) {
    absl::StatusOr<double> copied = rows_->CopyGrads();
    if (!copied.ok()) {
      push_small();
      WaitExchange().IgnoreError();
      return copied.status();
    }
    row_norm = *copied;
  }
  // The state this step's forward pass moved (BatchNorm moving statistics): this rank's values,
  // which the shards average with the other ranks' (the average comes back with the weights).
  for (size_t k = 0; k < dense_.size(); ++k) {
    if (!averaged_[k]) continue;
    absl::Status copied = model_->CopyValueToHost(params[dense_[k]].name, &grads_[k]);
    if (!copied.ok()) {
      push_small();
      WaitExchange().IgnoreError();
      return copied;
    }
    if (!clip) push(k);
  }
  float scale = 1.0f;
  if (clip) {
    scale = ClipDenseGradients(row_norm);
    for (size_t k = 0; k < grads_.size(); ++k) push(k);
  }
  push_small();
  if (rows_ != nullptr) rows_->Push(step, scale, ExchangeDoneFor(step, {}));
  return r;
}

absl::StatusOr<engine::StepResult> DistributedTrainer::DevicesStep(
    const engine::BatchView& batch, int64_t step, const std::function<void(size_t)>& push,
    const std::function<void()>& push_small) {
  // The whole batch's gradients in grads_ (and the state), and its rows', before any push: one
  // push per worker and step, as one device would make.
  absl::StatusOr<engine::StepResult> r =
      devices_->TrainStep(batch, model_->dropout_seed(), dense_names_, averaged_, &grads_);
  if (!r.ok()) return r;
  double row_norm = 0;
  if (rows_ != nullptr) {
    TESSERA_ASSIGN_OR_RETURN(row_norm, rows_->CopyGrads());
  }
  float scale = 1.0f;
  if (options_.task.spec().clipping().max_global_norm() > 0) scale = ClipDenseGradients(row_norm);
  for (size_t k = 0; k < grads_.size(); ++k) push(k);
  push_small();
  if (rows_ != nullptr) rows_->Push(step, scale, ExchangeDoneFor(step, {}));
  return r;
}

float DistributedTrainer::ClipDenseGradients(double row_norm) {
  double sum = row_norm;
  for (size_t k = 0; k < grads_.size(); ++k) {
    if (averaged_[k]) continue;  // values, not a gradient
    sum += kernels::SumOfSquares(grads_[k].data(), static_cast<int64_t>(grads_[k].size()));
  }
  const float scale = kernels::ClipScale(sum, options_.task.spec().clipping().max_global_norm());
  if (scale == 1.0f) return scale;
  for (size_t k = 0; k < grads_.size(); ++k) {
    if (averaged_[k]) continue;
    for (float& v : grads_[k]) v *= scale;
  }
  return scale;
}

absl::StatusOr<internal::SplitScore> DistributedTrainer::Evaluate() {
  internal::PrepareBatch prepare;
  if (rows_ != nullptr) {
    prepare = [this](const data::Batch& b) -> absl::StatusOr<engine::BatchView> {
      absl::StatusOr<engine::BatchView> v = rows_->FetchNow(b);
      if (!v.ok()) return ShardStatus(v.status());
      return v;
    };
  }
  return EvaluateSplit(
      *model_, test_, EvalBatchSize(options_.task.spec()), [this] { return CheckCancelled(); },
      prepare);
}

absl::Status DistributedTrainer::WaitAllWorkersDone(const v1::ProgressReport& done) {
  if (!options_.report) return absl::OkStatus();
  const absl::Time start = absl::Now();
  absl::Status last_error;
  for (;;) {
    TESSERA_RETURN_IF_ERROR(CheckCancelled());
    absl::StatusOr<v1::ProgressAck> ack = options_.report(done);
    if (ack.ok()) {
      if (ack->cancel()) {
        Cancel();
        return CheckCancelled();
      }
      if (ack->all_workers_done()) return absl::OkStatus();
    } else {
      last_error = ack.status();
    }
    if (options_.done_wait_timeout > absl::ZeroDuration() &&
        absl::Now() - start > options_.done_wait_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "coordinator: the other workers did not all report TRAINING_DONE within ",
          absl::FormatDuration(options_.done_wait_timeout),
          last_error.ok() ? "" : absl::StrCat("; last error: ", last_error.message())));
    }
    // Sleep in short slices so that a cancel is seen at once.
    const absl::Time wake = absl::Now() + options_.done_poll_interval;
    while (absl::Now() < wake && !cancelled()) absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<v1::ProgressReport> DistributedTrainer::Run() {
  if (ran_) return absl::FailedPreconditionError("DistributedTrainer::Run() was already called");
  ran_ = true;
  const v1::JobSpec& spec = options_.task.spec();
  TESSERA_RETURN_IF_ERROR(CheckCancelled());
  TESSERA_RETURN_IF_ERROR(Connect());

  const int eval_every = spec.eval().every_epochs() > 0 ? spec.eval().every_epochs() : 1;
  const Clock::time_point run_start = Clock::now();
  StepSums t;
  // Steps whose answers were all in are added to t.gate_wait and t.round_trip once.
  int64_t collected = start_step_ - 1;
  const auto collect = [&](int64_t answered_step) {
    if (answered_step <= collected) return;
    collected = answered_step;
    const LastAnswer last = TakeLastAnswer(answered_step);
    if (!last.any) return;
    t.gate_wait += last.gate_wait;
    t.round_trip += last.round_trip;
    ++t.answered;
  };
  int64_t samples = 0;
  // Since the last progress report.
  double interval_loss = 0;
  int64_t interval_correct = 0, interval_seen = 0;
  // A report right after another (an epoch end, the last one) has an empty interval: it repeats
  // the previous interval's figures rather than reporting a loss of 0.
  double last_loss = 0, last_train_accuracy = 0;
  bool have_last = false;
  Clock::time_point last_report = run_start;
  const auto progress_interval = absl::ToChronoNanoseconds(options_.progress_interval);

  // Steps this run trained (the step times' divisor).
  int64_t ran = 0;
  const auto make_report = [&](int64_t step, int epoch, int epochs_done) {
    v1::ProgressReport p;
    p.set_rank(rank_);
    p.set_phase(v1::TASK_PHASE_TRAINING);
    p.set_step(step);
    p.set_total_steps(total_steps_);
    p.set_epoch(epoch);
    p.set_epochs(epochs_done);
    if (interval_seen > 0) {
      last_loss = interval_loss / static_cast<double>(interval_seen);
      last_train_accuracy =
          static_cast<double>(interval_correct) / static_cast<double>(interval_seen);
      have_last = true;
    }
    if (have_last) {
      p.set_loss(last_loss);
      p.set_train_accuracy(last_train_accuracy);
    }
    p.set_incarnation(options_.task.incarnation());
    p.set_steps_per_epoch(steps_per_epoch_);
    const double elapsed = Seconds(Clock::now() - run_start);
    if (elapsed > 0) p.set_samples_per_second(static_cast<double>(samples) / elapsed);
    // The means over the steps this run trained (a resumed run starts at start_step_).
    SetStepTimes(t, ran, p.mutable_step_times());
    interval_loss = 0;
    interval_correct = 0;
    interval_seen = 0;
    last_report = Clock::now();
    return p;
  };

  // A resumed run starts inside epoch first_epoch, at the batch an uninterrupted run would take
  // at start_step_ (see DataPositionAt): pass `pass` of the rank's split, batch first_batch.
  int64_t step = start_step_;
  const int first_epoch = static_cast<int>(step / steps_per_epoch_);
  int epochs_done = step >= total_steps_ ? epochs_ : first_epoch;
  if (step < total_steps_ && batches_per_pass_ == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("data: rank ", rank_, " has no training examples"));
  }
  for (int epoch = first_epoch; epoch < epochs_ && step < total_steps_; ++epoch) {
    // Cap each epoch at steps_per_epoch batches; wrap around the shard if it ever runs short.
    std::unique_ptr<data::BatchPrefetcher> batches;
    int64_t step_in_epoch = epoch == first_epoch ? step % steps_per_epoch_ : 0;
    int64_t pass = step_in_epoch / batches_per_pass_;
    int64_t first_batch = step_in_epoch % batches_per_pass_;
    // Sparse models: the batch after this one, taken early so that its rows travel meanwhile.
    std::optional<data::Batch> next;
    while (step_in_epoch < steps_per_epoch_ && step < total_steps_) {
      TESSERA_RETURN_IF_ERROR(CheckCancelled());
      failpoint::MaybeHang(failpoint_, step,
                           [this] { return cancelled_.load(std::memory_order_acquire); });
      const Clock::time_point t0 = Clock::now();
      std::optional<data::Batch> b;
      if (next.has_value()) {
        b = std::move(next);
        next.reset();
      } else if (batches != nullptr) {
        b = batches->Next();
      }
      if (!b.has_value()) {
        data::BatchPrefetcher::Options o;
        o.batch_size = spec.batch_size();
        o.seed = spec.seed() + static_cast<uint64_t>(pass++);
        o.epoch = epoch;
        o.first_batch = first_batch;
        first_batch = 0;
        batches.reset();
        TESSERA_ASSIGN_OR_RETURN(batches, data::BatchPrefetcher::Create(train_, o));
        b = batches->Next();
        if (!b.has_value()) {
          return absl::FailedPreconditionError(
              absl::StrCat("data: rank ", rank_, " has no training examples"));
        }
      }
      engine::BatchView view = ViewOf(*b);
      if (rows_ != nullptr) {
        // The rows of this batch (fetched during the last step, or now), then the next batch's.
        if (!rows_->fetching()) {
          TESSERA_RETURN_IF_ERROR(Prefixed("data: ", rows_->Start(*b, step)));
        }
        absl::StatusOr<engine::BatchView> v = rows_->Finish(*b, [this] { return cancelled(); });
        if (!v.ok())
          return v.status().code() == absl::StatusCode::kCancelled ? v.status()
                                                                   : ShardStatus(v.status());
        view = *v;
        if (step + 1 < total_steps_ && step_in_epoch + 1 < steps_per_epoch_) {
          next = batches->Next();
          if (next.has_value()) {
            TESSERA_RETURN_IF_ERROR(Prefixed("data: ", rows_->Start(*next, step + 1)));
          }
        }
      }
      const Clock::time_point t1 = Clock::now();
      if (options_.on_batch) options_.on_batch(step, *b);
      SetDropoutSeed(step);
      absl::StatusOr<engine::StepResult> r = Step(view, step);
      const Clock::time_point t2 = Clock::now();
      TESSERA_RETURN_IF_ERROR(r.status());
      if (!std::isfinite(r->loss)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "training diverged: the loss is ", r->loss, " at step ", step + 1, " on rank ", rank_,
            "; lower optimizer.learning_rate or set clipping.max_global_norm"));
      }
      // Overlap: the next forward pass installs this step's weights as it reaches them.
      if (!overlap_) TESSERA_RETURN_IF_ERROR(WaitExchange());
      const Clock::time_point t3 = Clock::now();
      if (!overlap_) TESSERA_RETURN_IF_ERROR(InstallWeights());
      const Clock::time_point t4 = Clock::now();
      t.data += Seconds(t1 - t0);
      t.compute += Seconds(t2 - t1) - forward_wait_ - forward_install_;
      t.exchange += Seconds(t3 - t2) + forward_wait_;
      t.install += Seconds(t4 - t3) + forward_install_;
      batches->Recycle(std::move(*b));
      ++step;
      ++step_in_epoch;
      ++ran;
      // A step counts once every rank's push of it is in, which its answers say (the coordinator
      // hands a lost rank's place on from the ranks' smallest step, so a step reported done must
      // need nobody else's push): with the overlap that is the step before, whose every weight
      // this step's forward pass has installed.
      const int64_t exchanged = overlap_ ? step - 1 : step;
      steps_done_.store(exchanged, std::memory_order_release);
      collect(exchanged - 1);
      samples += r->examples;
      interval_loss += r->loss * static_cast<double>(r->examples);
      interval_correct += r->correct;
      interval_seen += r->examples;
      if (options_.on_progress && exchanged > start_step_ &&
          Clock::now() - last_report >= progress_interval) {
        options_.on_progress(make_report(exchanged, epoch + 1, epochs_done));
      }
    }
    batches.reset();
    if (overlap_) {
      // The epoch's last weights, before an evaluation or the end.
      const Clock::time_point t0 = Clock::now();
      forward_wait_ = 0;
      forward_install_ = 0;
      TESSERA_RETURN_IF_ERROR(AwaitAllWeights());
      TESSERA_RETURN_IF_ERROR(WaitExchange());
      t.exchange += Seconds(Clock::now() - t0) - forward_install_;
      t.install += forward_install_;
      steps_done_.store(step, std::memory_order_release);
      collect(step - 1);
    }
    epochs_done = epoch + 1;
    const bool last = epochs_done == epochs_ || step >= total_steps_;
    v1::ProgressReport p = make_report(step, epochs_done, epochs_done);
    // The last epoch's evaluation is the final one below, of the weights every rank ended with.
    if (test_ != nullptr && !last && epochs_done % eval_every == 0) {
      TESSERA_ASSIGN_OR_RETURN(internal::SplitScore score, Evaluate());
      const engine::StepResult& e = score.result;
      if (score.auc.has_value()) p.set_test_auc(*score.auc);
      p.set_evaluated(true);
      p.set_test_loss(e.loss);
      p.set_test_accuracy(e.examples > 0 ? static_cast<double>(e.correct) / e.examples : 0);
    }
    if (options_.on_progress) options_.on_progress(p);
  }

  v1::ProgressReport done = make_report(step, std::max(epochs_done, 1), epochs_done);
  done.set_phase(v1::TASK_PHASE_TRAINING_DONE);
  if (rank_ != 0) return done;

  TESSERA_RETURN_IF_ERROR(WaitAllWorkersDone(done));
  // Ungated: the weights after every rank's last push, exactly what an export pulls.
  TESSERA_RETURN_IF_ERROR(PullAll());
  v1::ProgressReport final_report = done;
  final_report.set_phase(v1::TASK_PHASE_SUCCEEDED);
  if (test_ != nullptr) {
    TESSERA_ASSIGN_OR_RETURN(internal::SplitScore score, Evaluate());
    const engine::StepResult& e = score.result;
    if (score.auc.has_value()) final_report.set_test_auc(*score.auc);
    final_report.set_evaluated(true);
    final_report.set_test_loss(e.loss);
    final_report.set_test_accuracy(e.examples > 0 ? static_cast<double>(e.correct) / e.examples
                                                  : 0);
  }
  return final_report;
}

}  // namespace tessera::trainer
