// Distributed training: one task, that is one rank of one job, against the job's parameter
// shards (DESIGN.md §4-§6, issue #4).
//
// Every rank builds the model from the spec's seed, so all ranks start from identical weights;
// DeclareJob (additive and idempotent on the shards) then Pull(step -1) make every rank start
// from the shards' state. Each step pushes every trainable parameter's gradient as soon as
// backward produces it (PushPullAsync) and gets back the fresh weight the shards' consistency
// gate releases; the shards average and apply the job's optimizer and schedule, the worker never
// applies an optimizer itself. On one device with no sparse tables the step ends once its pushes
// are out, and the next step's forward pass installs each fresh weight just before the first
// layer that reads it, waiting only for those still on their way (the pulls overlap the forward
// pass; DESIGN.md §5); otherwise the step waits for every weight and installs them all. With
// spec.clipping.max_global_norm > 0 the pushes wait until backward is done, so the whole gradient
// can be clipped by its global norm.
//
// Every rank runs exactly total_steps steps: steps_per_epoch = ceil(floor(N / world) / batch)
// with N the training split's example count, so no rank ever holds up a BSP step by running
// fewer. Rank 0 alone loads the test split, evaluates at the epoch ends spec.eval asks for, and
// at the end waits until every rank reported TRAINING_DONE, pulls the final weights ungated (the
// exact weights `tessera export` reads) and evaluates the whole test split with them.
//
// Resuming (DESIGN.md §7, issue #6). A task with start_step S > 0 (a rewind to checkpoint S, or a
// lost rank taken over from step S) trains steps S..total_steps-1 only. The data order of a rank
// is a pure function of (spec.seed, rank, epoch, pass): step S is batch S % steps_per_epoch of
// epoch S / steps_per_epoch, and since a rank's split may hold fewer batches than an epoch takes
// (the loop then reshuffles it with seed spec.seed + pass), that batch is batch
// offset % batches_per_pass of pass offset / batches_per_pass (DataPositionAt). The trainer
// checks task.data_position against this, skips the earlier batches without assembling them,
// and pulls the weights gated for step S, so a rank that joins at S waits until the others have
// finished step S - 1. Dropout masks are a function of (spec.seed, rank, step), so a resumed rank
// draws the masks an uninterrupted one would have drawn.
//
// Non-trainable state (BatchNorm moving statistics, DESIGN.md §5) lives on the shards beside the
// weights, declared DENSE_UPDATE_AVERAGE: after each step's forward pass a rank pushes its own
// values, the shards average the ranks' values (BSP: the mean of the step's pushes), and every
// rank installs the average with the fresh weights. So the state is checkpointed and restored
// with the weights, rank 0 evaluates with the average, and `tessera export` writes it: the
// exported model is the single-device model.
//
// With cpu_devices N > 1 (--devices cpu:N) the batch is trained on N CPU devices at once
// (internal/local_devices.h: N replicas whose gradients are reduced on the host, or the N stages
// of a pipelined model) before the one push per step; the trainer's own model then evaluates and
// holds the exported weights. cuda_devices does the same on several GPUs (NCCL sums the
// replicas' gradients), the trainer's own model on the first of them.
//
// Sparse tables (an EmbeddingBag's) are declared on the shards with their row initializer and
// travel by row (internal/row_exchange.h): each step fetches the rows its batch touches, gated
// for the step, and pushes one gradient per touched row; the next batch's fetch starts before the
// step computes. The worker never holds a whole table. Evaluation pulls each test batch's rows
// ungated.
//
// Life cycle: Create() validates the task, loads the data, builds the backend and the model
// (kNew -> kReady); Run() trains (kReady -> kDone) and may be called once. Cancel() may be called
// from any thread at any time; everything else is for the one thread that calls Run().
#ifndef TESSERA_WORKER_TRAINER_DISTRIBUTED_TRAINER_H_
#define TESSERA_WORKER_TRAINER_DISTRIBUTED_TRAINER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "kernels/backend.h"
#include "tessera/v1/job.pb.h"
#include "worker/client/parameter_client.h"
#include "worker/data/batch.h"
#include "worker/data/dataset.h"
#include "worker/engine/model.h"
#include "worker/trainer/internal/local_devices.h"
#include "worker/trainer/internal/row_exchange.h"
#include "worker/trainer/internal/splits.h"
#include "worker/trainer/internal/thread_tuner.h"

