// HeldWeights: a worker's copy of every dense partition it pulls as weight deltas (pull encodings
// TOPK and INT8; the shard's side is server/published_weights.h). Each copy is the shard's
// published weights as of the copy's weights_id: a delta is added to it value by value, exactly as
// the shard added it to its own, and an FP32 answer replaces it; the copy then goes to the caller.
#ifndef TESSERA_WORKER_CLIENT_HELD_WEIGHTS_H_
#define TESSERA_WORKER_CLIENT_HELD_WEIGHTS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::client {

// Thread-safe across partitions; one partition is used by one call at a time (a tensor has one
// PushPull in flight).
class HeldWeights {
 public:
  // The weights_id of the copy of partition `index` of `tensor` (0: none), for the request.
  uint64_t Id(absl::string_view tensor, uint32_t index) const;

  // Takes the answer `w` for that partition, whose request named `sent` (Id() then), and writes
  // the copy to out[0, count). INTERNAL, naming the partition, for an answer that does not fit:
  // a delta to a copy other than `sent` or of no copy, a malformed delta, or FP32 data of another
  // size; the copy is then dropped, so that the next pull gets whole weights.
  absl::Status Accept(absl::string_view tensor, uint32_t index, uint64_t sent, const v1::Slice& w,
                      float* out, size_t count);

 private:
  struct Copy {
    uint64_t id = 0;
    std::vector<float> values;
  };
  Copy* Find(absl::string_view tensor, uint32_t index, bool create) const;

  mutable absl::Mutex mu_;
  // unique_ptr: a copy stays where it is while other partitions are added.
  mutable std::map<std::pair<std::string, uint32_t>, std::unique_ptr<Copy>, std::less<>> copies_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::client

#endif  // TESSERA_WORKER_CLIENT_HELD_WEIGHTS_H_
