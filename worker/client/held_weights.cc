#include "worker/client/held_weights.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/gradient_compression.h"

namespace tessera::client {

HeldWeights::Copy* HeldWeights::Find(absl::string_view tensor, uint32_t index, bool create) const {
  absl::MutexLock lock(&mu_);
  auto it = copies_.find(std::make_pair(std::string(tensor), index));
  if (it != copies_.end()) return it->second.get();
  if (!create) return nullptr;
  return copies_.emplace(std::make_pair(std::string(tensor), index), std::make_unique<Copy>())
      .first->second.get();
}

uint64_t HeldWeights::Id(absl::string_view tensor, uint32_t index) const {
  const Copy* copy = Find(tensor, index, /*create=*/false);
  return copy == nullptr ? 0 : copy->id;
}

absl::Status HeldWeights::Accept(absl::string_view tensor, uint32_t index, uint64_t sent,
                                 const v1::Slice& w, float* out, size_t count) {
  Copy* copy = Find(tensor, index, /*create=*/true);
  auto refuse = [&](absl::string_view why) {
    copy->id = 0;
    copy->values.clear();
    return absl::InternalError(
        absl::StrCat("weights of tensor '", tensor, "' partition ", index, ": ", why));
  };
  if (IsWeightDelta(w.encoding())) {
    if (sent == 0 || copy->id != sent || copy->values.size() != count) {
      return refuse(absl::StrCat("a delta from weights ", sent, " answered for a copy of weights ",
                                 copy->id, " with ", copy->values.size(), " values"));
    }
    if (w.data().empty() && w.weights_id() != sent) {
      // The shard answers "nothing changed" only to a worker holding its newest weights.
      return refuse(
          absl::StrCat("an empty delta that moves weights ", sent, " to ", w.weights_id()));
    }
    if (w.encoding() == v1::ENCODING_TOPK) {
      const absl::Status valid = CheckCompressed(v1::ENCODING_TOPK, w.data(), count);
      if (!valid.ok()) return refuse(valid.message());
      AddTopK(w.data(), copy->values.data());
    } else if (!w.data().empty()) {  // INT8; empty: nothing changed
      const absl::Status valid = CheckInt8(w.data(), count);
      if (!valid.ok()) return refuse(valid.message());
      AddInt8(w.data(), copy->values.data(), count);
    }
  } else if (w.encoding() == v1::ENCODING_FP32 || w.encoding() == v1::ENCODING_UNSPECIFIED) {
    if (w.data().size() != count * sizeof(float)) {
      return refuse(
          absl::StrCat("expected ", count, " fp32 values, got ", w.data().size(), " bytes"));
    }
    copy->values.resize(count);
    if (count > 0) std::memcpy(copy->values.data(), w.data().data(), count * sizeof(float));
  } else {
    return refuse(absl::StrCat("encoding ", v1::Encoding_Name(w.encoding()),
                               " is neither a delta (TOPK, INT8) nor FP32"));
  }
  copy->id = w.weights_id();
  std::copy(copy->values.begin(), copy->values.end(), out);
  return absl::OkStatus();
}

}  // namespace tessera::client