namespace tessera::trainer {

// Where a rank's data stream stands at `step`: epoch = step / steps_per_epoch, batch_offset =
// step % steps_per_epoch, pass = batch_offset / batches_per_pass, seed = spec_seed + pass.
// REQUIRES: steps_per_epoch >= 1, batches_per_pass >= 1, step >= 0.
v1::DataPosition DataPositionAt(int64_t step, int64_t steps_per_epoch, int64_t batches_per_pass,
                                uint64_t spec_seed);

// Whether a status from DistributedTrainer::Run() came from the data plane: a shard unreachable
// or too slow (UNAVAILABLE, DEADLINE_EXCEEDED), the job unknown on a shard (NOT_FOUND, e.g. after
// the shard restarted), ABORTED, or FAILED_PRECONDITION (e.g. a stale incarnation). The trainer
// marks such errors where the shard's answer surfaces, by its status code, so a coordinator may
// recover the job from a checkpoint (ProgressReport.shard_error).
bool IsShardError(const absl::Status& status);

struct DistributedOptions {
  // The task as the coordinator sent it: job_id, rank, world_size, shard_addresses, spec,
  // incarnation, start_step and data_position (a resume).
  v1::Task task;
  // Overrides task.spec.device when not empty: "auto", "cpu" or "cuda".
  std::string device;
  // CPU threads for the backend; 0: measured on the first steps, the OpenMP default against 1,
  // keeping the faster (internal/thread_tuner.h; not with cpu_devices > 1).
  int num_threads = 0;
  // CPU backend memory bound (0: the host's physical memory); see TrainerOptions.
  int64_t memory_limit_bytes = 0;
  // --devices cpu:N: N devices on the CPU train each batch together before the one push
  // (internal/local_devices.h): N model replicas that split each batch and reduce their
  // gradients on the host, or, for a model with a pipeline of N stages, one stage per device.
  // num_threads is then per device (0: 1). 1: the single device `device` names (a pipelined
  // model then trains unsplit).
  int cpu_devices = 1;
  // --devices cuda:0,cuda:1: the GPUs that train each batch together, as the CPU devices do
  // (replicas whose gradients NCCL sums, or pipeline stages); one trains alone, as `device`
  // cuda on that GPU. Empty: cpu_devices. Not both.
  std::vector<int> cuda_devices;
  // The folders the task's dataset files must lie in (tessera-worker --dataset_root); empty:
  // anywhere. A spec naming a file elsewhere fails the task before anything is read.
  std::vector<std::string> dataset_roots;
  // Deadline of each data-plane call (ParameterClient::Options::call_timeout).
  absl::Duration call_timeout = absl::Seconds(30);
  // Attempts per data-plane request after UNAVAILABLE or DEADLINE_EXCEEDED, with backoff from
  // 50 ms capped at 2 s: 40 ride out about 70 s of a partition or an unreachable shard before the
  // task fails (a restarted shard ends the wait sooner: the coordinator rewinds the task).
  int max_attempts = 40;
  // How the channels to the shards are made (default: plaintext, no token).
  ClientCredentials credentials;
  // Progress reports come at most this often, and at every epoch end.
  absl::Duration progress_interval = absl::Milliseconds(500);
  // Rank 0: how often it re-reports TRAINING_DONE while waiting for all_workers_done, and how
  // long it waits at most (zero: until cancelled).
  absl::Duration done_poll_interval = absl::Milliseconds(200);
  absl::Duration done_wait_timeout = absl::ZeroDuration();

