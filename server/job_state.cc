#include "server/job_state.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera::server {

JobState::JobState(std::string job_id, const v1::JobConfig& cfg,
                   absl::StatusOr<kernels::OptimizerParams> p, std::shared_ptr<MemoryBudget> b,
                   int64_t bytes, std::shared_ptr<ShardCounters> c)
    : id(std::move(job_id)),
      config(cfg),
      dense_params(std::move(p)),
      gate(cfg.consistency(), cfg.staleness(), cfg.num_workers()),
      budget(std::move(b)),
      charged(bytes),
      counters(std::move(c)) {}

JobState::~JobState() { budget->Release(charged); }

int64_t JobState::FixedBytes(uint32_t workers, size_t id_size) {
  return static_cast<int64_t>(sizeof(JobState) + id_size) + int64_t{workers} * 10;
}

absl::StatusOr<std::shared_ptr<Partition>> JobState::Find(const SliceView& key) const {
  const std::pair<std::string, uint32_t> name(std::string(key.tensor), key.index);
  absl::ReaderMutexLock lock(&mu);
  auto it = dense.find(name);
  if (it != dense.end()) return it->second;
  if (key.index == 0) {
    auto t = tables.find(name.first);
    if (t != tables.end()) return t->second;
  }
  return absl::NotFoundError(
      absl::StrCat("job '", id, "': unknown key ", KeyName(key), " on this shard"));
}

std::vector<std::shared_ptr<Partition>> JobState::AllPartitions() const {
  absl::ReaderMutexLock lock(&mu);
  std::vector<std::shared_ptr<Partition>> out;
  out.reserve(dense.size() + tables.size());
  for (const auto& [k, p] : dense) out.push_back(p);
  for (const auto& [k, p] : tables) out.push_back(p);
  return out;
}

uint32_t JobState::NumDense() const {
  absl::ReaderMutexLock lock(&mu);
  return static_cast<uint32_t>(dense.size());
}

uint32_t JobState::NumTables() const {
  absl::ReaderMutexLock lock(&mu);
  return static_cast<uint32_t>(tables.size());
}

