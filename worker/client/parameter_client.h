// ParameterClient: a worker's view of a job's sharded parameters, like ps-lite's KVWorker.
//
// It cuts dense tensors into partitions (tensor_layout.h), routes every partition and sparse row
// to its shard by jump consistent hash, and keeps one PushPull stream per shard. A PushPull of a
// tensor sends all of its partitions to all of their shards at once and returns a future, so the
// caller overlaps communication with compute. Each request has a per-(worker, incarnation)
// sequence number; a retry after UNAVAILABLE or DEADLINE_EXCEEDED resends the very same request
// (same seq) after capped exponential backoff with jitter, and the shard acknowledges a seq it has
// already applied without applying it again. This is the one retry layer: the transport resends
// nothing (a broken stream fails its requests with UNAVAILABLE), so RetryPolicy alone says how
// often and when a request is sent again. Every error names the shard's address.
//
// fp32 gradients are not copied: each partition's bytes are lent from the caller's gradient to
// the transport (ShardClient::PushPullCall::lent), which sends them as gRPC slices pointing into it
// and runs the callback only once gRPC has let go of them. Other push encodings are encoded into
// the request's bytes field, which gRPC sends as slices of the request itself. Weights are decoded
// from the received bytes straight into the caller's buffer.
//
// Replication (Options::replicas 2, DESIGN.md §7): every partition and row also lives on the next
// shard index (replica_routing.h). Each push goes to every live copy with the same seq and is done
// once all of them acknowledged it; pulls go to the first live copy. SetDownShards takes the
// coordinator's word that shards are gone: a request still waiting on one of them is dropped when
// another copy holds its push, and one that wanted weights asks the next copy for them instead.
// Until that word comes, retryable errors on a replicated job are retried for
// replica_failover_timeout rather than max_attempts times, so that a lost shard costs a failover,
// not the call.
//
// Thread-safety: all methods may be called from any thread concurrently. The destructor fails
// every call in flight with CANCELLED (no retries) and returns once their callbacks have run.
#ifndef TESSERA_WORKER_CLIENT_PARAMETER_CLIENT_H_
#define TESSERA_WORKER_CLIENT_PARAMETER_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/gradient_compression.h"
#include "common/security.h"
#include "tessera/v1/parameter.pb.h"
#include "worker/client/held_weights.h"
#include "worker/client/push_encoder.h"
#include "worker/client/replica_routing.h"
#include "worker/client/shard_client.h"
#include "worker/client/tensor_layout.h"

