// ParameterClient's sparse half: pushes and pulls of embedding rows, each routed to the shards
// that hold the row's copies (ShardOfSparseRow, replica_routing.h).
#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/encoding.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "worker/client/internal/parameter_client_calls.h"
#include "worker/client/parameter_client.h"

namespace tessera {
namespace client {

using internal::EncodeInto;
using internal::ForEachConcurrently;

void ParameterClient::PushPullSparseAsync(absl::string_view table, int64_t step,
                                          absl::Span<const int64_t> rows,
                                          absl::Span<const float> gradient,
                                          absl::Span<float> weights_out, PushPullCallback done) {
  absl::StatusOr<SparseTable> found = FindTable(table);
  if (!found.ok()) return done(found.status());
  const SparseTable t = *std::move(found);
  const size_t dim = t.dim;
  if (gradient.size() != rows.size() * dim) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPullSparse table '", table, "': gradient has ", gradient.size(),
                     " values, ", rows.size(), " rows of dim ", dim, " need ", rows.size() * dim)));
  }
  if (!weights_out.empty() && weights_out.size() != rows.size() * dim) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPullSparse table '", table, "': weights_out has ", weights_out.size(),
                     " values, ", rows.size(), " rows of dim ", dim, " need ", rows.size() * dim)));
  }
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPullSparse table '", table, "': step must be >= 0, got ", step)));
  }
  if (!weights_out.empty() && routing_.replicas() > 1) {
    return done(absl::InvalidArgumentError(absl::StrCat(
        "PushPullSparse table '", table,
        "': weights_out needs replicas 1; pull a replicated table's rows with PullSparseAsync")));
  }
  // One request per live shard, rows or none: a table's clock on a shard advances with every push
  // to it, so under BSP and SSP a worker whose batch touches no row there still counts for the
  // step. Each row goes to every live copy of its home. The shard deduplicates per (worker,
  // table), so two requests for the same table on one shard must never be in flight at once.
  // The shards first: a fill that starts after this is missed by this push (SetFill says so).
  const std::vector<int> live = routing_.WriteShards(step);
  std::vector<bool> written(static_cast<size_t>(num_shards()), false);
  for (int s : live) written[static_cast<size_t>(s)] = true;
  std::vector<std::vector<size_t>> positions(num_shards());
  std::vector<std::set<int>> homes(num_shards());
  for (size_t i = 0; i < rows.size(); ++i) {
    const int home = ShardOfSparseRow(options_.job_id, t.name, rows[i], num_shards());
    const std::vector<int> copies = routing_.WriteCopies(home, step);
    if (copies.empty() || routing_.IsDown(copies.front())) {
      return done(absl::UnavailableError(absl::StrCat("PushPullSparse table '", table, "' row ",
                                                      rows[i], ": every copy is down")));
    }
    for (int s : copies) {
      if (!written[static_cast<size_t>(s)]) continue;
      positions[s].push_back(i);
      homes[s].insert(home);
    }
  }
  const size_t bpv = BytesPerValue(encoder_.sparse_encoding());
  for (const auto& pos : positions) {
    if (static_cast<int64_t>(pos.size() * dim * bpv) > options_.max_request_bytes) {
      return done(absl::InvalidArgumentError(absl::StrCat(
          "PushPullSparse table '", table, "': ", pos.size(), " rows for one shard exceed ",
          "max_request_bytes ", options_.max_request_bytes, "; push fewer rows at once")));
    }
  }
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  const int used = static_cast<int>(live.size());
  op->remaining.store(used);
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(used);
  }
  OpStarted();
  const bool want = !weights_out.empty();
  for (int s : live) {
    auto pos = std::make_shared<std::vector<size_t>>(std::move(positions[s]));
    std::shared_ptr<v1::PushPullRequest> request = NewRequest(step);
    v1::Slice* slice = request->add_push();
    slice->mutable_key()->set_tensor(t.name);
    slice->mutable_key()->set_index(0);
    slice->set_encoding(encoder_.sparse_encoding());
    slice->set_want_weights(want);
    std::vector<float> gathered(pos->size() * dim);
    for (size_t j = 0; j < pos->size(); ++j) {
      slice->add_row_ids(rows[(*pos)[j]]);
      std::copy_n(gradient.data() + (*pos)[j] * dim, dim, gathered.data() + j * dim);
    }
    EncodeInto(encoder_.sparse_encoding(), gathered.data(), gathered.size(), slice->mutable_data());
    auto attempt = std::make_shared<Attempt>();
    attempt->op = op;
    attempt->shard = s;
    attempt->fill_write = routing_.IsDown(s);
    attempt->homes.assign(homes[s].begin(), homes[s].end());
    if (want) attempt->want_homes = attempt->homes;
    attempt->call.request = std::move(request);
    attempt->what = absl::StrCat("PushPullSparse table '", table, "' step ", step, " (",
                                 pos->size(), " rows) on shard ", s);
    if (want) {
      float* out = weights_out.data();
      const std::string name = t.name;
      attempt->accept = [out, dim, pos, name](const v1::PushPullResponse& r) -> absl::Status {
        for (const v1::Slice& w : r.weights()) {
          if (w.key().tensor() != name) continue;
          std::vector<float> values(pos->size() * dim);
          TESSERA_RETURN_IF_ERROR(
              DecodeValues(w.encoding(), w.data(), values.data(), values.size()));
          for (size_t j = 0; j < pos->size(); ++j) {
            std::copy_n(values.data() + j * dim, dim, out + (*pos)[j] * dim);
          }
          return absl::OkStatus();
        }
        return absl::InternalError(
            absl::StrCat("response has no weights for sparse table '", name, "'"));
      };
    }
    Send(std::move(attempt));
  }
}

