// Validating job specs (proto/tessera/v1/job_spec.proto) and the values derived from them.
//
// ValidateJobSpec checks every field before any work starts: the coordinator at CreateJob
// (server/coordinator/), `tessera submit` and `tessera-worker --standalone` before they train.
// The model's shapes are inferred by spec/model_spec.h, the optimizer and schedule are checked by
// spec/optimizer_spec.h and spec/schedule_spec.h, and the device by spec/device_spec.h, so that
// every rule of a spec lives in spec/ and nothing here needs the engine or a device.
#ifndef TESSERA_SPEC_JOB_SPEC_H_
#define TESSERA_SPEC_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tessera/v1/job_spec.pb.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::spec {

struct ValidateOptions {
  // Check that the dataset files exist and are readable.
  bool check_files = true;
  // Also check the fields of distributed runs (num_workers, consistency, staleness,
  // partition_bytes, wire_encoding, checkpoint_every_steps, stall_timeout_seconds,
  // stall_policy), and that dataset paths are absolute. A standalone run ignores them.
  bool distributed = false;
  // When not empty, every dataset path must lie in one of these folders (DatasetChecks::roots,
  // spec/dataset_spec.h): the daemons' --dataset_root.
  std::vector<std::string> dataset_roots;
};

// Checks every field of `spec`. INVALID_ARGUMENT names the field and the value:
// "batch_size: must be in [1, 1048576], got 0", "dataset.train_images: file not found: /x",
// "model.layers[2] (dense_2): ...", "optimizer.learning_rate: ...". With check_files it stats
// the dataset files (blocking file-system calls). Thread-safe.
absl::Status ValidateJobSpec(const v1::JobSpec& spec, const ValidateOptions& options = {});

// The shards' view of a distributed job: consistency (with its staleness), num_workers (0 -> 1),
// optimizer, schedule. REQUIRES: ValidateJobSpec(spec, {.distributed = true}).ok().
v1::JobConfig MakeJobConfig(const v1::JobSpec& spec);
// spec.wire_encoding as the data plane's enum for dense pushes (empty -> FP32). REQUIRES: a
// validated spec.
v1::Encoding PushEncoding(const v1::JobSpec& spec);
// The same for pulled weights: spec.pull_encoding when set ("delta_topk": TOPK, "delta_int8": INT8,
// weight deltas);
// otherwise the push encoding, or bf16 under a compressed one.
v1::Encoding PullEncoding(const v1::JobSpec& spec);
// spec.pull_topk_fraction, 0 -> 0.1.
double PullTopKFraction(const v1::JobSpec& spec);
// spec.topk_fraction, 0 -> 0.01.
double TopKFraction(const v1::JobSpec& spec);
// spec.partition_bytes, 0 -> 4 MiB.
int64_t PartitionBytes(const v1::JobSpec& spec);
// spec.num_workers, 0 -> 1 (standalone specs leave it unset).
int NumWorkers(const v1::JobSpec& spec);

// The progress lease: spec.stall_timeout_seconds, 0 -> kDefaultStallTimeoutSeconds.
inline constexpr int kDefaultStallTimeoutSeconds = 300;
inline constexpr int kMinStallTimeoutSeconds = 5;
inline constexpr int kMaxStallTimeoutSeconds = 7 * 24 * 3600;
absl::Duration StallTimeout(const v1::JobSpec& spec);
// spec.stall_policy is "evict" (a stalled rank is lost); otherwise the coordinator only warns.
bool EvictsStalledRanks(const v1::JobSpec& spec);
// Copies of each partition and sparse row (spec.replication: 0 and 1 mean 1; 2 is the most).
inline constexpr int kMaxReplication = 2;
int Replicas(const v1::JobSpec& spec);

}  // namespace tessera::spec

#endif  // TESSERA_SPEC_JOB_SPEC_H_
