#include "server/checkpoint_restore.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/partition.h"
#include "server/request_validation.h"
#include "server/store_limits.h"

namespace tessera::server {
namespace {

absl::Status Loss(const v1::CheckpointHeader& h, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("checkpoint of step ", h.step(), ": ", what));
}

// The header's job as a CreateJobState request, validated as one, and its membership entries
// checked.
absl::Status CheckHeader(const v1::CheckpointHeader& h, v1::CreateJobStateRequest* request,
                         absl::StatusOr<kernels::OptimizerParams>* dense_params,
                         std::vector<kernels::OptimizerParams>* table_params) {
  if (h.format_version() != 1) {
    return Loss(h, absl::StrCat("unknown format_version ", h.format_version()));
  }
  if (h.step() < 0 || h.step() > kMaxStep) return Loss(h, absl::StrCat("bad step ", h.step()));
  request->set_job_id(h.job_id());
  *request->mutable_config() = h.config();
  for (const v1::PartitionCheckpoint& pc : h.partitions()) {
    if (!pc.sparse()) {
      v1::DensePartitionDecl* d = request->add_partitions();
      *d->mutable_key() = pc.key();
      d->set_num_elements(pc.num_elements());
      d->set_update(pc.update());
    } else {
      if (pc.key().tensor() != pc.table().name() || pc.key().index() != 0) {
        return Loss(h, absl::StrCat("table ", pc.table().name(), " has key ", KeyName(pc.key())));
      }
      *request->add_tables() = pc.table();
    }
  }
  absl::Status valid = ValidateJobRequest(*request, dense_params, table_params);
  if (!valid.ok()) return Loss(h, valid.message());
  const uint32_t workers = h.config().num_workers();
  // Each entry becomes a bit per worker in the gate: no more than the header's own size justifies.
  if (static_cast<uint64_t>(h.membership_size()) * ((workers + 7) / 8) >
      h.ByteSizeLong() * 8 + (uint64_t{1} << 20)) {
    return Loss(h,
                absl::StrCat(h.membership_size(), " membership entries for ", workers, " workers"));
  }
  for (const v1::CheckpointMembership& m : h.membership()) {
    if (m.effective_step() < 0 || m.effective_step() > kMaxStep || m.live_workers().empty()) {
      return Loss(h, absl::StrCat("bad membership entry at step ", m.effective_step()));
    }
    for (uint32_t w : m.live_workers()) {
      if (w >= workers) return Loss(h, absl::StrCat("membership names worker ", w));
    }
  }
  return absl::OkStatus();
}

// Every partition's version, clocks and seqs in range, and every range of exactly the expected
// size inside the data section.
absl::Status CheckPartitions(const v1::CheckpointHeader& h, absl::string_view data,
                             const kernels::OptimizerParams* dense_params,
                             const std::vector<kernels::OptimizerParams>& table_params) {
  const uint32_t workers = h.config().num_workers();
  auto check_range = [&](const v1::CheckpointRange& r, uint64_t bytes,
                         absl::string_view what) -> absl::Status {
    if (r.length() != bytes || r.offset() > data.size() || r.length() > data.size() - r.offset()) {
      return Loss(h, absl::StrCat(what, ": range [", r.offset(), ", +", r.length(), ") of a ",
                                  data.size(), "-byte data section, expected ", bytes, " bytes"));
    }
    return absl::OkStatus();
  };
  size_t table_i = 0;
  for (const v1::PartitionCheckpoint& pc : h.partitions()) {
    const std::string name = KeyName(pc.key());
    if (pc.version() < 0 || pc.version() > kMaxStep) {
      return Loss(h, absl::StrCat(name, ": bad version ", pc.version()));
    }
    if (pc.clocks_size() != static_cast<int>(workers)) {
      return Loss(h,
                  absl::StrCat(name, ": ", pc.clocks_size(), " clocks for ", workers, " workers"));
    }
    for (int64_t c : pc.clocks()) {
      if (c < 0 || c > kMaxStep) return Loss(h, absl::StrCat(name, ": bad clock ", c));
    }
    for (const v1::CheckpointSeq& seq : pc.last_applied()) {
      if (seq.worker() >= workers) {
        return Loss(h, absl::StrCat(name, ": seq of worker ", seq.worker()));
      }
    }
    if (!pc.sparse()) {
      // The header validated as a request: an optimizer partition has a dense optimizer.
      const int slots =
          pc.update() == v1::DENSE_UPDATE_AVERAGE ? 0 : kernels::NumSlots(dense_params->kind);
      const uint64_t bytes = static_cast<uint64_t>(pc.num_elements()) * 4;
      TESSERA_RETURN_IF_ERROR(check_range(pc.weights(), bytes, absl::StrCat(name, " weights")));
      if (pc.slots_size() != slots) {
        return Loss(h,
                    absl::StrCat(name, ": ", pc.slots_size(), " slots, the optimizer has ", slots));
      }
      for (const v1::CheckpointRange& r : pc.slots()) {
        TESSERA_RETURN_IF_ERROR(check_range(r, bytes, absl::StrCat(name, " slot")));
      }
    } else {
      const kernels::OptimizerParams& params = table_params[table_i++];
      const uint64_t rows = pc.num_rows();
      if (rows > data.size() / 8) return Loss(h, absl::StrCat(name, ": ", rows, " rows"));
      const uint64_t width = uint64_t{pc.table().dim()} * (1 + kernels::NumSlots(params.kind));
      if (width != 0 && rows > data.size() / 4 / width) {
        return Loss(h, absl::StrCat(name, ": ", rows, " rows of ", width, " values"));
      }
      TESSERA_RETURN_IF_ERROR(check_range(pc.row_ids(), rows * 8, absl::StrCat(name, " row_ids")));
      TESSERA_RETURN_IF_ERROR(
          check_range(pc.row_updates(), rows * 8, absl::StrCat(name, " row_updates")));
      TESSERA_RETURN_IF_ERROR(
          check_range(pc.row_values(), rows * width * 4, absl::StrCat(name, " row_values")));
      // Files from before row lifecycles have neither last clocks nor pending ids.
      if (pc.has_row_last_clocks()) {
        TESSERA_RETURN_IF_ERROR(
            check_range(pc.row_last_clocks(), rows * 8, absl::StrCat(name, " row_last_clocks")));
      }
      const uint64_t pending = pc.num_pending();
      if (pending > data.size() / 20) return Loss(h, absl::StrCat(name, ": ", pending, " pending"));
      if (pending > 0) {
        TESSERA_RETURN_IF_ERROR(
            check_range(pc.pending_ids(), pending * 8, absl::StrCat(name, " pending_ids")));
        TESSERA_RETURN_IF_ERROR(check_range(pc.pending_sightings(), pending * 4,
                                            absl::StrCat(name, " pending_sightings")));
        TESSERA_RETURN_IF_ERROR(check_range(pc.pending_last_clocks(), pending * 8,
                                            absl::StrCat(name, " pending_last_clocks")));
      }
    }
  }
  return absl::OkStatus();
}

// Sets p's state from its checkpoint `pc`, whose ranges were checked against `data`.
absl::Status FillPartition(const v1::CheckpointHeader& h, const v1::PartitionCheckpoint& pc,
                           absl::string_view data, MemoryBudget& budget, Partition& p) {
  auto at = [&](const v1::CheckpointRange& r) { return data.data() + r.offset(); };
  const uint32_t workers = h.config().num_workers();
  absl::MutexLock lock(&p.mu);
  p.version.store(pc.version(), std::memory_order_relaxed);
  for (uint32_t w = 0; w < workers; ++w) p.clocks[w].store(pc.clocks(static_cast<int>(w)));
  for (const v1::CheckpointSeq& seq : pc.last_applied()) {
    p.RecordAppliedLocked(seq.worker(), seq.incarnation(), seq.seq());
  }
  if (!pc.sparse()) {
    std::memcpy(p.MutableWeightsLocked(), at(pc.weights()), pc.weights().length());
    for (int s = 0; s < pc.slots_size(); ++s) {
      std::memcpy(p.slots[s].data(), at(pc.slots(s)), pc.slots(s).length());
    }
    return absl::OkStatus();
  }
  const size_t rows = pc.num_rows();
  const size_t pending = pc.num_pending();
  const size_t width = static_cast<size_t>(p.dim) * (1 + p.num_slots);
  const int64_t bytes = static_cast<int64_t>(rows) * p.RowBytes() +
                        static_cast<int64_t>(pending) * kernels::SparseRows::PendingBytes();
  if (!budget.TryReserve(bytes)) {
    return budget.Exhausted(absl::StrCat("restoring table ", p.name), bytes);
  }
  p.charged.fetch_add(bytes, std::memory_order_relaxed);
  auto read = [](const char* base, size_t i, auto* out) {
    std::memcpy(out, base + sizeof(*out) * i, sizeof(*out));
  };
  const char* ids = at(pc.row_ids());
  const char* updates = at(pc.row_updates());
  const char* values = at(pc.row_values());
  const char* last_clocks = pc.has_row_last_clocks() ? at(pc.row_last_clocks()) : nullptr;
  std::vector<float> row(width);
  for (size_t i = 0; i < rows; ++i) {
    int64_t id, row_updates, last_clock = pc.version();
    read(ids, i, &id);
    read(updates, i, &row_updates);
    if (last_clocks != nullptr) read(last_clocks, i, &last_clock);
    std::memcpy(row.data(), values + 4 * width * i, 4 * width);
    const absl::Status added = p.rows->RestoreRow(id, row_updates, last_clock, row);
    if (!added.ok()) return Loss(h, absl::StrCat(p.name, ": ", added.message()));
  }
  for (size_t i = 0; i < pending; ++i) {
    int64_t id, last_clock;
    uint32_t sightings;
    read(at(pc.pending_ids()), i, &id);
    read(at(pc.pending_sightings()), i, &sightings);
    read(at(pc.pending_last_clocks()), i, &last_clock);
    const absl::Status added = p.rows->RestorePending(id, sightings, last_clock);
    if (!added.ok()) return Loss(h, absl::StrCat(p.name, ": ", added.message()));
  }
  p.rows->RestoreCounts(pc.row_counts());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointToRestore> ReadCheckpointToRestore(const std::string& checkpoint_dir,
                                                            uint32_t shard_index,
                                                            const v1::RestoreRequest& request) {
  if (checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints need a data directory: --data_dir not set on this shard");
  }
  TESSERA_RETURN_IF_ERROR(ValidateJobId(request.job_id()));
  if (request.step() < 1 || request.step() > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: must be in [1, ", kMaxStep, "], got ", request.step()));
  }
  CheckpointToRestore out;
  out.path = CheckpointPath(checkpoint_dir, request.job_id(), request.step(), shard_index);
  TESSERA_ASSIGN_OR_RETURN(out.contents, ReadCheckpointFile(out.path));
  const v1::CheckpointHeader& h = out.contents.header;
  if (h.job_id() != request.job_id() || h.step() != request.step() ||
      h.shard_index() != shard_index) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint file ", out.path, " holds job '", absl::CHexEscape(h.job_id().substr(0, 160)),
        "' step ", h.step(), " shard ", h.shard_index(), ", not what its name says"));
  }
  // Files of this job already on disk may be committed: the restored job never deletes them as
  // unrequested.
  out.protect_through = h.step();
  absl::StatusOr<std::vector<int64_t>> existing =
      ListCheckpointSteps(absl::StrCat(checkpoint_dir, "/", request.job_id()), shard_index);
  if (existing.ok() && !existing->empty()) {
    out.protect_through = std::max(out.protect_through, existing->back());
  }
  return out;
}

