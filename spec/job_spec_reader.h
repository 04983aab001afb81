// Reading job specs (proto/tessera/v1/job_spec.proto) from textproto or JSON, as users write them
// (examples/*.textproto). What the spec means is checked afterwards by ValidateJobSpec
// (spec/job_spec.h).
#ifndef TESSERA_SPEC_JOB_SPEC_READER_H_
#define TESSERA_SPEC_JOB_SPEC_READER_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/job_spec.pb.h"

namespace tessera::spec {

// Parses a spec from text: JSON when the first non-blank character is '{', textproto otherwise.
// Unknown fields are refused. INVALID_ARGUMENT with `source` (a file name, for the message) and
// the line and column of the first error: "job.textproto:3:7: ...". Pure; thread-safe.
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source);

// Reads and parses `path` (blocking file I/O). NOT_FOUND naming the path when it does not exist;
// INVALID_ARGUMENT when it is not a regular file or is larger than 16 MiB; PERMISSION_DENIED
// when it cannot be opened, DATA_LOSS when a read fails. Thread-safe.
absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_JOB_SPEC_READER_H_
