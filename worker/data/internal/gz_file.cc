#include "worker/data/internal/gz_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tessera::data::internal {
namespace {

gzFile AsGz(void* f) { return static_cast<gzFile>(f); }

}  // namespace

absl::StatusOr<std::unique_ptr<GzFile>> GzFile::Open(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat(path, ": file not found"));
    }
    return absl::UnknownError(absl::StrCat(path, ": cannot stat: ", std::strerror(err)));
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, not a file"));
  }
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    if (err == EACCES) {
      return absl::PermissionDeniedError(absl::StrCat(path, ": permission denied"));
    }
    return absl::UnknownError(absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  gzbuffer(f, 1 << 17);
  return std::unique_ptr<GzFile>(new GzFile(path, f));
}

GzFile::~GzFile() { gzclose(AsGz(file_)); }

absl::StatusOr<size_t> GzFile::ReadSome(void* out, size_t n) {
  size_t total = 0;
  char* dst = static_cast<char*>(out);
  while (total < n) {
    // Small calls keep the offset in a corruption message within kChunk of the bad data: gzread
    // discards the bytes of a call that fails.
    constexpr size_t kChunk = 1 << 16;
    const unsigned chunk = static_cast<unsigned>(std::min(n - total, kChunk));
    const int got = gzread(AsGz(file_), dst + total, chunk);
    if (got > 0) {
      total += static_cast<size_t>(got);
      continue;
    }
    int errnum = Z_OK;
    const char* msg = gzerror(AsGz(file_), &errnum);
    if (errnum == Z_OK) break;  // end of data
    if (errnum == Z_BUF_ERROR) {
      // zlib's name for a gzip stream that stops before its end.
      return absl::DataLossError(absl::StrCat(path_, ": truncated at byte ", offset_ + total,
                                              ": the gzip stream ends early"));
    }
    return absl::DataLossError(
        absl::StrCat(path_, ": corrupt gzip data near byte ", offset_ + total, " (compressed byte ",
                     gzoffset(AsGz(file_)), "): ", msg != nullptr ? msg : "read error"));
  }
  offset_ += static_cast<int64_t>(total);
  return total;
}

absl::Status GzFile::ReadExactly(void* out, size_t n, const char* what) {
  const int64_t start = offset_;
  absl::StatusOr<size_t> got = ReadSome(out, n);
  if (!got.ok()) return got.status();
  if (*got != n) {
    return absl::DataLossError(absl::StrCat(path_, ": truncated at byte ", start + *got,
                                            ": expected ", n, " bytes of ", what, " from byte ",
                                            start, ", got ", *got));
  }
  return absl::OkStatus();
}

absl::Status GzFile::ExpectEnd() {
  char probe;
  const int64_t at = offset_;
  absl::StatusOr<size_t> got = ReadSome(&probe, 1);
  if (!got.ok()) return got.status();
  if (*got != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": unexpected trailing data at byte ", at));
  }
  return absl::OkStatus();
}

absl::Status GzFile::ReadAll(std::string* out) {
  out->clear();
  constexpr size_t kChunk = 1 << 20;
  while (true) {
    const size_t old = out->size();
    out->resize(old + kChunk);
    absl::StatusOr<size_t> got = ReadSome(&(*out)[old], kChunk);
    if (!got.ok()) return got.status();
    out->resize(old + *got);
    if (*got < kChunk) return absl::OkStatus();
  }
}

}  // namespace tessera::data::internal
