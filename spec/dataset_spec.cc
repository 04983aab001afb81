#include "spec/dataset_spec.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace tessera::spec {
namespace {

// `path` (normalized: absolute, no "." or "..") is `root` or below it.
bool IsUnder(const std::string& path, const std::string& root) {
  std::string r = root;
  while (r.size() > 1 && r.back() == '/') r.pop_back();
  if (r == "/") return true;
  return path == r || absl::StartsWith(path, r + "/");
}

// `path` with "." and ".." resolved (lexically), or, with `resolve_links` and when it exists,
// its realpath(3).
std::string Normalized(const std::string& path, bool resolve_links) {
  if (resolve_links) {
    char resolved[PATH_MAX];
    if (::realpath(path.c_str(), resolved) != nullptr) return resolved;
  }
  return std::filesystem::path(path).lexically_normal().string();
}

absl::Status CheckRoots(const char* field, const std::string& path, const DatasetChecks& checks,
                        bool resolve_links) {
  const std::string normal = Normalized(path, resolve_links);
  for (const std::string& root : checks.roots) {
    if (IsUnder(normal, Normalized(root, resolve_links))) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dataset.", field, ": ", absl::CEscape(path),
      resolve_links && normal != std::filesystem::path(path).lexically_normal().string()
          ? absl::StrCat(" (a link to ", normal, ")")
          : "",
      " is outside the dataset folders this daemon reads (--dataset_root ",
      absl::StrJoin(checks.roots, ", "), ")"));
}

absl::Status CheckFile(const char* field, const std::string& path, bool required,
                       const DatasetChecks& checks) {
  if (path.empty()) {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("dataset.", field, ": must be set"));
  }
  if (path.size() >= PATH_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.", field, ": a path of ", path.size(),
                                                   " bytes, more than PATH_MAX (", PATH_MAX, ")"));
  }
  if ((checks.absolute_paths || !checks.roots.empty()) && path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.", field, ": must be an absolute path (the workers read it on their ",
                     "own hosts), got \"", absl::CEscape(path), "\""));
  }
  // Outside the roots as written: refused before anything is looked at.
  if (!checks.roots.empty()) {
    TESSERA_RETURN_IF_ERROR(CheckRoots(field, path, checks, /*resolve_links=*/false));
  }
  if (!checks.check_files) return absl::OkStatus();
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.", field, ": file not found: ", path));
  }
  // Inside as written, but a link may lead out.
  if (!checks.roots.empty()) {
    TESSERA_RETURN_IF_ERROR(CheckRoots(field, path, checks, /*resolve_links=*/true));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.", field, ": not a regular file: ", path));
  }
  if (::access(path.c_str(), R_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.", field, ": file is not readable: ", path));
  }
  return absl::OkStatus();
}

// The files of d.format(): IDX reads image/label pairs, LIBSVM and CSV read one path per split.
absl::Status CheckFiles(const v1::DatasetSpec& d, const DatasetChecks& check_files) {
  switch (d.format()) {
    case v1::DatasetSpec::FORMAT_IDX:
      TESSERA_RETURN_IF_ERROR(CheckFile("train_images", d.train_images(), true, check_files));
      TESSERA_RETURN_IF_ERROR(CheckFile("train_labels", d.train_labels(), true, check_files));
      if (d.test_images().empty() != d.test_labels().empty()) {
        return absl::InvalidArgumentError(
            d.test_images().empty() ? "dataset.test_images: must be set with test_labels"
                                    : "dataset.test_labels: must be set with test_images");
      }
      TESSERA_RETURN_IF_ERROR(CheckFile("test_images", d.test_images(), false, check_files));
      TESSERA_RETURN_IF_ERROR(CheckFile("test_labels", d.test_labels(), false, check_files));
      if (!d.train_path().empty() || !d.test_path().empty()) {
        return absl::InvalidArgumentError(
            "dataset.train_path: FORMAT_IDX reads train_images/train_labels and "
            "test_images/test_labels, not train_path/test_path");
      }
      return absl::OkStatus();
    case v1::DatasetSpec::FORMAT_LIBSVM:
    case v1::DatasetSpec::FORMAT_CSV:
    case v1::DatasetSpec::FORMAT_CRITEO:
      TESSERA_RETURN_IF_ERROR(CheckFile("train_path", d.train_path(), true, check_files));
      TESSERA_RETURN_IF_ERROR(CheckFile("test_path", d.test_path(), false, check_files));
      if (!d.train_images().empty() || !d.train_labels().empty() || !d.test_images().empty() ||
          !d.test_labels().empty()) {
        return absl::InvalidArgumentError(
            "dataset.train_images: only FORMAT_IDX reads image/label files; LIBSVM, CSV and "
            "CRITEO read train_path/test_path");
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.format: must be FORMAT_IDX, FORMAT_LIBSVM, FORMAT_CSV or "
                       "FORMAT_CRITEO, got ",
                       v1::DatasetSpec::Format_Name(d.format()).empty()
                           ? std::to_string(d.format())
                           : v1::DatasetSpec::Format_Name(d.format())));
  }
}

absl::Status CheckNormalization(const v1::DatasetSpec& d) {
  const v1::Normalization& n = d.normalization();
  if (!std::isfinite(n.divide_by())) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.normalization.divide_by: must be finite, got ", n.divide_by()));
  }
  if (!std::isfinite(n.mean())) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.normalization.mean: must be finite, got ", n.mean()));
  }
  if (!std::isfinite(n.stddev()) || n.stddev() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.normalization.stddev: must be a finite number > 0 (0 means 1), got ", n.stddev()));
  }
  if (d.format() == v1::DatasetSpec::FORMAT_CRITEO &&
      (n.divide_by() != 0.0f || n.mean() != 0.0f || n.stddev() != 0.0f)) {
    return absl::InvalidArgumentError(
        "dataset.normalization: FORMAT_CRITEO values are log(1 + x) of the integer features and 1 "
        "for the categories; set no normalization");
  }
  if (d.format() == v1::DatasetSpec::FORMAT_LIBSVM && n.mean() != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.normalization.mean: must be 0 for sparse LIBSVM data, got ", n.mean()));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> DatasetFolders(const v1::DatasetSpec& d) {
  std::vector<std::string> folders;
  for (const std::string* path : {&d.train_images(), &d.train_labels(), &d.test_images(),
                                  &d.test_labels(), &d.train_path(), &d.test_path()}) {
    if (path->empty()) continue;
    std::string folder = std::filesystem::path(*path).lexically_normal().parent_path().string();
    if (folder.empty()) folder = ".";
    if (std::find(folders.begin(), folders.end(), folder) == folders.end()) {
      folders.push_back(std::move(folder));
    }
  }
  return folders;
}

absl::Status ValidateDataset(const v1::DatasetSpec& d, const DatasetChecks& checks) {
  TESSERA_RETURN_IF_ERROR(CheckFiles(d, checks));
  if (d.num_classes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.num_classes: must be >= 0, got ", d.num_classes()));
  }
  if (d.num_features() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.num_features: must be >= 0, got ", d.num_features()));
  }
  if (d.label_column() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.label_column: must be >= 0, got ", d.label_column()));
  }
  if (d.delimiter().size() > 1 || d.delimiter() == "\n" || d.delimiter() == "\"") {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.delimiter: must be one character other than newline and quote, got \"",
        absl::CEscape(d.delimiter()), "\""));
  }
  return CheckNormalization(d);
}

}  // namespace tessera::spec
