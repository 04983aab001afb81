#include "worker/client/shard_client.h"

#include <utility>

namespace tessera {
namespace client {

ShardClient::PushPullCall WithLentDataCopied(ShardClient::PushPullCall call) {
  bool lends = false;
  for (absl::string_view b : call.lent) lends = lends || !b.empty();
  if (lends) {
    auto copy = std::make_shared<v1::PushPullRequest>(*call.request);
    for (size_t i = 0; i < call.lent.size() && i < static_cast<size_t>(copy->push_size()); ++i) {
      if (call.lent[i].empty()) continue;
      copy->mutable_push(static_cast<int>(i))
          ->mutable_data()
          ->assign(call.lent[i].data(), call.lent[i].size());
    }
    call.request = std::move(copy);
  }
  call.lent.clear();
  return call;
}

}  // namespace client
}  // namespace tessera