namespace tessera {
namespace client {

class ShardProbes;  // worker/client/internal/shard_probes.h

// How ParameterClient sends a request again after a retryable error (UNAVAILABLE, which includes
// a PushPull stream that broke under the request, or DEADLINE_EXCEEDED).
struct RetryPolicy {
  // Attempts per request, the first included. 1 disables retries.
  int max_attempts = 5;
  // Backoff before retry r (1-based): min(max_backoff, initial_backoff * multiplier^(r-1)),
  // scaled by a uniform factor in [1 - jitter, 1 + jitter].
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  double multiplier = 2.0;
  double jitter = 0.2;
};

// The backoff before retry `retry` (1-based) under `policy`, with `unit_random` in [0, 1) picking
// the jitter: min(max_backoff, initial * multiplier^(retry-1)) * (1 - jitter + 2*jitter*unit).
absl::Duration RetryBackoff(const RetryPolicy& policy, int retry, double unit_random);

// A dense tensor to declare: fp32 values in row-major order.
struct DenseTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  // Starting weights, one per element; empty means zeros. Only read during DeclareJob.
  absl::Span<const float> initial_values;
  // How the shards apply its pushes: gradients through the job's optimizer, or (state that is
  // not trained, such as BatchNorm moving statistics) values they average.
  v1::DenseUpdate update = v1::DENSE_UPDATE_OPTIMIZER;
};

// Outcome of one PushPull over all the partitions (or sparse shard groups) it touched.
struct PushPullResult {
  int64_t min_version = 0;  // smallest partition version in the answers (0 without weights)
  int64_t max_version = 0;
  uint32_t duplicates = 0;          // slices the shards acknowledged as already applied
  uint32_t skipped_non_finite = 0;  // slices skipped for NaN/Inf (NON_FINITE_POLICY_SKIP)
  uint32_t requests = 0;            // requests sent (one per partition or sparse chunk)
  uint32_t retries = 0;             // resends after a retryable error
  // The longest wait of the answers at a shard's consistency gate (PushPullResponse.gate_wait_us).
  uint64_t gate_wait_us = 0;
};

class ParameterClient {
 public:
  struct Options {
    std::vector<std::string> shard_addresses;  // index = shard index
    std::string job_id;
    uint32_t worker_id = 0;
    uint64_t incarnation = 0;
    int64_t partition_bytes = 4 << 20;
    v1::Encoding push_encoding = v1::ENCODING_FP32;
    // Weights of PushPull answers: FP32, BF16, FP16, or TOPK for weight deltas (dense partitions
    // only; the shard keeps what the deltas leave out, server/published_weights.h, and sparse
    // rows come in FP32).
    v1::Encoding pull_encoding = v1::ENCODING_FP32;
    // TOPK pushes: the fraction of each dense partition's values sent, in (0, 1].
    double topk_fraction = 0.01;
    // Deadline of every call, counted from each attempt's start.
    absl::Duration call_timeout = absl::Seconds(30);
    RetryPolicy retry;
    // PushPull streams per shard (on the one connection): the shard works on the requests of one
    // stream in order, so a few let it work on several partitions of one worker at once.
    int streams_per_shard = 1;
    // Large push values go to gRPC as slices of the request, without a serialisation copy.
    bool zero_copy_push = true;
    // Upper bound for one CreateJobState batch; keep it under the shards' --max_message_bytes.
    int64_t max_request_bytes = 16 << 20;
    // How the channels to the shards are made (default: plaintext, no token).
    ClientCredentials credentials;
    // Copies of every partition and row (the job's spec.replication): 1, or 2 for a backup on the
    // next shard index. At most the number of shards.
    int replicas = 1;
    // Shards already down when the client is made (Task.down_shards); see SetDownShards.
    std::vector<int> down_shards;
    // Replicated jobs: how long a request keeps being retried on a shard that fails with a
    // retryable error, waiting for the coordinator to say whether the shard is down.
    absl::Duration replica_failover_timeout = absl::Seconds(120);
    // Replicated jobs: a shard with a call unanswered this long is asked whether its process
    // answers at all (a health check of probe_timeout); one that does not (SIGSTOP, a frozen
    // host: its calls would otherwise end only at call_timeout) is named by the next
    // TakeUnreachableShards(). A call parked at a barrier for another rank waits as long, but its
    // shard answers the check (docs/data-plane.md "Replication").
    absl::Duration probe_after = absl::Seconds(1);
    absl::Duration probe_timeout = absl::Milliseconds(500);
    // Makes the transport to a shard that serves at a new address (SetFill). Create sets it to
    // a GrpcShardClient with these options; empty: a fill at another address is refused.
    std::function<absl::StatusOr<std::unique_ptr<ShardClient>>(const std::string& address)> connect;
  };

  using PushPullCallback = std::function<void(absl::StatusOr<PushPullResult>)>;

  // Connects one GrpcShardClient per address (lazily: no RPC is made here). INVALID_ARGUMENT,
  // naming the field, for no shards, an empty job_id, partition_bytes < 4, max_attempts < 1, an
  // unknown encoding or a negative backoff.
  static absl::StatusOr<std::unique_ptr<ParameterClient>> Create(const Options& options);
  // Same with caller-supplied transports (tests, fault injection). shards.size() must equal
  // options.shard_addresses.size(); shards[i] is shard i.
  static absl::StatusOr<std::unique_ptr<ParameterClient>> CreateWithShards(
      const Options& options, std::vector<std::unique_ptr<ShardClient>> shards);

  ~ParameterClient();

  // Records the tensors' layouts and creates the job's state on every shard (CreateJobState,
  // batched under max_request_bytes; additive and idempotent, so every worker may call it).
  // Blocks. INVALID_ARGUMENT for a bad spec or an initial_values size that does not match the
  // shape; a shard's error carries its address.
  absl::Status DeclareJob(const v1::JobConfig& config, const std::vector<DenseTensorSpec>& tensors,
                          const std::vector<v1::SparseTableDecl>& tables);
  // Records the layouts only (no RPC), for a worker whose job another process declared.
  absl::Status AttachJob(const std::vector<DenseTensorSpec>& tensors,
                         const std::vector<v1::SparseTableDecl>& tables);

  // The layout of a declared tensor; NOT_FOUND otherwise. The pointer lives as long as *this.
  absl::StatusOr<const DenseLayout*> Layout(absl::string_view name) const;