  // Progress (phase TRAINING), on the training thread: at most every progress_interval and at
  // every epoch end; evaluated reports (rank 0) carry test_loss and test_accuracy. Every report
  // (these, the TRAINING_DONE polls and Run()'s result) carries task.incarnation and
  // steps_per_epoch. member_id and job_id are left for the caller. Should not block for long. May
  // be empty.
  std::function<void(const v1::ProgressReport&)> on_progress;
  // Called with a line about how the run is set up (the thread count chosen), on the training
  // thread. May be empty.
  std::function<void(const std::string&)> on_note;
  // Tests: sees every batch a step trains on, with the step, before the step runs. May be empty.
  std::function<void(int64_t step, const data::Batch& batch)> on_batch;
  // Rank 0 only: sends a TRAINING_DONE report to the coordinator and returns its answer (blocks).
  // Called every done_poll_interval until the answer has all_workers_done (or cancel). An error
  // answer is logged and retried. Empty: rank 0 does not wait (single-process tests, world 1).
  std::function<absl::StatusOr<v1::ProgressAck>(const v1::ProgressReport&)> report;
};

class DistributedTrainer {
 public:
  // INVALID_ARGUMENT naming the field for a bad task or spec (ValidateJobSpec with
  // distributed = true; rank outside [0, world_size), world_size != spec.num_workers, no shard
  // addresses; start_step outside [0, total_steps]; "data_position: ..." when start_step > 0 and
  // task.data_position is unset or differs from DataPositionAt(start_step): epoch and
  // batch_offset must match; pass and seed must match too unless they are 0 / unset, or pass 0
  // with seed spec.seed, which a coordinator that does not know the rank's split sends);
  // the readers' errors
  // prefixed "data: "; FAILED_PRECONDITION when CUDA is forced and absent. No RPC is made.
  static absl::StatusOr<std::unique_ptr<DistributedTrainer>> Create(DistributedOptions options);
  // Blocks until every data-plane call in flight has ended (at most the call deadline, sooner
  // once the coordinator drops the job on the shards).
  ~DistributedTrainer();

  DistributedTrainer(const DistributedTrainer&) = delete;
  DistributedTrainer& operator=(const DistributedTrainer&) = delete;

  // Trains steps start_step..total_steps-1 of the task (push step numbers as an uninterrupted
  // run's). Returns the terminal report to send: phase SUCCEEDED with test_loss and
  // test_accuracy of the final weights on rank 0, TRAINING_DONE on other ranks (member_id and
  // job_id left for the caller). With start_step == total_steps no step runs: rank 0 goes
  // straight to waiting for all_workers_done, the final pull and evaluation. Errors: CANCELLED
  // "cancelled" after Cancel() (within one step, or within a second while it waits for the
  // weights of start_step); a shard's error with its address ("shards: PushPull tensor
  // 'dense_1/kernel' partition 0 step 3 on shard 1 ...: 127.0.0.1:4100: ...", IsShardError
  // tells the data-plane ones); FAILED_PRECONDITION for a non-finite loss.
  absl::StatusOr<v1::ProgressReport> Run();

