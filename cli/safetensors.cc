#include "cli/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tessera::cli {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write", path);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

void AppendLittleEndian(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

std::string JsonQuote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      out += absl::StrFormat("\\u%04x", u);
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

absl::StatusOr<std::string> EncodeSafetensors(const std::vector<NamedTensor>& tensors,
                                              const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  std::vector<std::string> entries;
  uint64_t offset = 0;
  for (const NamedTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor name: must be non-empty and not __metadata__, got \"", t.name, "\""));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\": duplicate name"));
    }
    uint64_t elements = 1;
    for (const int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", t.name, "\": negative dimension ", d));
      }
      elements *= static_cast<uint64_t>(d);
    }
    const size_t count = t.int64 ? t.ids.size() : t.values.size();
    if (elements != count) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\": shape [",
                                                     absl::StrJoin(t.shape, ","), "] needs ",
                                                     elements, " values, got ", count));
    }
    const uint64_t end = offset + elements * (t.int64 ? sizeof(int64_t) : sizeof(float));
    entries.push_back(absl::StrCat(JsonQuote(t.name), ":{\"dtype\":\"", t.int64 ? "I64" : "F32",
                                   "\",\"shape\":[", absl::StrJoin(t.shape, ","),
                                   "],\"data_offsets\":[", offset, ",", end, "]}"));
    offset = end;
  }
  std::vector<std::string> meta;
  for (const auto& [key, value] : metadata) {
    meta.push_back(absl::StrCat(JsonQuote(key), ":", JsonQuote(value)));
  }
  entries.push_back(absl::StrCat("\"__metadata__\":{", absl::StrJoin(meta, ","), "}"));
  std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  header.append((8 - header.size() % 8) % 8, ' ');

  std::string out;
  out.reserve(8 + header.size() + offset);
  AppendLittleEndian(header.size(), &out);
  out += header;
  static_assert(sizeof(float) == 4, "float32 expected");
  for (const NamedTensor& t : tensors) {
    // x86-64 and aarch64 are little-endian, as safetensors is.
    if (t.int64) {
      out.append(reinterpret_cast<const char*>(t.ids.data()), t.ids.size() * sizeof(int64_t));
    } else {
      out.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * sizeof(float));
    }
  }
  return out;
}

absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<NamedTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> bytes = EncodeSafetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("open", tmp);
  absl::Status status = WriteAll(fd, *bytes, tmp);
  if (status.ok() && fsync(fd) != 0) status = ErrnoError("fsync", tmp);
  if (close(fd) != 0 && status.ok()) status = ErrnoError("close", tmp);
  if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) status = ErrnoError("rename", tmp);
  if (!status.ok()) {
    unlink(tmp.c_str());
    return status;
  }
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return ErrnoError("open directory", dir);
  const bool synced = fsync(dir_fd) == 0;
  close(dir_fd);
  if (!synced) return ErrnoError("fsync directory", dir);
  return absl::OkStatus();
}

}  // namespace tessera::cli
