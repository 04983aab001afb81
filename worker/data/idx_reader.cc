// IDX files (http://yann.lecun.com/exdb/mnist/): two zero bytes, an element type byte, a rank
// byte, then `rank` big-endian uint32 dimensions and the elements, big-endian, row-major.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/dataset.h"
#include "worker/data/internal/gz_file.h"
#include "worker/data/internal/labels.h"

namespace tessera::data {
namespace {

using internal::GzFile;

struct IdxHeader {
  uint8_t type = 0;
  std::vector<int64_t> dims;
  int element_bytes = 0;
};

int ElementBytes(uint8_t type) {
  switch (type) {
    case 0x08:  // unsigned byte
    case 0x09:  // signed byte
      return 1;
    case 0x0B:  // short
      return 2;
    case 0x0C:  // int
    case 0x0D:  // float
      return 4;
    case 0x0E:  // double
      return 8;
    default:
      return 0;
  }
}

absl::StatusOr<IdxHeader> ReadHeader(GzFile& file, int min_rank, int max_rank) {
  uint8_t magic[4];
  TESSERA_RETURN_IF_ERROR(file.ReadExactly(magic, 4, "IDX magic number"));
  if (magic[0] != 0 || magic[1] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": not an IDX file: bad magic number at byte 0 (0x",
        absl::Hex(magic[0], absl::kZeroPad2), absl::Hex(magic[1], absl::kZeroPad2),
        absl::Hex(magic[2], absl::kZeroPad2), absl::Hex(magic[3], absl::kZeroPad2), ")"));
  }
  IdxHeader h;
  h.type = magic[2];
  h.element_bytes = ElementBytes(h.type);
  if (h.element_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": unknown IDX element type 0x",
                                                   absl::Hex(h.type), " at byte 2"));
  }
  const int rank = magic[3];
  if (rank < min_rank || rank > max_rank) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": IDX rank ", rank,
                                                   " at byte 3 must be in [", min_rank, ", ",
                                                   max_rank, "]"));
  }
  for (int i = 0; i < rank; ++i) {
    uint8_t b[4];
    const int64_t at = file.offset();
    TESSERA_RETURN_IF_ERROR(file.ReadExactly(b, 4, "IDX dimension"));
    const int64_t dim = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
    if (dim <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": IDX dimension ", i, " at byte ", at, " is ", dim));
    }
    h.dims.push_back(dim);
  }
  int64_t elements = 1;
  for (int64_t d : h.dims) {
    if (elements > (int64_t{1} << 40) / d) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": IDX dimensions describe more than 2^40 elements"));
    }
    elements *= d;
  }
  return h;
}

