// The rules for an optimizer config (proto/tessera/v1/optimizer.proto), checked wherever one
// enters: ValidateJobSpec for a job spec, the shard's CreateJobState for a job's config and a
// sparse table's override. kernels::MakeOptimizerParams (kernels/optimizer.h) turns a config that
// passed into the update's hyper-parameters.
#ifndef TESSERA_SPEC_OPTIMIZER_SPEC_H_
#define TESSERA_SPEC_OPTIMIZER_SPEC_H_

#include "absl/status/status.h"
#include "tessera/v1/optimizer.pb.h"

namespace tessera::spec {

// Checks `config` for the tensors it updates: `sparse` selects the set of allowed kinds (FTRL is
// sparse only; momentum, Nesterov and AdamW are dense only). learning_rate must be set; every
// other field is range-checked whatever the kind, 0 (unset in proto3) being valid everywhere.
// INVALID_ARGUMENT names the field and the value, e.g.
// "optimizer.learning_rate: must be a finite number > 0, got -1". Pure; thread-safe.
absl::Status ValidateOptimizer(const v1::OptimizerConfig& config, bool sparse);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_OPTIMIZER_SPEC_H_
