// PublishedWeights: weight-delta pulls of one dense partition (pull encodings TOPK and INT8,
// issue #17).
//
// Under BSP every worker pulls the same weights after each step, so the change from one step's
// weights to the next is the same for all of them, and a shard can send that change instead of
// the weights. A top-k of it is far smaller than the weights; what it leaves out must not be lost.
// So the shard keeps the weights its workers hold, the "published" weights P, beside its own W:
// when W has moved on since P was published, the next delta is the TOPK payload of the
// `fraction` largest values of W - P, and P += that delta, value by value, exactly as a worker
// adds it to its copy. W - P, what was not sent yet, stays in the next difference: the shard's
// error feedback, as a worker's ErrorFeedback does for its pushes (common/gradient_compression.h).
// Workers compute their gradients at P, which trails W by the top-k residual. INT8 sends every
// value of W - P instead, quantised per block of 256 to its largest magnitude / 127, so P trails W
// by at most half a step of each block's scale; a change holding NaN or Inf is published whole
// (the next answer is P in FP32).
//
// Each published state has a random 64-bit id. A worker names the id it holds (Slice.weights_id)
// and gets the delta when it holds the state just before the newest, an empty delta when it holds
// the newest, and otherwise (its first pull, a shard that restarted or took over, a worker that
// missed a step) P itself in FP32; every answer carries the id it leaves the worker holding. P is
// made on the first such pull and charged to the shard's memory budget; when the budget cannot
// take it, pulls are answered with W in FP32 and id 0, as without deltas. Nothing here is
// checkpointed: after a restore every worker gets P in full once.
#ifndef TESSERA_SERVER_PUBLISHED_WEIGHTS_H_
#define TESSERA_SERVER_PUBLISHED_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/synchronization/mutex.h"
#include "server/memory_budget.h"
#include "server/shared_weights.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// Thread-safe.
class PublishedWeights {
 public:
  // `budget` null: not charged.
  explicit PublishedWeights(std::shared_ptr<MemoryBudget> budget);
  ~PublishedWeights();  // gives its charge back
  PublishedWeights(const PublishedWeights&) = delete;
  PublishedWeights& operator=(const PublishedWeights&) = delete;

  // Answers a worker holding `held` (0: nothing) with the partition's weights `weights` at
  // `version`, publishing them first when `version` differs from the published one: slice gets
  // the encoding (`encoding`, TOPK or INT8: a delta, at most as many bytes as FP32; FP32: the
  // published weights, or `weights` when the budget refused them), the data, `version` and the
  // weights_id the worker holds afterwards. `fraction` in (0, 1] is the share of values a TOPK
  // delta sends. A worker asking in the other delta encoding than the one the newest state was
  // published in gets FP32. Does not keep `weights`.
  // REQUIRES: weights.size() is the same on every call; IsWeightDelta(encoding).
  void Answer(const SharedWeights& weights, int64_t version, uint64_t held, v1::Encoding encoding,
              double fraction, v1::Slice* slice);

  // Bytes charged to the budget (0 before the first answer).
  int64_t charged() const;

 private:
  // Makes the next published state from `weights`. REQUIRES: values_ is not empty.
  void PublishLocked(const float* weights, v1::Encoding encoding, double fraction)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NewIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<MemoryBudget> budget_;
  mutable absl::Mutex mu_;
  std::vector<float> values_ ABSL_GUARDED_BY(mu_);  // P; empty until the first answer
  int64_t charged_ ABSL_GUARDED_BY(mu_) = 0;
  bool refused_ ABSL_GUARDED_BY(mu_) = false;  // the budget could not take P
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;   // the version P was published at
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;       // P's id
  uint64_t from_id_ ABSL_GUARDED_BY(mu_) = 0;  // the state before P (0: none)
  std::string delta_ ABSL_GUARDED_BY(mu_);     // payload from from_id_ to id_
  v1::Encoding delta_encoding_ ABSL_GUARDED_BY(mu_) = v1::ENCODING_TOPK;  // delta_'s
  std::vector<float> diff_ ABSL_GUARDED_BY(mu_);                          // W - P, reused
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_PUBLISHED_WEIGHTS_H_
