// The Criteo TSV reader (dataset.h). A worker parses only its own byte range of the file; the
// whole file is only scanned for newlines, to count the examples every rank must agree on.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "worker/data/dataset.h"
#include "worker/data/internal/gz_file.h"
#include "worker/data/internal/labels.h"

namespace tessera::data {
namespace {

// The file's bytes: mapped when plain, decompressed into memory when gzip.
class FileText {
 public:
  static absl::StatusOr<std::unique_ptr<FileText>> Open(const std::string& path) {
    auto t = std::unique_ptr<FileText>(new FileText());
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      if (e == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
      return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open: ", std::strerror(e)));
    }
    struct stat st {};
    unsigned char magic[2] = {0, 0};
    const bool gzip = pread(fd, magic, 2, 0) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
    }
    if (gzip || st.st_size == 0) {
      close(fd);
      TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<internal::GzFile> f, internal::GzFile::Open(path));
      TESSERA_RETURN_IF_ERROR(f->ReadAll(&t->owned_));
      t->text_ = t->owned_;
      return t;
    }
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
    }
    t->mapped_ = p;
    t->mapped_size_ = static_cast<size_t>(st.st_size);
    t->text_ = absl::string_view(static_cast<const char*>(p), t->mapped_size_);
    return t;
  }
  ~FileText() {
    if (mapped_ != nullptr) munmap(mapped_, mapped_size_);
  }
  absl::string_view text() const { return text_; }

 private:
  FileText() = default;
  std::string owned_;
  void* mapped_ = nullptr;
  size_t mapped_size_ = 0;
  absl::string_view text_;
};

// A field of the file, told by its size only (an error never echoes the file's contents).
std::string Described(absl::string_view s) {
  return absl::StrCat("(", s.size(), s.size() == 1 ? " byte)" : " bytes)");
}

bool ParseHex(absl::string_view s, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else {
      return false;
    }
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

// The start of the first line that begins at or after `pos`.
size_t LineStartAtOrAfter(absl::string_view text, size_t pos) {
  if (pos == 0 || pos >= text.size()) return std::min(pos, text.size());
  if (text[pos - 1] == '\n') return pos;
  const size_t nl = text.find('\n', pos);
  return nl == absl::string_view::npos ? text.size() : nl + 1;
}

}  // namespace

int64_t CriteoFeatureId(int field, uint64_t value) {
  uint64_t z = value + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(field + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return static_cast<int64_t>((z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFFULL);
}

absl::StatusOr<std::shared_ptr<const Dataset>> ReadCriteoDataset(const std::string& path,
                                                                 const ReadOptions& options) {
  TESSERA_RETURN_IF_ERROR(ValidateReadOptions(options));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<FileText> file, FileText::Open(path));
  const absl::string_view text = file->text();
  // Every rank counts the same examples: the lines of the whole file.
  int64_t total = std::count(text.begin(), text.end(), '\n');
  if (!text.empty() && text.back() != '\n') ++total;
  const size_t size = text.size();
  const size_t begin = LineStartAtOrAfter(
      text,
      static_cast<size_t>(static_cast<unsigned __int128>(size) * options.rank / options.world));
  const size_t end =
      LineStartAtOrAfter(text, static_cast<size_t>(static_cast<unsigned __int128>(size) *
                                                   (options.rank + 1) / options.world));
  // The line number of `begin`, for messages.
  int64_t line_no = std::count(text.begin(), text.begin() + static_cast<ptrdiff_t>(begin), '\n');

  std::vector<int64_t> offsets = {0};
  std::vector<int64_t> ids;
  std::vector<float> values;
  std::vector<float> labels;
  // options.criteo_fields: the dense features and one field per category.
  const bool as_fields = options.criteo_fields;
  std::vector<float> dense;
  std::vector<FieldBatch> categories(as_fields ? kCriteoCategoricalFields : 0);
  for (FieldBatch& f : categories) f.offsets = {0};
  absl::string_view fields[kCriteoFields];
  for (size_t pos = begin; pos < end;) {
    size_t stop = text.find('\n', pos);
    if (stop == absl::string_view::npos || stop > end) stop = std::min(end, size);
    absl::string_view line = text.substr(pos, stop - pos);
    pos = stop + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string where = absl::StrCat(path, ":", line_no);
    if (line.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": empty line"));
    int count = 0;
    for (size_t start = 0;;) {
      const size_t tab = line.find('\t', start);
      const absl::string_view f = line.substr(
          start, tab == absl::string_view::npos ? absl::string_view::npos : tab - start);
      if (count < kCriteoFields) fields[count] = f;
      ++count;
      if (tab == absl::string_view::npos) break;
      start = tab + 1;
    }
    if (count != kCriteoFields) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", count, " tab-separated fields, ",
                                                     "Criteo TSV has ", kCriteoFields,
                                                     " (label, 13 integers, 26 categories)"));
    }
    double label = 0;
    if (!absl::SimpleAtod(fields[0], &label)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": label ", Described(fields[0]), " is not a number"));
    }
    float stored = 0;
    TESSERA_RETURN_IF_ERROR(internal::CheckLabel(label, options.num_classes, where, &stored));
    labels.push_back(stored);
    if (as_fields) dense.resize(dense.size() + kCriteoIntegerFields, 0.0f);
    for (int i = 0; i < kCriteoIntegerFields; ++i) {
      const absl::string_view f = fields[1 + i];
      if (f.empty()) continue;
      int64_t x = 0;
      if (!absl::SimpleAtoi(f, &x)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": integer feature I", i + 1, " ",
                                                       Described(f), " is not an integer"));
      }
      if (x <= 0) continue;  // log(1 + max(x, 0)) is 0: nothing to add
      if (as_fields) {
        dense[dense.size() - kCriteoIntegerFields + i] =
            static_cast<float>(std::log1p(static_cast<double>(x)));
        continue;
      }
      ids.push_back(CriteoFeatureId(i, 0));
      values.push_back(static_cast<float>(std::log1p(static_cast<double>(x))));
    }
    for (int c = 0; c < kCriteoCategoricalFields; ++c) {
      const absl::string_view f = fields[1 + kCriteoIntegerFields + c];
      if (f.empty()) {
        if (as_fields)
          categories[c].offsets.push_back(static_cast<int64_t>(categories[c].ids.size()));
        continue;
      }
      uint64_t v = 0;
      if (!ParseHex(f, &v)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": categorical field C", c + 1, " ",
                                                       Described(f),
                                                       " is not 1 to 16 hexadecimal digits"));
      }
      if (as_fields) {
        categories[c].ids.push_back(CriteoFeatureId(kCriteoIntegerFields + c, v));
        categories[c].offsets.push_back(static_cast<int64_t>(categories[c].ids.size()));
        continue;
      }
      ids.push_back(CriteoFeatureId(kCriteoIntegerFields + c, v));
      values.push_back(1.0f);
    }
    offsets.push_back(static_cast<int64_t>(ids.size()));
  }
  if (as_fields) {
    return Dataset::FromFields(kCriteoIntegerFields, std::move(dense), std::move(categories),
                               std::move(labels), options.num_classes, total);
  }
  // feature_dim 0: the ids are hashed (any int64).
  return Dataset::FromSparse(0, std::move(offsets), std::move(ids), std::move(values),
                             std::move(labels), options.num_classes, total);
}

}  // namespace tessera::data
