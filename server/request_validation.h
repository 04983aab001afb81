// The checks a request passes before it touches any state (docs/data-plane.md, "Validation and
// limits"): job declarations, and the keys, encodings, byte counts, row ids and NaN/Inf of pushes
// and pulls, resolved to the partitions they name. Any error fails the whole request, with a
// message that names the field and the value.
#ifndef TESSERA_SERVER_REQUEST_VALIDATION_H_
#define TESSERA_SERVER_REQUEST_VALIDATION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/push_pull_view.h"
#include "kernels/optimizer.h"
#include "server/consistency_gate.h"
#include "server/job_state.h"
#include "server/partition.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// The checks of CreateJobState (and of a restored checkpoint) before any state is touched:
// INVALID_ARGUMENT naming the field for a bad job_id, config or declaration. Fills the job's dense
// optimizer (or why it has none: FTRL updates only sparse rows) and each table's optimizer.
absl::Status ValidateJobRequest(const v1::CreateJobStateRequest& request,
                                absl::StatusOr<kernels::OptimizerParams>* dense_params_out,
                                std::vector<kernels::OptimizerParams>* table_params_out);

// The checks of a pulling caller of `job`: a known `encoding` (INVALID_ARGUMENT naming
// `encoding_field`) and a worker_id below the job's num_workers.
absl::Status CheckPullCaller(const JobState& job, uint32_t worker_id, v1::Encoding encoding,
                             absl::string_view encoding_field);

// Resolves and checks the push half of `request` without locks: the worker, step and
// incarnation, then every slice (its key, encoding, byte count, row ids, SSP staleness bound,
// NaN/Inf under the job's non_finite_policy, no key twice). Fills *items in request order (none
// for a request without push slices). NOT_FOUND for an unknown key; INVALID_ARGUMENT or
// FAILED_PRECONDITION naming the field otherwise.
absl::Status ResolvePush(const JobState& job, const PushPullView& request,
                         std::vector<PushSlice>* items);

// One key of a pull with the step its gate opens at (-1: no gating).
struct PullItem {
  std::shared_ptr<Partition> partition;
  v1::PartitionKey key;
  std::vector<int64_t> row_ids;
  bool all_rows = false;  // every row of a sparse table (Pull only)
  int64_t gate_step = -1;
  // Weight-delta pulls (pull encoding TOPK) of a dense partition: the weights_id the puller holds
  // and the share of values a delta sends (JobConfig.pull_topk_fraction); 0 otherwise.
  uint64_t held_weights = 0;
  double delta_fraction = 0;
};

// JobConfig.pull_topk_fraction when 0.
inline constexpr double kDefaultPullTopKFraction = 0.1;

// Resolves the pull slices of `request` (gated for request.step) and then its push slices with
// want_weights (gated for step + 1) into *items, in that order. Each answered slice must fit
// `max_message_bytes` (0: no limit), and with `one_message` (PushPull) the whole answer too:
// RESOURCE_EXHAUSTED otherwise. NOT_FOUND for an unknown key; INVALID_ARGUMENT for row ids on a
// dense key or none on a table (pulls) unless all_rows (only on a table without row ids, and only
// outside PushPull), a key pulled twice, or a BSP pull from the future.
absl::Status ResolvePulls(const JobState& job, const PushPullView& request, bool one_message,
                          size_t max_message_bytes, std::vector<PullItem>* items);

}  // namespace tessera::server

#endif  // TESSERA_SERVER_REQUEST_VALIDATION_H_
