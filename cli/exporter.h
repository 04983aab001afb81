// Export of a job's final weights to one safetensors file (DESIGN.md §7, `tessera export`).
//
// The job's spec says what the model is: it is built on the CPU backend (nothing is trained) to
// learn its parameters' names and shapes, in the order Model::parameters() gives them.
// Each of them is then pulled whole (ungated, fp32) from the job's shards through a
// ParameterClient, so the file holds the same single-device model however many shards and
// workers trained it. A sparse table (an embedding_bag's) is every row the shards hold, as two
// tensors: "<name>.ids" (int64 [n], each shard's ids ascending) and "<name>" (float32 [n, dim],
// row i of id ids[i]); an id without a row never received a gradient and reads as its
// initializer. Non-trainable state (BatchNorm's "<layer>/moving_mean" and
// "<layer>/moving_variance") is on the shards too, averaged over the ranks (DENSE_UPDATE_AVERAGE),
// and is exported beside the weights.
#ifndef TESSERA_CLI_EXPORTER_H_
#define TESSERA_CLI_EXPORTER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/safetensors.h"
#include "common/security.h"
#include "tessera/v1/job.pb.h"

namespace tessera::cli {

struct ExportOptions {
  // Deadline of each pull call (the client retries UNAVAILABLE under its default policy).
  absl::Duration call_timeout = absl::Seconds(30);
  // How the channels to the shards are made (default: plaintext, no token).
  ClientCredentials credentials;
};

// Pulls every parameter of `job` from job.shard_addresses(). Blocks on the RPCs.
// FAILED_PRECONDITION when the job never started (no shard addresses) or a shard no longer holds
// it ("shard 1 (127.0.0.1:4001) no longer holds job 'x-1' ..."); INVALID_ARGUMENT for a spec
// whose model does not build; a shard's transport error names its address.
absl::StatusOr<std::vector<NamedTensor>> PullJobWeights(const v1::Job& job,
                                                        const ExportOptions& options = {});

// PullJobWeights, then WriteSafetensorsFile(out_path, ..., {job_id, format: "tessera", ...}).
// Returns the tensors' total value count.
absl::StatusOr<int64_t> ExportJob(const v1::Job& job, const std::string& out_path,
                                  const ExportOptions& options = {});

}  // namespace tessera::cli

#endif  // TESSERA_CLI_EXPORTER_H_
