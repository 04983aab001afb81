#include "spec/job_spec_reader.h"

#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace tessera::spec {
namespace {

// A spec is a few kilobytes; a larger file is not a spec.
constexpr int64_t kMaxSpecBytes = int64_t{16} << 20;

// Collects the first error of a textproto parse with its position (1-based).
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (!has_error_) {
      has_error_ = true;
      // The parser counts from 0.
      error_ = absl::StrCat(line + 1, ":", column + 1, ": ", message);
    }
  }
  void AddWarning(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
  bool has_error() const { return has_error_; }
  const std::string& error() const { return error_; }

 private:
  bool has_error_ = false;
  std::string error_;
};

// Line and column (1-based) of byte `offset` in `text`.
std::string Position(absl::string_view text, size_t offset) {
  int line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return absl::StrCat(line, ":", column);
}

// protobuf's JSON parser reports errors as a message followed by the text around the error and a
// '^' under it ("Unexpected token.\n  \"x\": bad\n         ^"); finds that place in `text`.
absl::optional<size_t> JsonErrorOffset(absl::string_view text, absl::string_view message) {
  // message = summary '\n' context '\n' spaces '^', where the context is a window of the input
  // (it may span lines) and the caret's column is an offset into that window.
  const size_t first = message.find('\n');
  const size_t last = message.rfind('\n');
  if (first == absl::string_view::npos || last <= first) return absl::nullopt;
  absl::string_view context = message.substr(first + 1, last - first - 1);
  absl::string_view caret = message.substr(last + 1);
  const size_t col = caret.find('^');
  if (col == absl::string_view::npos || context.empty()) return absl::nullopt;
  const size_t at = text.find(context);
  if (at == absl::string_view::npos || text.find(context, at + 1) != absl::string_view::npos) {
    return absl::nullopt;
  }
  return at + col;
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source) {
  v1::JobSpec spec;
  absl::string_view body = absl::StripLeadingAsciiWhitespace(text);
  if (!body.empty() && body.front() == '{') {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const auto status = google::protobuf::util::JsonStringToMessage(
        google::protobuf::StringPiece(text.data(), text.size()), &spec, options);
    if (!status.ok()) {
      const std::string message(status.message().data(), status.message().size());
      absl::optional<size_t> offset = JsonErrorOffset(text, message);
      const std::string first_line = message.substr(0, message.find('\n'));
      return absl::InvalidArgumentError(
          absl::StrCat(source, offset.has_value() ? absl::StrCat(":", Position(text, *offset)) : "",
                       ": invalid JSON job spec: ", first_line));
    }
    return spec;
  }
  google::protobuf::TextFormat::Parser parser;
  FirstErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &spec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ":", errors.has_error() ? errors.error() : "invalid textproto job spec"));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("job spec file not found: ", path));
  }
  // A directory opens and reads as empty, which would parse as an empty spec.
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("job spec file is not a regular file: ", path));
  }
  if (st.st_size > kMaxSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("job spec file ", path, " holds ", st.st_size,
                                                   " bytes, more than ", kMaxSpecBytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat("cannot read job spec file: ", path));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read job spec file: ", path));
  return ParseJobSpec(buffer.str(), path);
}

}  // namespace tessera::spec
