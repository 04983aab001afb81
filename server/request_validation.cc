#include "server/request_validation.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/encoding.h"
#include "common/gradient_compression.h"
#include "common/status_macros.h"
#include "server/checkpoint_file.h"
#include "server/gradient_payload.h"
#include "server/store_limits.h"
#include "spec/optimizer_spec.h"
#include "spec/row_lifecycle_spec.h"
#include "spec/schedule_spec.h"

namespace tessera::server {
namespace {

// `config`'s update parameters once spec/'s rules for `sparse` tensors accept it; their
// INVALID_ARGUMENT otherwise.
absl::StatusOr<kernels::OptimizerParams> ValidOptimizerParams(const v1::OptimizerConfig& config,
                                                              bool sparse) {
  TESSERA_RETURN_IF_ERROR(spec::ValidateOptimizer(config, sparse));
  return kernels::MakeOptimizerParams(config);
}

// The checks of the pushing worker before its slices are looked at.
absl::Status CheckPusher(const JobState& job, const PushPullView& request) {
  const uint32_t worker = request.worker_id;
  const int64_t step = request.step;
  if (worker >= job.gate.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("worker_id: ", worker,
                                                   " is out of range for job '", job.id,
                                                   "' (num_workers ", job.gate.num_workers(), ")"));
  }
  if (step < 0 || step > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: must be in [0, ", kMaxStep, "], got ", step));
  }
  return absl::OkStatus();
}

// The checks of a compressed push slice i to dense partition p; sets *non_finite. A payload in
// pieces is joined into item->joined, which the apply then reads.
absl::Status CheckCompressedSlice(const SliceView& s, size_t i, const std::string& key,
                                  const Partition& p, PushSlice* item, bool* non_finite) {
  if (p.sparse) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push[", i, "] key ", key, ": ", v1::Encoding_Name(s.encoding),
        " is for dense partitions; a sparse table's rows travel in fp32, bf16 or fp16"));
  }
  absl::string_view bytes = s.data;
  if (!s.pieces.empty()) {
    item->joined = std::make_unique<PushSlice::Joined>();
    bytes = Contiguous(s, &item->joined->bytes);
    item->joined->view = s;
    item->joined->view.data = bytes;
    item->joined->view.pieces = {};
  }
  const absl::Status valid =
      CheckCompressed(s.encoding, bytes, static_cast<size_t>(p.num_elements), non_finite);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("push[", i, "] key ", key, ": ", valid.message()));
  }
  return absl::OkStatus();
}

// The checks of push slice i to p (key name `key`); fills item's data_size and staleness, and
// sets *non_finite when the gradient holds NaN or Inf.
absl::Status CheckPushSlice(const JobState& job, const PushPullView& request, size_t i,
                            const std::string& key, const Partition& p, PushSlice* item,
                            bool* non_finite) {
  const SliceView& s = request.push[i];
  if (IsCompressed(s.encoding)) {
    TESSERA_RETURN_IF_ERROR(CheckCompressedSlice(s, i, key, p, item, non_finite));
    TESSERA_RETURN_IF_ERROR(job.gate.AdmitSlice(key, p, request.step, &item->staleness));
    item->data_size = DataSize(s);
    return absl::OkStatus();
  }
  const size_t width = BytesPerValue(s.encoding);
  if (s.encoding == v1::ENCODING_INT8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push[", i, "] key ", key,
        ": ENCODING_INT8 is for weight deltas in pulls; gradients go in fp32, bf16, fp16, SIGN1 "
        "or TOPK"));
  }
  if (width == 0) {
    return absl::InvalidArgumentError(absl::StrCat("push[", i, "] key ", key, ": unknown encoding ",
                                                   static_cast<int>(s.encoding)));
  }
  const size_t data_size = DataSize(s);
  size_t values = 0;
  if (!p.sparse) {
    if (!s.row_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("push[", i, "] key ", key, ": row_ids (",
                                                     s.row_ids.size(),
                                                     ") given for a dense partition"));
    }
    values = static_cast<size_t>(p.num_elements);
  } else {
    if (s.row_ids.empty() && data_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("push[", i, "] key ", key,
                                                     ": row_ids missing for sparse table (",
                                                     data_size, " bytes of data)"));
    }
    values = s.row_ids.size() * p.dim;
  }
  if (data_size != values * width) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push[", i, "] key ", key, ": expected ", values, " values (", values * width, " bytes of ",
        v1::Encoding_Name(s.encoding), ") but got ", data_size, " bytes"));
  }
  TESSERA_RETURN_IF_ERROR(job.gate.AdmitSlice(key, p, request.step, &item->staleness));
  item->data_size = data_size;
  *non_finite = HasNonFinite(s);
  return absl::OkStatus();
}

