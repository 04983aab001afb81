// ParameterClient's batched dense calls: PushPullManyAsync, which sends the partitions of several
// small tensors that live on one shard in one request.
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/encoding.h"
#include "common/status_macros.h"
#include "worker/client/internal/parameter_client_calls.h"
#include "worker/client/parameter_client.h"

namespace tessera {
namespace client {

void ParameterClient::PushPullManyAsync(int64_t step, std::vector<TensorUpdate> tensors,
                                        PushPullCallback done, bool urgent) {
  if (step < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("PushPull of ", tensors.size(), " tensors: step must be >= 0, got ", step)));
  }
  // Per shard: its request and, for each pushed slice that wants weights, where they go.
  struct Target {
    std::string tensor;
    uint32_t index = 0;
    float* out = nullptr;
    size_t count = 0;
    uint64_t held = 0;  // weight-delta pulls: the weights_id sent
  };
  struct ShardPart {
    std::shared_ptr<v1::PushPullRequest> request;
    std::vector<absl::string_view> lent;  // per push slice, as PushPullCall::lent
    bool lends = false;
    std::vector<Target> targets;
    std::vector<std::string> names;
    std::set<int> homes;       // the home shards of its partitions
    std::set<int> want_homes;  // ... and of those it asks weights for
    size_t bytes = 0;
  };
  std::map<int, ShardPart> parts;
  std::set<std::string, std::less<>> seen;
  for (const TensorUpdate& t : tensors) {
    absl::StatusOr<const DenseLayout*> found = Layout(t.name);
    if (!found.ok()) return done(found.status());
    const DenseLayout& layout = **found;
    if (!seen.insert(t.name).second) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull of ", tensors.size(), " tensors: '", t.name, "' appears twice")));
    }
    if (static_cast<int64_t>(t.gradient.size()) != layout.num_elements) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull tensor '", t.name, "': gradient has ", t.gradient.size(),
                       " values, the tensor has ", layout.num_elements)));
    }
    if (!t.weights_out.empty() &&
        static_cast<int64_t>(t.weights_out.size()) != layout.num_elements) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull tensor '", t.name, "': weights_out has ", t.weights_out.size(),
                       " values, the tensor has ", layout.num_elements)));
    }
    const bool want = !t.weights_out.empty();
    for (const PartitionSpan& p : layout.partitions) {
      // Every live copy gets the slice; the first (acting) one alone is asked for weights.
      const std::vector<int> copies = routing_.WriteCopies(p.shard, step);
      if (copies.empty() || routing_.IsDown(copies.front())) {
        return done(absl::UnavailableError(absl::StrCat("PushPull tensor '", t.name, "' partition ",
                                                        p.index, ": every copy is down")));
      }
      // Encoded once (a compressed push moves its residual on): the copies get the same bytes.
      absl::string_view lent;
      const v1::Slice* first = nullptr;
      for (size_t c = 0; c < copies.size(); ++c) {
        ShardPart& part = parts[copies[c]];
        if (part.request == nullptr) part.request = NewRequest(step);
        part.homes.insert(p.shard);
        v1::Slice* slice = part.request->add_push();
        slice->mutable_key()->set_tensor(layout.name);
        slice->mutable_key()->set_index(p.index);
        slice->set_encoding(options_.push_encoding);
        slice->set_want_weights(want && c == 0);
        if (c == 0) {
          lent = encoder_.Encode(layout.name, p.index, t.gradient.data() + p.offset,
                                 static_cast<size_t>(p.num_elements), slice);
          first = slice;
        } else if (lent.empty()) {
          *slice->mutable_data() = first->data();
        }
        part.lent.push_back(lent);
        part.lends = part.lends || !lent.empty();
        part.bytes += lent.empty() ? slice->data().size() : lent.size();
        if (want && c == 0) {
          part.want_homes.insert(p.shard);
          const uint64_t held = DeltaPulls() ? held_.Id(layout.name, p.index) : 0;
          slice->set_weights_id(held);
          part.targets.push_back(Target{layout.name, p.index, t.weights_out.data() + p.offset,
                                        static_cast<size_t>(p.num_elements), held});
        }
        if (part.names.empty() || part.names.back() != t.name) part.names.push_back(t.name);
      }
    }
  }
  for (const auto& [shard, part] : parts) {
    if (static_cast<int64_t>(part.bytes) > options_.max_request_bytes) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("PushPull of ", tensors.size(), " tensors: ", part.bytes,
                       " bytes for shard ", shard, " exceed max_request_bytes ",
                       options_.max_request_bytes, "; push large tensors with PushPullAsync")));
    }
  }
  if (parts.empty()) return done(PushPullResult{});
  auto op = std::make_shared<Op>();
  op->done = std::move(done);
  op->remaining.store(static_cast<int>(parts.size()));
  {
    absl::MutexLock lock(&op->mu);
    op->result.requests = static_cast<uint32_t>(parts.size());
  }
  OpStarted();
  for (auto& [shard, part] : parts) {
    auto attempt = std::make_shared<Attempt>();
    attempt->op = op;
    attempt->shard = shard;
    attempt->fill_write = routing_.IsDown(shard);
    attempt->homes.assign(part.homes.begin(), part.homes.end());
    attempt->want_homes.assign(part.want_homes.begin(), part.want_homes.end());
    attempt->call.request = std::move(part.request);
    attempt->call.urgent = urgent;
    if (part.lends) attempt->call.lent = std::move(part.lent);
    attempt->what = absl::StrCat("PushPull of tensors ", absl::StrJoin(part.names, ", "), " step ",
                                 step, " on shard ", shard);
    if (!part.targets.empty()) {
      attempt->accept = [this, targets = std::move(part.targets)](const v1::PushPullResponse& r) {
        for (const Target& t : targets) {
          const v1::Slice* found = nullptr;
          for (const v1::Slice& w : r.weights()) {
            if (w.key().index() == t.index && w.key().tensor() == t.tensor) {
              found = &w;
              break;
            }
          }
          if (found == nullptr) {
            return absl::InternalError(absl::StrCat("response has no weights for tensor '",
                                                    t.tensor, "' partition ", t.index));
          }
          if (DeltaPulls()) {
            TESSERA_RETURN_IF_ERROR(
                held_.Accept(t.tensor, t.index, t.held, *found, t.out, t.count));
          } else {
            TESSERA_RETURN_IF_ERROR(DecodeValues(found->encoding(), found->data(), t.out, t.count));
          }
        }
        return absl::OkStatus();
      };
    }
    Send(std::move(attempt));
  }
}

}  // namespace client
}  // namespace tessera
