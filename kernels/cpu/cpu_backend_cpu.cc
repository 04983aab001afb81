// The CPU backend: oneDNN 2.6 primitives (inner product, convolution, pooling, eltwise,
// log-softmax, batch normalisation), cached by shape, plus OpenMP loops (cpu_loops.h) for the
// losses, dropout, embedding bags and element-wise updates.
//
// oneDNN 2.x API: an operation descriptor, then its primitive descriptor. Convolutions let oneDNN
// choose its blocked layouts (format_tag::any). Their outputs stay blocked through ReLU and pooling
// into the next convolution where the layout fits the tensor exactly (see "Blocked activations"
// below); elsewhere data is reordered from and to NCHW through cached reorder primitives and
// scratch buffers, so a steady-state step allocates nothing.
// oneDNN reports errors by throwing dnnl::error; every entry point turns that into INTERNAL.
#include <omp.h>
#include <xmmintrin.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_loops.h"
#include "kernels/cpu/internal/onednn_primitives.h"
#include "kernels/optimizer.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace tessera::kernels {
namespace {

using cpu_internal::BatchNormEntry;
using cpu_internal::ConvEntry;
using cpu_internal::DataType;
using cpu_internal::DenseEntry;
using cpu_internal::EltwiseAlgorithm;
using cpu_internal::EltwiseEntry;
using cpu_internal::Key;
using cpu_internal::LogSoftmaxEntry;
using cpu_internal::PlainDesc;
using cpu_internal::PoolEntry;
using cpu_internal::Staged;
using cpu_internal::Tag;
using dnnl::memory;

// MXCSR flush-to-zero (bit 15) and denormals-are-zero (bit 6).
constexpr unsigned kFlushDenormals = 0x8040;

// The calling thread is the OpenMP master of every parallel region the op starts; the pool's
// other threads got the flags when the backend was created.
inline void FlushDenormalsOnThisThread() {
  const unsigned csr = _mm_getcsr();
  if ((csr & kFlushDenormals) != kFlushDenormals) _mm_setcsr(csr | kFlushDenormals);
}

#define TESSERA_DNNL_TRY(...)                                                                  \
  try {                                                                                        \
    __VA_ARGS__                                                                                \
  } catch (const dnnl::error& e) {                                                             \
    return absl::InternalError(absl::StrCat("oneDNN (", __func__, "): ", e.what(), " status ", \
                                            static_cast<int>(e.status)));                      \
  }

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, int64_t memory_limit_bytes)
      : eng_(dnnl::engine::kind::cpu, 0),
        stream_(eng_),
        threads_(threads),
        memory_limit_bytes_(memory_limit_bytes) {}

  std::string Name() const override { return "cpu"; }
  std::string Description() const override {
    const dnnl_version_t* v = dnnl_version();
    return absl::StrCat("cpu (oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ", threads_,
                        " OpenMP threads)");
  }
  bool IsCuda() const override { return false; }
  int Threads() const override { return threads_; }
  absl::Status SetThreads(int threads) override {
    if (threads < 1) {
      return absl::InvalidArgumentError(absl::StrCat("threads: must be >= 1, got ", threads));
    }
    if (threads == threads_) return absl::OkStatus();
    omp_set_num_threads(threads);
    // A larger team may bring threads that have not flushed denormals yet.
#pragma omp parallel
    { _mm_setcsr(_mm_getcsr() | kFlushDenormals); }
    threads_ = threads;
    // oneDNN fixes a primitive's partitioning over threads when it is made: primitives made for
    // the old count would go on using it. Tensors keep their layouts (blocked_).
    dense_.clear();
    conv_.clear();
    pool_.clear();
    pool_workspace_owner_.clear();
    eltwise_.clear();
    batch_norm_.clear();
    log_softmax_.clear();
    return absl::OkStatus();
  }
  int64_t MemoryCapacityBytes() const override {
    return memory_limit_bytes_ > 0 ? memory_limit_bytes_ : HostMemoryBytes();
  }

  absl::StatusOr<Tensor> Allocate(const Shape& shape, DType dtype) override {
    for (int64_t d : shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("Allocate: negative dimension in shape ", ShapeString(shape)));
      }
    }
    const int64_t bytes = CheckedProduct(CheckedNumElements(shape), DTypeSize(dtype));
    if (bytes < 0 || bytes > MemoryCapacityBytes()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("Allocate: shape ", ShapeString(shape), " needs more than the ",
                       MemoryCapacityBytes(), " bytes of memory of this host"));
    }
    // 64-byte aligned for AVX-512; at least one line so that empty tensors are distinct.
    const size_t rounded = static_cast<size_t>(std::max<int64_t>(64, (bytes + 63) / 64 * 64));
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("Allocate: out of memory for ", bytes,
                                                       " bytes, shape ", ShapeString(shape)));
    }
    blocked_.erase(p);  // a stale entry of freed memory at the same address
    return Tensor(std::shared_ptr<void>(p, std::free), p, shape, dtype);
  }

  absl::Status CopyToDevice(const void* host, const Tensor& dst) override {
    MarkPlain(dst);
    if (dst.num_bytes() > 0) std::memcpy(dst.raw(), host, dst.num_bytes());
    return absl::OkStatus();
  }
  absl::Status CopyToHost(const Tensor& src, void* host) override {
    if (const memory::desc* layout = BlockedLayout(src)) {
      TESSERA_DNNL_TRY({
        const memory::desc plain = PlainDesc(layout->dims());
        memory from(*layout, eng_, src.raw()), to(plain, eng_, host);
        dnnl::reorder(dnnl::reorder::primitive_desc(eng_, *layout, eng_, plain))
            .execute(stream_, from, to);
      })
      return absl::OkStatus();
    }
    if (src.num_bytes() > 0) std::memcpy(host, src.raw(), src.num_bytes());
    return absl::OkStatus();
  }
  absl::Status CopyDeviceToDevice(const Tensor& src, const Tensor& dst) override {
    if (src.num_bytes() != dst.num_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CopyDeviceToDevice: ", src.num_bytes(), " bytes into ", dst.num_bytes()));
    }
    TESSERA_RETURN_IF_ERROR(MakePlain({&src}));
    if (src.raw() != dst.raw() && src.num_bytes() > 0) {
      MarkPlain(dst);
      std::memcpy(dst.raw(), src.raw(), src.num_bytes());
    }
    return absl::OkStatus();
  }
  absl::Status Fill(const Tensor& t, float value) override {
    MarkPlain(t);
    cpu::Fill(t.f32(), t.num_elements(), value);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    TESSERA_DNNL_TRY(stream_.wait();)
    return absl::OkStatus();
  }

  // --- Dense -----------------------------------------------------------------------------------
  absl::Status DenseForward(const Tensor& x, const Tensor& w, const Tensor& b,
                            const Tensor& y) override {
    FlushDenormalsOnThisThread();
    TESSERA_RETURN_IF_ERROR(MakePlain({&x}));
    MarkPlain(y);
    TESSERA_DNNL_TRY({
      DenseEntry& e = DenseFor(x.dim(0), w.dim(1), w.dim(0));
      e.fwd.execute(stream_, {{DNNL_ARG_SRC, memory(e.src_md, eng_, x.raw())},
                              {DNNL_ARG_WEIGHTS, memory(e.w_md, eng_, w.raw())},
                              {DNNL_ARG_BIAS, memory(e.b_md, eng_, b.raw())},
                              {DNNL_ARG_DST, memory(e.dst_md, eng_, y.raw())}});
    })
    return absl::OkStatus();
  }

  absl::Status DenseBackward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor* dx,
                             const Tensor& dw, const Tensor& db, bool accumulate) override {
    FlushDenormalsOnThisThread();
    TESSERA_RETURN_IF_ERROR(MakePlain({&x, &dy}));
    if (dx != nullptr) MarkPlain(*dx);
    if (accumulate) TESSERA_RETURN_IF_ERROR(AccumulateDenseWeightGrads(x, dy, dw, db));
    TESSERA_DNNL_TRY({
      DenseEntry& e = DenseFor(x.dim(0), w.dim(1), w.dim(0));
      if (!e.bwd_weights) {
        namespace ip = dnnl;
        e.bwd_data =
            ip::inner_product_backward_data(ip::inner_product_backward_data::primitive_desc(
                ip::inner_product_backward_data::desc(e.src_md, e.w_md, e.dst_md), eng_, e.fwd_pd));
        e.bwd_weights =
            ip::inner_product_backward_weights(ip::inner_product_backward_weights::primitive_desc(
                ip::inner_product_backward_weights::desc(e.src_md, e.w_md, e.b_md, e.dst_md), eng_,
                e.fwd_pd));
      }
      memory ddst(e.dst_md, eng_, dy.raw());
      if (!accumulate) {
        e.bwd_weights.execute(stream_, {{DNNL_ARG_SRC, memory(e.src_md, eng_, x.raw())},
                                        {DNNL_ARG_DIFF_DST, ddst},
                                        {DNNL_ARG_DIFF_WEIGHTS, memory(e.w_md, eng_, dw.raw())},
                                        {DNNL_ARG_DIFF_BIAS, memory(e.b_md, eng_, db.raw())}});
      }
      if (dx != nullptr) {
        e.bwd_data.execute(stream_, {{DNNL_ARG_DIFF_DST, ddst},
                                     {DNNL_ARG_WEIGHTS, memory(e.w_md, eng_, w.raw())},
                                     {DNNL_ARG_DIFF_SRC, memory(e.src_md, eng_, dx->raw())}});
      }
    })
    return absl::OkStatus();
  }

  // dw[o, i] += sum over n of dy[n, o] x[n, i] (oneDNN's sgemm with beta 1), db[o] += sum over n
  // of dy[n, o]. x and dy are plain.
  absl::Status AccumulateDenseWeightGrads(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                          const Tensor& db) {
    const int64_t n = x.dim(0), out = dw.dim(0), in = dw.dim(1);
    const float* g = static_cast<const float*>(dy.raw());
    const dnnl_status_t status =
        dnnl_sgemm('T', 'N', out, in, n, 1.0f, g, out, static_cast<const float*>(x.raw()), in, 1.0f,
                   static_cast<float*>(dw.raw()), in);
    if (status != dnnl_success) {
      return absl::InternalError(
          absl::StrCat("oneDNN sgemm (dense weight gradient): status ", static_cast<int>(status)));
    }
    float* b = static_cast<float*>(db.raw());
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t o = 0; o < out; ++o) b[o] += g[r * out + o];
    }
    return absl::OkStatus();
  }

  // --- Conv2D ----------------------------------------------------------------------------------
  absl::Status Conv2DForward(const Conv2DGeometry& g, const Tensor& x, const Tensor& w,
                             const Tensor& b, const Tensor& y) override {
    FlushDenormalsOnThisThread();
    TESSERA_DNNL_TRY({
      ConvEntry& e = ConvFor(g);
      memory src;
      const memory::desc* layout = BlockedLayout(x);
      if (layout != nullptr && *layout == e.fwd_pd.src_desc()) {
        src = memory(*layout, eng_, x.raw());
        e.forward_src = nullptr;
      } else {
        Materialize(x);
        src = e.src.Input(stream_, x.raw());
        e.forward_src = x.raw();
      }
      memory wts = e.weights.Input(stream_, w.raw());
      // The output stays in the primitive's layout when that fits the tensor's memory exactly.
      const bool keep_blocked = FitsInPlace(e.fwd_pd.dst_desc(), y);
      memory dst =
          keep_blocked ? memory(e.fwd_pd.dst_desc(), eng_, y.raw()) : e.dst.Output(y.raw());
      e.fwd.execute(stream_, {{DNNL_ARG_SRC, src},
                              {DNNL_ARG_WEIGHTS, wts},
                              {DNNL_ARG_BIAS, memory(e.bias_md, eng_, b.raw())},
                              {DNNL_ARG_DST, dst}});
      if (keep_blocked) {
        MarkBlocked(y, e.fwd_pd.dst_desc());
      } else {
        e.dst.Finish(stream_, y.raw());
        MarkPlain(y);
      }
    })
    return absl::OkStatus();
  }

  absl::Status Conv2DBackward(const Conv2DGeometry& g, const Tensor& x, const Tensor& w,
                              const Tensor& dy, const Tensor* dx, const Tensor& dw,
                              const Tensor& db) override {
    FlushDenormalsOnThisThread();
    TESSERA_DNNL_TRY({
      ConvEntry& e = ConvFor(g);
      if (!e.bwd_ready) InitConvBackward(g, &e);
      // x still holds the forward pass's values (backend.h), so its reordered copy is reusable.
      memory src;
      const memory::desc* x_layout = BlockedLayout(x);
      if (x_layout != nullptr && *x_layout == e.bw_src.prim_md()) {
        src = memory(*x_layout, eng_, x.raw());
      } else if (x_layout == nullptr && e.bw_src.SharesLayoutWith(e.src) &&
                 e.forward_src == x.raw()) {
        src = e.src.scratch();
      } else {
        Materialize(x);
        src = e.bw_src.Input(stream_, x.raw());
      }
      memory ddst;
      const memory::desc* dy_layout = BlockedLayout(dy);
      const bool dy_direct = dy_layout != nullptr && *dy_layout == e.bw_diff_dst.prim_md();
      if (dy_direct) {
        ddst = memory(*dy_layout, eng_, dy.raw());
      } else {
        Materialize(dy);
        ddst = e.bw_diff_dst.Input(stream_, dy.raw());
      }
      memory dwts = e.bw_diff_weights.Output(dw.raw());
      e.bwd_weights.execute(stream_, {{DNNL_ARG_SRC, src},
                                      {DNNL_ARG_DIFF_DST, ddst},
                                      {DNNL_ARG_DIFF_WEIGHTS, dwts},
                                      {DNNL_ARG_DIFF_BIAS, memory(e.bias_md, eng_, db.raw())}});
      e.bw_diff_weights.Finish(stream_, dw.raw());
      if (dx != nullptr) {
        memory ddst2;
        if (dy_direct && e.bd_diff_dst.prim_md() == e.bw_diff_dst.prim_md()) {
          ddst2 = ddst;
        } else if (!dy_direct && e.bd_diff_dst.SharesLayoutWith(e.bw_diff_dst)) {
          ddst2 = e.bw_diff_dst.scratch();
        } else {
          Materialize(dy);
          ddst2 = e.bd_diff_dst.Input(stream_, dy.raw());
        }
        memory wts = e.bd_weights.Input(stream_, w.raw());
        const bool keep_blocked = FitsInPlace(e.bd_diff_src.prim_md(), *dx);
        memory dsrc = keep_blocked ? memory(e.bd_diff_src.prim_md(), eng_, dx->raw())
                                   : e.bd_diff_src.Output(dx->raw());
        e.bwd_data.execute(
            stream_,
            {{DNNL_ARG_DIFF_DST, ddst2}, {DNNL_ARG_WEIGHTS, wts}, {DNNL_ARG_DIFF_SRC, dsrc}});
        if (keep_blocked) {
          MarkBlocked(*dx, e.bd_diff_src.prim_md());
        } else {
          e.bd_diff_src.Finish(stream_, dx->raw());
          MarkPlain(*dx);
        }
      }
    })
    return absl::OkStatus();
  }

  // --- Pooling ---------------------------------------------------------------------------------
  absl::StatusOr<Tensor> PoolWorkspace(const Pool2DGeometry& g) override {
    if (g.kind != PoolKind::kMax) return Tensor();
    int64_t bytes = 0;
    TESSERA_DNNL_TRY({
      bytes = static_cast<int64_t>(PoolFor(g, true, nullptr).fwd_pd.workspace_desc().get_size());
    })
    // Room for the workspace of the blocked-layout variant too (at most 4 bytes per output).
    bytes = std::max(bytes, g.n * g.c * g.oh * g.ow * 4);
    return Allocate({(bytes + 3) / 4}, DType::kInt32);
  }

  absl::Status Pool2DForward(const Pool2DGeometry& g, const Tensor& x, const Tensor& y,
                             const Tensor& workspace, bool training) override {
    TESSERA_DNNL_TRY({
      const bool with_ws = training && g.kind == PoolKind::kMax;
      PoolEntry* e = nullptr;
      if (const memory::desc* layout = BlockedLayout(x)) {
        e = &PoolFor(g, with_ws, layout);
        if (!e->blocked || (with_ws && static_cast<int64_t>(e->fwd_pd.workspace_desc().get_size()) >
                                           workspace.num_bytes())) {
          e = nullptr;
        }
      }
      if (e == nullptr) {
        Materialize(x);
        e = &PoolFor(g, with_ws, nullptr);
      }
      std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(e->src_md, eng_, x.raw())},
                                              {DNNL_ARG_DST, memory(e->dst_md, eng_, y.raw())}};
      if (with_ws) {
        args[DNNL_ARG_WORKSPACE] = memory(e->fwd_pd.workspace_desc(), eng_, workspace.raw());
        pool_workspace_owner_[workspace.raw()] = e;
      }
      e->fwd.execute(stream_, args);
      if (e->blocked) {
        MarkBlocked(y, e->dst_md);
      } else {
        MarkPlain(y);
      }
    })
    return absl::OkStatus();
  }

  absl::Status Pool2DBackward(const Pool2DGeometry& g, const Tensor& x, const Tensor& y,
                              const Tensor& dy, const Tensor& workspace,
                              const Tensor& dx) override {
    TESSERA_DNNL_TRY({
      const bool with_ws = g.kind == PoolKind::kMax;
      // Max pooling: the variant whose forward pass wrote this workspace. Average pooling: any.
      PoolEntry* entry = nullptr;
      if (with_ws) {
        auto owner = pool_workspace_owner_.find(workspace.raw());
        if (owner != pool_workspace_owner_.end()) entry = owner->second;
      } else if (const memory::desc* layout = BlockedLayout(x)) {
        entry = &PoolFor(g, false, layout);
        if (!entry->blocked) entry = nullptr;
      }
      if (entry == nullptr) entry = &PoolFor(g, with_ws, nullptr);
      PoolEntry& e = *entry;
      if (!e.bwd_ready) {
        e.bwd = dnnl::pooling_backward(dnnl::pooling_backward::primitive_desc(
            dnnl::pooling_backward::desc(PoolAlgorithm(g), e.src_md, e.dst_md,
                                         {g.stride_h, g.stride_w}, {g.kh, g.kw}, {g.pad_h, g.pad_w},
                                         PadRight(g)),
            eng_, e.fwd_pd));
        e.bwd_ready = true;
      }
      memory ddst;
      const memory::desc* dy_layout = BlockedLayout(dy);
      if (dy_layout != nullptr && *dy_layout == e.dst_md) {
        ddst = memory(e.dst_md, eng_, dy.raw());
      } else {
        Materialize(dy);
        if (e.blocked) {
          if (!e.dy_scratch) e.dy_scratch = memory(e.dst_md, eng_);
          const memory::desc plain = PlainDesc({g.n, g.c, g.oh, g.ow});
          memory plain_dy(plain, eng_, dy.raw());
          dnnl::reorder(dnnl::reorder::primitive_desc(eng_, plain, eng_, e.dst_md))
              .execute(stream_, plain_dy, e.dy_scratch);
          ddst = e.dy_scratch;
        } else {
          ddst = memory(e.dst_md, eng_, dy.raw());
        }
      }
      std::unordered_map<int, memory> args = {
          {DNNL_ARG_DIFF_DST, ddst}, {DNNL_ARG_DIFF_SRC, memory(e.src_md, eng_, dx.raw())}};
      if (with_ws) {
        args[DNNL_ARG_WORKSPACE] = memory(e.fwd_pd.workspace_desc(), eng_, workspace.raw());
      }
      e.bwd.execute(stream_, args);
      if (e.blocked) {
        MarkBlocked(dx, e.src_md);
      } else {
        MarkPlain(dx);
      }
    })
    return absl::OkStatus();
  }

  // --- Activations -----------------------------------------------------------------------------
  // Element-wise ops run on the raw elements, so they keep whatever layout their operands share.
  absl::Status ActivationForward(Activation kind, const Tensor& x, const Tensor& y) override {
    const memory::desc* layout = BlockedLayout(x);
    const memory::desc x_layout = layout != nullptr ? *layout : memory::desc();
    TESSERA_DNNL_TRY({
      EltwiseEntry& e = EltwiseFor(kind, x.num_elements());
      e.fwd.execute(stream_, {{DNNL_ARG_SRC, memory(e.md, eng_, x.raw())},
                              {DNNL_ARG_DST, memory(e.md, eng_, y.raw())}});
    })
    if (layout != nullptr) {
      MarkBlocked(y, x_layout);
    } else {
      MarkPlain(y);
    }
    return absl::OkStatus();
  }

  absl::Status ActivationBackward(Activation kind, const Tensor& x, const Tensor& y,
                                  const Tensor& dy, const Tensor& dx) override {
    const bool use_dst = kind != Activation::kRelu;
    const Tensor& value = use_dst ? y : x;
    const memory::desc* value_layout = BlockedLayout(value);
    const memory::desc* dy_layout = BlockedLayout(dy);
    const bool same = value_layout == nullptr ? dy_layout == nullptr
                                              : dy_layout != nullptr && *value_layout == *dy_layout;
    const bool blocked_shared = same && value_layout != nullptr;
    memory::desc shared;
    if (blocked_shared) {
      shared = *value_layout;
    } else if (!same) {
      TESSERA_RETURN_IF_ERROR(MakePlain({&value, &dy}));
    }
    TESSERA_DNNL_TRY({
      EltwiseEntry& e = EltwiseFor(kind, x.num_elements());
      if (!e.bwd_ready) {
        e.bwd = dnnl::eltwise_backward(dnnl::eltwise_backward::primitive_desc(
            dnnl::eltwise_backward::desc(EltwiseAlgorithm(kind), e.md, e.md, 0.0f, 0.0f), eng_,
            e.fwd_pd));
        e.bwd_ready = true;
      }
      e.bwd.execute(stream_,
                    {{use_dst ? DNNL_ARG_DST : DNNL_ARG_SRC, memory(e.md, eng_, value.raw())},
                     {DNNL_ARG_DIFF_DST, memory(e.md, eng_, dy.raw())},
                     {DNNL_ARG_DIFF_SRC, memory(e.md, eng_, dx.raw())}});
    })
    if (blocked_shared) {
      MarkBlocked(dx, shared);
    } else {
      MarkPlain(dx);
    }
    return absl::OkStatus();
  }

  // --- Dropout ---------------------------------------------------------------------------------
  absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x, const Tensor& mask,
                              const Tensor& y) override {
    // Masks are defined on the plain (NCHW) element order, the same on every backend.
    TESSERA_RETURN_IF_ERROR(MakePlain({&x}));
    MarkPlain(mask);
    MarkPlain(y);
    cpu::DropoutForward(rate, seed, x.f32(), mask.f32(), y.f32(), x.num_elements());
    return absl::OkStatus();
  }
  absl::Status DropoutBackward(const Tensor& dy, const Tensor& mask, const Tensor& dx) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&dy, &mask}));
    MarkPlain(dx);
    cpu::Multiply(dy.f32(), mask.f32(), dx.f32(), dy.num_elements());
    return absl::OkStatus();
  }

  // --- Batch normalisation ---------------------------------------------------------------------
  absl::Status BatchNormForwardTraining(const BatchNormGeometry& g, const Tensor& x,
                                        const Tensor& gamma, const Tensor& beta, const Tensor& y,
                                        const Tensor& moving_mean, const Tensor& moving_var,
                                        const Tensor& save_mean, const Tensor& save_var) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x}));
    MarkPlain(y);
    TESSERA_DNNL_TRY({
      BatchNormEntry& e = BatchNormFor(g);
      e.train.execute(stream_, {{DNNL_ARG_SRC, memory(e.data_md, eng_, x.raw())},
                                {DNNL_ARG_SCALE, memory(e.stat_md, eng_, gamma.raw())},
                                {DNNL_ARG_SHIFT, memory(e.stat_md, eng_, beta.raw())},
                                {DNNL_ARG_MEAN, memory(e.stat_md, eng_, save_mean.raw())},
                                {DNNL_ARG_VARIANCE, memory(e.stat_md, eng_, save_var.raw())},
                                {DNNL_ARG_DST, memory(e.data_md, eng_, y.raw())}});
    })
    cpu::UpdateMovingStats(g.momentum, g.n * g.spatial, save_mean.f32(), save_var.f32(),
                           moving_mean.f32(), moving_var.f32(), g.c);
    return absl::OkStatus();
  }

  absl::Status BatchNormForwardInference(const BatchNormGeometry& g, const Tensor& x,
                                         const Tensor& gamma, const Tensor& beta,
                                         const Tensor& moving_mean, const Tensor& moving_var,
                                         const Tensor& y) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x}));
    MarkPlain(y);
    TESSERA_DNNL_TRY({
      BatchNormEntry& e = BatchNormFor(g);
      if (!e.infer_ready) {
        e.infer =
            dnnl::batch_normalization_forward(dnnl::batch_normalization_forward::primitive_desc(
                dnnl::batch_normalization_forward::desc(
                    dnnl::prop_kind::forward_inference, e.data_md, g.epsilon,
                    dnnl::normalization_flags::use_global_stats |
                        dnnl::normalization_flags::use_scale |
                        dnnl::normalization_flags::use_shift),
                eng_));
        e.infer_ready = true;
      }
      e.infer.execute(stream_, {{DNNL_ARG_SRC, memory(e.data_md, eng_, x.raw())},
                                {DNNL_ARG_SCALE, memory(e.stat_md, eng_, gamma.raw())},
                                {DNNL_ARG_SHIFT, memory(e.stat_md, eng_, beta.raw())},
                                {DNNL_ARG_MEAN, memory(e.stat_md, eng_, moving_mean.raw())},
                                {DNNL_ARG_VARIANCE, memory(e.stat_md, eng_, moving_var.raw())},
                                {DNNL_ARG_DST, memory(e.data_md, eng_, y.raw())}});
    })
    return absl::OkStatus();
  }

  absl::Status BatchNormBackward(const BatchNormGeometry& g, const Tensor& x, const Tensor& gamma,
                                 const Tensor& save_mean, const Tensor& save_var, const Tensor& dy,
                                 const Tensor& dx, const Tensor& dgamma,
                                 const Tensor& dbeta) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x, &dy}));
    MarkPlain(dx);
    TESSERA_DNNL_TRY({
      BatchNormEntry& e = BatchNormFor(g);
      if (!e.bwd_ready) {
        e.bwd =
            dnnl::batch_normalization_backward(dnnl::batch_normalization_backward::primitive_desc(
                dnnl::batch_normalization_backward::desc(
                    dnnl::prop_kind::backward, e.data_md, e.data_md, g.epsilon,
                    dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift),
                eng_, e.train_pd));
        e.bwd_ready = true;
      }
      e.bwd.execute(stream_, {{DNNL_ARG_SRC, memory(e.data_md, eng_, x.raw())},
                              {DNNL_ARG_MEAN, memory(e.stat_md, eng_, save_mean.raw())},
                              {DNNL_ARG_VARIANCE, memory(e.stat_md, eng_, save_var.raw())},
                              {DNNL_ARG_DIFF_DST, memory(e.data_md, eng_, dy.raw())},
                              {DNNL_ARG_SCALE, memory(e.stat_md, eng_, gamma.raw())},
                              {DNNL_ARG_SHIFT, memory(e.stat_md, eng_, e.unused_shift.data())},
                              {DNNL_ARG_DIFF_SRC, memory(e.data_md, eng_, dx.raw())},
                              {DNNL_ARG_DIFF_SCALE, memory(e.stat_md, eng_, dgamma.raw())},
                              {DNNL_ARG_DIFF_SHIFT, memory(e.stat_md, eng_, dbeta.raw())}});
    })
    return absl::OkStatus();
  }

  // --- EmbeddingBag ----------------------------------------------------------------------------
  absl::Status EmbeddingBagForward(Combiner combiner, const Tensor& table, const Tensor& ids,
                                   const Tensor& offsets, const Tensor* values,
                                   const Tensor& out) override {
    MarkPlain(out);
    cpu::EmbeddingBagForward(combiner == Combiner::kMean, table.f32(), table.dim(1), ids.i64(),
                             offsets.i64(), values != nullptr ? values->f32() : nullptr, out.dim(0),
                             out.f32());
    return absl::OkStatus();
  }
  absl::Status EmbeddingBagBackward(Combiner combiner, const Tensor& ids, const Tensor& offsets,
                                    const Tensor* values, const Tensor& dout,
                                    const Tensor& dtable) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&dout}));
    cpu::Fill(dtable.f32(), dtable.num_elements(), 0.0f);
    cpu::EmbeddingBagBackward(combiner == Combiner::kMean, dtable.dim(1), ids.i64(), offsets.i64(),
                              values != nullptr ? values->f32() : nullptr, dout.dim(0), dout.f32(),
                              dtable.f32());
    return absl::OkStatus();
  }

  // --- Multi-input models ----------------------------------------------------------------------
  absl::Status CopyColumns(const Tensor& src, int64_t src_offset, const Tensor& dst,
                           int64_t dst_offset, int64_t width, bool accumulate) override {
    // dst keeps its other columns: it is read as well.
    TESSERA_RETURN_IF_ERROR(MakePlain({&src, &dst}));
    const int64_t rows = src.dim(0);
    cpu::CopyColumns(src.f32(), src.num_elements() / rows, src_offset, dst.f32(),
                     dst.num_elements() / rows, dst_offset, rows, width, accumulate);
    return absl::OkStatus();
  }
  absl::Status DotInteractionForward(const Tensor& x, const Tensor& y, int64_t y_offset) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x, &y}));
    const int64_t n = x.dim(0);
    cpu::DotInteractionForward(x.f32(), n, x.dim(1), x.dim(2), y.f32(), y.num_elements() / n,
                               y_offset);
    return absl::OkStatus();
  }
  absl::Status DotInteractionBackward(const Tensor& x, const Tensor& dy, int64_t y_offset,
                                      const Tensor& dx) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x, &dy}));
    MarkPlain(dx);
    const int64_t n = x.dim(0);
    cpu::DotInteractionBackward(x.f32(), n, x.dim(1), x.dim(2), dy.f32(), dy.num_elements() / n,
                                y_offset, dx.f32());
    return absl::OkStatus();
  }

  // --- Losses ----------------------------------------------------------------------------------
  absl::Status LossForwardBackward(LossKind kind, const Tensor& logits, const Tensor& labels,
                                   const Tensor* dlogits, const Tensor& metrics) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&logits, &labels}));
    if (dlogits != nullptr) MarkPlain(*dlogits);
    const int64_t n = logits.dim(0);
    const int64_t k = logits.num_elements() / n;
    float* d = dlogits != nullptr ? dlogits->f32() : nullptr;
    float* m = metrics.f32();
    switch (kind) {
      case LossKind::kSoftmaxCrossEntropy: {
        TESSERA_DNNL_TRY({
          LogSoftmaxEntry& e = LogSoftmaxFor(n, k);
          e.fwd.execute(stream_, {{DNNL_ARG_SRC, memory(e.md, eng_, logits.raw())},
                                  {DNNL_ARG_DST, memory(e.md, eng_, e.log_probs.data())}});
          cpu::SoftmaxCrossEntropy(e.log_probs.data(), labels.i32(), n, k, d, &m[0], &m[1]);
        })
        break;
      }
      case LossKind::kSigmoidCrossEntropy:
        cpu::SigmoidCrossEntropy(logits.f32(), labels.f32(), n, k, d, &m[0], &m[1]);
        break;
      case LossKind::kMeanSquaredError:
        cpu::MeanSquaredError(logits.f32(), labels.f32(), n, k, d, &m[0], &m[1]);
        break;
    }
    return absl::OkStatus();
  }

  // --- Element-wise ----------------------------------------------------------------------------
  absl::Status Axpy(float alpha, const Tensor& x, const Tensor& y) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x, &y}));
    cpu::Axpy(alpha, x.f32(), y.f32(), x.num_elements());
    return absl::OkStatus();
  }
  absl::Status Scale(float alpha, const Tensor& x) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x}));
    cpu::Scale(alpha, x.f32(), x.num_elements());
    return absl::OkStatus();
  }
  absl::StatusOr<double> SquaredNorm(const Tensor& x) override {
    TESSERA_RETURN_IF_ERROR(MakePlain({&x}));
    return cpu::SquaredNorm(x.f32(), x.num_elements());
  }

  absl::Status ApplyUpdate(const OptimizerParams& params, float lr, int64_t t, float grad_scale,
                           const Tensor& grad, const Tensor& w,
                           absl::Span<const Tensor> slots) override {
    if (static_cast<int>(slots.size()) != NumSlots(params.kind)) {
      return absl::InvalidArgumentError(absl::StrCat("ApplyUpdate: ", slots.size(),
                                                     " slots given, the optimizer needs ",
                                                     NumSlots(params.kind)));
    }
    for (const Tensor& t : slots) {
      if (t.num_elements() != w.num_elements()) {
        return absl::InvalidArgumentError(absl::StrCat("ApplyUpdate: slot shape ",
                                                       ShapeString(t.shape()), " vs weights ",
                                                       ShapeString(w.shape())));
      }
    }
    if (grad.num_elements() != w.num_elements()) {
      return absl::InvalidArgumentError(absl::StrCat("ApplyUpdate: gradient shape ",
                                                     ShapeString(grad.shape()), " vs weights ",
                                                     ShapeString(w.shape())));
    }
    TESSERA_RETURN_IF_ERROR(MakePlain({&grad, &w}));
    float* slot_ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
    for (size_t i = 0; i < slots.size() && i < 4; ++i) slot_ptrs[i] = slots[i].f32();
    ApplyUpdateCpu(params, lr, t, grad_scale, grad.f32(), w.f32(), slot_ptrs, w.num_elements());
    return absl::OkStatus();
  }

 private:
  // --- Blocked activations -----------------------------------------------------------------------
  // A convolution's output stays in oneDNN's blocked layout (nChw16c) when that layout fills the
  // tensor's memory exactly; ReLU and pooling then work on it in place of NCHW, and the next
  // convolution reads it without a reorder. blocked_ records which tensors (by data pointer) hold
  // such data. Every other op reads a tensor only after Materialize() turned it back into NCHW,
  // and marks what it writes as plain, so the layout never shows outside the backend.
  const memory::desc* BlockedLayout(const Tensor& t) const {
    if (blocked_.empty()) return nullptr;
    auto it = blocked_.find(t.raw());
    return it == blocked_.end() ? nullptr : &it->second;
  }
  void MarkPlain(const Tensor& t) {
    if (!blocked_.empty()) blocked_.erase(t.raw());
  }
  void MarkBlocked(const Tensor& t, const memory::desc& layout) { blocked_[t.raw()] = layout; }
  static bool FitsInPlace(const memory::desc& layout, const Tensor& t) {
    return layout != PlainDesc(layout.dims()) &&
           static_cast<int64_t>(layout.get_size()) == t.num_bytes();
  }
  // Reorders a blocked tensor back to NCHW in its own memory. Throws dnnl::error.
  void Materialize(const Tensor& t) {
    auto it = blocked_.find(t.raw());
    if (it == blocked_.end()) return;
    const memory::desc layout = it->second;
    blocked_.erase(it);
    const memory::desc plain = PlainDesc(layout.dims());
    plain_scratch_.resize(plain.get_size() / sizeof(float) + 1);
    memory from(layout, eng_, t.raw()), to(plain, eng_, plain_scratch_.data());
    dnnl::reorder(dnnl::reorder::primitive_desc(eng_, layout, eng_, plain))
        .execute(stream_, from, to);
    std::memcpy(t.raw(), plain_scratch_.data(), plain.get_size());
  }
  absl::Status MakePlain(std::initializer_list<const Tensor*> tensors) {
    if (blocked_.empty()) return absl::OkStatus();
    TESSERA_DNNL_TRY({
      for (const Tensor* t : tensors) Materialize(*t);
    })
    return absl::OkStatus();
  }

  static dnnl::algorithm PoolAlgorithm(const Pool2DGeometry& g) {
    return g.kind == PoolKind::kMax ? dnnl::algorithm::pooling_max
                                    : dnnl::algorithm::pooling_avg_exclude_padding;
  }
  // oneDNN wants the right padding that makes the output size exact.
  static memory::dims PadRight(const Pool2DGeometry& g) {
    return {(g.oh - 1) * g.stride_h + g.kh - g.h - g.pad_h,
            (g.ow - 1) * g.stride_w + g.kw - g.w - g.pad_w};
  }

  DenseEntry& DenseFor(int64_t n, int64_t in, int64_t out) {
    std::unique_ptr<DenseEntry>& slot = dense_[{n, in, out}];
    if (!slot) {
      auto e = std::make_unique<DenseEntry>();
      e->src_md = PlainDesc({n, in});
      e->w_md = PlainDesc({out, in});
      e->b_md = PlainDesc({out});
      e->dst_md = PlainDesc({n, out});
      e->fwd_pd = dnnl::inner_product_forward::primitive_desc(
          dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, e->src_md, e->w_md,
                                            e->b_md, e->dst_md),
          eng_);
      e->fwd = dnnl::inner_product_forward(e->fwd_pd);
      slot = std::move(e);
    }
    return *slot;
  }

  ConvEntry& ConvFor(const Conv2DGeometry& g) {
    std::unique_ptr<ConvEntry>& slot =
        conv_[{g.n, g.c, g.h, g.w, g.k, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w}];
    if (!slot) {
      auto e = std::make_unique<ConvEntry>();
      const memory::dims src{g.n, g.c, g.h, g.w}, wts{g.k, g.c, g.kh, g.kw},
          dst{g.n, g.k, g.oh, g.ow};
      const memory::desc any_src(src, DataType::f32, Tag::any);
      const memory::desc any_w(wts, DataType::f32, Tag::any);
      const memory::desc any_dst(dst, DataType::f32, Tag::any);
      e->bias_md = PlainDesc({g.k});
      e->fwd_pd = dnnl::convolution_forward::primitive_desc(
          dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                          dnnl::algorithm::convolution_direct, any_src, any_w,
                                          e->bias_md, any_dst, {g.stride_h, g.stride_w},
                                          {g.pad_h, g.pad_w}, {g.pad_h, g.pad_w}),
          eng_);
      e->fwd = dnnl::convolution_forward(e->fwd_pd);
      e->src = Staged(PlainDesc(src), e->fwd_pd.src_desc(), eng_);
      e->weights = Staged(PlainDesc(wts), e->fwd_pd.weights_desc(), eng_);
      e->dst = Staged(PlainDesc(dst), e->fwd_pd.dst_desc(), eng_);
      slot = std::move(e);
    }
    return *slot;
  }

  void InitConvBackward(const Conv2DGeometry& g, ConvEntry* e) {
    const memory::dims src{g.n, g.c, g.h, g.w}, wts{g.k, g.c, g.kh, g.kw},
        dst{g.n, g.k, g.oh, g.ow};
    const memory::desc any_src(src, DataType::f32, Tag::any);
    const memory::desc any_w(wts, DataType::f32, Tag::any);
    const memory::desc any_dst(dst, DataType::f32, Tag::any);
    auto bd_pd = dnnl::convolution_backward_data::primitive_desc(
        dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, any_src, any_w,
                                              any_dst, {g.stride_h, g.stride_w}, {g.pad_h, g.pad_w},
                                              {g.pad_h, g.pad_w}),
        eng_, e->fwd_pd);
    e->bwd_data = dnnl::convolution_backward_data(bd_pd);
    e->bd_diff_dst = Staged(PlainDesc(dst), bd_pd.diff_dst_desc(), eng_);
    e->bd_weights = Staged(PlainDesc(wts), bd_pd.weights_desc(), eng_);
    e->bd_diff_src = Staged(PlainDesc(src), bd_pd.diff_src_desc(), eng_);
    auto bw_pd = dnnl::convolution_backward_weights::primitive_desc(
        dnnl::convolution_backward_weights::desc(
            dnnl::algorithm::convolution_direct, any_src, any_w, e->bias_md, any_dst,
            {g.stride_h, g.stride_w}, {g.pad_h, g.pad_w}, {g.pad_h, g.pad_w}),
        eng_, e->fwd_pd);
    e->bwd_weights = dnnl::convolution_backward_weights(bw_pd);
    e->bw_src = Staged(PlainDesc(src), bw_pd.src_desc(), eng_);
    e->bw_diff_dst = Staged(PlainDesc(dst), bw_pd.diff_dst_desc(), eng_);
    e->bw_diff_weights = Staged(PlainDesc(wts), bw_pd.diff_weights_desc(), eng_);
    e->bwd_ready = true;
  }

  // The pooling of plain NCHW input (layout null) or of input in `layout`. A blocked entry whose
  // output would not fit its tensor in place comes back with blocked == false and is not used.
  PoolEntry& PoolFor(const Pool2DGeometry& g, bool training, const memory::desc* layout) {
    Key key{static_cast<int64_t>(g.kind),
            training ? 1 : 0,
            g.n,
            g.c,
            g.h,
            g.w,
            g.kh,
            g.kw,
            g.stride_h,
            g.stride_w,
            g.pad_h,
            g.pad_w,
            layout != nullptr ? 1 : 0};
    if (layout != nullptr) {
      // Distinguish blocked layouts by their inner blocking.
      const dnnl_blocking_desc_t& b = layout->data.format_desc.blocking;
      key.push_back(b.inner_nblks);
      for (int i = 0; i < b.inner_nblks; ++i) {
        key.push_back(b.inner_blks[i]);
        key.push_back(b.inner_idxs[i]);
      }
    }
    std::unique_ptr<PoolEntry>& slot = pool_[key];
    if (!slot) {
      auto e = std::make_unique<PoolEntry>();
      e->src_md = layout != nullptr ? *layout : PlainDesc({g.n, g.c, g.h, g.w});
      const memory::desc dst_request =
          layout != nullptr ? memory::desc({g.n, g.c, g.oh, g.ow}, DataType::f32, Tag::any)
                            : PlainDesc({g.n, g.c, g.oh, g.ow});
      e->fwd_pd = dnnl::pooling_forward::primitive_desc(
          dnnl::pooling_forward::desc(
              training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference,
              PoolAlgorithm(g), e->src_md, dst_request, {g.stride_h, g.stride_w}, {g.kh, g.kw},
              {g.pad_h, g.pad_w}, PadRight(g)),
          eng_);
      e->dst_md = e->fwd_pd.dst_desc();
      e->blocked =
          layout != nullptr && static_cast<int64_t>(e->dst_md.get_size()) ==
                                   g.n * g.c * g.oh * g.ow * static_cast<int64_t>(sizeof(float));
      e->fwd = dnnl::pooling_forward(e->fwd_pd);
      slot = std::move(e);
    }
    return *slot;
  }

  EltwiseEntry& EltwiseFor(Activation kind, int64_t n) {
    std::unique_ptr<EltwiseEntry>& slot = eltwise_[{static_cast<int64_t>(kind), n}];
    if (!slot) {
      auto e = std::make_unique<EltwiseEntry>();
      e->md = PlainDesc({n});
      e->fwd_pd = dnnl::eltwise_forward::primitive_desc(
          dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, EltwiseAlgorithm(kind),
                                      e->md, 0.0f, 0.0f),
          eng_);
      e->fwd = dnnl::eltwise_forward(e->fwd_pd);
      slot = std::move(e);
    }
    return *slot;
  }

  BatchNormEntry& BatchNormFor(const BatchNormGeometry& g) {
    float eps = g.epsilon;
    int32_t eps_bits;
    std::memcpy(&eps_bits, &eps, sizeof(eps_bits));
    std::unique_ptr<BatchNormEntry>& slot = batch_norm_[{g.n, g.c, g.spatial, eps_bits}];
    if (!slot) {
      auto e = std::make_unique<BatchNormEntry>();
      e->data_md = PlainDesc({g.n, g.c, g.spatial, 1});
      e->stat_md = PlainDesc({g.c});
      e->unused_shift.assign(static_cast<size_t>(g.c), 0.0f);
      e->train_pd = dnnl::batch_normalization_forward::primitive_desc(
          dnnl::batch_normalization_forward::desc(
              dnnl::prop_kind::forward_training, e->data_md, g.epsilon,
              dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift),
          eng_);
      e->train = dnnl::batch_normalization_forward(e->train_pd);
      slot = std::move(e);
    }
    return *slot;
  }

  LogSoftmaxEntry& LogSoftmaxFor(int64_t n, int64_t k) {
    std::unique_ptr<LogSoftmaxEntry>& slot = log_softmax_[{n, k}];
    if (!slot) {
      auto e = std::make_unique<LogSoftmaxEntry>();
      e->md = PlainDesc({n, k});
      e->fwd = dnnl::logsoftmax_forward(dnnl::logsoftmax_forward::primitive_desc(
          dnnl::logsoftmax_forward::desc(dnnl::prop_kind::forward_inference, e->md, 1), eng_));
      e->log_probs.resize(static_cast<size_t>(n * k));
      slot = std::move(e);
    }
    return *slot;
  }

  dnnl::engine eng_;
  dnnl::stream stream_;
  int threads_;
  int64_t memory_limit_bytes_;
  std::map<Key, std::unique_ptr<DenseEntry>> dense_;
  std::map<Key, std::unique_ptr<ConvEntry>> conv_;
  std::map<Key, std::unique_ptr<PoolEntry>> pool_;
  std::map<Key, std::unique_ptr<EltwiseEntry>> eltwise_;
  std::map<Key, std::unique_ptr<BatchNormEntry>> batch_norm_;
  std::map<Key, std::unique_ptr<LogSoftmaxEntry>> log_softmax_;
  std::unordered_map<const void*, memory::desc> blocked_;
  std::vector<float> plain_scratch_;
  // Which pooling variant last wrote each max-pooling workspace.
  std::unordered_map<const void*, PoolEntry*> pool_workspace_owner_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const BackendOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads: must be >= 0, got ", options.num_threads));
  }
  if (options.num_threads > 0) omp_set_num_threads(options.num_threads);
  // Flush denormals to zero on every OpenMP thread (and this one), as TensorFlow does on CPU:
  // denormal products cost oneDNN's convolutions 15-20% here, and tiny gradients are common late
  // in training.
  _mm_setcsr(_mm_getcsr() | kFlushDenormals);
#pragma omp parallel
  { _mm_setcsr(_mm_getcsr() | kFlushDenormals); }
  try {
    return std::unique_ptr<Backend>(
        new CpuBackend(omp_get_max_threads(), options.memory_limit_bytes));
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN: cannot create the CPU engine: ", e.what()));
  }
}

}  // namespace tessera::kernels
