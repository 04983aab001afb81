// DataDirClaim: a shard's data directory is its identity (issue #16). The first shard to use a
// directory writes a random identity into <dir>/identity (fsync, rename); every later start with
// that directory reads it back and registers with it, so the coordinator knows a shard that
// restarted on another port for the one it replaces (its dead instance is dropped at once instead
// of holding the shard index until its lease runs out). The claim also holds an exclusive lock
// (flock) on <dir>/lock for the process's life, so that two live shards cannot share a directory
// (and an identity): the second one is refused at start.
#ifndef TESSERA_SERVER_DATA_DIR_CLAIM_H_
#define TESSERA_SERVER_DATA_DIR_CLAIM_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tessera::server {

class DataDirClaim {
 public:
  // Creates `dir` when missing, locks it and reads (or makes) its identity. FAILED_PRECONDITION
  // naming --data_dir when another process holds the lock, or when the directory or the identity
  // file cannot be used (an identity that is not 32 hex digits is refused, not replaced).
  static absl::StatusOr<std::unique_ptr<DataDirClaim>> Claim(const std::string& dir);

  ~DataDirClaim();  // releases the lock
  DataDirClaim(const DataDirClaim&) = delete;
  DataDirClaim& operator=(const DataDirClaim&) = delete;

  // 32 lowercase hex digits, the same on every start with this directory.
  const std::string& identity() const { return identity_; }

 private:
  DataDirClaim(int lock_fd, std::string identity) : lock_fd_(lock_fd), identity_(identity) {}

  const int lock_fd_;
  const std::string identity_;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_DATA_DIR_CLAIM_H_