// The config's checks; fills the job's dense optimizer (or why it has none).
absl::Status ValidateJobConfig(const v1::JobConfig& config,
                               absl::StatusOr<kernels::OptimizerParams>* dense_params_out) {
  if (config.num_workers() < 1 || config.num_workers() > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat("config.num_workers: must be in [1, ",
                                                   kMaxWorkers, "], got ", config.num_workers()));
  }
  if (!v1::Consistency_IsValid(config.consistency())) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.consistency: unknown value ", static_cast<int>(config.consistency())));
  }
  if (config.consistency() != v1::CONSISTENCY_SSP &&
      config.consistency() != v1::CONSISTENCY_HYBRID && config.staleness() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.staleness: only SSP and HYBRID have a staleness bound, got ",
                     config.staleness(), " for ", v1::Consistency_Name(config.consistency())));
  }
  if (!v1::NonFinitePolicy_IsValid(config.non_finite_policy())) {
    return absl::InvalidArgumentError(absl::StrCat("config.non_finite_policy: unknown value ",
                                                   static_cast<int>(config.non_finite_policy())));
  }
  absl::StatusOr<kernels::OptimizerParams>& dense_params = *dense_params_out;
  dense_params = ValidOptimizerParams(config.optimizer(), /*sparse=*/false);
  if (!dense_params.ok()) {
    // A job whose optimizer only updates sparse rows (FTRL) may still hold tables.
    absl::StatusOr<kernels::OptimizerParams> sparse_params =
        ValidOptimizerParams(config.optimizer(), /*sparse=*/true);
    if (!sparse_params.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("config.", dense_params.status().message()));
    }
  }
  absl::Status schedule = spec::ValidateSchedule(config.schedule());
  if (!schedule.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config.", schedule.message()));
  }
  return absl::OkStatus();
}

// The checks of partitions[i]; `declared` collects the keys declared so far.
absl::Status ValidatePartitionDecl(
    const v1::JobConfig& config, const v1::DensePartitionDecl& d, int i, bool has_dense_optimizer,
    absl::flat_hash_set<std::pair<std::string, uint32_t>>* declared) {
  const std::string field = absl::StrCat("partitions[", i, "]");
  if (d.key().tensor().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".key.tensor: must not be empty"));
  }
  if (d.num_elements() < 1 || d.num_elements() > kMaxPartitionElements) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".num_elements (key ", KeyName(d.key()),
                                                   "): must be in [1, ", kMaxPartitionElements,
                                                   "], got ", d.num_elements()));
  }
  if (!d.initial_values().empty() &&
      d.initial_values().size() != static_cast<size_t>(d.num_elements()) * 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".initial_values (key ", KeyName(d.key()), "): expected ", d.num_elements() * 4,
        " bytes (", d.num_elements(), " fp32 values) or none, got ", d.initial_values().size()));
  }
  if (HasNonFinite(v1::ENCODING_FP32, d.initial_values())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".initial_values (key ", KeyName(d.key()), "): holds NaN or Inf"));
  }
  if (!declared->emplace(d.key().tensor(), d.key().index()).second) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".key: ", KeyName(d.key()), " is declared twice in one request"));
  }
  if (!v1::DenseUpdate_IsValid(d.update())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".update (key ", KeyName(d.key()), "): unknown value ", d.update()));
  }
  if (!has_dense_optimizer && d.update() == v1::DENSE_UPDATE_OPTIMIZER) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " (key ", KeyName(d.key()), "): config.optimizer.kind ",
        v1::OptimizerKind_Name(config.optimizer().kind()), " cannot update dense partitions"));
  }
  return absl::OkStatus();
}