  // Asks Run() to stop: it returns CANCELLED within one step (waits for weights are interrupted
  // too). Thread-safe; idempotent.
  void Cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // Replicated jobs (spec.replication 2): the coordinator's down shards (ProgressAck.down_shards),
  // applied to the data plane at once or, before Run() has connected, when it does; and the
  // shards it found unreachable since the last call, for the next progress report. Thread-safe.
  void SetDownShards(const std::vector<int>& down);
  std::vector<int> TakeUnreachableShards();
  // Replicated jobs: the coordinator's fill of a down shard (ProgressAck.fill; null: none), applied
  // to the data plane once Run() has connected (the next ack brings it again before then); and
  // what the next progress report says of it (fill_from_step, fill_missed). Thread-safe.
  void SetFill(const v1::ShardFill* fill);
  client::ParameterClient::FillReport FillReport();

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // Batches in one pass over this rank's split (ceil(examples / batch_size)).
  int64_t batches_per_pass() const { return batches_per_pass_; }
  int64_t start_step() const { return start_step_; }
  // Where this rank's data stands at `step` (see DataPositionAt).
  v1::DataPosition DataPosition(int64_t step) const;
  int64_t total_steps() const { return total_steps_; }
  // The local devices (CPU or GPUs) that train each batch (1: the one device, no local reduce).
  int local_devices() const { return devices_ != nullptr ? devices_->size() : 1; }
  // What they do, for the log ("splits each batch over 2 CPU replicas"); empty with one device.
  std::string devices_description() const {
    return devices_ != nullptr ? devices_->Describe() : std::string();
  }
  // Steps Run() has completed: pushed, and their weights received and installed (with the
  // overlap, installed as the next step's forward pass reaches each layer).
  int64_t steps_done() const { return steps_done_.load(std::memory_order_acquire); }
  const engine::Model& model() const { return *model_; }
  const kernels::Backend& backend() const { return *backend_; }
  const data::Dataset& train_data() const { return *train_; }

 private:
  explicit DistributedTrainer(DistributedOptions options) : options_(std::move(options)) {}
  absl::Status Init();
  // Validates task.start_step and task.data_position (see Create()).
  absl::Status CheckStart();
  absl::Status Connect();
  // One training step: TrainStep with pipelined pushes, wait for every weight, install.
  absl::StatusOr<engine::StepResult> Step(const engine::BatchView& batch, int64_t step);
  // Waits until every PushPull in flight has answered; CANCELLED on Cancel().
  absl::Status WaitExchange();
  bool ExchangeDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(exchange_mu_);
  // The callback of a PushPull of `step` that carries dense_ entries `slots` (none: the rows').
  client::ParameterClient::PushPullCallback ExchangeDoneFor(int64_t step,
                                                            std::vector<size_t> slots);
  // The request of `step` answered last (see last_answer_), reset for step + 2.
  struct LastAnswer {
    std::chrono::steady_clock::time_point at{};
    double gate_wait = 0;   // seconds its answers waited at a shard's consistency gate
    double round_trip = 0;  // seconds from sending it to its answer
    bool any = false;
  };
  LastAnswer TakeLastAnswer(int64_t step);
  // Overlap: installs the fresh weights that the forward pass reads first at `position`
  // (Model::ForwardPosition), each as soon as its PushPull has answered; CANCELLED on Cancel(),
  // the exchange's first error.
  absl::Status AwaitWeights(int position);
  // Overlap: AwaitWeights for every position (before an evaluation, the final pull, an error).
  absl::Status AwaitAllWeights();
  // Rank 0: reports TRAINING_DONE until all_workers_done.
  absl::Status WaitAllWorkersDone(const v1::ProgressReport& done);
  // Ungated pull of every dense tensor (initial and final weights), installed in the model.
  absl::Status PullAll();
  // Pulls every dense tensor gated for `step` (a resume), in slices of at most a second so a
  // Cancel() is seen, and installs them.
  absl::Status PullGated(int64_t step);
  // Dropout masks of `step`: a function of (spec.seed, rank, step) only.
  void SetDropoutSeed(int64_t step);
  absl::Status InstallWeights();
  // Clipping (spec.clipping): the scale that brings the global norm of the dense gradients in
  // grads_ (averaged state left out) and the rows' squared norm `row_norm` to the bound, applied
  // to grads_ in place; returns it (1: no change).
  float ClipDenseGradients(double row_norm);
  // Step() with cpu:N devices: trains the batch on them, then pushes every gradient of the whole
  // batch and the state (`push` one tensor, `push_small` the batched ones), and the rows' for
  // `step`.
  absl::StatusOr<engine::StepResult> DevicesStep(const engine::BatchView& batch, int64_t step,
                                                 const std::function<void(size_t)>& push,
                                                 const std::function<void()>& push_small);
  absl::StatusOr<internal::SplitScore> Evaluate();
  // CANCELLED "cancelled" when Cancel() was called, otherwise OK.
  absl::Status CheckCancelled() const;

