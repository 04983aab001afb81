#include "server/published_weights.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/gradient_compression.h"

namespace tessera::server {
namespace {

void SetFp32(const float* values, size_t n, v1::Slice* slice) {
  slice->set_encoding(v1::ENCODING_FP32);
  slice->mutable_data()->assign(reinterpret_cast<const char*>(values), n * sizeof(float));
}

}  // namespace

PublishedWeights::PublishedWeights(std::shared_ptr<MemoryBudget> budget)
    : budget_(std::move(budget)) {}

PublishedWeights::~PublishedWeights() {
  absl::MutexLock lock(&mu_);
  if (charged_ > 0 && budget_ != nullptr) budget_->Release(charged_);
}

int64_t PublishedWeights::charged() const {
  absl::MutexLock lock(&mu_);
  return charged_;
}

uint64_t PublishedWeights::NewIdLocked() {
  uint64_t id = 0;
  while (id == 0 || id == id_ || id == from_id_) id = absl::Uniform<uint64_t>(bitgen_);
  return id;
}

void PublishedWeights::PublishLocked(const float* weights, v1::Encoding encoding, double fraction) {
  const size_t n = values_.size();
  diff_.resize(n);
  for (size_t i = 0; i < n; ++i) diff_[i] = weights[i] - values_[i];
  from_id_ = id_;
  id_ = NewIdLocked();
  delta_encoding_ = encoding;
  if (encoding == v1::ENCODING_INT8) {
    if (EncodeInt8(diff_.data(), n, &delta_)) {
      AddInt8(delta_, values_.data(), n);
      return;
    }
    // A change of NaN or Inf has no scale: the weights are published as they are, whole.
    values_.assign(weights, weights + n);
    from_id_ = 0;
    return;
  }
  EncodeCompressed(v1::ENCODING_TOPK, diff_.data(), n, TopKCount(n, fraction), &delta_);
  AddTopK(delta_, values_.data());
}

void PublishedWeights::Answer(const SharedWeights& weights, int64_t version, uint64_t held,
                              v1::Encoding encoding, double fraction, v1::Slice* slice) {
  const size_t n = weights.size();
  slice->set_version(version);
  absl::MutexLock lock(&mu_);
  if (values_.empty() && !refused_ && n > 0) {
    const auto bytes = static_cast<int64_t>(2 * n * sizeof(float));  // P and diff_
    if (budget_ == nullptr || budget_->TryReserve(bytes)) {
      charged_ = bytes;
      values_.assign(weights.data(), weights.data() + n);
      version_ = version;
      id_ = NewIdLocked();
    } else {
      refused_ = true;
    }
  }
  if (values_.empty()) {
    SetFp32(weights.data(), n, slice);
    slice->set_weights_id(0);
    return;
  }
  if (version < version_) {
    // Weights from before the published ones (a job rebuilt in place): published anew, whole.
    values_.assign(weights.data(), weights.data() + n);
    from_id_ = 0;
    id_ = NewIdLocked();
    version_ = version;
  } else if (version > version_) {
    PublishLocked(weights.data(), encoding, fraction);
    version_ = version;
  }
  slice->set_weights_id(id_);
  if (held == id_) {
    slice->set_encoding(encoding);  // nothing changed since
    slice->clear_data();
  } else if (held != 0 && held == from_id_ && encoding == delta_encoding_ &&
             delta_.size() <= n * sizeof(float)) {
    slice->set_encoding(encoding);
    slice->mutable_data()->assign(delta_);
  } else {
    SetFp32(values_.data(), n, slice);
  }
}

}  // namespace tessera::server