absl::Status ParameterClient::PullAllRows(absl::string_view table, std::vector<int64_t>* ids,
                                          std::vector<float>* values) {
  TESSERA_ASSIGN_OR_RETURN(SparseTable t, FindTable(table));
  const size_t dim = t.dim;
  std::vector<std::vector<int64_t>> shard_ids(num_shards());
  std::vector<std::vector<float>> shard_values(num_shards());
  // Every live shard; with copies, a row counts from its acting copy alone.
  TESSERA_RETURN_IF_ERROR(ForEachConcurrently(routing_.Live(), [&](int s) -> absl::Status {
    v1::PullRequest r;
    r.set_job_id(options_.job_id);
    r.set_worker_id(options_.worker_id);
    r.set_step(-1);
    r.set_encoding(v1::ENCODING_FP32);
    v1::Slice* key = r.add_keys();
    key->mutable_key()->set_tensor(t.name);
    key->mutable_key()->set_index(0);
    key->set_all_rows(true);
    std::vector<v1::Slice> slices;
    TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(slices, Shard(s)->Pull(r, deadline));
      return absl::OkStatus();
    }));
    std::vector<float> decoded;
    for (const v1::Slice& w : slices) {
      if (w.key().tensor() != t.name) continue;
      const size_t n = static_cast<size_t>(w.row_ids_size());
      decoded.resize(n * dim);
      TESSERA_RETURN_IF_ERROR(
          WithAddress(s, DecodeValues(w.encoding(), w.data(), decoded.data(), n * dim)));
      for (size_t j = 0; j < n; ++j) {
        const int64_t id = w.row_ids(static_cast<int>(j));
        if (routing_.Acting(ShardOfSparseRow(options_.job_id, t.name, id, num_shards())) != s) {
          continue;  // a backup's copy of a row another shard serves
        }
        shard_ids[s].push_back(id);
        shard_values[s].insert(shard_values[s].end(), decoded.begin() + j * dim,
                               decoded.begin() + (j + 1) * dim);
      }
    }
    return absl::OkStatus();
  }));
  ids->clear();
  values->clear();
  for (size_t s = 0; s < static_cast<size_t>(num_shards()); ++s) {
    ids->insert(ids->end(), shard_ids[s].begin(), shard_ids[s].end());
    values->insert(values->end(), shard_values[s].begin(), shard_values[s].end());
  }
  return absl::OkStatus();
}

void ParameterClient::PullSparseAsync(absl::string_view table, int64_t step,
                                      absl::Span<const int64_t> rows, absl::Span<float> out,
                                      PushPullCallback done) {
  absl::StatusOr<SparseTable> found = FindTable(table);
  if (!found.ok()) return done(found.status());
  const SparseTable t = *std::move(found);
  const size_t dim = t.dim;
  if (out.size() != rows.size() * dim) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PullSparseAsync table '", table, "': out has ", out.size(), " values, ",
                     rows.size(), " rows of dim ", dim, " need ", rows.size() * dim)));
  }
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PullSparseAsync table '", table, "': step must be >= 0, got ", step)));
  }
  // Each row from its acting copy.
  std::vector<std::vector<size_t>> positions(num_shards());
  std::vector<std::set<int>> homes(num_shards());
  for (size_t i = 0; i < rows.size(); ++i) {
    const int home = ShardOfSparseRow(options_.job_id, t.name, rows[i], num_shards());
    const int s = routing_.Acting(home);
    if (s < 0) {
      return done(absl::UnavailableError(absl::StrCat("PullSparseAsync table '", table, "' row ",
                                                      rows[i], ": every copy is down")));
    }
    positions[s].push_back(i);
    homes[s].insert(home);
  }
  int used = 0;
  for (const auto& pos : positions) used += pos.empty() ? 0 : 1;
  if (used == 0) return done(PushPullResult{});
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  op->remaining.store(used);
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(used);
  }
  OpStarted();
  for (int s = 0; s < num_shards(); ++s) {
    if (positions[s].empty()) continue;
    auto pos = std::make_shared<std::vector<size_t>>(std::move(positions[s]));
    // A request without push slices: only its pull, gated for `step`.
    std::shared_ptr<v1::PushPullRequest> request = NewRequest(step);
    v1::Slice* key = request->add_pull();
    key->mutable_key()->set_tensor(t.name);
    key->mutable_key()->set_index(0);
    for (size_t i : *pos) key->add_row_ids(rows[i]);
    auto attempt = std::make_shared<Attempt>();
    attempt->op = op;
    attempt->shard = s;
    attempt->homes.assign(homes[s].begin(), homes[s].end());
    attempt->want_homes = attempt->homes;
    attempt->call.request = std::move(request);
    attempt->what = absl::StrCat("PullSparse table '", table, "' step ", step, " (", pos->size(),
                                 " rows) on shard ", s);
    float* dst = out.data();
    const std::string name = t.name;
    attempt->accept = [dst, dim, pos, name](const v1::PushPullResponse& r) -> absl::Status {
      for (const v1::Slice& w : r.weights()) {
        if (w.key().tensor() != name) continue;
        if (static_cast<size_t>(w.row_ids_size()) != pos->size()) {
          return absl::InternalError(absl::StrCat("sparse table '", name, "': ", w.row_ids_size(),
                                                  " rows came back for ", pos->size(), " asked"));
        }
        std::vector<float> values(pos->size() * dim);
        TESSERA_RETURN_IF_ERROR(DecodeValues(w.encoding(), w.data(), values.data(), values.size()));
        for (size_t j = 0; j < pos->size(); ++j) {
          std::copy_n(values.data() + j * dim, dim, dst + (*pos)[j] * dim);
        }
        return absl::OkStatus();
      }
      return absl::InternalError(
          absl::StrCat("response has no rows for sparse table '", name, "'"));
    };
    Send(std::move(attempt));
  }
}

