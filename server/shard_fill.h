// Filling a new copy of a replicated job's shard (docs/reliability.md "Filling a new copy").
//
// With `replicas` copies, shard index i holds the partitions and rows whose home (their placement,
// common/placement.h) is i, i - 1, ..., i - replicas + 1 (mod num_shards). When index i comes back
// after a failover, the coordinator has its neighbours snapshot the job at a step boundary S
// (ordinary checkpoint files), copies those files to it page by page (FillRequest), and the shard
// cuts from them what its index holds and installs that as the job at step S. The ranks write it
// every push of step S and later, so from then on it is a copy like the others.
#ifndef TESSERA_SERVER_SHARD_FILL_H_
#define TESSERA_SERVER_SHARD_FILL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoint_file.h"
#include "server/memory_budget.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// True when shard index `shard` keeps a copy of what lives at `home`: home <= shard <
// home + replicas, counted mod num_shards. REQUIRES: num_shards >= 1.
bool HoldsCopyOf(int home, int shard, int num_shards, int replicas);

// The contents shard index `shard` would have written at the sources' step, cut from the
// sources' files (its neighbours' snapshots of the same step): every dense partition it holds a
// copy of (from the first source that has it), and of every sparse table the rows and pending ids
// it holds a copy of (each id from the first source that holds a copy of its home, by the
// sources' shard_index; the table's lifecycle counts are the first source's). Versions, clocks,
// membership and the config are the first source's, except that a table gated as SSP or ASP
// takes each worker's smallest clock over the sources (FillOverlap: the rows come from sources
// captured at different moments).
// The exactly-once tables are left empty: the copies number their sparse requests each on its own,
// and the ranks write the filled shard only from the step on, so it applies each of their later
// requests once. DATA_LOSS when the sources disagree on the job or step, or a range lies outside
// its data; INVALID_ARGUMENT for no sources or a bad shape.
absl::StatusOr<CheckpointContents> CutFill(const std::vector<CheckpointContents>& sources,
                                           uint32_t shard, int num_shards, int replicas);

// What a fill's cut holds already of the pushes its journal kept (server/fill_journal.h), so that
// catching up applies each push to each partition and row exactly once.
//
// Under BSP every source is captured at the boundary S, before any push of step S is applied, so
// the cut holds none of the kept pushes (all of step S or later). Under SSP and ASP, and for the
// sparse tables of HYBRID, a source is captured once its slowest live worker's clock reaches S: a
// faster worker's pushes of S and later may be in it as well as in the journal, and each source
// is captured at its own moment. A partition's or table's clock for a worker (its last pushed
// step + 1) in the source it was cut from says which: worker w's push of step s is in the cut for
// a dense partition iff s < w's clock on it there, and for a sparse row iff s < w's clock on the
// row's table in the source the row was cut from (the first one that holds a copy of its home).
class FillOverlap {
 public:
  // From the sources the cut was made of (CutFill's arguments, in the same order).
  FillOverlap(const std::vector<CheckpointContents>& sources, int num_shards, int replicas);

  // `push` (a kept push) less the sparse rows the cut holds already; nullopt when it holds none
  // of its rows (apply `push` as it is). The dense partitions whose slice the cut holds are added
  // to `*held_dense` by their store name ("tensor/index"): the store records those slices' seqs
  // as applied without applying them again. Adds the rows dropped to `*rows_held` and the dense
  // slices to `*slices_held`. Under BSP (nothing held) it only looks the keys up.
  std::optional<v1::PushPullRequest> Unheld(const v1::PushPullRequest& push,
                                            absl::flat_hash_set<std::string>* held_dense,
                                            int64_t* slices_held, int64_t* rows_held) const;

 private:
  std::string job_id_;
  int num_shards_ = 0;
  int replicas_ = 0;
  std::vector<int> source_shards_;
  // Dense partitions gated as SSP or ASP: "tensor/index" -> the clocks of the source it was cut
  // from.
  absl::flat_hash_map<std::string, std::vector<int64_t>> dense_;
  // Sparse tables gated as SSP or ASP: table -> the clocks of each source (empty where a source
  // has no such table).
  absl::flat_hash_map<std::string, std::vector<std::vector<int64_t>>> tables_;
};

// Collects the pages of one fill per job (FillRequest) until every source file is whole.
// Thread-safe.
class FillAssembler {
 public:
  // The buffered pages count against `budget` (RESOURCE_EXHAUSTED past it) until their fill is
  // whole or forgotten.
  explicit FillAssembler(std::shared_ptr<MemoryBudget> budget) : budget_(std::move(budget)) {}
  ~FillAssembler();

  // Adds a page. False while pages are missing; true once the last one came, with the whole
  // files in source order in `files` (the job's buffers are then forgotten). A first page (source
  // 0, offset 0) or a page of another step starts over. INVALID_ARGUMENT naming the field for a
  // page out of order or past its file, or fields that disagree with the job's earlier pages (the
  // job's buffers are dropped).
  absl::StatusOr<bool> Add(const v1::FillRequest& page, std::vector<std::string>* files);

  // Fills being received at once (one per job; the coordinator runs one per job at a time): a new
  // one beyond this drops the oldest.
  static constexpr size_t kMaxPending = 4;

  // Drops the job's buffers (a dropped job, a fill given up).
  void Forget(const std::string& job_id);

  // Bytes buffered over all jobs.
  uint64_t buffered_bytes() const;

 private:
  struct Pending {
    v1::FillRequest shape;  // job_id, step, num_sources, num_shards, replicas (no data)
    std::vector<std::string> files;
    std::vector<uint64_t> file_bytes;
    uint64_t order = 0;  // when it began, for kMaxPending
  };

  void DropLocked(std::map<std::string, Pending>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<MemoryBudget> budget_;
  mutable absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t buffered_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
};

// The largest page of a ReadCheckpoint or FillRequest.
inline constexpr uint32_t kMaxFillPageBytes = 16u << 20;

// Bytes [offset, offset + max_bytes) of the file at `path`, with the file's size. NOT_FOUND when
// it does not exist; INVALID_ARGUMENT for max_bytes outside 1..kMaxFillPageBytes or an offset past
// the end; INTERNAL for other I/O errors. Blocks on file I/O.
absl::StatusOr<v1::ReadCheckpointResponse> ReadFilePage(const std::string& path, uint64_t offset,
                                                        uint32_t max_bytes);

}  // namespace tessera::server

#endif  // TESSERA_SERVER_SHARD_FILL_H_
