// The on-disk format of a shard's checkpoint file (DESIGN.md §7, docs/checkpoints.md).
//
// Layout, all integers little-endian:
//   "TSCKPT01"                     8 bytes of magic
//   u64 header_length, header      a serialized v1::CheckpointHeader
//   u64 data_length, data          the raw values the header's ranges point into
//   u32 crc32c                     CRC32C (Castagnoli) of every byte before it
// A file is written to <path>.tmp, fsynced, renamed to <path> and its directory fsynced, so a
// reader finds either the previous file or the whole new one. A file that does not verify is
// refused with DATA_LOSS and never loaded.
#ifndef TESSERA_SERVER_CHECKPOINT_FILE_H_
#define TESSERA_SERVER_CHECKPOINT_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "tessera/v1/checkpoint.pb.h"

namespace tessera::server {

// CRC32C (Castagnoli) of `data` continuing from `crc` (0 to start), computed with ISA-L's
// crc32_iscsi. Crc32c("123456789") == 0xE3069283. Thread-safe.
uint32_t Crc32c(absl::string_view data, uint32_t crc = 0);

// A parsed and verified file.
struct CheckpointContents {
  v1::CheckpointHeader header;
  std::string data;
};

// Parses a whole file's bytes and verifies the magic, the lengths and the CRC. DATA_LOSS naming
// what is wrong (bad magic, short, header does not parse, sizes disagree, CRC mismatch). Never
// allocates more than the input's size. The ranges inside the header are NOT checked here (the
// store checks them against the data before it reads them). Thread-safe.
absl::StatusOr<CheckpointContents> ParseCheckpoint(absl::string_view bytes);
// ParseCheckpoint, taking the buffer: the data section is moved into `contents.data` in place
// (shifted to the front of `bytes`' own allocation), so only one copy of the file's data exists. On
// an error `bytes` is freed.
absl::StatusOr<CheckpointContents> ParseCheckpointBuffer(std::string bytes);

// Reads and parses the file at `path`. NOT_FOUND when it does not exist; INTERNAL for other I/O
// errors; DATA_LOSS as ParseCheckpoint. Every message names the path. Blocks on file I/O. Holds
// one buffer of the file's size: the returned data is that buffer, not a copy.
absl::StatusOr<CheckpointContents> ReadCheckpointFile(const std::string& path);

struct WrittenCheckpoint {
  uint64_t bytes = 0;   // the file's size
  uint32_t crc32c = 0;  // the CRC stored at its end
};

// Writes magic, `header`, the concatenation of `data` and the CRC to path + ".tmp", fsyncs it,
// renames it to `path` and fsyncs the directory. The directory must exist. INTERNAL with the
// errno text and the path on I/O errors (the temporary file is removed). Blocks on file I/O.
absl::StatusOr<WrittenCheckpoint> WriteCheckpointFile(const std::string& path,
                                                      const v1::CheckpointHeader& header,
                                                      absl::Span<const absl::string_view> data);

// Creates `path` and its missing parents (mode 0755), fsyncing the parent of each directory it
// creates. INTERNAL naming the path on errors.
absl::Status MakeDurableDirs(const std::string& path);

// Fsyncs the directory `path`. INTERNAL naming it on errors.
absl::Status SyncDirectory(const std::string& path);

// <checkpoint_dir>/<job_id>/ckpt-<step>/shard-<shard_index>.
std::string CheckpointPath(absl::string_view checkpoint_dir, absl::string_view job_id, int64_t step,
                           uint32_t shard_index);

// The steps of <job_dir>/ckpt-<step>/shard-<shard_index> files that exist, ascending (temporary
// files are not counted). An absent job_dir has none. INTERNAL on other errors.
absl::StatusOr<std::vector<int64_t>> ListCheckpointSteps(const std::string& job_dir,
                                                         uint32_t shard_index);

// Removes the leftover temporary files of interrupted writes under <checkpoint_dir>/<job>/ckpt-*/:
// shard `shard_index`'s own ("shard-<i>.tmp"; other shards sharing the directory may be writing
// theirs), or every "*.tmp" when shard_index < 0. Fsyncs each directory it changed. Returns how
// many it removed; INTERNAL on errors.
absl::StatusOr<int> RemoveTemporaryCheckpointFiles(const std::string& checkpoint_dir,
                                                   int shard_index);

// True when `job_id` is safe as one directory name: 1..160 characters of letters, digits, '_',
// '-' and '.', and not "." or "..".
bool IsSafeJobId(absl::string_view job_id);
// OK, or INVALID_ARGUMENT "job_id: ..." explaining what is wrong with it.
absl::Status ValidateJobId(absl::string_view job_id);

}  // namespace tessera::server

#endif  // TESSERA_SERVER_CHECKPOINT_FILE_H_
