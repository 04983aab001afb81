// The worker's reading of a validated job spec: how its data is read and which backend runs it.
// Parsing, defaults and validation of specs live in spec/ (spec/job_spec.h), which the
// coordinator shares; what needs worker/data or kernels/ is here.
#ifndef TESSERA_WORKER_TRAINER_JOB_SPEC_H_
#define TESSERA_WORKER_TRAINER_JOB_SPEC_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "tessera/v1/job_spec.pb.h"
#include "worker/data/dataset.h"

namespace tessera::trainer {

// The reader options for one split of `spec.dataset` on shard rank/world.
// REQUIRES: spec::ValidateJobSpec(spec).ok().
data::ReadOptions MakeReadOptions(const v1::DatasetSpec& dataset, int rank, int world);

// The backend that `device` (a spec's device or a --device flag: "auto" or empty, "cpu", "cuda",
// "gpu", in any case) names, by spec::ParseDeviceChoice (spec/device_spec.h); its
// INVALID_ARGUMENT otherwise. Pure; thread-safe.
absl::StatusOr<kernels::DeviceChoice> ParseDeviceChoice(absl::string_view device);

}  // namespace tessera::trainer

#endif  // TESSERA_WORKER_TRAINER_JOB_SPEC_H_