absl::Status JobState::CheckRedeclarationsLocked(const v1::CreateJobStateRequest& request) const {
  for (int i = 0; i < request.partitions_size(); ++i) {
    const v1::DensePartitionDecl& d = request.partitions(i);
    auto it = dense.find(std::make_pair(d.key().tensor(), d.key().index()));
    if (it != dense.end() && it->second->num_elements != d.num_elements()) {
      return absl::FailedPreconditionError(
          absl::StrCat("partitions[", i, "]: key ", KeyName(d.key()), " already exists with ",
                       it->second->num_elements, " elements, redeclared with ", d.num_elements()));
    }
    if (it != dense.end() && it->second->average != (d.update() == v1::DENSE_UPDATE_AVERAGE)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partitions[", i, "]: key ", KeyName(d.key()), " already exists with update ",
          it->second->average ? "DENSE_UPDATE_AVERAGE" : "DENSE_UPDATE_OPTIMIZER",
          ", redeclared with ", v1::DenseUpdate_Name(d.update())));
    }
    if (d.key().index() == 0 && tables.contains(d.key().tensor())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partitions[", i, "]: key ", KeyName(d.key()), " is already a sparse table"));
    }
  }
  for (int i = 0; i < request.tables_size(); ++i) {
    const v1::SparseTableDecl& t = request.tables(i);
    auto it = tables.find(t.name());
    if (it != tables.end() && it->second->table_decl != t.SerializeAsString()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tables[", i, "]: table ", t.name(), " already exists with dim ", it->second->dim,
          " and another declaration (redeclared with dim ", t.dim(), ")"));
    }
    if (dense.contains(std::make_pair(t.name(), 0u))) {
      return absl::FailedPreconditionError(
          absl::StrCat("tables[", i, "]: ", t.name(), " is already a dense tensor"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateJobStateResponse> JobState::AddDeclared(
    const v1::CreateJobStateRequest& request,
    const std::vector<kernels::OptimizerParams>& table_params, int64_t next_capture) {
  const uint32_t workers = request.config().num_workers();
  const int dense_slots = dense_params.ok() ? kernels::NumSlots(dense_params->kind) : 0;
  auto dense_bytes = [&](const v1::DensePartitionDecl& d) {
    return Partition::FixedBytes(workers, KeyName(d.key()).size()) +
           d.num_elements() * 4 * (1 + (d.update() == v1::DENSE_UPDATE_AVERAGE ? 0 : dense_slots));
  };
  auto table_bytes = [&](const v1::SparseTableDecl& t) {
    return Partition::FixedBytes(workers, t.name().size() + 2) +
           static_cast<int64_t>(t.ByteSizeLong());
  };

  // 1. Under the job's lock: check, pick what is new and reserve its bytes.
  std::vector<int> new_dense;
  std::vector<int> new_tables;
  {
    absl::MutexLock lock(&mu);
    TESSERA_RETURN_IF_ERROR(CheckRedeclarationsLocked(request));
    int64_t bytes = 0;
    for (int i = 0; i < request.partitions_size(); ++i) {
      const v1::DensePartitionDecl& d = request.partitions(i);
      if (dense.contains(std::make_pair(d.key().tensor(), d.key().index()))) continue;
      new_dense.push_back(i);
      bytes += dense_bytes(d);
    }
    for (int i = 0; i < request.tables_size(); ++i) {
      if (tables.contains(request.tables(i).name())) continue;
      new_tables.push_back(i);
      bytes += table_bytes(request.tables(i));
    }
    if (bytes > 0 && !budget->TryReserve(bytes)) {
      return budget->Exhausted(
          absl::StrCat("the partitions and tables of job '", id, "' declared here"), bytes);
    }
  }

  // 2. Without it: allocate and fill (up to gigabytes), while the job's pushes and pulls go on.
  // Each partition owns its share of the reservation and gives it back if it is not inserted.
  PartitionSetup setup;
  setup.budget = budget;
  setup.counters = counters;
  setup.schedule = config.schedule();
  setup.workers = workers;
  setup.next_capture = next_capture;
  std::vector<std::shared_ptr<Partition>> new_partitions;
  for (int i : new_dense) {
    const v1::DensePartitionDecl& d = request.partitions(i);
    // An averaging partition uses no optimizer; a job with only those may have none for dense.
    new_partitions.push_back(Partition::Dense(
        d, dense_params.ok() ? *dense_params : kernels::OptimizerParams{}, setup, dense_bytes(d)));
  }
  std::vector<std::shared_ptr<Partition>> new_table_states;
  for (int i : new_tables) {
    const v1::SparseTableDecl& t = request.tables(i);
    new_table_states.push_back(Partition::Table(t, table_params[i], setup, table_bytes(t)));
  }

  // 3. Under the lock again: a concurrent call may have declared some of the keys meanwhile, so
  // check again; keys now present keep their partition (the new one is dropped).
  absl::MutexLock lock(&mu);
  TESSERA_RETURN_IF_ERROR(CheckRedeclarationsLocked(request));
  for (size_t k = 0; k < new_dense.size(); ++k) {
    const v1::PartitionKey& key = request.partitions(new_dense[k]).key();
    dense.try_emplace(std::make_pair(key.tensor(), key.index()), std::move(new_partitions[k]));
  }
  for (size_t k = 0; k < new_tables.size(); ++k) {
    tables.try_emplace(request.tables(new_tables[k]).name(), std::move(new_table_states[k]));
  }
  num_partitions.store(dense.size() + tables.size(), std::memory_order_release);
  v1::CreateJobStateResponse response;
  response.set_partitions(static_cast<uint32_t>(dense.size()));
  response.set_tables(static_cast<uint32_t>(tables.size()));
  return response;
}

absl::Status JobState::UpdateMembership(const std::vector<uint32_t>& live, int64_t effective_step) {
  absl::MutexLock lock(&membership_mu);
  TESSERA_RETURN_IF_ERROR(gate.UpdateMembership(live, effective_step));
  absl::MutexLock log_lock(&log_mu);
  while (!membership_log.empty() && membership_log.back().effective_step() >= effective_step) {
    membership_log.pop_back();
  }
  v1::CheckpointMembership entry;
  entry.set_effective_step(effective_step);
  for (uint32_t w : live) entry.add_live_workers(w);
  membership_log.push_back(std::move(entry));
  return absl::OkStatus();
}

std::vector<v1::CheckpointMembership> JobState::MembershipLog() const {
  absl::MutexLock lock(&log_mu);
  return membership_log;
}

}  // namespace tessera::server