  // Pushes `gradient` for `step` (all partitions, all shards at once) and, when `weights_out` is
  // not empty, writes the fresh weights there once the shards' consistency gate for step + 1
  // opens. Does not block. `done` runs once, on an internal thread.
  // REQUIRES: gradient and weights_out stay valid and untouched until `done` runs; their sizes
  // equal the tensor's element count (weights_out may be empty). `urgent` marks its requests
  // (ShardClient::PushPullCall::urgent); a tensor must be urgent at every step or at none.
  void PushPullAsync(absl::string_view name, int64_t step, absl::Span<const float> gradient,
                     absl::Span<float> weights_out, PushPullCallback done, bool urgent = false);
  std::future<absl::StatusOr<PushPullResult>> PushPull(absl::string_view name, int64_t step,
                                                       absl::Span<const float> gradient,
                                                       absl::Span<float> weights_out);

  // One tensor of a PushPullManyAsync.
  struct TensorUpdate {
    std::string name;
    absl::Span<const float> gradient;
    absl::Span<float> weights_out;  // empty: push only
  };
  // PushPullAsync of several tensors in one request per shard: every partition of `tensors` that
  // lives on shard i travels in shard i's request. Meant for small tensors (biases, small layers),
  // where one round trip per tensor costs more than the bytes. INVALID_ARGUMENT (through `done`)
  // for an unknown tensor, a size mismatch, a tensor named twice, or a shard's share over
  // options.max_request_bytes. Same REQUIREs as PushPullAsync, for every tensor.
  void PushPullManyAsync(int64_t step, std::vector<TensorUpdate> tensors, PushPullCallback done,
                         bool urgent = false);

  // Blocking pull of the whole tensor into `out`, gated as for `step` (negative: not gated, for
  // initial weights, evaluation and export). With `min_version`, the smallest version of the
  // tensor's partitions in the answers is written there.
  absl::Status Pull(absl::string_view name, int64_t step, absl::Span<float> out,
                    int64_t* min_version = nullptr);

  // Sparse tables: rows[i]'s gradient is gradient[i*dim, (i+1)*dim). Each row goes to
  // ShardOfSparseRow(job, table, row) and its copies, and every live shard gets one request, rows
  // or none (its clock for the table advances: a BSP step there does not wait for this worker).
  // Weights come back into weights_out in the same layout (replicas 1 only: INVALID_ARGUMENT
  // otherwise). Same REQUIREs as PushPullAsync; sizes are rows.size() * dim; the rows are
  // distinct.
  void PushPullSparseAsync(absl::string_view table, int64_t step, absl::Span<const int64_t> rows,
                           absl::Span<const float> gradient, absl::Span<float> weights_out,
                           PushPullCallback done);
  std::future<absl::StatusOr<PushPullResult>> PushPullSparse(absl::string_view table, int64_t step,
                                                             absl::Span<const int64_t> rows,
                                                             absl::Span<const float> gradient,
                                                             absl::Span<float> weights_out);
  absl::Status PullSparse(absl::string_view table, int64_t step, absl::Span<const int64_t> rows,
                          absl::Span<float> out);
  // Every row a table holds on any shard (ungated; for export), ids ascending per shard: row i's
  // values are values[i * dim ...]. Blocks.
  absl::Status PullAllRows(absl::string_view table, std::vector<int64_t>* ids,
                           std::vector<float>* values);
  // The rows `rows` of a table into out[i * dim ...] once the shards' consistency gate for
  // `step` opens (>= 0; BSP: once step - 1 is applied), each shard holding some of them asked in
  // one request on its PushPull stream, under the retry policy. Does not block: a pull for the
  // next step can be parked on the shards while this one computes. `done` runs once.
  // REQUIRES: out stays valid until `done` runs; out.size() == rows.size() * dim.
  void PullSparseAsync(absl::string_view table, int64_t step, absl::Span<const int64_t> rows,
                       absl::Span<float> out, PushPullCallback done);

  // The shards the coordinator has found down (replicated jobs; Job.down_shards): nothing is sent
  // to them any more; requests waiting on them are dropped (their pushes are held by another
  // copy) or sent as pulls to the next copy, now. INVALID_ARGUMENT for an index out of range or
  // on a client with one copy.
  absl::Status SetDownShards(const std::vector<int>& down);
  // The coordinator's fill of a down shard (ProgressAck.fill; docs/reliability.md "Filling a new
  // copy"), or none (shard < 0). While it lasts, every push of from_step or later goes to that
  // shard too, at `address` (a new transport when it changed); it is read from once it is no
  // longer down. A fill that ends with the shard still down stops the writes to it. What the
  // next progress report says of it:
  struct FillReport {
    int64_t from_step = 0;  // the fill this client writes (0: none)
    bool missed = false;    // it had routed a push of from_step or later without the shard
  };
  // INVALID_ARGUMENT for a shard out of range or not down, on a client with one copy, or an
  // address it cannot connect (no Options::connect).
  absl::StatusOr<FillReport> SetFill(int shard, const std::string& address, int64_t from_step);
  FillReport fill_report() const;

