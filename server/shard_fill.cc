#include "server/shard_fill.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "server/partition.h"

namespace tessera::server {
namespace {

absl::Status Loss(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("fill: ", what));
}

// The bytes of `range` in `contents`' data; DATA_LOSS when it lies outside.
absl::StatusOr<absl::string_view> Bytes(const CheckpointContents& contents,
                                        const v1::CheckpointRange& range, absl::string_view what) {
  const std::string& data = contents.data;
  if (range.offset() > data.size() || range.length() > data.size() - range.offset()) {
    return Loss(absl::StrCat(what, ": range [", range.offset(), ", +", range.length(),
                             ") outside a ", data.size(), "-byte data section"));
  }
  return absl::string_view(data).substr(range.offset(), range.length());
}

// The data section being cut, and the ranges of what goes into it.
class DataBuilder {
 public:
  v1::CheckpointRange Append(absl::string_view bytes) {
    v1::CheckpointRange range;
    range.set_offset(data_.size());
    range.set_length(bytes.size());
    data_.append(bytes.data(), bytes.size());
    return range;
  }
  std::string Take() { return std::move(data_); }

 private:
  std::string data_;
};

template <typename T>
T ReadAt(absl::string_view bytes, size_t i) {
  T value;
  std::memcpy(&value, bytes.data() + i * sizeof(T), sizeof(T));
  return value;
}

template <typename T>
void AppendValue(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// One sparse table's rows and pending ids, as they are cut.
struct TableCut {
  v1::PartitionCheckpoint partition;  // the first source's, without its rows
  absl::flat_hash_set<int64_t> ids;   // rows and pending ids taken
  uint64_t stride = 0;                // bytes per row of row_values; 0 until a source had rows
  std::string row_ids, row_updates, row_values, row_last_clocks;
  std::string pending_ids, pending_sightings, pending_last_clocks;
  uint64_t rows = 0, pending = 0;
};

// The position in `source_shards` of the first source that holds a copy of `home` (-1: none).
int FirstSourceHolding(int home, const std::vector<int>& source_shards, int num_shards,
                       int replicas) {
  for (size_t k = 0; k < source_shards.size(); ++k) {
    if (HoldsCopyOf(home, source_shards[k], num_shards, replicas)) return static_cast<int>(k);
  }
  return -1;
}

std::vector<int> SourceShards(const std::vector<CheckpointContents>& sources) {
  std::vector<int> out;
  for (const CheckpointContents& s : sources) {
    out.push_back(static_cast<int>(s.header.shard_index()));
  }
  return out;
}

// True when the partitions of this kind are captured at an exact step boundary (BSP gating):
// a copy then holds no push of its step or later.
bool ExactCut(const v1::JobConfig& config, bool sparse) {
  return config.consistency() == v1::CONSISTENCY_BSP ||
         (config.consistency() == v1::CONSISTENCY_HYBRID && !sparse);
}

// Cuts from `source` (position `source_pos` in `source_shards`) the rows and pending ids that
// shard `shard` holds and that this source is the first to hold a copy of.
absl::Status CutTable(const CheckpointContents& source, const v1::PartitionCheckpoint& pc,
                      uint32_t shard, int num_shards, int replicas,
                      const std::vector<int>& source_shards, int source_pos, TableCut* cut) {
  const std::string& job = source.header.job_id();
  const std::string& table = pc.key().tensor();
  const std::string what = absl::StrCat("table '", table, "'");
  const uint64_t rows = pc.num_rows();
  TESSERA_ASSIGN_OR_RETURN(absl::string_view ids, Bytes(source, pc.row_ids(), what));
  TESSERA_ASSIGN_OR_RETURN(absl::string_view updates, Bytes(source, pc.row_updates(), what));
  TESSERA_ASSIGN_OR_RETURN(absl::string_view values, Bytes(source, pc.row_values(), what));
  absl::string_view last_clocks;
  if (pc.has_row_last_clocks()) {
    TESSERA_ASSIGN_OR_RETURN(last_clocks, Bytes(source, pc.row_last_clocks(), what));
  }
  if (ids.size() != rows * 8 || updates.size() != rows * 8 ||
      (!last_clocks.empty() && last_clocks.size() != rows * 8) ||
      (rows > 0 && values.size() % rows != 0)) {
    return Loss(absl::StrCat(what, ": ranges do not match its ", rows, " rows"));
  }
  if (rows > 0) {
    const uint64_t stride = values.size() / rows;
    if (cut->stride != 0 && cut->stride != stride) {
      return Loss(absl::StrCat(what, ": rows of ", stride, " bytes here, ", cut->stride,
                               " in another source"));
    }
    cut->stride = stride;
  }
  for (uint64_t i = 0; i < rows; ++i) {
    const int64_t id = ReadAt<int64_t>(ids, i);
    const int home = ShardOfSparseRow(job, table, id, num_shards);
    if (!HoldsCopyOf(home, static_cast<int>(shard), num_shards, replicas) ||
        FirstSourceHolding(home, source_shards, num_shards, replicas) != source_pos) {
      continue;
    }
    if (!cut->ids.insert(id).second) continue;
    AppendValue(&cut->row_ids, id);
    AppendValue(&cut->row_updates, ReadAt<int64_t>(updates, i));
    cut->row_values.append(values.data() + i * cut->stride, cut->stride);
    AppendValue(&cut->row_last_clocks,
                last_clocks.empty() ? pc.version() : ReadAt<int64_t>(last_clocks, i));
    ++cut->rows;
  }
  const uint64_t pending = pc.num_pending();
  if (pending == 0) return absl::OkStatus();
  TESSERA_ASSIGN_OR_RETURN(absl::string_view p_ids, Bytes(source, pc.pending_ids(), what));
  TESSERA_ASSIGN_OR_RETURN(absl::string_view p_sightings,
                           Bytes(source, pc.pending_sightings(), what));
  TESSERA_ASSIGN_OR_RETURN(absl::string_view p_clocks,
                           Bytes(source, pc.pending_last_clocks(), what));
  if (p_ids.size() != pending * 8 || p_sightings.size() != pending * 4 ||
      p_clocks.size() != pending * 8) {
    return Loss(absl::StrCat(what, ": ranges do not match its ", pending, " pending ids"));
  }
  for (uint64_t i = 0; i < pending; ++i) {
    const int64_t id = ReadAt<int64_t>(p_ids, i);
    const int home = ShardOfSparseRow(job, table, id, num_shards);
    if (!HoldsCopyOf(home, static_cast<int>(shard), num_shards, replicas) ||
        FirstSourceHolding(home, source_shards, num_shards, replicas) != source_pos) {
      continue;
    }
    if (!cut->ids.insert(id).second) continue;
    AppendValue(&cut->pending_ids, id);
    AppendValue(&cut->pending_sightings, ReadAt<uint32_t>(p_sightings, i));
    AppendValue(&cut->pending_last_clocks, ReadAt<int64_t>(p_clocks, i));
    ++cut->pending;
  }
  return absl::OkStatus();
}

std::string DenseName(const v1::PartitionKey& key) {
  return absl::StrCat(key.tensor(), "#", key.index());
}

}  // namespace

bool HoldsCopyOf(int home, int shard, int num_shards, int replicas) {
  const int distance = ((shard - home) % num_shards + num_shards) % num_shards;
  return distance < replicas;
}

absl::StatusOr<CheckpointContents> CutFill(const std::vector<CheckpointContents>& sources,
                                           uint32_t shard, int num_shards, int replicas) {
  if (sources.empty()) return absl::InvalidArgumentError("fill: no source files");
  if (num_shards < 1 || replicas < 1 || replicas > num_shards ||
      static_cast<int>(shard) >= num_shards) {
    return absl::InvalidArgumentError(absl::StrCat("fill: shard ", shard, " of ", num_shards,
                                                   " shards with ", replicas, " copies"));
  }
  const v1::CheckpointHeader& first = sources.front().header;
  CheckpointContents out;
  out.header = first;
  out.header.clear_partitions();
  out.header.set_shard_index(shard);
  for (const CheckpointContents& source : sources) {
    const v1::CheckpointHeader& h = source.header;
    if (h.job_id() != first.job_id() || h.step() != first.step()) {
      return Loss(absl::StrCat("a source holds job '", h.job_id(), "' step ", h.step(),
                               ", another job '", first.job_id(), "' step ", first.step()));
    }
    out.header.set_min_incarnation(std::max(out.header.min_incarnation(), h.min_incarnation()));
  }
  DataBuilder data;
  std::set<std::string> dense_taken;
  std::vector<std::string> table_order;
  std::map<std::string, TableCut> tables;
  const std::vector<int> source_shards = SourceShards(sources);
  const bool exact_tables = ExactCut(first.config(), /*sparse=*/true);
  for (size_t pos = 0; pos < sources.size(); ++pos) {
    const CheckpointContents& source = sources[pos];
    for (const v1::PartitionCheckpoint& pc : source.header.partitions()) {
      if (pc.sparse()) {
        auto [it, added] = tables.try_emplace(pc.key().tensor());
        if (added) {
          table_order.push_back(pc.key().tensor());
          it->second.partition = pc;
        } else if (!exact_tables) {
          // Rows from sources captured at different moments: a worker's pushes are all in only
          // up to its smallest clock (the kept pushes bring it up).
          v1::PartitionCheckpoint& kept = it->second.partition;
          for (int w = 0; w < kept.clocks_size() && w < pc.clocks_size(); ++w) {
            kept.set_clocks(w, std::min(kept.clocks(w), pc.clocks(w)));
          }
        }
        TESSERA_RETURN_IF_ERROR(CutTable(source, pc, shard, num_shards, replicas, source_shards,
                                         static_cast<int>(pos), &it->second));
        continue;
      }
      const int home =
          ShardOfPartition(first.job_id(), pc.key().tensor(), pc.key().index(), num_shards);
      if (!HoldsCopyOf(home, static_cast<int>(shard), num_shards, replicas)) continue;
      const std::string name = DenseName(pc.key());
      if (!dense_taken.insert(name).second) continue;
      v1::PartitionCheckpoint* copy = out.header.add_partitions();
      *copy = pc;
      copy->clear_last_applied();
      TESSERA_ASSIGN_OR_RETURN(absl::string_view weights, Bytes(source, pc.weights(), name));
      *copy->mutable_weights() = data.Append(weights);
      for (int s = 0; s < pc.slots_size(); ++s) {
        TESSERA_ASSIGN_OR_RETURN(absl::string_view slot, Bytes(source, pc.slots(s), name));
        *copy->mutable_slots(s) = data.Append(slot);
      }
    }
  }
  for (const std::string& name : table_order) {
    TableCut& cut = tables[name];
    v1::PartitionCheckpoint* pc = out.header.add_partitions();
    *pc = std::move(cut.partition);
    pc->clear_last_applied();
    pc->set_num_rows(cut.rows);
    *pc->mutable_row_ids() = data.Append(cut.row_ids);
    *pc->mutable_row_updates() = data.Append(cut.row_updates);
    *pc->mutable_row_values() = data.Append(cut.row_values);
    *pc->mutable_row_last_clocks() = data.Append(cut.row_last_clocks);
    pc->set_num_pending(cut.pending);
    if (cut.pending > 0) {
      *pc->mutable_pending_ids() = data.Append(cut.pending_ids);
      *pc->mutable_pending_sightings() = data.Append(cut.pending_sightings);
      *pc->mutable_pending_last_clocks() = data.Append(cut.pending_last_clocks);
    } else {
      pc->clear_pending_ids();
      pc->clear_pending_sightings();
      pc->clear_pending_last_clocks();
    }
  }
  out.data = data.Take();
  return out;
}

FillOverlap::FillOverlap(const std::vector<CheckpointContents>& sources, int num_shards,
                         int replicas)
    : num_shards_(num_shards), replicas_(replicas), source_shards_(SourceShards(sources)) {
  if (sources.empty()) return;
  const v1::CheckpointHeader& first = sources.front().header;
  job_id_ = first.job_id();
  const bool exact_dense = ExactCut(first.config(), /*sparse=*/false);
  const bool exact_tables = ExactCut(first.config(), /*sparse=*/true);
  for (size_t pos = 0; pos < sources.size(); ++pos) {
    for (const v1::PartitionCheckpoint& pc : sources[pos].header.partitions()) {
      std::vector<int64_t> clocks(pc.clocks().begin(), pc.clocks().end());
      if (pc.sparse()) {
        if (exact_tables) continue;
        auto [it, added] = tables_.try_emplace(pc.key().tensor());
        if (added) it->second.resize(sources.size());
        it->second[pos] = std::move(clocks);
      } else if (!exact_dense) {
        // From the first source that has it, as CutFill takes it.
        dense_.try_emplace(KeyName(pc.key()), std::move(clocks));
      }
    }
  }
}

std::optional<v1::PushPullRequest> FillOverlap::Unheld(const v1::PushPullRequest& push,
                                                       absl::flat_hash_set<std::string>* held_dense,
                                                       int64_t* slices_held,
                                                       int64_t* rows_held) const {
  const uint32_t w = push.worker_id();
  const int64_t step = push.step();
  auto holds = [&](const std::vector<int64_t>& clocks) {
    return w < clocks.size() && step < clocks[w];
  };
  std::optional<v1::PushPullRequest> out;  // copied only once a row is dropped
  for (int s = 0; s < push.push_size(); ++s) {
    const v1::Slice& slice = push.push(s);
    auto table = tables_.find(slice.key().tensor());
    if (table == tables_.end()) {
      auto dense = dense_.find(KeyName(slice.key()));
      if (dense != dense_.end() && holds(dense->second)) {
        held_dense->insert(dense->first);
        ++*slices_held;
      }
      continue;
    }
    const int n = slice.row_ids_size();
    if (n == 0 || slice.data().size() % static_cast<size_t>(n) != 0) continue;
    const size_t stride = slice.data().size() / static_cast<size_t>(n);
    std::string data;
    std::vector<int64_t> ids;
    for (int i = 0; i < n; ++i) {
      const int64_t id = slice.row_ids(i);
      const int source =
          FirstSourceHolding(ShardOfSparseRow(job_id_, slice.key().tensor(), id, num_shards_),
                             source_shards_, num_shards_, replicas_);
      if (source >= 0 && holds(table->second[static_cast<size_t>(source)])) continue;
      ids.push_back(id);
      data.append(slice.data(), static_cast<size_t>(i) * stride, stride);
    }
    if (ids.size() == static_cast<size_t>(n)) continue;
    *rows_held += n - static_cast<int64_t>(ids.size());
    if (!out.has_value()) out = push;
    v1::Slice& kept = *out->mutable_push(s);
    kept.mutable_row_ids()->Assign(ids.begin(), ids.end());
    kept.set_data(std::move(data));
  }
  return out;
}

FillAssembler::~FillAssembler() {
  absl::MutexLock lock(&mu_);
  if (buffered_ > 0) budget_->Release(static_cast<int64_t>(buffered_));
}

void FillAssembler::DropLocked(std::map<std::string, Pending>::iterator it) {
  uint64_t bytes = 0;
  for (const std::string& file : it->second.files) bytes += file.size();
  budget_->Release(static_cast<int64_t>(bytes));
  buffered_ -= bytes;
  pending_.erase(it);
}

absl::StatusOr<bool> FillAssembler::Add(const v1::FillRequest& page,
                                        std::vector<std::string>* files) {
  TESSERA_RETURN_IF_ERROR(ValidateJobId(page.job_id()));
  if (page.step() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("step: must be >= 1, got ", page.step()));
  }
  if (page.num_sources() < 1 || page.num_sources() > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_sources: must be 1..16, got ", page.num_sources()));
  }
  if (page.source() >= page.num_sources()) {
    return absl::InvalidArgumentError(absl::StrCat("source: must be below num_sources ",
                                                   page.num_sources(), ", got ", page.source()));
  }
  if (page.num_shards() < 1 || page.replicas() < 1 || page.replicas() > page.num_shards()) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards, replicas: need 1 <= replicas <= ", "num_shards, got ",
                     page.replicas(), " and ", page.num_shards()));
  }
  if (page.file_bytes() == 0 || page.data().size() > kMaxFillPageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("file_bytes, data: a page of ",
                                                   page.data().size(), " bytes of a ",
                                                   page.file_bytes(), "-byte file"));
  }
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(page.job_id());
  const bool first_page = page.source() == 0 && page.offset() == 0;
  if (it != pending_.end() && (first_page || it->second.shape.step() != page.step())) {
    DropLocked(it);
    it = pending_.end();
  }
  if (it == pending_.end()) {
    if (!first_page) {
      return absl::InvalidArgumentError(
          absl::StrCat("offset: no fill of job '", page.job_id(), "' step ", page.step(),
                       " is being received; its first page (source 0, offset 0) starts one"));
    }
    if (pending_.size() >= kMaxPending) {
      auto oldest = pending_.begin();
      for (auto p = pending_.begin(); p != pending_.end(); ++p) {
        if (p->second.order < oldest->second.order) oldest = p;
      }
      DropLocked(oldest);
    }
    Pending fresh;
    fresh.order = next_order_++;
    fresh.shape = page;
    fresh.shape.clear_data();
    fresh.files.resize(page.num_sources());
    fresh.file_bytes.assign(page.num_sources(), 0);
    it = pending_.emplace(page.job_id(), std::move(fresh)).first;
  }
  Pending& p = it->second;
  if (p.shape.num_sources() != page.num_sources() || p.shape.num_shards() != page.num_shards() ||
      p.shape.replicas() != page.replicas()) {
    DropLocked(it);
    return absl::InvalidArgumentError(
        "num_sources, num_shards, replicas: differ from the fill's first page");
  }
  std::string& file = p.files[page.source()];
  uint64_t& size = p.file_bytes[page.source()];
  if (size == 0) size = page.file_bytes();
  if (size != page.file_bytes() || page.offset() != file.size() ||
      page.data().size() > size - file.size()) {
    const std::string why = absl::StrCat(
        "offset: page [", page.offset(), ", +", page.data().size(), ") of source ", page.source(),
        " (", page.file_bytes(), " bytes), expected offset ", file.size(), " of ", size, " bytes");
    DropLocked(it);
    return absl::InvalidArgumentError(why);
  }
  const int64_t bytes = static_cast<int64_t>(page.data().size());
  if (!budget_->TryReserve(bytes)) {
    const absl::Status exhausted =
        budget_->Exhausted(absl::StrCat("fill of job '", page.job_id(), "'"), bytes);
    DropLocked(it);
    return exhausted;
  }
  buffered_ += page.data().size();
  file.append(page.data());
  for (size_t s = 0; s < p.files.size(); ++s) {
    if (p.file_bytes[s] == 0 || p.files[s].size() != p.file_bytes[s]) return false;
  }
  *files = std::move(p.files);
  p.files.clear();
  uint64_t total = 0;
  for (const std::string& f : *files) total += f.size();
  budget_->Release(static_cast<int64_t>(total));
  buffered_ -= total;
  pending_.erase(it);
  return true;
}

void FillAssembler::Forget(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(job_id);
  if (it != pending_.end()) DropLocked(it);
}

uint64_t FillAssembler::buffered_bytes() const {
  absl::MutexLock lock(&mu_);
  return buffered_;
}

absl::StatusOr<v1::ReadCheckpointResponse> ReadFilePage(const std::string& path, uint64_t offset,
                                                        uint32_t max_bytes) {
  if (max_bytes < 1 || max_bytes > kMaxFillPageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_bytes: must be 1..", kMaxFillPageBytes, ", got ", max_bytes));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InternalError(absl::StrCat(path, ": open: ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat(path, ": fstat: ", std::strerror(err)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (offset > size) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("offset: ", offset, " is past the end of ", path, " (", size, " bytes)"));
  }
  v1::ReadCheckpointResponse response;
  response.set_file_bytes(size);
  std::string* data = response.mutable_data();
  data->resize(std::min<uint64_t>(max_bytes, size - offset));
  size_t done = 0;
  while (done < data->size()) {
    const ssize_t n =
        ::pread(fd, data->data() + done, data->size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": pread: ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return response;
}

}  // namespace tessera::server
