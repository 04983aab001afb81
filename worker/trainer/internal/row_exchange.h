// RowExchange: the sparse-table traffic of one distributed rank (DESIGN.md §2-§4). Private to
// worker/trainer.
//
// A step moves only the rows its batch touches, of every sparse table of the model. Before step s
// the rank fetches those rows
// (deduplicated, internal::RowMapper), gated for step s, from the shards that own them; after
// backward it pushes one gradient per row (the sum of the row's uses) for step s, to every shard,
// rows or none, so that each shard's table counts the rank for the step. The fetch of step s + 1
// starts before step s computes: the shards park it until step s is applied (BSP) or the clocks
// allow it (SSP), so it travels while the step computes and exchanges, and a step waits for no
// extra round trip. Under ASP such a fetch is answered at once, without this rank's own update of
// step s (ASP bounds no staleness).
//
// BSP orders pushes per shard: a push for step s is refused unless the shard's table has applied
// step s - 1. The fetch for step s therefore asks every shard for something: a shard owning none
// of the batch's rows is asked for a probe row (a fixed id it owns; reading it creates nothing),
// so that once the fetch is in, every shard has applied step s - 1.
//
// Two slots alternate: the rows of the step in flight (installed in the model, their gradients
// being pushed) and the fetch of the next one. Thread-compatible: the trainer's thread drives it;
// the client's callbacks only fill a slot and signal.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_ROW_EXCHANGE_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_ROW_EXCHANGE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/job_spec.pb.h"
#include "tessera/v1/parameter.pb.h"
#include "worker/client/parameter_client.h"
#include "worker/data/batch.h"
#include "worker/engine/model.h"
#include "worker/trainer/internal/batch_rows.h"
#include "worker/trainer/internal/local_devices.h"

namespace tessera::trainer::internal {

// The shards' declaration of `model`'s sparse tables: name, row width and initializer
// (spec::RowInitializer from the spec's seed); the job's optimizer applies.
std::vector<v1::SparseTableDecl> SparseTableDecls(const engine::Model& model,
                                                  const v1::JobSpec& spec);

class RowExchange {
 public:
  // `client`, `model` and `devices` are not owned and must outlive the exchange; the model has
  // at least one sparse table. The client must outlive every call in flight: destroy it first.
  // A training step's rows go to `devices` when not null (`--devices cpu:N`: every replica gets
  // them; the gradients are the replicas' sum), otherwise to `model`; evaluation's always go to
  // `model`.
  RowExchange(client::ParameterClient* client, engine::Model* model, LocalDevices* devices);

  RowExchange(const RowExchange&) = delete;
  RowExchange& operator=(const RowExchange&) = delete;

  // Starts fetching the rows of `batch` gated for `step`, every table at once. Does not block.
  // INVALID_ARGUMENT for a batch whose ids a table refuses. REQUIRES: no fetch in flight
  // (Finish since the last Start).
  absl::Status Start(const data::Batch& batch, int64_t step);
  bool fetching() const { return fetching_; }
  // Waits for the fetch Start began for `batch`, installs its rows in the model and returns the
  // batch's view with mapped ids (valid until the next Finish). The first table's fetch error,
  // prefixed "shards: " by the caller; CANCELLED "cancelled" as soon as `cancelled()` is true.
  absl::StatusOr<engine::BatchView> Finish(const data::Batch& batch,
                                           const std::function<bool()>& cancelled);
  // Copies the installed rows' gradients out of the model or the devices (after TrainStep) and
  // returns their sum of squares (for global-norm clipping).
  absl::StatusOr<double> CopyGrads();
  // Pushes the gradients CopyGrads copied, times `scale`, for `step`, every table's; `done` is
  // called once, when all are answered, with the first error or the summed counts (as for
  // ParameterClient::PushPullSparseAsync). The buffers stay untouched until the next-but-one
  // Finish; the caller waits for `done` before then.
  void Push(int64_t step, float scale, client::ParameterClient::PushPullCallback done);
  // Ungated, blocking: fetches and installs the rows of `batch` (evaluation, the final weights).
  absl::StatusOr<engine::BatchView> FetchNow(const data::Batch& batch);

 private:
  // One step's rows, per table (model sparse_tables() order).
  struct Slot {
    std::vector<BatchRows> rows;
    std::vector<std::vector<int64_t>> asked;  // rows[t].rows, then the probe rows
    std::vector<std::vector<float>> values;   // asked[t].size() * dim
    std::vector<std::vector<float>> grads;    // rows[t].rows.size() * dim
    std::vector<engine::SparseFieldView> uses;
  };
  struct Table {
    engine::SparseTableInfo info;
    size_t dim = 0;
    std::vector<int64_t> probes;  // per shard, a row id it owns
  };
  // Maps the batch into slot.rows and sizes the slot's buffers; with probes, asks every shard.
  absl::Status Map(const data::Batch& batch, bool probes, Slot& slot);
  // Installs the slot's rows in the model, or for training (`train`) on the devices if any.
  absl::Status Install(const Slot& slot, bool train);

  client::ParameterClient* const client_;
  engine::Model* const model_;
  LocalDevices* const devices_;
  std::vector<Table> tables_;
  RowMapper mapper_;
  std::array<Slot, 2> slots_;
  int current_ = 0;  // the slot installed in the model
  Slot eval_;
  bool fetching_ = false;

  absl::Mutex mu_;
  size_t fetches_left_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fetch_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_ROW_EXCHANGE_H_