// The checks of tables[i]; fills the table's optimizer.
absl::Status ValidateTableDecl(const v1::JobConfig& config, const v1::SparseTableDecl& t, int i,
                               absl::flat_hash_set<std::pair<std::string, uint32_t>>* declared,
                               kernels::OptimizerParams* params_out) {
  const std::string field = absl::StrCat("tables[", i, "]");
  if (t.name().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".name: must not be empty"));
  }
  if (!declared->emplace(t.name(), 0u).second) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".name: ", t.name(),
                                                   " is declared twice in one request (or also as ",
                                                   t.name(), "/0)"));
  }
  if (t.dim() < 1 || t.dim() > kMaxSparseDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".dim (table ", t.name(), "): must be in [1, ", kMaxSparseDim, "], got ", t.dim()));
  }
  const v1::Initializer& init = t.initializer();
  if (!v1::Initializer::Kind_IsValid(init.kind()) || !std::isfinite(init.value()) ||
      !std::isfinite(init.scale()) || init.scale() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".initializer (table ", t.name(), "): needs a known kind and finite value and ",
        "scale >= 0, got kind ", static_cast<int>(init.kind()), " value ", init.value(), " scale ",
        init.scale()));
  }
  const absl::Status lifecycle =
      spec::ValidateRowLifecycle(t.lifecycle(), absl::StrCat(field, ".lifecycle"));
  if (!lifecycle.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(lifecycle.message(), " (table ", t.name(), ")"));
  }
  const v1::OptimizerConfig& opt = t.has_optimizer() ? t.optimizer() : config.optimizer();
  absl::StatusOr<kernels::OptimizerParams> params = ValidOptimizerParams(opt, true);
  const v1::OptimizerKind kind = opt.kind();
  if (params.ok() && kind != v1::OPTIMIZER_KIND_SGD && kind != v1::OPTIMIZER_KIND_ADAGRAD &&
      kind != v1::OPTIMIZER_KIND_ADAM && kind != v1::OPTIMIZER_KIND_FTRL) {
    params = absl::InvalidArgumentError(absl::StrCat("optimizer.kind: sparse tables take SGD, ",
                                                     "ADAGRAD, ADAM or FTRL, got ",
                                                     v1::OptimizerKind_Name(kind)));
  }
  if (!params.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, t.has_optimizer() ? "." : " (job optimizer, no override): ",
                     params.status().message(), " (table ", t.name(), ")"));
  }
  *params_out = *params;
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobRequest(const v1::CreateJobStateRequest& request,
                                absl::StatusOr<kernels::OptimizerParams>* dense_params_out,
                                std::vector<kernels::OptimizerParams>* table_params_out) {
  TESSERA_RETURN_IF_ERROR(ValidateJobId(request.job_id()));
  const v1::JobConfig& config = request.config();
  absl::StatusOr<kernels::OptimizerParams> dense_params = absl::UnknownError("unset");
  TESSERA_RETURN_IF_ERROR(ValidateJobConfig(config, &dense_params));
  // Validate every declaration before touching any state.
  absl::flat_hash_set<std::pair<std::string, uint32_t>> declared;
  for (int i = 0; i < request.partitions_size(); ++i) {
    TESSERA_RETURN_IF_ERROR(
        ValidatePartitionDecl(config, request.partitions(i), i, dense_params.ok(), &declared));
  }
  std::vector<kernels::OptimizerParams> table_params(request.tables_size());
  for (int i = 0; i < request.tables_size(); ++i) {
    TESSERA_RETURN_IF_ERROR(
        ValidateTableDecl(config, request.tables(i), i, &declared, &table_params[i]));
  }
  if (config.checkpoint_every_steps() < 0 || config.checkpoint_every_steps() > kMaxStep) {
    return absl::InvalidArgumentError(absl::StrCat("config.checkpoint_every_steps: must be in [0, ",
                                                   kMaxStep, "], got ",
                                                   config.checkpoint_every_steps()));
  }
  if (!(config.pull_topk_fraction() >= 0 && config.pull_topk_fraction() <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.pull_topk_fraction: must be in (0, 1] (or 0 for ",
                     kDefaultPullTopKFraction, "), got ", config.pull_topk_fraction()));
  }
  *dense_params_out = std::move(dense_params);
  *table_params_out = std::move(table_params);
  return absl::OkStatus();
}

absl::Status CheckPullCaller(const JobState& job, uint32_t worker_id, v1::Encoding encoding,
                             absl::string_view encoding_field) {
  if (encoding == v1::ENCODING_SIGN1) {
    return absl::InvalidArgumentError(absl::StrCat(
        encoding_field, ": ", v1::Encoding_Name(encoding),
        " compresses pushed gradients only; weights are pulled in fp32, bf16, fp16 or as TOPK "
        "or INT8 deltas"));
  }
  if (BytesPerValue(encoding) == 0 && !IsWeightDelta(encoding)) {
    return absl::InvalidArgumentError(
        absl::StrCat(encoding_field, ": unknown encoding ", static_cast<int>(encoding)));
  }
  if (worker_id >= job.gate.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("worker_id: ", worker_id,
                                                   " is out of range for job '", job.id,
                                                   "' (num_workers ", job.gate.num_workers(), ")"));
  }
  return absl::OkStatus();
}