  // The shards that failed a request with a retryable error since the last call, or answered no
  // health check while a call waited on them (Options::probe_after; replicated jobs), for the
  // worker's next progress report. Starts those health checks.
  std::vector<int> TakeUnreachableShards();

  // Control calls, sent to every shard that is not down. Block.
  absl::Status UpdateMembership(const std::vector<uint32_t>& live_workers, int64_t effective_step);
  absl::Status DropJob();

  const Options& options() const { return options_; }
  // Weights come back from PushPull as deltas (pull_encoding TOPK or INT8, held_weights.h);
  // blocking pulls get them in FP32.
  bool DeltaPulls() const { return IsWeightDelta(options_.pull_encoding); }
  const ReplicaRouting& routing() const { return routing_; }
  // The dense pushes' encoder, with the error feedback of a compressed push_encoding.
  PushEncoder& encoder() { return encoder_; }
  int num_shards() const { return num_shards_; }

 private:
  struct Op;
  struct Attempt;
  class RetryTimer;
  // Notes a call to `shard` in flight under `key` (replicated clients), until Answered(key).
  void Sent(const void* key, int shard);
  void Answered(const void* key);
  struct SparseTable {
    std::string name;
    uint32_t dim = 0;
  };

  ParameterClient(const Options& options, std::vector<std::unique_ptr<ShardClient>> shards);

  absl::Status RecordLayouts(const std::vector<DenseTensorSpec>& tensors,
                             const std::vector<v1::SparseTableDecl>& tables);
  absl::StatusOr<SparseTable> FindTable(absl::string_view table) const;
  std::shared_ptr<v1::PushPullRequest> NewRequest(int64_t step);
  void Send(std::shared_ptr<Attempt> attempt);
  // An attempt whose shard is down: finished when it wants no weights and every partition of it
  // has another live copy, sent as a pull to the next copy when it wants weights, else failed.
  void Reroute(std::shared_ptr<Attempt> attempt, const absl::Status& error);
  void Finish(std::shared_ptr<Attempt> attempt, absl::Status error,
              const v1::PushPullResponse* response);
  // Runs `call` (a blocking pull) once more when it failed and the down shards changed meanwhile.
  absl::Status AgainAfterAFailover(const std::function<absl::Status()>& call);
  absl::Status PullOnce(absl::string_view name, int64_t step, absl::Span<float> out,
                        int64_t* min_version);
  absl::Status PullSparseOnce(absl::string_view table, int64_t step, absl::Span<const int64_t> rows,
                              absl::Span<float> out);
  void OnResponse(std::shared_ptr<Attempt> attempt, absl::StatusOr<v1::PushPullResponse> response);
  absl::Duration Backoff(int retry) const;
  // Runs `call` under the retry policy (idempotent blocking calls: Pull and control); replicated
  // clients with retries retry for replica_failover_timeout unless the shard is found down.
  absl::Status CallWithRetries(int shard, const std::function<absl::Status(absl::Time)>& call);
  absl::Status WithAddress(int shard, const absl::Status& status) const;
  bool Stopping() const;
  void OpStarted();
  void OpFinished();

  // The transport of shard `index` now (SetFill may replace it).
  std::shared_ptr<ShardClient> Shard(int index) const;
  // A write to the shard being filled failed for good: the fill is missed (the coordinator gives
  // it up and tries again), and the push stands on its other copies.
  void BreakFill(int shard, const absl::Status& error);

  const Options options_;
  const int num_shards_;
  mutable absl::Mutex shards_mu_;
  std::vector<std::shared_ptr<ShardClient>> shards_ ABSL_GUARDED_BY(shards_mu_);
  // Replaced transports, kept until the client goes: a call may still hold one.
  std::vector<std::shared_ptr<ShardClient>> retired_ ABSL_GUARDED_BY(shards_mu_);
  ReplicaRouting routing_;
  PushEncoder encoder_;
  HeldWeights held_;
  std::atomic<uint64_t> next_seq_{1};
  std::unique_ptr<RetryTimer> retry_timer_;

  mutable absl::Mutex mu_;
  std::map<std::string, DenseLayout, std::less<>> layouts_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, SparseTable, std::less<>> tables_ ABSL_GUARDED_BY(mu_);
  int ops_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<int> unreachable_ ABSL_GUARDED_BY(mu_);
  // Replicated jobs: the calls in flight (attempts and blocking calls, by address), with their
  // shard and when they were sent; and the health checks of shards they wait on.
  std::map<const void*, std::pair<int, absl::Time>> unanswered_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ShardProbes> probes_;
  FillReport fill_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_PARAMETER_CLIENT_H_