absl::StatusOr<std::shared_ptr<JobState>> BuildJobFromCheckpoint(
    const CheckpointContents& contents, uint64_t min_incarnation, int64_t protect_through,
    const std::shared_ptr<MemoryBudget>& budget, const std::shared_ptr<ShardCounters>& counters) {
  const v1::CheckpointHeader& h = contents.header;
  v1::CreateJobStateRequest request;
  absl::StatusOr<kernels::OptimizerParams> dense_params = absl::UnknownError("unset");
  std::vector<kernels::OptimizerParams> table_params;
  TESSERA_RETURN_IF_ERROR(CheckHeader(h, &request, &dense_params, &table_params));
  TESSERA_RETURN_IF_ERROR(CheckPartitions(
      h, contents.data, dense_params.ok() ? &*dense_params : nullptr, table_params));

  // Build the new job aside; nothing of the current one changes until the swap.
  const uint32_t workers = h.config().num_workers();
  const int64_t fixed = JobState::FixedBytes(workers, h.job_id().size());
  if (!budget->TryReserve(fixed)) {
    return budget->Exhausted(absl::StrCat("restoring job '", h.job_id(), "'"), fixed);
  }
  auto job =
      std::make_shared<JobState>(h.job_id(), h.config(), dense_params, budget, fixed, counters);
  {
    absl::MutexLock lock(&job->checkpoints.mu);
    job->checkpoints.retired = true;  // no captures until it is swapped in and its partitions set
    job->checkpoints.max_requested_step = std::max(protect_through, h.step());
  }
  TESSERA_RETURN_IF_ERROR(job->AddDeclared(request, table_params, kNoCapture).status());
  for (const v1::CheckpointMembership& m : h.membership()) {
    std::vector<uint32_t> live(m.live_workers().begin(), m.live_workers().end());
    absl::Status s = job->UpdateMembership(live, m.effective_step());
    if (!s.ok()) return Loss(h, s.message());
  }
  job->min_incarnation.store(std::max(min_incarnation, h.min_incarnation()));
  for (const v1::PartitionCheckpoint& pc : h.partitions()) {
    SliceView key;
    key.tensor = pc.key().tensor();
    key.index = pc.key().index();
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Partition> p, job->Find(key));
    TESSERA_RETURN_IF_ERROR(FillPartition(h, pc, contents.data, *budget, *p));
  }
  return job;
}

}  // namespace tessera::server