absl::Status ResolvePush(const JobState& job, const PushPullView& request,
                         std::vector<PushSlice>* items) {
  TESSERA_RETURN_IF_ERROR(CheckPusher(job, request));
  if (request.push.empty()) return absl::OkStatus();
  const uint64_t min_incarnation = job.min_incarnation.load(std::memory_order_acquire);
  if (request.incarnation < min_incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation: ", request.incarnation, " of worker ", request.worker_id, " is older than ",
        min_incarnation, ", the oldest job '", job.id, "' accepts since it was restored"));
  }
  TESSERA_RETURN_IF_ERROR(job.gate.AdmitPusher(request.worker_id, request.step, job.id));
  items->reserve(request.push.size());
  absl::flat_hash_set<const Partition*> seen;
  const bool skip_policy = job.config.non_finite_policy() == v1::NON_FINITE_POLICY_SKIP;
  for (size_t i = 0; i < request.push.size(); ++i) {
    const SliceView& s = request.push[i];
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Partition> p, job.Find(s));
    const std::string key = KeyName(s);
    PushSlice item;
    bool non_finite = false;
    TESSERA_RETURN_IF_ERROR(CheckPushSlice(job, request, i, key, *p, &item, &non_finite));
    item.slice = item.joined != nullptr ? &item.joined->view : &s;
    item.partition = std::move(p);
    if (non_finite) {
      if (!skip_policy) {
        return absl::InvalidArgumentError(absl::StrCat(
            "push[", i, "] key ", key, ": gradient holds NaN or Inf (non_finite_policy REJECT)"));
      }
      item.skip = true;
    }
    if (!seen.insert(item.partition.get()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("push[", i, "] key ", key, ": key appears twice in one request"));
    }
    items->push_back(std::move(item));
  }
  return absl::OkStatus();
}

absl::Status ResolvePulls(const JobState& job, const PushPullView& request, bool one_message,
                          size_t max_message_bytes, std::vector<PullItem>* items) {
  const int64_t step = request.step;
  // A weight delta (TOPK, INT8) is never larger than the weights in FP32
  // (server/published_weights.h).
  const bool deltas = IsWeightDelta(request.pull_encoding);
  const size_t width = deltas ? sizeof(float) : BytesPerValue(request.pull_encoding);
  const size_t limit = max_message_bytes;
  size_t total = 0;
  absl::flat_hash_set<const Partition*> pulled;
  // A sparse push without rows (a BSP "nothing this step" contribution) may want weights: it
  // gets an empty slice back.
  auto add = [&](const SliceView& s, int64_t gate_step, absl::string_view field,
                 bool from_push) -> absl::Status {
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Partition> p, job.Find(s));
    if (!p->sparse && !s.row_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, " key ", KeyName(s), ": row_ids (",
                                                     s.row_ids.size(),
                                                     ") given for a dense partition"));
    }
    if (s.all_rows) {
      if (!p->sparse || !s.row_ids.empty() || one_message) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " key ", KeyName(s),
                         ": all_rows is for a sparse table's Pull, without row_ids"));
      }
    } else if (p->sparse && s.row_ids.empty() && !from_push) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " key ", KeyName(s), ": row_ids missing for sparse table"));
    }
    // A push key twice is refused by ResolvePush before anything is read.
    if (!from_push && !pulled.insert(p.get()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " key ", KeyName(s), ": key appears twice in one request"));
    }
    // Check the size of the answer before anything is read or parked.
    const size_t values =
        p->sparse ? s.row_ids.size() * p->dim : static_cast<size_t>(p->num_elements);
    total += values * width;
    if (limit != 0 && values * width > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat(field, " key ", KeyName(s), ": the answer takes ", values * width,
                       " bytes, over the message limit of ", limit, " bytes; pull fewer rows"));
    }
    if (limit != 0 && one_message && total > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat(field, " key ", KeyName(s), ": the answer takes at least ", total,
                       " bytes, over the message limit of ", limit, " bytes; pull fewer keys"));
    }
    TESSERA_RETURN_IF_ERROR(job.gate.CheckPullStep(field, s, *p, gate_step));
    PullItem item;
    item.partition = std::move(p);
    item.key.set_tensor(std::string(s.tensor));
    item.key.set_index(s.index);
    item.row_ids.assign(s.row_ids.begin(), s.row_ids.end());
    item.all_rows = s.all_rows;
    item.gate_step = gate_step;
    if (deltas && !item.partition->sparse) {
      item.held_weights = s.weights_id;
      item.delta_fraction = job.config.pull_topk_fraction() == 0 ? kDefaultPullTopKFraction
                                                                 : job.config.pull_topk_fraction();
    }
    items->push_back(std::move(item));
    return absl::OkStatus();
  };
  for (size_t i = 0; i < request.pull.size(); ++i) {
    TESSERA_RETURN_IF_ERROR(
        add(request.pull[i], step, absl::StrCat("pull[", i, "]"), /*from_push=*/false));
  }
  for (size_t i = 0; i < request.push.size(); ++i) {
    if (!request.push[i].want_weights) continue;
    // The rows of a sparse push are the rows wanted back.
    TESSERA_RETURN_IF_ERROR(
        add(request.push[i], step + 1, absl::StrCat("push[", i, "]"), /*from_push=*/true));
  }
  return absl::OkStatus();
}

}  // namespace tessera::server
