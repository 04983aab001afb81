// The rules for a job's dataset (DatasetSpec in proto/tessera/v1/job_spec.proto): the format,
// the files each format reads, and the reader's settings. ValidateJobSpec (spec/job_spec.h)
// applies them with the checks that tie the dataset to the model.
#ifndef TESSERA_SPEC_DATASET_SPEC_H_
#define TESSERA_SPEC_DATASET_SPEC_H_

#include "absl/status/status.h"
#include "tessera/v1/job_spec.pb.h"

namespace tessera::spec {

// Checks `dataset`. With `check_files`, each named file must exist and be a readable regular
// file (stat(2) and access(2): blocking file-system calls); without, only a path's length is
// checked. INVALID_ARGUMENT names the field and the value: "dataset.train_images: file not
// found: /x", "dataset.num_classes: must be >= 0, got -1". Thread-safe.
absl::Status ValidateDataset(const v1::DatasetSpec& dataset, bool check_files);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_DATASET_SPEC_H_
