#include "server/checkpoint_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "isa-l/crc.h"

namespace tessera::server {
namespace {

constexpr char kMagic[] = "TSCKPT01";
constexpr size_t kMagicSize = 8;
constexpr size_t kMaxJobIdSize = 160;

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status IoError(absl::string_view what, const std::string& path, int err) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", ErrnoText(err)));
}

void PutU64(uint64_t v, std::string* out) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 8);
}

uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Writes all of `bytes` to fd, retrying short writes and EINTR.
absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, std::min<size_t>(left, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("cannot write", path, errno);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The step of a "ckpt-<step>" name, or -1.
int64_t StepOfDirName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "ckpt-")) return -1;
  if (name.empty() || name.size() > 19) return -1;
  for (char c : name) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return -1;
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(name, &step)) return -1;
  return step;
}

// The names in `dir`. An absent directory has none.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return names;
    return IoError("cannot list", dir, errno);
  }
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    names.push_back(name);
  }
  ::closedir(d);
  return names;
}

}  // namespace

uint32_t Crc32c(absl::string_view data, uint32_t crc) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t left = data.size();
  crc = ~crc;
  while (left > 0) {
    const int n = static_cast<int>(std::min<size_t>(left, size_t{1} << 30));
    crc = crc32_iscsi(const_cast<unsigned char*>(p), n, crc);
    p += n;
    left -= static_cast<size_t>(n);
  }
  return ~crc;
}

namespace {

// Verifies `bytes` as ParseCheckpoint does and parses the header into *contents; *data_offset
// receives where the data section starts (its length is what lies between it and the CRC).
absl::Status VerifyCheckpoint(absl::string_view bytes, CheckpointContents* contents,
                              size_t* data_offset) {
  const size_t total = bytes.size();
  if (total < kMagicSize + 8 + 8 + 4) {
    return absl::DataLossError(absl::StrCat("checkpoint is short: ", total,
                                            " bytes, less than the smallest file (28 bytes)"));
  }
  if (std::memcmp(bytes.data(), kMagic, kMagicSize) != 0) {
    return absl::DataLossError("checkpoint has a bad magic (not a TSCKPT01 file)");
  }
  size_t at = kMagicSize;
  const uint64_t header_length = GetU64(bytes.data() + at);
  at += 8;
  // What is left must hold the header, the data length and the CRC.
  if (header_length > total - at - 8 - 4) {
    return absl::DataLossError(absl::StrCat("checkpoint is short: header length ", header_length,
                                            " but only ", total - at - 12,
                                            " bytes follow it before the data length and CRC"));
  }
  const absl::string_view header_bytes = bytes.substr(at, header_length);
  at += header_length;
  const uint64_t data_length = GetU64(bytes.data() + at);
  at += 8;
  if (data_length != total - at - 4) {
    return absl::DataLossError(absl::StrCat("checkpoint sizes disagree: data length ", data_length,
                                            " but ", total - at - 4,
                                            " bytes lie between it and the CRC"));
  }
  const uint32_t stored = GetU32(bytes.data() + total - 4);
  const uint32_t computed = Crc32c(bytes.substr(0, total - 4));
  if (stored != computed) {
    return absl::DataLossError(absl::StrCat("checkpoint CRC mismatch: stored ", absl::Hex(stored),
                                            ", computed ", absl::Hex(computed)));
  }
  if (header_length > static_cast<uint64_t>(std::numeric_limits<int>::max()) ||
      !contents->header.ParseFromArray(header_bytes.data(), static_cast<int>(header_length))) {
    return absl::DataLossError("checkpoint header does not parse");
  }
  *data_offset = at;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointContents> ParseCheckpoint(absl::string_view bytes) {
  CheckpointContents contents;
  size_t at = 0;
  TESSERA_RETURN_IF_ERROR(VerifyCheckpoint(bytes, &contents, &at));
  contents.data.assign(bytes.data() + at, bytes.size() - at - 4);
  return contents;
}

absl::StatusOr<CheckpointContents> ParseCheckpointBuffer(std::string bytes) {
  CheckpointContents contents;
  size_t at = 0;
  TESSERA_RETURN_IF_ERROR(VerifyCheckpoint(bytes, &contents, &at));
  // The data section becomes `contents.data` in place: shifted to the buffer's start and cut
  // before the CRC, without a second buffer.
  const size_t data_length = bytes.size() - at - 4;
  bytes.erase(0, at);
  bytes.resize(data_length);
  contents.data = std::move(bytes);
  return contents;
}

absl::StatusOr<CheckpointContents> ReadCheckpointFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("checkpoint file ", path, " does not exist"));
    }
    return IoError("cannot open checkpoint file", path, err);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError("cannot stat checkpoint file", path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is not a regular file"));
  }
  std::string bytes;
  bytes.resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, &bytes[got], std::min<size_t>(bytes.size() - got, 1u << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return IoError("cannot read checkpoint file", path, err);
    }
    if (n == 0) break;  // shrank while read: the parse reports it short
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  bytes.resize(got);
  absl::StatusOr<CheckpointContents> contents = ParseCheckpointBuffer(std::move(bytes));
  if (!contents.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", path, ": ", contents.status().message()));
  }
  return contents;
}

