#include "server/data_dir_claim.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/checkpoint_file.h"

namespace tessera::server {
namespace {

constexpr size_t kIdentityBytes = 16;

absl::Status Refused(const std::string& what, int err) {
  return absl::FailedPreconditionError(
      absl::StrCat("--data_dir: ", what, err != 0 ? absl::StrCat(": ", std::strerror(err)) : ""));
}

bool IsIdentity(const std::string& text) {
  if (text.size() != 2 * kIdentityBytes) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return false;
  }
  return true;
}

// A new identity in <dir>/identity, written durably (temp file, fsync, rename, fsync of dir).
absl::StatusOr<std::string> MakeIdentity(const std::string& dir) {
  char bytes[kIdentityBytes];
  if (::getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes))) {
    return Refused("cannot draw a random identity", errno);
  }
  const std::string identity = absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
  const std::string path = dir + "/identity";
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Refused(absl::StrCat("cannot create ", tmp), errno);
  const std::string text = identity + "\n";
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int why = ok ? errno : err;
    ::unlink(tmp.c_str());
    return Refused(absl::StrCat("cannot write ", path), why);
  }
  absl::Status synced = SyncDirectory(dir);
  if (!synced.ok()) return Refused(std::string(synced.message()), 0);
  return identity;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataDirClaim>> DataDirClaim::Claim(const std::string& dir) {
  absl::Status made = MakeDurableDirs(dir);
  if (!made.ok()) return Refused(std::string(made.message()), 0);
  const std::string lock_path = dir + "/lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Refused(absl::StrCat("cannot open ", lock_path), errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return Refused(absl::StrCat(dir, " is in use by another tessera-server (", lock_path,
                                  " is locked); give each shard its own data directory"),
                     0);
    }
    return Refused(absl::StrCat("cannot lock ", lock_path), err);
  }
  const std::string path = dir + "/identity";
  absl::StatusOr<std::string> identity;
  struct stat st;
  std::ifstream in;
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT) {
    identity = MakeIdentity(dir);
  } else if (in.open(path), !in) {
    identity = Refused(absl::StrCat("cannot read ", path), errno);
  } else {
    std::stringstream text;
    text << in.rdbuf();
    identity = std::string(absl::StripAsciiWhitespace(text.str()));
    if (!IsIdentity(*identity)) {
      identity = Refused(absl::StrCat(path,
                                      " does not hold an identity (32 hex digits); remove it "
                                      "only if this directory belongs to no other shard"),
                         0);
    }
  }
  if (!identity.ok()) {
    ::close(fd);
    return identity.status();
  }
  return std::unique_ptr<DataDirClaim>(new DataDirClaim(fd, *std::move(identity)));
}

DataDirClaim::~DataDirClaim() { ::close(lock_fd_); }

}  // namespace tessera::server
