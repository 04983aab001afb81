// How a worker's dense gradients go on the wire: lent as they are (fp32), rounded (bf16, fp16),
// or compressed with error feedback (SIGN1, TOPK; common/gradient_compression.h), one residual
// per partition kept here across steps. The encoder lives in one task's ParameterClient, so a
// new incarnation (a rewind to a checkpoint, a hand-over) starts with no residual: the residuals
// belonged to steps that are undone or to another process (docs/decisions.md).
#ifndef TESSERA_WORKER_CLIENT_PUSH_ENCODER_H_
#define TESSERA_WORKER_CLIENT_PUSH_ENCODER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/gradient_compression.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {
namespace client {

// Thread-safe; one partition is encoded by one call at a time (a worker pushes a partition once
// per step).
class PushEncoder {
 public:
  // REQUIRES: a known encoding; 0 < topk_fraction <= 1 (used by TOPK only).
  PushEncoder(v1::Encoding encoding, double topk_fraction)
      : encoding_(encoding), topk_fraction_(topk_fraction) {}

  v1::Encoding encoding() const { return encoding_; }
  // What sparse rows are pushed in: the encoding, or fp32 when it is a compressed one.
  v1::Encoding sparse_encoding() const;

  // The payload of partition (tensor, index), values in[0, n): lent from the caller's memory when
  // fp32 (returned; slice's data stays empty), else written into slice's data (returns empty).
  // Compressed encodings add the partition's residual first and keep the new one, so each call
  // is one step's push: a resend reuses the request, never calls this again.
  absl::string_view Encode(absl::string_view tensor, uint32_t index, const float* in, size_t n,
                           v1::Slice* slice);

  // Sum of |residual| over the partitions, for the logs and the tests.
  double ResidualL1() const;

 private:
  const v1::Encoding encoding_;
  const double topk_fraction_;
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, uint32_t>, std::unique_ptr<ErrorFeedback>> feedback_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_PUSH_ENCODER_H_
