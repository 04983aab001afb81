// Restoring a job from its checkpoint file (docs/checkpoints.md, "Restore"): reading and checking
// the file a Restore call names, and building a fresh job from verified contents, every field and
// range checked before anything is read. The store swaps the built job in
// (ParameterStore::Restore).
#ifndef TESSERA_SERVER_CHECKPOINT_RESTORE_H_
#define TESSERA_SERVER_CHECKPOINT_RESTORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/checkpoint_file.h"
#include "server/job_state.h"
#include "server/memory_budget.h"
#include "server/shard_counters.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// The file a Restore call names, read and verified.
struct CheckpointToRestore {
  std::string path;
  CheckpointContents contents;
  // The newest step of the job's files on disk (at least the restored one): files up to it may be
  // committed, so the restored job never deletes them as unrequested.
  int64_t protect_through = 0;
};

// Reads <checkpoint_dir>/<job_id>/ckpt-<step>/shard-<shard_index>. FAILED_PRECONDITION without a
// checkpoint_dir; INVALID_ARGUMENT for a bad job_id or step; NOT_FOUND when the file does not
// exist; DATA_LOSS when it does not verify or holds another job, step or shard; INTERNAL for other
// I/O errors. Blocks on file I/O.
absl::StatusOr<CheckpointToRestore> ReadCheckpointToRestore(const std::string& checkpoint_dir,
                                                            uint32_t shard_index,
                                                            const v1::RestoreRequest& request);

// A fresh job built from `contents` (DATA_LOSS naming what is wrong when any field or range does
// not check; RESOURCE_EXHAUSTED when it does not fit `budget`), refusing pushes of an incarnation
// below max(min_incarnation, the header's). Its captures are retired until
// CheckpointWriter::ResumeCaptures, and it never deletes automatic files up to
// max(protect_through, the header's step) as unrequested. Needs no file (the fuzz target builds
// from bytes). Thread-safe.
absl::StatusOr<std::shared_ptr<JobState>> BuildJobFromCheckpoint(
    const CheckpointContents& contents, uint64_t min_incarnation, int64_t protect_through,
    const std::shared_ptr<MemoryBudget>& budget, const std::shared_ptr<ShardCounters>& counters);

}  // namespace tessera::server

#endif  // TESSERA_SERVER_CHECKPOINT_RESTORE_H_