// Big-endian element k of `raw` as a double.
double Element(const IdxHeader& h, const uint8_t* raw, int64_t k) {
  const uint8_t* p = raw + k * h.element_bytes;
  switch (h.type) {
    case 0x08:
      return p[0];
    case 0x09:
      return static_cast<int8_t>(p[0]);
    case 0x0B:
      return static_cast<int16_t>(static_cast<uint16_t>((p[0] << 8) | p[1]));
    case 0x0C:
    case 0x0D: {
      const uint32_t u =
          (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
      if (h.type == 0x0C) return static_cast<int32_t>(u);
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    default: {
      uint64_t u = 0;
      for (int i = 0; i < 8; ++i) u = (u << 8) | p[i];
      double d;
      std::memcpy(&d, &u, 8);
      return d;
    }
  }
}

// Reads are done and buffers grown in pieces of at most this many bytes, so that a header that
// claims more data than the file holds fails at the end of the data, not in a huge allocation.
constexpr int64_t kChunkBytes = int64_t{1} << 20;

// Appends exactly n bytes of `file` to *out, growing it as the data arrives. DATA_LOSS like
// GzFile::ReadExactly when the data ends early.
absl::Status AppendExactly(GzFile& file, int64_t n, const char* what, std::vector<uint8_t>* out) {
  const int64_t start = file.offset();
  for (int64_t left = n; left > 0;) {
    const int64_t len = std::min(left, kChunkBytes);
    const size_t at = out->size();
    out->resize(at + static_cast<size_t>(len));
    TESSERA_ASSIGN_OR_RETURN(size_t got, file.ReadSome(out->data() + at, static_cast<size_t>(len)));
    if (static_cast<int64_t>(got) != len) {
      return absl::DataLossError(absl::StrCat(file.path(), ": truncated at byte ", file.offset(),
                                              ": expected ", n, " bytes of ", what, " from byte ",
                                              start, ", got ", file.offset() - start));
    }
    left -= len;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Dataset>> ReadIdxDataset(const std::string& images_path,
                                                              const std::string& labels_path,
                                                              const ReadOptions& options) {
  TESSERA_RETURN_IF_ERROR(ValidateReadOptions(options));
  // Labels first: they are small, and a count mismatch is found before the large read.
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GzFile> lf, GzFile::Open(labels_path));
  TESSERA_ASSIGN_OR_RETURN(IdxHeader lh, ReadHeader(*lf, 1, 1));
  const int64_t n = lh.dims[0];
  std::vector<uint8_t> raw_labels;
  const int64_t labels_start = lf->offset();
  TESSERA_RETURN_IF_ERROR(AppendExactly(*lf, n * lh.element_bytes, "labels", &raw_labels));
  TESSERA_RETURN_IF_ERROR(lf->ExpectEnd());

  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<GzFile> imf, GzFile::Open(images_path));
  TESSERA_ASSIGN_OR_RETURN(IdxHeader ih, ReadHeader(*imf, 1, 4));
  if (ih.dims[0] != n) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, " holds ", ih.dims[0],
                                                   " examples but ", labels_path, " holds ", n,
                                                   " labels"));
  }
  std::vector<int64_t> shape(ih.dims.begin() + 1, ih.dims.end());
  if (shape.empty()) shape.push_back(1);
  int64_t feature_dim = 1;
  for (int64_t d : shape) feature_dim *= d;

  const int64_t shard_n =
      n > options.rank ? (n - options.rank + options.world - 1) / options.world : 0;
  std::vector<float> labels(static_cast<size_t>(shard_n));
  for (int64_t p = options.rank, i = 0; p < n; p += options.world, ++i) {
    TESSERA_RETURN_IF_ERROR(internal::CheckLabel(
        Element(lh, raw_labels.data(), p), options.num_classes,
        absl::StrCat(labels_path, ": label ", p, " at byte ", labels_start + p * lh.element_bytes),
        &labels[i]));
  }

  // Read example by example, in pieces, so that only this shard's examples are kept and memory
  // grows only with the data actually read.
  const int64_t example_bytes = feature_dim * ih.element_bytes;
  std::vector<uint8_t> row;
  std::vector<uint8_t> bytes;
  std::vector<float> floats;
  const bool keep_bytes = ih.type == 0x08;
  const Normalization& norm = options.normalization;
  for (int64_t p = 0; p < n; ++p) {
    const bool mine = p % options.world == options.rank;
    if (mine && keep_bytes) {
      TESSERA_RETURN_IF_ERROR(AppendExactly(*imf, example_bytes, "example data", &bytes));
      continue;
    }
    row.clear();
    TESSERA_RETURN_IF_ERROR(AppendExactly(*imf, example_bytes, "example data", &row));
    if (!mine) continue;
    for (int64_t j = 0; j < feature_dim; ++j) {
      const double v = Element(ih, row.data(), j);
      floats.push_back(static_cast<float>((v / norm.divide_by - norm.mean) / norm.stddev));
    }
  }
  TESSERA_RETURN_IF_ERROR(imf->ExpectEnd());
  if (keep_bytes) {
    return Dataset::FromBytes(std::move(shape), std::move(bytes), std::move(labels),
                              options.num_classes, norm, n);
  }
  return Dataset::FromFloats(std::move(shape), std::move(floats), std::move(labels),
                             options.num_classes, n);
}

}  // namespace tessera::data
