// LIBSVM and CSV readers. Both read the whole (possibly gzip) file into memory, walk it line by
// line, check every line, and keep the examples of this worker's shard.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "worker/data/dataset.h"
#include "worker/data/internal/gz_file.h"
#include "worker/data/internal/labels.h"

namespace tessera::data {
namespace {

// Calls fn(line_number, line) for each line (1-based numbers, '\r\n' endings stripped).
template <typename Fn>
absl::Status ForEachLine(absl::string_view text, Fn fn) {
  int64_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == absl::string_view::npos) end = text.size();
    absl::string_view line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++line_no;
    TESSERA_RETURN_IF_ERROR(fn(line_no, line));
    pos = end + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<internal::GzFile> file, internal::GzFile::Open(path));
  std::string text;
  TESSERA_RETURN_IF_ERROR(file->ReadAll(&text));
  return text;
}

// A field of the file, told by its size only: an error never echoes the file's contents (a spec
// that names a file it should not read learns nothing from it).
std::string Described(absl::string_view s) {
  return absl::StrCat("(", s.size(), s.size() == 1 ? " byte)" : " bytes)");
}

float Normalize(double v, const Normalization& n) {
  return static_cast<float>((v / n.divide_by - n.mean) / n.stddev);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Dataset>> ReadLibsvmDataset(const std::string& path,
                                                                 const ReadOptions& options) {
  TESSERA_RETURN_IF_ERROR(ValidateReadOptions(options));
  TESSERA_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  std::vector<int64_t> offsets = {0};
  std::vector<int64_t> ids;
  std::vector<float> values;
  std::vector<float> labels;
  int64_t position = 0;  // example number in the file
  int64_t max_id = -1;
  const int64_t base = options.zero_based ? 0 : 1;
  TESSERA_RETURN_IF_ERROR(
      ForEachLine(text, [&](int64_t line_no, absl::string_view line) -> absl::Status {
        const size_t hash = line.find('#');
        if (hash != absl::string_view::npos) line = line.substr(0, hash);
        std::vector<absl::string_view> tokens =
            absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
        if (tokens.empty()) return absl::OkStatus();
        const std::string where = absl::StrCat(path, ":", line_no);
        const bool mine = position % options.world == options.rank;
        ++position;
        double label = 0;
        if (!absl::SimpleAtod(tokens[0], &label)) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": label ", Described(tokens[0]), " is not a number"));
        }
        float stored_label = 0;
        TESSERA_RETURN_IF_ERROR(
            internal::CheckLabel(label, options.num_classes, where, &stored_label));
        int64_t prev = -1;
        for (size_t t = 1; t < tokens.size(); ++t) {
          const size_t colon = tokens[t].find(':');
          int64_t index = 0;
          double value = 0;
          if (colon == absl::string_view::npos ||
              !absl::SimpleAtoi(tokens[t].substr(0, colon), &index) ||
              !absl::SimpleAtod(tokens[t].substr(colon + 1), &value)) {
            return absl::InvalidArgumentError(absl::StrCat(
                where, ": feature ", t, " ", Described(tokens[t]), " is not index:value"));
          }
          if (index < base) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": feature index ", index, " is below the first index ", base));
          }
          const int64_t id = index - base;
          if (id == std::numeric_limits<int64_t>::max()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": feature index ", index, " is too large"));
          }
          if (id <= prev) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": feature index ", index,
                                                           " does not increase (previous ",
                                                           prev + base, ")"));
          }
          if (!std::isfinite(value)) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": feature ", index, " value is not finite"));
          }
          if (options.num_features > 0 && id >= options.num_features) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": feature index ", index,
                                                           " is beyond num_features ",
                                                           options.num_features));
          }
          prev = id;
          max_id = std::max(max_id, id);
          if (mine) {
            ids.push_back(id);
            values.push_back(Normalize(value, options.normalization));
          }
        }
        if (mine) {
          offsets.push_back(static_cast<int64_t>(ids.size()));
          labels.push_back(stored_label);
        }
        return absl::OkStatus();
      }));
  if (position == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  }
  const int64_t feature_dim = options.num_features > 0 ? options.num_features : max_id + 1;
  if (feature_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no features in any example and num_features is not set"));
  }
  return Dataset::FromSparse(feature_dim, std::move(offsets), std::move(ids), std::move(values),
                             std::move(labels), options.num_classes, position);
}

absl::StatusOr<std::shared_ptr<const Dataset>> ReadCsvDataset(const std::string& path,
                                                              const ReadOptions& options) {
  TESSERA_RETURN_IF_ERROR(ValidateReadOptions(options));
  TESSERA_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  std::vector<float> features;
  std::vector<float> labels;
  int64_t position = 0;
  int64_t columns = -1;
  bool header_pending = options.has_header;
  const char delim[2] = {options.delimiter, '\0'};
  TESSERA_RETURN_IF_ERROR(
      ForEachLine(text, [&](int64_t line_no, absl::string_view line) -> absl::Status {
        if (absl::StripAsciiWhitespace(line).empty()) return absl::OkStatus();
        std::vector<absl::string_view> fields = absl::StrSplit(line, delim);
        const std::string where = absl::StrCat(path, ":", line_no);
        if (columns < 0) {
          columns = static_cast<int64_t>(fields.size());
          if (columns < 2) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": a CSV row needs a label and at least one feature, got ",
                             columns, " field(s) (delimiter '", delim, "')"));
          }
          if (options.label_column >= columns) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": label_column ",
                                                           options.label_column, " is beyond the ",
                                                           columns, " columns"));
          }
        } else if (static_cast<int64_t>(fields.size()) != columns) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": ", fields.size(), " fields, but earlier rows have ", columns));
        }
        if (header_pending) {
          header_pending = false;
          return absl::OkStatus();
        }
        const bool mine = position % options.world == options.rank;
        ++position;
        float stored_label = 0;
        for (int64_t c = 0; c < columns; ++c) {
          double v = 0;
          if (!absl::SimpleAtod(fields[c], &v) || !std::isfinite(v)) {
            return absl::InvalidArgumentError(absl::StrCat(where, ", column ", c + 1,
                                                           ": the field ", Described(fields[c]),
                                                           " is not a finite number"));
          }
          if (c == options.label_column) {
            TESSERA_RETURN_IF_ERROR(internal::CheckLabel(
                v, options.num_classes, absl::StrCat(where, ", column ", c + 1), &stored_label));
          } else if (mine) {
            features.push_back(Normalize(v, options.normalization));
          }
        }
        if (mine) labels.push_back(stored_label);
        return absl::OkStatus();
      }));
  if (position == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  }
  return Dataset::FromFloats({columns - 1}, std::move(features), std::move(labels),
                             options.num_classes, position);
}

}  // namespace tessera::data