absl::Status SyncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("cannot open directory", path, errno);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError("cannot fsync directory", path, err);
  }
  ::close(fd);
  return absl::OkStatus();
}

absl::Status MakeDurableDirs(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("cannot create directory ", path, ": not a directory"));
  }
  const std::string parent = DirName(path);
  if (parent != path) {
    absl::Status s = MakeDurableDirs(parent);
    if (!s.ok()) return s;
  }
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return IoError("cannot create directory", path, errno);
  }
  return SyncDirectory(parent);
}

absl::StatusOr<WrittenCheckpoint> WriteCheckpointFile(const std::string& path,
                                                      const v1::CheckpointHeader& header,
                                                      absl::Span<const absl::string_view> data) {
  std::string head(kMagic, kMagicSize);
  std::string header_bytes;
  if (!header.SerializeToString(&header_bytes)) {
    return absl::InternalError(absl::StrCat("cannot serialize the header of ", path));
  }
  PutU64(header_bytes.size(), &head);
  head += header_bytes;
  uint64_t data_length = 0;
  for (absl::string_view piece : data) data_length += piece.size();
  PutU64(data_length, &head);
  uint32_t crc = Crc32c(head);
  for (absl::string_view piece : data) crc = Crc32c(piece, crc);
  std::string tail;
  for (int i = 0; i < 4; ++i) tail.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("cannot create", tmp, errno);
  auto fail = [&](absl::Status status) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return status;
  };
  absl::Status s = WriteAll(fd, head, tmp);
  for (size_t i = 0; s.ok() && i < data.size(); ++i) s = WriteAll(fd, data[i], tmp);
  if (s.ok()) s = WriteAll(fd, tail, tmp);
  if (!s.ok()) return fail(s);
  if (::fsync(fd) != 0) return fail(IoError("cannot fsync", tmp, errno));
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return IoError("cannot close", tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return IoError(absl::StrCat("cannot rename ", tmp, " to"), path, err);
  }
  absl::Status synced = SyncDirectory(DirName(path));
  if (!synced.ok()) return synced;
  WrittenCheckpoint written;
  written.bytes = head.size() + data_length + tail.size();
  written.crc32c = crc;
  return written;
}

std::string CheckpointPath(absl::string_view checkpoint_dir, absl::string_view job_id, int64_t step,
                           uint32_t shard_index) {
  return absl::StrCat(checkpoint_dir, "/", job_id, "/ckpt-", step, "/shard-", shard_index);
}

absl::StatusOr<std::vector<int64_t>> ListCheckpointSteps(const std::string& job_dir,
                                                         uint32_t shard_index) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(job_dir);
  if (!names.ok()) return names.status();
  const std::string file = absl::StrCat("shard-", shard_index);
  std::vector<int64_t> steps;
  for (const std::string& name : *names) {
    const int64_t step = StepOfDirName(name);
    if (step < 0) continue;
    struct stat st;
    const std::string path = absl::StrCat(job_dir, "/", name, "/", file);
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<int> RemoveTemporaryCheckpointFiles(const std::string& checkpoint_dir,
                                                   int shard_index) {
  // Another shard sharing the directory may be writing its own temp file right now.
  const std::string own = absl::StrCat("shard-", shard_index, ".tmp");
  absl::StatusOr<std::vector<std::string>> jobs = ListDir(checkpoint_dir);
  if (!jobs.ok()) return jobs.status();
  int removed = 0;
  for (const std::string& job : *jobs) {
    const std::string job_dir = absl::StrCat(checkpoint_dir, "/", job);
    absl::StatusOr<std::vector<std::string>> ckpts = ListDir(job_dir);
    if (!ckpts.ok()) continue;  // not a directory
    for (const std::string& ckpt : *ckpts) {
      if (StepOfDirName(ckpt) < 0) continue;
      const std::string dir = absl::StrCat(job_dir, "/", ckpt);
      absl::StatusOr<std::vector<std::string>> files = ListDir(dir);
      if (!files.ok()) continue;
      bool changed = false;
      for (const std::string& f : *files) {
        if (shard_index >= 0 ? f != own : !absl::EndsWith(f, ".tmp")) continue;
        const std::string path = absl::StrCat(dir, "/", f);
        if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
          return IoError("cannot remove", path, errno);
        }
        ++removed;
        changed = true;
      }
      if (changed) {
        absl::Status s = SyncDirectory(dir);
        if (!s.ok()) return s;
      }
    }
  }
  return removed;
}

bool IsSafeJobId(absl::string_view job_id) { return ValidateJobId(job_id).ok(); }

absl::Status ValidateJobId(absl::string_view job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must not be empty");
  if (job_id.size() > kMaxJobIdSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id: at most ", kMaxJobIdSize, " characters, got ", job_id.size()));
  }
  if (job_id == "." || job_id == "..") {
    return absl::InvalidArgumentError(absl::StrCat("job_id: '", job_id, "' is not a file name"));
  }
  for (char c : job_id) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (!absl::ascii_isalnum(u) && c != '_' && c != '-' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("job_id: may hold only letters, digits, '_', '-' and '.', got '",
                       absl::CHexEscape(job_id.substr(0, 64)), "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tessera::server
