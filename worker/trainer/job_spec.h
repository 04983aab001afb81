// Reading and validating job specs (proto/tessera/v1/job_spec.proto).
#ifndef TESSERA_WORKER_TRAINER_JOB_SPEC_H_
#define TESSERA_WORKER_TRAINER_JOB_SPEC_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/job_spec.pb.h"
#include "tessera/v1/parameter.pb.h"
#include "worker/data/dataset.h"

namespace tessera::trainer {

// Parses a spec from text: JSON when the first non-blank character is '{', textproto otherwise.
// Unknown fields are refused. INVALID_ARGUMENT with `source` (a file name, for the message) and
// the line and column of the first error: "job.textproto:3:7: ...".
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source);

// Reads and parses `path`. NOT_FOUND naming the path when it does not exist; INVALID_ARGUMENT
// when it is not a regular file or is larger than 16 MiB.
absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path);

struct ValidateOptions {
  // Check that the dataset files exist and are readable.
  bool check_files = true;
  // Also check the fields of distributed runs (num_workers, consistency, staleness,
  // partition_bytes, wire_encoding, checkpoint_every_steps). A standalone run ignores them.
  bool distributed = false;
};

// Checks every field of `spec` before any work starts. INVALID_ARGUMENT names the field and the
// value: "batch_size: must be in [1, 1048576], got 0", "dataset.train_images: file not found: /x",
// "model.layers[2] (dense_2): ...", "optimizer.learning_rate: ...".
absl::Status ValidateJobSpec(const v1::JobSpec& spec, const ValidateOptions& options = {});

// The shards' view of a distributed job: consistency (with its staleness), num_workers (0 -> 1),
// optimizer, schedule. REQUIRES: ValidateJobSpec(spec, {.distributed = true}).ok().
v1::JobConfig MakeJobConfig(const v1::JobSpec& spec);
// spec.wire_encoding as the data plane's enum (empty -> FP32). REQUIRES: a validated spec.
v1::Encoding WireEncoding(const v1::JobSpec& spec);
// spec.partition_bytes, 0 -> 4 MiB.
int64_t PartitionBytes(const v1::JobSpec& spec);
// spec.num_workers, 0 -> 1 (standalone specs leave it unset).
int NumWorkers(const v1::JobSpec& spec);

// The reader options for one split of `spec.dataset` on shard rank/world.
// REQUIRES: ValidateJobSpec(spec).ok().
data::ReadOptions MakeReadOptions(const v1::DatasetSpec& dataset, int rank, int world);

}  // namespace tessera::trainer

#endif  // TESSERA_WORKER_TRAINER_JOB_SPEC_H_
