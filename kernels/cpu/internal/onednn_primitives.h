// The oneDNN pieces the CPU backend (cpu_backend_cpu.cc) caches per shape: the staging of a tensor
// between the user's plain layout and a primitive's, and one entry per op with its primitives
// (created on first use, backward ones on first backward use). Private to kernels/cpu/.
#ifndef TESSERA_KERNELS_CPU_INTERNAL_ONEDNN_PRIMITIVES_H_
#define TESSERA_KERNELS_CPU_INTERNAL_ONEDNN_PRIMITIVES_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace tessera::kernels::cpu_internal {

using dnnl::memory;
using Tag = dnnl::memory::format_tag;
using DataType = dnnl::memory::data_type;
using Key = std::vector<int64_t>;

inline memory::desc PlainDesc(const memory::dims& dims) {
  Tag tag = Tag::a;
  switch (dims.size()) {
    case 1:
      tag = Tag::a;
      break;
    case 2:
      tag = Tag::ab;
      break;
    case 3:
      tag = Tag::abc;
      break;
    case 4:
      tag = Tag::abcd;
      break;
    default:
      tag = Tag::abcde;
      break;
  }
  return memory::desc(dims, DataType::f32, tag);
}

// A tensor as the user holds it (plain layout) and as a primitive wants it. When the layouts
// differ, the data goes through a scratch buffer and a cached reorder.
class Staged {
 public:
  Staged() = default;
  Staged(const memory::desc& user_md, const memory::desc& prim_md, const dnnl::engine& eng)
      : user_md_(user_md), prim_md_(prim_md), eng_(eng), reorder_needed_(user_md != prim_md) {
    if (reorder_needed_) scratch_ = memory(prim_md_, eng_);
  }

  // The primitive's input, holding the values at `ptr`.
  memory Input(dnnl::stream& s, void* ptr) {
    memory user(user_md_, eng_, ptr);
    if (!reorder_needed_) return user;
    if (!to_prim_)
      to_prim_ = dnnl::reorder(dnnl::reorder::primitive_desc(eng_, user_md_, eng_, prim_md_));
    to_prim_.execute(s, user, scratch_);
    return scratch_;
  }
  // The memory the primitive writes; Finish() then moves it to `ptr`.
  memory Output(void* ptr) { return reorder_needed_ ? scratch_ : memory(user_md_, eng_, ptr); }
  // True when this and `other` hold the same primitive layout through a scratch buffer, so the
  // scratch of one can stand in for the other's Input() of the same values.
  bool SharesLayoutWith(const Staged& other) const {
    return reorder_needed_ && other.reorder_needed_ && prim_md_ == other.prim_md_;
  }
  const memory& scratch() const { return scratch_; }
  const memory::desc& prim_md() const { return prim_md_; }

  void Finish(dnnl::stream& s, void* ptr) {
    if (!reorder_needed_) return;
    if (!from_prim_) {
      from_prim_ = dnnl::reorder(dnnl::reorder::primitive_desc(eng_, prim_md_, eng_, user_md_));
    }
    memory user(user_md_, eng_, ptr);
    from_prim_.execute(s, scratch_, user);
  }

 private:
  memory::desc user_md_, prim_md_;
  dnnl::engine eng_;
  bool reorder_needed_ = false;
  memory scratch_;
  dnnl::reorder to_prim_, from_prim_;
};

struct DenseEntry {
  dnnl::inner_product_forward::primitive_desc fwd_pd;
  dnnl::inner_product_forward fwd;
  memory::desc src_md, w_md, b_md, dst_md;
  // Created on first backward use.
  dnnl::inner_product_backward_data bwd_data;
  dnnl::inner_product_backward_weights bwd_weights;
};

struct ConvEntry {
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Staged src, weights, dst;
  memory::desc bias_md;
  // The x of the last forward pass, whose reordered copy the backward pass may reuse.
  const void* forward_src = nullptr;
  bool bwd_ready = false;
  dnnl::convolution_backward_data bwd_data;
  Staged bd_diff_dst, bd_weights, bd_diff_src;
  dnnl::convolution_backward_weights bwd_weights;
  Staged bw_src, bw_diff_dst, bw_diff_weights;
};

struct PoolEntry {
  dnnl::pooling_forward::primitive_desc fwd_pd;
  dnnl::pooling_forward fwd;
  memory::desc src_md, dst_md;
  // Runs on oneDNN's blocked layout of a convolution's output (see BlockedLayout()).
  bool blocked = false;
  memory dy_scratch;  // blocked: the plain output gradient reordered
  bool bwd_ready = false;
  dnnl::pooling_backward bwd;
};

struct EltwiseEntry {
  dnnl::eltwise_forward::primitive_desc fwd_pd;
  dnnl::eltwise_forward fwd;
  bool bwd_ready = false;
  dnnl::eltwise_backward bwd;
  memory::desc md;
};

struct BatchNormEntry {
  dnnl::batch_normalization_forward::primitive_desc train_pd;
  dnnl::batch_normalization_forward train;
  dnnl::batch_normalization_forward infer;
  dnnl::batch_normalization_backward bwd;
  memory::desc data_md, stat_md;
  // oneDNN 2.6 wants a shift argument in the backward pass too, although the gradients do not
  // depend on it: zeros of the right size.
  std::vector<float> unused_shift;
  bool infer_ready = false, bwd_ready = false;
};

struct LogSoftmaxEntry {
  dnnl::logsoftmax_forward fwd;
  memory::desc md;
  std::vector<float> log_probs;
};

inline dnnl::algorithm EltwiseAlgorithm(Activation kind) {
  switch (kind) {
    case Activation::kRelu:
      return dnnl::algorithm::eltwise_relu;
    case Activation::kTanh:
      return dnnl::algorithm::eltwise_tanh_use_dst_for_bwd;
    case Activation::kSigmoid:
      return dnnl::algorithm::eltwise_logistic_use_dst_for_bwd;
  }
  return dnnl::algorithm::eltwise_relu;
}

}  // namespace tessera::kernels::cpu_internal

#endif  // TESSERA_KERNELS_CPU_INTERNAL_ONEDNN_PRIMITIVES_H_