  DistributedOptions options_;
  int rank_ = 0;
  int world_ = 1;
  std::string failpoint_;  // "trainer.rank<R>.step" (common/failpoint.h)
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<engine::Model> model_;
  // cpu:N (N > 1): the devices that train; model_ then evaluates and is what is exported.
  std::unique_ptr<internal::LocalDevices> devices_;
  // One device, no --threads: picks the thread count on the first steps.
  std::unique_ptr<internal::ThreadTuner> tuner_;
  std::shared_ptr<const data::Dataset> train_;
  std::shared_ptr<const data::Dataset> test_;  // rank 0 only
  // Indices into model_->parameters() of the dense tensors the shards hold: trainable ones, and
  // state the shards average (averaged_[k]).
  std::vector<int> dense_;
  std::vector<bool> averaged_;
  std::vector<std::string> dense_names_;  // per dense_ entry, the parameter's name
  std::vector<int> slot_of_;  // per parameter, its gradient's index into dense_ (-1: none)
  std::vector<v1::SparseTableDecl> tables_;
  int64_t steps_per_epoch_ = 0;
  int64_t batches_per_pass_ = 0;
  int64_t total_steps_ = 0;
  int64_t start_step_ = 0;
  uint64_t dropout_base_ = 0;
  int epochs_ = 0;
  bool ran_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> steps_done_{0};

  // Host buffers per dense_ entry: the gradient (averaged state: the values) being pushed and the
  // weights coming back.
  // Declared before client_, so they outlive every call the client still has in flight.
  std::vector<std::vector<float>> grads_;
  std::vector<std::vector<float>> weights_;

  // The exchange: PushPulls that have not answered yet, and the first error (which ends Run()).
  absl::Mutex exchange_mu_;
  int pending_ ABSL_GUARDED_BY(exchange_mu_) = 0;
  absl::Status exchange_error_ ABSL_GUARDED_BY(exchange_mu_);

  // Overlap of the pulls with the next forward pass (one device, no sparse tables; DESIGN.md
  // §5): a step ends once its pushes are out, and the next step's forward pass installs each
  // fresh weight just before the first layer that reads it, waiting only for those that have not
  // arrived yet. Per forward position, the dense_ entries first read there.
  bool overlap_ = false;
  std::vector<std::vector<size_t>> read_at_;
  // Per dense_ entry: read by the forward pass's first layer with parameters, so its requests
  // are urgent (ShardClient::PushPullCall::urgent) and do not queue behind larger ones.
  std::vector<bool> urgent_;
  // Per dense_ entry: pushed, its fresh weight not installed yet (the training thread's).
  std::vector<bool> awaited_;
  // Per dense_ entry: its PushPull answered, so weights_ holds the fresh weight.
  std::vector<bool> arrived_ ABSL_GUARDED_BY(exchange_mu_);
  // The step's time in the forward pass spent waiting for weights and installing them.
  double forward_wait_ = 0, forward_install_ = 0;
  // Per step parity, the request answered last (a step's requests are all answered before the
  // step after next sends any: its forward pass, or the wait after it, reads every weight).
  LastAnswer last_answer_[2] ABSL_GUARDED_BY(exchange_mu_);

  // The sparse tables' rows (null for a dense model); outlives client_, whose calls fill it.
  std::unique_ptr<internal::RowExchange> rows_;

  // What SetDownShards and TakeUnreachableShards reach: client_ once Connect() made it.
  absl::Mutex replica_mu_;
  client::ParameterClient* connected_ ABSL_GUARDED_BY(replica_mu_) = nullptr;
  std::vector<int> down_shards_ ABSL_GUARDED_BY(replica_mu_);

  // Last member: destroyed first, which waits for its calls in flight.
  std::unique_ptr<client::ParameterClient> client_;
};

}  // namespace tessera::trainer

#endif  // TESSERA_WORKER_TRAINER_DISTRIBUTED_TRAINER_H_
