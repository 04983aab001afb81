#include "worker/client/push_encoder.h"

#include "common/encoding.h"
#include "worker/client/internal/parameter_client_calls.h"

namespace tessera {
namespace client {

v1::Encoding PushEncoder::sparse_encoding() const {
  return IsCompressed(encoding_) ? v1::ENCODING_FP32 : encoding_;
}

absl::string_view PushEncoder::Encode(absl::string_view tensor, uint32_t index, const float* in,
                                      size_t n, v1::Slice* slice) {
  if (!IsCompressed(encoding_)) {
    if (BytesPerValue(encoding_) == 4 && n > 0) {
      return absl::string_view(reinterpret_cast<const char*>(in), n * sizeof(float));
    }
    internal::EncodeInto(encoding_, in, n, slice->mutable_data());
    return absl::string_view();
  }
  ErrorFeedback* feedback;
  {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<ErrorFeedback>& slot = feedback_[{std::string(tensor), index}];
    if (slot == nullptr) slot = std::make_unique<ErrorFeedback>();
    feedback = slot.get();
  }
  const size_t top_k = encoding_ == v1::ENCODING_TOPK ? TopKCount(n, topk_fraction_) : 0;
  feedback->Encode(encoding_, in, n, top_k, slice->mutable_data());
  return absl::string_view();
}

double PushEncoder::ResidualL1() const {
  absl::MutexLock lock(&mu_);
  double l1 = 0;
  for (const auto& [key, feedback] : feedback_) l1 += feedback->ResidualL1();
  return l1;
}

}  // namespace client
}  // namespace tessera
