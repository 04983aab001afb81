// Sequential reads of a plain or gzip-compressed file through zlib, with errors that name the file
// and the byte offset in the (decompressed) data.
#ifndef TESSERA_WORKER_DATA_INTERNAL_GZ_FILE_H_
#define TESSERA_WORKER_DATA_INTERNAL_GZ_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tessera::data::internal {

// Not thread-safe. Closes the file on destruction.
class GzFile {
 public:
  // NOT_FOUND when the file does not exist, PERMISSION_DENIED / UNKNOWN for other open failures.
  static absl::StatusOr<std::unique_ptr<GzFile>> Open(const std::string& path);
  ~GzFile();
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  // Reads exactly n bytes. DATA_LOSS naming the file, the offset and `what` when the data ends
  // early or the gzip stream is corrupt.
  absl::Status ReadExactly(void* out, size_t n, const char* what);
  // OK when no data follows; INVALID_ARGUMENT naming the offset otherwise (DATA_LOSS when the
  // stream is corrupt, e.g. a failed gzip CRC in the trailer).
  absl::Status ExpectEnd();
  // Reads everything that is left into *out.
  absl::Status ReadAll(std::string* out);
  // Reads up to n bytes; returns how many (fewer only at the end of the data), or DATA_LOSS for a
  // corrupt stream.
  absl::StatusOr<size_t> ReadSome(void* out, size_t n);

  const std::string& path() const { return path_; }
  // Bytes of (decompressed) data consumed so far.
  int64_t offset() const { return offset_; }

 private:
  GzFile(std::string path, void* file) : path_(std::move(path)), file_(file) {}

  std::string path_;
  void* file_;  // gzFile
  int64_t offset_ = 0;
};

}  // namespace tessera::data::internal

#endif  // TESSERA_WORKER_DATA_INTERNAL_GZ_FILE_H_