std::future<absl::StatusOr<PushPullResult>> ParameterClient::PushPullSparse(
    absl::string_view table, int64_t step, absl::Span<const int64_t> rows,
    absl::Span<const float> gradient, absl::Span<float> weights_out) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<PushPullResult>>>();
  std::future<absl::StatusOr<PushPullResult>> future = promise->get_future();
  PushPullSparseAsync(
      table, step, rows, gradient, weights_out,
      [promise](absl::StatusOr<PushPullResult> r) { promise->set_value(std::move(r)); });
  return future;
}

absl::Status ParameterClient::PullSparse(absl::string_view table, int64_t step,
                                         absl::Span<const int64_t> rows, absl::Span<float> out) {
  return AgainAfterAFailover([&] { return PullSparseOnce(table, step, rows, out); });
}

absl::Status ParameterClient::PullSparseOnce(absl::string_view table, int64_t step,
                                             absl::Span<const int64_t> rows,
                                             absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(SparseTable t, FindTable(table));
  const size_t dim = t.dim;
  if (out.size() != rows.size() * dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("PullSparse table '", table, "': out has ", out.size(), " values, ",
                     rows.size(), " rows of dim ", dim, " need ", rows.size() * dim));
  }
  std::vector<std::vector<size_t>> positions(num_shards());
  std::vector<int> used;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int s = routing_.Acting(ShardOfSparseRow(options_.job_id, t.name, rows[i], num_shards()));
    if (s < 0) {
      return absl::UnavailableError(
          absl::StrCat("PullSparse table '", table, "' row ", rows[i], ": every copy is down"));
    }
    if (positions[s].empty()) used.push_back(s);
    positions[s].push_back(i);
  }
  return ForEachConcurrently(used, [&](int s) -> absl::Status {
    v1::PullRequest r;
    r.set_job_id(options_.job_id);
    r.set_worker_id(options_.worker_id);
    r.set_step(step);
    r.set_encoding(options_.pull_encoding);
    v1::Slice* key = r.add_keys();
    key->mutable_key()->set_tensor(t.name);
    key->mutable_key()->set_index(0);
    for (size_t i : positions[s]) key->add_row_ids(rows[i]);
    std::vector<v1::Slice> slices;
    TESSERA_RETURN_IF_ERROR(CallWithRetries(s, [&](absl::Time deadline) -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(slices, Shard(s)->Pull(r, deadline));
      return absl::OkStatus();
    }));
    // The rows may come back in several slices, in request order.
    std::vector<float> values(positions[s].size() * dim);
    size_t filled = 0;
    for (const v1::Slice& w : slices) {
      if (w.key().tensor() != t.name) continue;
      const size_t n = static_cast<size_t>(w.row_ids_size()) * dim;
      const size_t count = w.row_ids_size() > 0 ? n : values.size() - filled;
      if (filled + count > values.size()) {
        return absl::InternalError(absl::StrCat(Shard(s)->address(), ": PullSparse table '", table,
                                                "' returned too many rows"));
      }
      TESSERA_RETURN_IF_ERROR(
          WithAddress(s, DecodeValues(w.encoding(), w.data(), values.data() + filled, count)));
      filled += count;
    }
    if (filled != values.size()) {
      return absl::InternalError(absl::StrCat(Shard(s)->address(), ": PullSparse table '", table,
                                              "' returned ", filled / dim, " of ",
                                              positions[s].size(), " rows"));
    }
    for (size_t j = 0; j < positions[s].size(); ++j) {
      std::copy_n(values.data() + j * dim, dim, out.data() + positions[s][j] * dim);
    }
    return absl::OkStatus();
  });
}

}  // namespace client
}  // namespace tessera
