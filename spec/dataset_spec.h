// The rules for a job's dataset (DatasetSpec in proto/tessera/v1/job_spec.proto): the format,
// the files each format reads, and the reader's settings. ValidateJobSpec (spec/job_spec.h)
// applies them with the checks that tie the dataset to the model.
#ifndef TESSERA_SPEC_DATASET_SPEC_H_
#define TESSERA_SPEC_DATASET_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tessera/v1/job_spec.pb.h"

namespace tessera::spec {

// Where Debian installs its datasets (dataset-fashion-mnist): a --dataset_root of every daemon
// by default.
inline constexpr char kDebianDatasetsFolder[] = "/usr/share/datasets";

// What ValidateDataset checks of the files a dataset names.
struct DatasetChecks {
  // Each named file must exist and be a readable regular file (stat(2), access(2), realpath(3):
  // blocking file-system calls); without, only the paths themselves are checked.
  bool check_files = true;
  // Every path must be absolute (a distributed job's files are read on the workers' hosts).
  bool absolute_paths = false;
  // When not empty, every path must lie in one of these folders (a daemon's --dataset_root):
  // first as written (with "." and ".." resolved, before the file is touched, so a path outside
  // learns nothing of what is there), then, with check_files, with its symbolic links resolved.
  std::vector<std::string> roots;
};

// Checks `dataset`. INVALID_ARGUMENT names the field and the value: "dataset.train_images: file
// not found: /x", "dataset.train_path: /etc/passwd is outside the dataset folders
// (--dataset_root /usr/share/datasets)", "dataset.num_classes: must be >= 0, got -1".
// Thread-safe.
absl::Status ValidateDataset(const v1::DatasetSpec& dataset, const DatasetChecks& checks);

// The folders of the files `dataset` names, each once, in order (what `tessera local` gives its
// daemons as --dataset_root).
std::vector<std::string> DatasetFolders(const v1::DatasetSpec& dataset);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_DATASET_SPEC_H_
