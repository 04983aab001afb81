#include "server/parameter_store.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/encoding.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/schedule.h"

namespace tessera::server {
namespace {

constexpr int64_t kMaxPartitionElements = int64_t{1} << 28;  // 1 GiB of fp32
constexpr uint32_t kMaxSparseDim = 1u << 20;
constexpr uint32_t kMaxWorkers = 1u << 16;
// Steps and effective steps beyond this are refused, so that step + 1 and the gates' arithmetic
// never overflow.
constexpr int64_t kMaxStep = int64_t{1} << 62;
constexpr double kPi = 3.14159265358979323846;

std::string KeyName(const v1::PartitionKey& key) {
  return absl::StrCat(key.tensor(), "/", key.index());
}

std::string KeyName(const SliceView& s) { return absl::StrCat(s.tensor, "/", s.index); }

// A sparse gradient with unique row ids (duplicates in a push are summed in order).
struct SparseGrad {
  std::vector<int64_t> ids;
  std::vector<float> values;  // ids.size() * dim
};

// SplitMix64: a small, portable generator so row r of a table initialises the same everywhere.
uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) with 24 random bits.
float UnitFloat(uint64_t* state) {
  return static_cast<float>(SplitMix(state) >> 40) * (1.0f / 16777216.0f);
}

void InitRow(const v1::Initializer& init, int64_t row, float* out, uint32_t dim) {
  uint64_t state = init.seed() ^ (static_cast<uint64_t>(row) * 0xd1b54a32d192ed03ull);
  switch (init.kind()) {
    case v1::Initializer::KIND_CONSTANT:
      std::fill(out, out + dim, init.value());
      return;
    case v1::Initializer::KIND_UNIFORM:
      for (uint32_t i = 0; i < dim; ++i) out[i] = (2.0f * UnitFloat(&state) - 1.0f) * init.scale();
      return;
    case v1::Initializer::KIND_NORMAL:
      for (uint32_t i = 0; i < dim; i += 2) {
        // Box-Muller; 1 - u keeps the logarithm finite.
        const double u1 = 1.0 - UnitFloat(&state);
        const double u2 = UnitFloat(&state);
        const double r = std::sqrt(-2.0 * std::log(u1));
        out[i] = static_cast<float>(r * std::cos(2.0 * kPi * u2)) * init.scale();
        if (i + 1 < dim)
          out[i + 1] = static_cast<float>(r * std::sin(2.0 * kPi * u2)) * init.scale();
      }
      return;
    default:
      std::fill(out, out + dim, 0.0f);
  }
}

// The fp32 check runs over blocks of this many values (1 KiB), and asks for the bytes
// kNonFinitePrefetchBytes ahead of each block to be fetched meanwhile: the check is the first
// pass over a gradient that the kernel has just copied into gRPC's receive buffers, in pieces of 8
// to 64 KiB that the hardware prefetcher does not follow across pages, and it waited on those
// loads (measured: 4 shards, 1 client, 64 MiB, ratio 0.463 without and 0.486 with, means of 5
// interleaved runs; docs/benchmarks.md).
constexpr size_t kNonFiniteBlockValues = 256;
constexpr size_t kNonFinitePrefetchBytes = 2048;

// True when any value in `bytes` is NaN or Inf, checked on the raw bits.
bool HasNonFinite(v1::Encoding encoding, absl::string_view bytes) {
  const char* p = bytes.data();
  if (BytesPerValue(encoding) == 4) {
    const size_t n = bytes.size() / 4;
    uint32_t bad = 0;
    for (size_t begin = 0; begin < n; begin += kNonFiniteBlockValues) {
      const size_t end = std::min(n, begin + kNonFiniteBlockValues);
      const size_t ahead = 4 * begin + kNonFinitePrefetchBytes;
      for (size_t line = 0; line < 4 * kNonFiniteBlockValues && ahead + line < bytes.size();
           line += 64) {
        __builtin_prefetch(p + ahead + line);
      }
#pragma omp simd reduction(| : bad)
      for (size_t i = begin; i < end; ++i) {
        uint32_t u;
        std::memcpy(&u, p + 4 * i, 4);
        bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
      }
    }
    return bad != 0;
  }
  const uint16_t mask = encoding == v1::ENCODING_BF16 ? 0x7f80u : 0x7c00u;
  const size_t n = bytes.size() / 2;
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    bad |= static_cast<uint32_t>((h & mask) == mask);
  }
  return bad != 0;
}

// Bytes of the slice's data (see SliceView).
size_t DataSize(const SliceView& slice) {
  if (slice.pieces.empty()) return slice.data.size();
  size_t n = 0;
  for (absl::string_view piece : slice.pieces) n += piece.size();
  return n;
}

// Calls run(const char* bytes, size_t size) over the slice's data in order, in runs of whole
// values of `width` bytes at any alignment; a value that straddles two pieces is passed alone from
// a small buffer. REQUIRES: DataSize(slice) is a multiple of width, and width <= 8.
template <typename Run>
void ForEachRun(const SliceView& slice, size_t width, const Run& run) {
  if (slice.pieces.empty()) {
    if (!slice.data.empty()) run(slice.data.data(), slice.data.size());
    return;
  }
  char carry[8];
  size_t carried = 0;
  for (absl::string_view piece : slice.pieces) {
    const char* p = piece.data();
    size_t n = piece.size();
    if (carried > 0) {
      const size_t k = std::min(width - carried, n);
      std::memcpy(carry + carried, p, k);
      carried += k;
      p += k;
      n -= k;
      if (carried < width) continue;
      run(static_cast<const char*>(carry), width);
      carried = 0;
    }
    const size_t whole = n / width * width;
    if (whole > 0) run(p, whole);
    if (n > whole) std::memcpy(carry, p + whole, n - whole);
    carried = n - whole;
  }
}

bool HasNonFinite(const SliceView& slice) {
  const size_t width = BytesPerValue(slice.encoding);
  bool bad = false;
  ForEachRun(slice, width, [&](const char* p, size_t n) {
    if (!bad) bad = HasNonFinite(slice.encoding, absl::string_view(p, n));
  });
  return bad;
}

// Decodes the slice's n values into out[0, n). REQUIRES: the size and encoding were validated.
void DecodeSlice(const SliceView& slice, float* out, size_t n) {
  const size_t width = BytesPerValue(slice.encoding);
  size_t at = 0;
  ForEachRun(slice, width, [&](const char* p, size_t bytes) {
    const size_t k = std::min(bytes / width, n - at);
    DecodeValues(slice.encoding, absl::string_view(p, k * width), out + at, k).IgnoreError();
    at += k;
  });
}

// Calls apply(const float* g, size_t begin, size_t count) or apply_bytes(const char* g, size_t
// begin, size_t count) over the slice's n values, in order: once with the payload itself when it
// is aligned fp32 in one piece; for other fp32 data, apply_bytes over each run of whole values as
// it lies in the pieces, at any alignment (the optimizer reads such bytes directly, so the
// gradient is read once, in place; a value split between two pieces comes alone from a small
// buffer); for bf16 and fp16, once with the whole gradient decoded into `scratch`.
// REQUIRES: the size and encoding were validated.
template <typename Apply, typename ApplyBytes>
void ForEachGradientRun(const SliceView& slice, size_t n, std::vector<float>* scratch,
                        const Apply& apply, const ApplyBytes& apply_bytes) {
  if (BytesPerValue(slice.encoding) != 4) {
    scratch->resize(n);
    DecodeSlice(slice, scratch->data(), n);
    apply(static_cast<const float*>(scratch->data()), size_t{0}, n);
    return;
  }
  if (slice.pieces.empty() &&
      reinterpret_cast<uintptr_t>(slice.data.data()) % alignof(float) == 0) {
    apply(reinterpret_cast<const float*>(slice.data.data()), size_t{0}, n);
    return;
  }
  size_t done = 0;
  ForEachRun(slice, 4, [&](const char* p, size_t bytes) {
    const size_t k = std::min(bytes / 4, n - done);
    apply_bytes(p, done, k);
    done += k;
  });
}

SparseGrad MergeRows(const SliceView& slice, uint32_t dim) {
  const size_t k = slice.row_ids.size();
  std::vector<float> raw(k * dim);
  DecodeSlice(slice, raw.data(), raw.size());
  std::vector<size_t> order(k);
  for (size_t i = 0; i < k; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return slice.row_ids[a] < slice.row_ids[b]; });
  SparseGrad out;
  out.ids.reserve(k);
  out.values.reserve(k * dim);
  for (size_t i : order) {
    const float* src = raw.data() + i * dim;
    if (!out.ids.empty() && out.ids.back() == slice.row_ids[i]) {
      float* dst = out.values.data() + (out.ids.size() - 1) * dim;
      for (uint32_t j = 0; j < dim; ++j) dst[j] += src[j];
    } else {
      out.ids.push_back(slice.row_ids[i]);
      out.values.insert(out.values.end(), src, src + dim);
    }
  }
  return out;
}

// Identifies the wait whose gate is being checked inline on this thread (see AnswerWhenOpen).
thread_local const void* inline_wait_token = nullptr;

// Three quarters of the physical memory, or of the cgroup (v2) limit when that is lower.
int64_t DefaultMemoryLimit() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  int64_t memory =
      pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : int64_t{16} << 30;
  if (std::FILE* f = std::fopen("/sys/fs/cgroup/memory.max", "r")) {
    long long cgroup = 0;
    if (std::fscanf(f, "%lld", &cgroup) == 1 && cgroup > 0) {
      memory = std::min<int64_t>(memory, cgroup);
    }
    std::fclose(f);
  }
  return memory / 4 * 3;
}

}  // namespace

// Bytes of state held by the whole store, against options.max_memory_bytes. Thread-safe.
class ParameterStore::MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}

  // Reserves `bytes` unless the total would pass the limit.
  bool TryReserve(int64_t bytes) {
    int64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (bytes > limit_ - used) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  // For growth that was checked beforehand (sparse rows created when a BSP step completes).
  void ForceReserve(int64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  absl::Status Exhausted(absl::string_view what, int64_t bytes) const {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " needs ", bytes, " more bytes of state, but the shard already holds ",
                     used_.load(std::memory_order_relaxed), " of its max_memory_bytes ", limit_));
  }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

namespace {

// 10 us .. 60 s, for gate waits in nanoseconds.
std::vector<int64_t> WaitBoundsNs() {
  std::vector<int64_t> bounds;
  for (int64_t us :
       {10,    50,     100,    250,    500,     1000,    2500,    5000,     10000,    25000,
        50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 30000000, 60000000}) {
    bounds.push_back(us * 1000);
  }
  return bounds;
}

}  // namespace

struct ParameterStore::Counters {
  std::atomic<int64_t> bytes_pushed{0};
  std::atomic<int64_t> bytes_pulled{0};
  std::atomic<int64_t> updates_applied{0};
  std::atomic<int64_t> duplicates{0};
  std::atomic<int64_t> skipped_non_finite{0};
  std::atomic<int64_t> weight_copies_on_write{0};
  StoreHistogram bsp_wait_ns{WaitBoundsNs()};
  StoreHistogram ssp_wait_ns{WaitBoundsNs()};
  StoreHistogram ssp_staleness{{0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100}};
};

// One dense partition or one sparse table.
struct ParameterStore::Partition {
  struct Seq {
    bool seen = false;
    uint64_t incarnation = 0;
    uint64_t seq = 0;
  };
  struct Row {
    std::vector<float> values;  // dim weights, then NumSlots * dim slot values
    int64_t updates = 0;
  };

  ~Partition() {
    if (budget != nullptr) budget->Release(charged.load(std::memory_order_relaxed));
  }

  // Bytes of bookkeeping that do not depend on the values: this struct, the name and the
  // per-worker vectors.
  static int64_t FixedBytes(uint32_t workers, size_t name_size) {
    return static_cast<int64_t>(sizeof(Partition) + name_size) +
           int64_t{workers} * static_cast<int64_t>(sizeof(Seq) + 2 + sizeof(SparseGrad) +
                                                   sizeof(int64_t) + sizeof(std::atomic<int64_t>));
  }
  // Bytes of one sparse row: weights, slots and the hash map entry.
  int64_t RowBytes() const {
    return int64_t{dim} * 4 * (1 + num_slots) +
           static_cast<int64_t>(sizeof(Row) + sizeof(int64_t) + 16);
  }

  std::shared_ptr<MemoryBudget> budget;
  std::atomic<int64_t> charged{0};     // bytes reserved in `budget`, given back on destruction
  std::shared_ptr<Counters> counters;  // the store's

  std::string name;    // "tensor/index", for messages
  std::string tensor;  // the key: tensor (or table) name and index (0 for a table)
  uint32_t index = 0;
  bool sparse = false;
  int64_t num_elements = 0;  // dense
  uint32_t dim = 0;          // sparse
  v1::Initializer initializer;
  std::string table_decl;  // serialized SparseTableDecl, to check redeclarations
  kernels::OptimizerParams params;
  int num_slots = 0;

  // Written under mu; read without it by parked pulls.
  std::atomic<int64_t> version{0};
  WorkerClocks clocks;  // sized at creation, steps completed per worker

  mutable absl::Mutex mu;
  std::vector<Seq> last_applied ABSL_GUARDED_BY(mu);  // per worker
  // BSP staging of step == version: which workers pushed, which of those were skipped.
  std::vector<uint8_t> contributed ABSL_GUARDED_BY(mu);
  std::vector<uint8_t> skipped ABSL_GUARDED_BY(mu);
  uint32_t contributors ABSL_GUARDED_BY(mu) = 0;
  // Dense. Only mu guards the handle: answers and checkpoints take a reference under the reader
  // lock, and every write goes through MutableWeightsLocked (copy-on-write).
  SharedWeights weights ABSL_GUARDED_BY(mu);
  std::vector<std::vector<float>> slots ABSL_GUARDED_BY(mu);
  std::vector<std::vector<float>> staged ABSL_GUARDED_BY(mu);  // per worker
  // Sparse.
  absl::flat_hash_map<int64_t, Row> rows ABSL_GUARDED_BY(mu);
  std::vector<SparseGrad> staged_rows ABSL_GUARDED_BY(mu);     // per worker
  std::vector<int64_t> staged_rows_bytes ABSL_GUARDED_BY(mu);  // per worker, reserved for it
  // Checkpoints: the next step this partition must be captured at (INT64_MAX: none), and BSP's
  // exactly-once table as it was at the current step boundary (copied when the step's first
  // push is staged, so a capture registered mid-step still gets the boundary's table).
  int64_t next_capture ABSL_GUARDED_BY(mu) = std::numeric_limits<int64_t>::max();
  std::vector<Seq> boundary_seqs ABSL_GUARDED_BY(mu);

  Row& RowLocked(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto [it, inserted] = rows.try_emplace(id);
    if (inserted) {
      // The push that creates rows checked that they fit (ParameterStore::PushToJob).
      budget->ForceReserve(RowBytes());
      charged.fetch_add(RowBytes(), std::memory_order_relaxed);
      it->second.values.resize(static_cast<size_t>(dim) * (1 + num_slots));
      InitRow(initializer, id, it->second.values.data(), dim);
      for (int s = 0; s < num_slots; ++s) {
        float* slot = it->second.values.data() + static_cast<size_t>(dim) * (1 + s);
        std::fill(slot, slot + dim, kernels::SlotInitialValue(params, s));
      }
    }
    return it->second;
  }

  // The dense weights to write in place. When an answer or a checkpoint still holds a reference
  // to them, they are copied first and the partition keeps the copy (the holders keep the old
  // values). unique() is an acquire load of the count that every holder decrements with release
  // once done reading, so seeing 1 orders the writes that follow after those reads; no reference
  // can appear meanwhile, since new ones are taken only under mu (held exclusively here) or from
  // the partition's own handle.
  float* MutableWeightsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!weights.unique()) {
      weights = SharedWeights(std::vector<float>(weights.data(), weights.data() + weights.size()));
      counters->weight_copies_on_write.fetch_add(1, std::memory_order_relaxed);
    }
    return weights.mutable_data();
  }

  // Applies a dense gradient to values [begin, begin + count) in place (count < 0: all, from
  // 0); g holds the gradient of those values. The caller bumps the version once per update. The
  // optimizers are elementwise, so applying one gradient block by block gives the same weights.
  // G is float (aligned values) or char (fp32 bytes at any alignment, read in place by
  // kernels::ApplyUpdateCpuUnaligned).
  template <typename G>
  void ApplyDenseLocked(const v1::JobConfig& config, int64_t step, float scale, const G* g,
                        int64_t begin = 0, int64_t count = -1) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    static_assert(std::is_same_v<G, float> || std::is_same_v<G, char>);
    const int64_t v = version.load(std::memory_order_relaxed);
    const float lr = kernels::ScheduledLearningRate(config.schedule(), params.learning_rate, step);
    float* slot_ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
    for (int s = 0; s < num_slots; ++s) slot_ptrs[s] = slots[s].data() + begin;
    float* const w = MutableWeightsLocked() + begin;
    const int64_t n = count < 0 ? num_elements : count;
    if constexpr (std::is_same_v<G, float>) {
      kernels::ApplyUpdateCpu(params, lr, v + 1, scale, g, w, slot_ptrs, n);
    } else {
      kernels::ApplyUpdateCpuUnaligned(params, lr, v + 1, scale, g, w, slot_ptrs, n);
    }
  }

  void ApplySparseLocked(const v1::JobConfig& config, int64_t step, float scale,
                         const SparseGrad& grad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const float lr = kernels::ScheduledLearningRate(config.schedule(), params.learning_rate, step);
    for (size_t i = 0; i < grad.ids.size(); ++i) {
      Row& row = RowLocked(grad.ids[i]);
      float* slot_ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
      for (int s = 0; s < num_slots; ++s) {
        slot_ptrs[s] = row.values.data() + static_cast<size_t>(dim) * (1 + s);
      }
      ++row.updates;
      kernels::ApplyUpdateCpu(params, lr, row.updates, scale, grad.values.data() + i * dim,
                              row.values.data(), slot_ptrs, dim);
    }
  }

  // Copies the weights (dense) or rows `row_ids` (sparse) into `slice`; the data goes into
  // slice->mutable_data(), reusing its capacity.
  void ReadInto(const std::vector<int64_t>& row_ids, v1::Encoding encoding, v1::Slice* slice) const
      ABSL_SHARED_LOCKS_REQUIRED(mu) {
    slice->set_encoding(encoding == v1::ENCODING_UNSPECIFIED ? v1::ENCODING_FP32 : encoding);
    slice->set_version(version.load(std::memory_order_relaxed));
    if (!sparse) {
      if (BytesPerValue(encoding) == 4) {
        // One copy, without the zero fill of a resize.
        slice->mutable_data()->assign(weights.bytes().data(), weights.bytes().size());
      } else {
        EncodeValues(encoding, weights.data(), weights.size(), slice->mutable_data());
      }
      return;
    }
    std::vector<float> out(row_ids.size() * dim);
    for (size_t i = 0; i < row_ids.size(); ++i) {
      auto it = rows.find(row_ids[i]);
      if (it != rows.end()) {
        std::copy_n(it->second.values.data(), dim, out.data() + i * dim);
      } else {
        InitRow(initializer, row_ids[i], out.data() + i * dim, dim);
      }
    }
    for (int64_t id : row_ids) slice->add_row_ids(id);
    EncodeValues(encoding, out.data(), out.size(), slice->mutable_data());
  }
};

struct ParameterStore::Job : std::enable_shared_from_this<ParameterStore::Job> {
  Job(std::string job_id, const v1::JobConfig& cfg, absl::StatusOr<kernels::OptimizerParams> p,
      std::shared_ptr<MemoryBudget> b, int64_t bytes, std::shared_ptr<Counters> c)
      : id(std::move(job_id)),
        config(cfg),
        dense_params(std::move(p)),
        gate(cfg.consistency(), cfg.staleness(), cfg.num_workers()),
        budget(std::move(b)),
        charged(bytes),
        counters(std::move(c)) {}
  ~Job() { budget->Release(charged); }

  // Bytes of a job without partitions: this struct, its id and the gate's per-worker state.
  static int64_t FixedBytes(uint32_t workers, size_t id_size) {
    return static_cast<int64_t>(sizeof(Job) + id_size) + int64_t{workers} * 10;
  }

  const std::string id;
  const v1::JobConfig config;
  // The job's optimizer for dense partitions, or why it cannot update them (FTRL).
  const absl::StatusOr<kernels::OptimizerParams> dense_params;
  ConsistencyGate gate;
  const std::shared_ptr<MemoryBudget> budget;
  const int64_t charged;
  // The store's shard-wide counters.
  const std::shared_ptr<Counters> counters;

  mutable absl::Mutex mu;
  absl::flat_hash_map<std::pair<std::string, uint32_t>, std::shared_ptr<Partition>> dense
      ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::shared_ptr<Partition>> tables ABSL_GUARDED_BY(mu);

  std::atomic<int64_t> duplicates{0};
  std::atomic<int64_t> skipped_non_finite{0};
  std::atomic<int64_t> updates_applied{0};

  // Pushes of an incarnation below this are refused (set by Restore).
  std::atomic<uint64_t> min_incarnation{0};
  // Partitions and tables held (dense.size() + tables.size()), read without mu by captures.
  std::atomic<size_t> num_partitions{0};
  // Serializes UpdateMembership so that the gate and membership_log change in the same order.
  absl::Mutex membership_mu;
  // The membership changes applied to the gate, with the gate's own truncation (an entry replaces
  // those at or after its step), so replaying them on a fresh gate gives the same history.
  mutable absl::Mutex log_mu;
  std::vector<v1::CheckpointMembership> membership_log ABSL_GUARDED_BY(log_mu);
  // Captures by step: pending, being written, and the few newest written ones.
  absl::Mutex ckpt_mu;
  std::map<int64_t, std::shared_ptr<Capture>> captures ABSL_GUARDED_BY(ckpt_mu);
  // Set when the job is dropped or replaced: later captures are refused.
  bool retired ABSL_GUARDED_BY(ckpt_mu) = false;
  // Set by DropJob: captures of the job still queued for the writer are not written.
  bool dropped ABSL_GUARDED_BY(ckpt_mu) = false;
  // The largest step a Checkpoint call named (0: none). Automatic files above it were never asked
  // for, so none of them can be committed; the writer keeps only the newest few of them.
  int64_t max_requested_step ABSL_GUARDED_BY(ckpt_mu) = 0;
  // Automatic steps this job wrote that no Checkpoint call named (all > max_requested_step).
  std::set<int64_t> unrequested_files ABSL_GUARDED_BY(ckpt_mu);

  bool bsp() const { return gate.mode() == v1::CONSISTENCY_BSP; }

  // The partition or table named by `key`, or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Partition>> Find(const SliceView& key) const {
    const std::pair<std::string, uint32_t> name(std::string(key.tensor), key.index);
    absl::ReaderMutexLock lock(&mu);
    auto it = dense.find(name);
    if (it != dense.end()) return it->second;
    if (key.index == 0) {
      auto t = tables.find(name.first);
      if (t != tables.end()) return t->second;
    }
    return absl::NotFoundError(
        absl::StrCat("job '", id, "': unknown key ", KeyName(key), " on this shard"));
  }

  // BSP: when every worker live at the staged step has pushed, applies sum / contributors once
  // (sum in ascending worker order) and moves to the next step. Returns true when it applied.
  bool CompleteBspStepLocked(Partition& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu) {
    if (p.contributors == 0) return false;
    const int64_t step = p.version.load(std::memory_order_relaxed);
    const std::vector<bool> live = gate.LiveSet(step);
    for (size_t w = 0; w < live.size(); ++w) {
      if (live[w] && !p.contributed[w]) return false;
    }
    const float scale = 1.0f / static_cast<float>(p.contributors);
    if (!p.sparse) {
      std::vector<float>* sum = nullptr;
      for (size_t w = 0; w < p.contributed.size(); ++w) {
        if (!p.contributed[w] || p.skipped[w]) continue;
        if (sum == nullptr) {
          sum = &p.staged[w];
          continue;
        }
        const float* __restrict__ src = p.staged[w].data();
        float* __restrict__ dst = sum->data();
        for (int64_t i = 0; i < p.num_elements; ++i) dst[i] += src[i];
      }
      if (sum != nullptr) {
        p.ApplyDenseLocked(config, step, scale, sum->data());
        updates_applied.fetch_add(1, std::memory_order_relaxed);
        counters->updates_applied.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      SparseGrad merged;
      absl::flat_hash_map<int64_t, size_t> index;
      for (size_t w = 0; w < p.contributed.size(); ++w) {
        if (!p.contributed[w] || p.skipped[w]) continue;
        const SparseGrad& g = p.staged_rows[w];
        for (size_t i = 0; i < g.ids.size(); ++i) {
          auto [it, inserted] = index.try_emplace(g.ids[i], merged.ids.size());
          const float* src = g.values.data() + i * p.dim;
          if (inserted) {
            merged.ids.push_back(g.ids[i]);
            merged.values.insert(merged.values.end(), src, src + p.dim);
          } else {
            float* dst = merged.values.data() + it->second * p.dim;
            for (uint32_t j = 0; j < p.dim; ++j) dst[j] += src[j];
          }
        }
        p.staged_rows[w] = SparseGrad();
        p.budget->Release(p.staged_rows_bytes[w]);
        p.charged.fetch_sub(p.staged_rows_bytes[w], std::memory_order_relaxed);
        p.staged_rows_bytes[w] = 0;
      }
      if (!merged.ids.empty()) {
        p.ApplySparseLocked(config, step, scale, merged);
        updates_applied.fetch_add(1, std::memory_order_relaxed);
        counters->updates_applied.fetch_add(1, std::memory_order_relaxed);
      }
    }
    std::fill(p.contributed.begin(), p.contributed.end(), 0);
    std::fill(p.skipped.begin(), p.skipped.end(), 0);
    p.contributors = 0;
    p.version.store(step + 1, std::memory_order_release);
    return true;
  }

  std::vector<std::shared_ptr<Partition>> AllPartitions() const {
    absl::ReaderMutexLock lock(&mu);
    std::vector<std::shared_ptr<Partition>> out;
    out.reserve(dense.size() + tables.size());
    for (const auto& [k, p] : dense) out.push_back(p);
    for (const auto& [k, p] : tables) out.push_back(p);
    return out;
  }
};

// One key of a pull with the step its gate opens at (-1: no gating).
struct ParameterStore::PullItem {
  std::shared_ptr<Partition> partition;
  v1::PartitionKey key;
  std::vector<int64_t> row_ids;
  int64_t gate_step = -1;
};

ParameterStore::ParameterStore(ParameterStoreOptions options)
    : options_(std::move(options)),
      budget_(std::make_shared<MemoryBudget>(
          options_.max_memory_bytes > 0 ? options_.max_memory_bytes : DefaultMemoryLimit())),
      counters_(std::make_shared<Counters>()) {
  if (!options_.checkpoint_dir.empty()) {
    writer_ = std::thread([this] { WriterLoop(); });
  } else {
    absl::MutexLock lock(&writer_mu_);
    writer_joined_ = true;
  }
}

ParameterStore::~ParameterStore() {
  CloseAll(absl::CancelledError("the parameter store is shutting down"));
  if (writer_.joinable()) {
    {
      absl::MutexLock lock(&writer_mu_);
      writer_stop_ = true;
    }
    writer_.join();
  }
  // Tasks queued after the writer's last look at its queue: answered (cancelled) here, with no
  // lock held.
  std::deque<std::function<void(bool)>> left;
  {
    absl::MutexLock lock(&writer_mu_);
    writer_joined_ = true;
    left.swap(writer_queue_);
  }
  for (std::function<void(bool)>& task : left) task(/*cancelled=*/true);
}

absl::StatusOr<std::shared_ptr<ParameterStore::Job>> ParameterStore::FindJob(
    absl::string_view job_id) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job_id: unknown job '", job_id, "' on this shard"));
  }
  return it->second;
}

namespace {

// The checks of CreateJobState (and of a restored checkpoint) before any state is touched; fills
// the job's dense optimizer (or why it has none) and each table's optimizer.
absl::Status ValidateJobRequest(const v1::CreateJobStateRequest& request,
                                absl::StatusOr<kernels::OptimizerParams>* dense_params_out,
                                std::vector<kernels::OptimizerParams>* table_params_out) {
  TESSERA_RETURN_IF_ERROR(ValidateJobId(request.job_id()));
  const v1::JobConfig& config = request.config();
  if (config.num_workers() < 1 || config.num_workers() > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat("config.num_workers: must be in [1, ",
                                                   kMaxWorkers, "], got ", config.num_workers()));
  }
  if (!v1::Consistency_IsValid(config.consistency())) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.consistency: unknown value ", static_cast<int>(config.consistency())));
  }
  if (config.consistency() != v1::CONSISTENCY_SSP && config.staleness() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.staleness: only SSP has a staleness bound, got ", config.staleness(),
                     " for ", v1::Consistency_Name(config.consistency())));
  }
  if (!v1::NonFinitePolicy_IsValid(config.non_finite_policy())) {
    return absl::InvalidArgumentError(absl::StrCat("config.non_finite_policy: unknown value ",
                                                   static_cast<int>(config.non_finite_policy())));
  }
  absl::StatusOr<kernels::OptimizerParams> dense_params =
      kernels::MakeOptimizerParams(config.optimizer(), /*sparse=*/false);
  if (!dense_params.ok()) {
    // A job whose optimizer only updates sparse rows (FTRL) may still hold tables.
    absl::StatusOr<kernels::OptimizerParams> sparse_params =
        kernels::MakeOptimizerParams(config.optimizer(), /*sparse=*/true);
    if (!sparse_params.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("config.", dense_params.status().message()));
    }
  }
  absl::Status schedule = kernels::ValidateSchedule(config.schedule());
  if (!schedule.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config.", schedule.message()));
  }

  // Validate every declaration before touching any state.
  absl::flat_hash_set<std::pair<std::string, uint32_t>> declared;
  for (int i = 0; i < request.partitions_size(); ++i) {
    const v1::DensePartitionDecl& d = request.partitions(i);
    const std::string field = absl::StrCat("partitions[", i, "]");
    if (d.key().tensor().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".key.tensor: must not be empty"));
    }
    if (d.num_elements() < 1 || d.num_elements() > kMaxPartitionElements) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".num_elements (key ", KeyName(d.key()),
                                                     "): must be in [1, ", kMaxPartitionElements,
                                                     "], got ", d.num_elements()));
    }
    if (!d.initial_values().empty() &&
        d.initial_values().size() != static_cast<size_t>(d.num_elements()) * 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".initial_values (key ", KeyName(d.key()), "): expected ", d.num_elements() * 4,
          " bytes (", d.num_elements(), " fp32 values) or none, got ", d.initial_values().size()));
    }
    if (HasNonFinite(v1::ENCODING_FP32, d.initial_values())) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".initial_values (key ", KeyName(d.key()), "): holds NaN or Inf"));
    }
    if (!declared.emplace(d.key().tensor(), d.key().index()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".key: ", KeyName(d.key()), " is declared twice in one request"));
    }
    if (!dense_params.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " (key ", KeyName(d.key()), "): config.optimizer.kind ",
          v1::OptimizerKind_Name(config.optimizer().kind()), " cannot update dense partitions"));
    }
  }
  std::vector<kernels::OptimizerParams> table_params;
  for (int i = 0; i < request.tables_size(); ++i) {
    const v1::SparseTableDecl& t = request.tables(i);
    const std::string field = absl::StrCat("tables[", i, "]");
    if (t.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".name: must not be empty"));
    }
    if (!declared.emplace(t.name(), 0u).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".name: ", t.name(), " is declared twice in one request (or also as ",
                       t.name(), "/0)"));
    }
    if (t.dim() < 1 || t.dim() > kMaxSparseDim) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".dim (table ", t.name(),
                                                     "): must be in [1, ", kMaxSparseDim, "], got ",
                                                     t.dim()));
    }
    const v1::Initializer& init = t.initializer();
    if (!v1::Initializer::Kind_IsValid(init.kind()) || !std::isfinite(init.value()) ||
        !std::isfinite(init.scale()) || init.scale() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".initializer (table ", t.name(), "): needs a known kind and finite value and ",
          "scale >= 0, got kind ", static_cast<int>(init.kind()), " value ", init.value(),
          " scale ", init.scale()));
    }
    const v1::OptimizerConfig& opt = t.has_optimizer() ? t.optimizer() : config.optimizer();
    absl::StatusOr<kernels::OptimizerParams> params = kernels::MakeOptimizerParams(opt, true);
    const v1::OptimizerKind kind = opt.kind();
    if (params.ok() && kind != v1::OPTIMIZER_KIND_SGD && kind != v1::OPTIMIZER_KIND_ADAGRAD &&
        kind != v1::OPTIMIZER_KIND_ADAM && kind != v1::OPTIMIZER_KIND_FTRL) {
      params = absl::InvalidArgumentError(absl::StrCat("optimizer.kind: sparse tables take SGD, ",
                                                       "ADAGRAD, ADAM or FTRL, got ",
                                                       v1::OptimizerKind_Name(kind)));
    }
    if (!params.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, t.has_optimizer() ? "." : " (job optimizer, no override): ",
                       params.status().message(), " (table ", t.name(), ")"));
    }
    table_params.push_back(*params);
  }
  if (config.checkpoint_every_steps() < 0 || config.checkpoint_every_steps() > kMaxStep) {
    return absl::InvalidArgumentError(absl::StrCat("config.checkpoint_every_steps: must be in [0, ",
                                                   kMaxStep, "], got ",
                                                   config.checkpoint_every_steps()));
  }
  *dense_params_out = std::move(dense_params);
  *table_params_out = std::move(table_params);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::CreateJobStateResponse> ParameterStore::CreateJobState(
    const v1::CreateJobStateRequest& request) {
  const v1::JobConfig& config = request.config();
  absl::StatusOr<kernels::OptimizerParams> dense_params = absl::UnknownError("unset");
  std::vector<kernels::OptimizerParams> table_params;
  TESSERA_RETURN_IF_ERROR(ValidateJobRequest(request, &dense_params, &table_params));

  std::shared_ptr<Job> job;
  bool created = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it == jobs_.end()) {
      const int64_t bytes = Job::FixedBytes(config.num_workers(), request.job_id().size());
      if (!budget_->TryReserve(bytes)) {
        return budget_->Exhausted(absl::StrCat("job '", request.job_id(), "'"), bytes);
      }
      job =
          std::make_shared<Job>(request.job_id(), config, dense_params, budget_, bytes, counters_);
      if (!closed_.ok()) job->gate.Close(closed_);
      jobs_.emplace(request.job_id(), job);
      created = true;
    } else {
      job = it->second;
      if (!google::protobuf::util::MessageDifferencer::Equals(job->config, config)) {
        return absl::FailedPreconditionError(
            absl::StrCat("config: job '", request.job_id(),
                         "' already exists on this shard with a different config"));
      }
    }
  }

  absl::StatusOr<v1::CreateJobStateResponse> added = AddToJob(*job, request, table_params);
  if (!added.ok() && created) {
    // All or nothing: forget the job this call created, unless another call added to it since.
    std::shared_ptr<Job> forget;
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it != jobs_.end() && it->second == job && job->AllPartitions().empty()) {
      forget = std::move(it->second);
      jobs_.erase(it);
    }
  }
  return added;
}

absl::StatusOr<v1::CreateJobStateResponse> ParameterStore::AddToJob(
    Job& job, const v1::CreateJobStateRequest& request,
    const std::vector<kernels::OptimizerParams>& table_params) {
  // Redeclarations must match what exists, so that the call stays all or nothing.
  auto check_locked = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu) -> absl::Status {
    for (int i = 0; i < request.partitions_size(); ++i) {
      const v1::DensePartitionDecl& d = request.partitions(i);
      auto it = job.dense.find(std::make_pair(d.key().tensor(), d.key().index()));
      if (it != job.dense.end() && it->second->num_elements != d.num_elements()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "partitions[", i, "]: key ", KeyName(d.key()), " already exists with ",
            it->second->num_elements, " elements, redeclared with ", d.num_elements()));
      }
      if (d.key().index() == 0 && job.tables.contains(d.key().tensor())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "partitions[", i, "]: key ", KeyName(d.key()), " is already a sparse table"));
      }
    }
    for (int i = 0; i < request.tables_size(); ++i) {
      const v1::SparseTableDecl& t = request.tables(i);
      auto it = job.tables.find(t.name());
      if (it != job.tables.end() && it->second->table_decl != t.SerializeAsString()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tables[", i, "]: table ", t.name(), " already exists with dim ", it->second->dim,
            " and another declaration (redeclared with dim ", t.dim(), ")"));
      }
      if (job.dense.contains(std::make_pair(t.name(), 0u))) {
        return absl::FailedPreconditionError(
            absl::StrCat("tables[", i, "]: ", t.name(), " is already a dense tensor"));
      }
    }
    return absl::OkStatus();
  };
  const uint32_t workers = request.config().num_workers();
  const int dense_slots = job.dense_params.ok() ? kernels::NumSlots(job.dense_params->kind) : 0;
  auto dense_bytes = [&](const v1::DensePartitionDecl& d) {
    return Partition::FixedBytes(workers, KeyName(d.key()).size()) +
           d.num_elements() * 4 * (1 + dense_slots);
  };
  auto table_bytes = [&](const v1::SparseTableDecl& t) {
    return Partition::FixedBytes(workers, t.name().size() + 2) +
           static_cast<int64_t>(t.ByteSizeLong());
  };

  // 1. Under the job's lock: check, pick what is new and reserve its bytes.
  std::vector<int> new_dense;
  std::vector<int> new_tables;
  {
    absl::MutexLock lock(&job.mu);
    TESSERA_RETURN_IF_ERROR(check_locked());
    int64_t bytes = 0;
    for (int i = 0; i < request.partitions_size(); ++i) {
      const v1::DensePartitionDecl& d = request.partitions(i);
      if (job.dense.contains(std::make_pair(d.key().tensor(), d.key().index()))) continue;
      new_dense.push_back(i);
      bytes += dense_bytes(d);
    }
    for (int i = 0; i < request.tables_size(); ++i) {
      if (job.tables.contains(request.tables(i).name())) continue;
      new_tables.push_back(i);
      bytes += table_bytes(request.tables(i));
    }
    if (bytes > 0 && !budget_->TryReserve(bytes)) {
      return budget_->Exhausted(
          absl::StrCat("the partitions and tables of job '", job.id, "' declared here"), bytes);
    }
  }

  // 2. Without it: allocate and fill (up to gigabytes), while the job's pushes and pulls go on.
  // Each partition owns its share of the reservation and gives it back if it is not inserted.
  const int64_t next_capture = NextCaptureAfter(job, 0);
  std::vector<std::shared_ptr<Partition>> dense;
  for (int i : new_dense) {
    const v1::DensePartitionDecl& d = request.partitions(i);
    auto p = std::make_shared<Partition>();
    p->name = KeyName(d.key());
    p->tensor = d.key().tensor();
    p->index = d.key().index();
    p->budget = budget_;
    p->counters = counters_;
    p->charged = dense_bytes(d);
    p->num_elements = d.num_elements();
    p->params = *job.dense_params;
    p->num_slots = kernels::NumSlots(p->params.kind);
    p->clocks = WorkerClocks(workers);
    absl::MutexLock plock(&p->mu);
    p->last_applied.resize(workers);
    p->contributed.assign(workers, 0);
    p->skipped.assign(workers, 0);
    p->staged.resize(workers);
    p->next_capture = next_capture;
    p->weights = SharedWeights(std::vector<float>(static_cast<size_t>(d.num_elements()), 0.0f));
    if (!d.initial_values().empty()) {
      std::memcpy(p->MutableWeightsLocked(), d.initial_values().data(), d.initial_values().size());
    }
    for (int s = 0; s < p->num_slots; ++s) {
      p->slots.emplace_back(static_cast<size_t>(d.num_elements()),
                            kernels::SlotInitialValue(p->params, s));
    }
    dense.push_back(std::move(p));
  }
  std::vector<std::shared_ptr<Partition>> tables;
  for (int i : new_tables) {
    const v1::SparseTableDecl& t = request.tables(i);
    auto p = std::make_shared<Partition>();
    p->name = absl::StrCat(t.name(), "/0");
    p->tensor = t.name();
    p->budget = budget_;
    p->counters = counters_;
    p->charged = table_bytes(t);
    p->sparse = true;
    p->dim = t.dim();
    p->initializer = t.initializer();
    p->table_decl = t.SerializeAsString();
    p->params = table_params[i];
    p->num_slots = kernels::NumSlots(p->params.kind);
    p->clocks = WorkerClocks(workers);
    absl::MutexLock plock(&p->mu);
    p->last_applied.resize(workers);
    p->contributed.assign(workers, 0);
    p->skipped.assign(workers, 0);
    p->staged_rows.resize(workers);
    p->staged_rows_bytes.assign(workers, 0);
    p->next_capture = next_capture;
    tables.push_back(std::move(p));
  }

  // 3. Under the lock again: a concurrent call may have declared some of the keys meanwhile, so
  // check again; keys now present keep their partition (the new one is dropped).
  absl::MutexLock lock(&job.mu);
  TESSERA_RETURN_IF_ERROR(check_locked());
  for (size_t k = 0; k < new_dense.size(); ++k) {
    const v1::PartitionKey& key = request.partitions(new_dense[k]).key();
    job.dense.try_emplace(std::make_pair(key.tensor(), key.index()), std::move(dense[k]));
  }
  for (size_t k = 0; k < new_tables.size(); ++k) {
    job.tables.try_emplace(request.tables(new_tables[k]).name(), std::move(tables[k]));
  }
  job.num_partitions.store(job.dense.size() + job.tables.size(), std::memory_order_release);
  v1::CreateJobStateResponse response;
  response.set_partitions(static_cast<uint32_t>(job.dense.size()));
  response.set_tables(static_cast<uint32_t>(job.tables.size()));
  return response;
}

absl::StatusOr<v1::UpdateMembershipResponse> ParameterStore::UpdateMembership(
    const v1::UpdateMembershipRequest& request) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  if (request.effective_step() > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("effective_step: must be <= ", kMaxStep, ", got ", request.effective_step()));
  }
  std::vector<uint32_t> live(request.live_workers().begin(), request.live_workers().end());
  {
    absl::MutexLock lock(&job->membership_mu);
    TESSERA_RETURN_IF_ERROR(job->gate.UpdateMembership(live, request.effective_step()));
    absl::MutexLock log_lock(&job->log_mu);
    std::vector<v1::CheckpointMembership>& log = job->membership_log;
    while (!log.empty() && log.back().effective_step() >= request.effective_step()) {
      log.pop_back();
    }
    v1::CheckpointMembership entry;
    entry.set_effective_step(request.effective_step());
    for (uint32_t w : live) entry.add_live_workers(w);
    log.push_back(std::move(entry));
  }
  // A BSP step that waited only for removed workers is complete now; an SSP/ASP partition whose
  // slowest live worker was removed may have reached a capture step.
  bool applied = false;
  int64_t completed = 0;
  const std::vector<bool> live_now = job->gate.LiveSet(kMaxStep);
  for (const std::shared_ptr<Partition>& p : job->AllPartitions()) {
    absl::MutexLock lock(&p->mu);
    if (job->bsp()) {
      if (job->CompleteBspStepLocked(*p)) {
        applied = true;
        MaybeCaptureLocked(*job, *p);
      }
      completed = std::max(completed, p->version.load(std::memory_order_relaxed));
    } else {
      MaybeCaptureLocked(*job, *p);
      for (size_t w = 0; w < live_now.size() && w < p->clocks.size(); ++w) {
        if (live_now[w]) completed = std::max(completed, p->clocks[w].load());
      }
    }
  }
  if (applied) job->gate.Notify();
  v1::UpdateMembershipResponse response;
  response.set_completed_steps(completed);
  return response;
}

absl::Status ParameterStore::CheckLive() const {
  return MutexResponds(&mu_, absl::Seconds(5), "the parameter store's lock");
}

absl::Status ParameterStore::DropJob(absl::string_view job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) {
      job = std::move(it->second);
      jobs_.erase(it);
      absl::MutexLock ckpt_lock(&job->ckpt_mu);
      job->dropped = true;  // its writes still queued are skipped
    }
    // Its checkpoint files go too, also for a job not in memory (this process started after the
    // job was created, and nobody restored it); a job id that is no file name has none. Queued
    // under mu_, so it runs after every write of this job and before any write of a job created
    // later under the same id.
    if (!options_.checkpoint_dir.empty() && ValidateJobId(job_id).ok()) {
      EnqueueWrite([this, dir = absl::StrCat(options_.checkpoint_dir, "/", job_id)](bool) {
        std::error_code error;
        if (std::filesystem::remove_all(dir, error) > 0 && !error) {
          SyncDirectory(options_.checkpoint_dir).IgnoreError();
        }
      });
    }
  }
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrCat("job_id: unknown job '", job_id, "' on this shard"));
  }
  job->gate.Close(absl::AbortedError(absl::StrCat("job '", job_id, "' was dropped")));
  RetireCaptures(*job, absl::AbortedError(absl::StrCat("job '", job_id, "' was dropped")));
  return absl::OkStatus();
}

absl::StatusOr<PushAck> ParameterStore::Push(const v1::PushPullRequest& request) {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return PushToJob(*job, ViewOf(request));
}

absl::StatusOr<PushAck> ParameterStore::PushToJob(Job& job, const PushPullView& request) {
  const uint32_t worker = request.worker_id;
  const int64_t step = request.step;
  if (worker >= job.gate.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("worker_id: ", worker,
                                                   " is out of range for job '", job.id,
                                                   "' (num_workers ", job.gate.num_workers(), ")"));
  }
  if (step < 0 || step > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: must be in [0, ", kMaxStep, "], got ", step));
  }
  PushAck ack;
  if (request.push.empty()) return ack;
  const uint64_t min_incarnation = job.min_incarnation.load(std::memory_order_acquire);
  if (request.incarnation < min_incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation: ", request.incarnation, " of worker ", worker, " is older than ",
        min_incarnation, ", the oldest job '", job.id, "' accepts since it was restored"));
  }
  if (!job.gate.IsLive(worker, step)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker_id: worker ", worker, " is not live in job '", job.id, "' at step ", step));
  }

  // 1. Resolve and check every slice without locks.
  struct Item {
    const SliceView* slice;
    std::shared_ptr<Partition> partition;
    bool skip = false;          // non-finite under NON_FINITE_POLICY_SKIP
    bool duplicate = false;     // seen (worker, incarnation, seq)
    bool record_seq = false;    // a duplicate whose (incarnation, seq) becomes the last applied
    int64_t staging_bytes = 0;  // BSP: what staging the gradient adds (reserved in step 2)
    size_t data_size = 0;
    int64_t ssp_slowest = 0;  // SSP: the slowest live clock at admission
  };
  std::vector<Item> items;
  items.reserve(request.push.size());
  absl::flat_hash_set<const Partition*> seen;
  const bool skip_policy = job.config.non_finite_policy() == v1::NON_FINITE_POLICY_SKIP;
  for (size_t i = 0; i < request.push.size(); ++i) {
    const SliceView& s = request.push[i];
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Partition> p, job.Find(s));
    const std::string key = KeyName(s);
    const size_t width = BytesPerValue(s.encoding);
    if (width == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "push[", i, "] key ", key, ": unknown encoding ", static_cast<int>(s.encoding)));
    }
    const size_t data_size = DataSize(s);
    size_t values = 0;
    if (!p->sparse) {
      if (!s.row_ids.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("push[", i, "] key ", key, ": row_ids (",
                                                       s.row_ids.size(),
                                                       ") given for a dense partition"));
      }
      values = static_cast<size_t>(p->num_elements);
    } else {
      if (s.row_ids.empty() && data_size != 0) {
        return absl::InvalidArgumentError(absl::StrCat("push[", i, "] key ", key,
                                                       ": row_ids missing for sparse table (",
                                                       data_size, " bytes of data)"));
      }
      values = s.row_ids.size() * p->dim;
    }
    if (data_size != values * width) {
      return absl::InvalidArgumentError(absl::StrCat(
          "push[", i, "] key ", key, ": expected ", values, " values (", values * width,
          " bytes of ", v1::Encoding_Name(s.encoding), ") but got ", data_size, " bytes"));
    }
    int64_t slowest = 0;
    if (job.gate.mode() == v1::CONSISTENCY_SSP) {
      // Clocks only grow, so this still holds when the push is applied.
      TESSERA_RETURN_IF_ERROR(job.gate.CheckSspPushStep(key, p->clocks, step, &slowest));
    }
    Item item{&s, std::move(p)};
    item.data_size = data_size;
    item.ssp_slowest = slowest;
    if (HasNonFinite(s)) {
      if (!skip_policy) {
        return absl::InvalidArgumentError(absl::StrCat(
            "push[", i, "] key ", key, ": gradient holds NaN or Inf (non_finite_policy REJECT)"));
      }
      item.skip = true;
    }
    if (!seen.insert(item.partition.get()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("push[", i, "] key ", key, ": key appears twice in one request"));
    }
    items.push_back(std::move(item));
  }

  // 2. Lock in address order, then check sequence numbers and steps.
  std::vector<Partition*> order;
  order.reserve(items.size());
  for (const Item& it : items) order.push_back(it.partition.get());
  std::sort(order.begin(), order.end());
  for (Partition* p : order) p->mu.Lock();
  auto unlock_all = [&order] {
    for (auto it = order.rbegin(); it != order.rend(); ++it) (*it)->mu.Unlock();
  };
  const uint64_t incarnation = request.incarnation;
  const uint64_t seq = request.seq;
  const bool bsp = job.bsp();
  for (Item& item : items) {
    Partition& p = *item.partition;
    p.mu.AssertHeld();
    const Partition::Seq& last = p.last_applied[worker];
    if (last.seen && incarnation < last.incarnation) {
      unlock_all();
      return absl::FailedPreconditionError(
          absl::StrCat("key ", p.name, ": worker ", worker, " incarnation ", incarnation,
                       " is older than incarnation ", last.incarnation, " already applied"));
    }
    if (last.seen && incarnation == last.incarnation && seq <= last.seq) {
      item.duplicate = true;
      continue;
    }
    if (!bsp) continue;
    const int64_t version = p.version.load(std::memory_order_relaxed);
    if (step > version) {
      unlock_all();
      return absl::InvalidArgumentError(absl::StrCat("key ", p.name, ": step ", step,
                                                     " is from the future (partition version ",
                                                     version, ", BSP accepts step ", version, ")"));
    }
    if (step < version) {
      unlock_all();
      return absl::FailedPreconditionError(absl::StrCat("key ", p.name, ": step ", step,
                                                        " was already applied (version ", version,
                                                        ") without worker ", worker));
    }
    if (p.contributed[worker]) {
      // Pushed by an earlier incarnation: this one's seq counts as applied, so that its retries
      // after the step completes are acknowledged too.
      item.duplicate = true;
      item.record_seq = true;
    }
  }
  // The state this push grows: BSP staging (a dense partition's buffer is kept for later steps,
  // sparse rows are given back when the step completes) is reserved here; new sparse rows (at
  // most one per row id) are checked to fit here and charged as they are created.
  int64_t staging = 0;
  int64_t rows = 0;
  const Partition* growing = nullptr;
  for (Item& item : items) {
    const Partition& p = *item.partition;
    p.mu.AssertHeld();
    if (item.duplicate || item.skip) continue;
    if (bsp && !p.sparse && p.staged[worker].empty()) {
      item.staging_bytes = p.num_elements * 4;
      staging += item.staging_bytes;
      if (growing == nullptr) growing = &p;
    }
    if (p.sparse && !item.slice->row_ids.empty()) {
      const int64_t num_rows = static_cast<int64_t>(item.slice->row_ids.size());
      rows += num_rows * p.RowBytes();
      if (bsp) {  // staged until the step completes
        item.staging_bytes = num_rows * (int64_t{p.dim} * 4 + 8);
        staging += item.staging_bytes;
      }
      if (growing == nullptr) growing = &p;
    }
  }
  if (staging + rows > 0) {
    if (!budget_->TryReserve(staging + rows)) {
      unlock_all();
      return budget_->Exhausted(absl::StrCat("a push of worker ", worker, " to key ", growing->name,
                                             " (job '", job.id, "')"),
                                staging + rows);
    }
    budget_->Release(rows);
    for (Item& item : items) {
      item.partition->charged.fetch_add(item.staging_bytes, std::memory_order_relaxed);
    }
  }

  // 3. Apply.
  bool version_changed = false;
  const bool ssp = job.gate.mode() == v1::CONSISTENCY_SSP;
  int64_t bytes_pushed = 0;
  const float scale = job.gate.mode() == v1::CONSISTENCY_SSP
                          ? 1.0f / static_cast<float>(job.gate.NumLive(step))
                          : 1.0f;
  std::vector<float> scratch;
  for (Item& item : items) {
    Partition& p = *item.partition;
    p.mu.AssertHeld();
    std::atomic<int64_t>& clock = p.clocks[worker];
    if (clock.load(std::memory_order_relaxed) < step + 1) {
      clock.store(step + 1, std::memory_order_release);
    }
    if (item.duplicate) {
      if (item.record_seq) p.last_applied[worker] = Partition::Seq{true, incarnation, seq};
      ++ack.duplicates;
      continue;
    }
    if (bsp && p.contributors == 0) p.boundary_seqs = p.last_applied;
    p.last_applied[worker] = Partition::Seq{true, incarnation, seq};
    // Only bytes applied or staged: a slice skipped for NaN/Inf counts in skipped_non_finite.
    if (item.skip) {
      ++ack.skipped_non_finite;
    } else {
      bytes_pushed += static_cast<int64_t>(item.data_size);
    }
    const SliceView& s = *item.slice;
    if (bsp) {
      p.contributed[worker] = 1;
      p.skipped[worker] = item.skip ? 1 : 0;
      ++p.contributors;
      if (!item.skip) {
        if (!p.sparse) {
          p.staged[worker].resize(static_cast<size_t>(p.num_elements));
          DecodeSlice(s, p.staged[worker].data(), p.staged[worker].size());
        } else {
          p.staged_rows[worker] = MergeRows(s, p.dim);
          p.staged_rows_bytes[worker] = item.staging_bytes;
        }
      }
      if (job.CompleteBspStepLocked(p)) {
        version_changed = true;
        MaybeCaptureLocked(job, p);
      }
      continue;
    }
    if (item.skip) continue;
    if (!p.sparse) {
      ForEachGradientRun(
          s, static_cast<size_t>(p.num_elements), &scratch,
          [&](const float* g, size_t begin, size_t count) {
            p.mu.AssertHeld();
            p.ApplyDenseLocked(job.config, step, scale, g, static_cast<int64_t>(begin),
                               static_cast<int64_t>(count));
          },
          [&](const char* g, size_t begin, size_t count) {
            p.mu.AssertHeld();
            p.ApplyDenseLocked(job.config, step, scale, g, static_cast<int64_t>(begin),
                               static_cast<int64_t>(count));
          });
    } else {
      if (s.row_ids.empty()) continue;
      p.ApplySparseLocked(job.config, step, scale, MergeRows(s, p.dim));
    }
    p.version.fetch_add(1, std::memory_order_release);
    job.updates_applied.fetch_add(1, std::memory_order_relaxed);
    job.counters->updates_applied.fetch_add(1, std::memory_order_relaxed);
    if (ssp) job.counters->ssp_staleness.Observe(std::max<int64_t>(0, step - item.ssp_slowest));
    version_changed = true;
  }
  if (!bsp) {
    // SSP/ASP: the clocks moved; a partition whose slowest live worker reached a capture step is
    // captured now, with this push applied.
    for (Item& item : items) {
      item.partition->mu.AssertHeld();
      MaybeCaptureLocked(job, *item.partition);
    }
  }
  unlock_all();

  // 4. Release the pulls that the new versions (BSP) or clocks (SSP) open.
  job.duplicates.fetch_add(ack.duplicates, std::memory_order_relaxed);
  job.skipped_non_finite.fetch_add(ack.skipped_non_finite, std::memory_order_relaxed);
  Counters& counters = *job.counters;
  if (bytes_pushed > 0) counters.bytes_pushed.fetch_add(bytes_pushed, std::memory_order_relaxed);
  if (ack.duplicates > 0) {
    counters.duplicates.fetch_add(ack.duplicates, std::memory_order_relaxed);
  }
  if (ack.skipped_non_finite > 0) {
    counters.skipped_non_finite.fetch_add(ack.skipped_non_finite, std::memory_order_relaxed);
  }
  if ((version_changed && bsp) || job.gate.mode() == v1::CONSISTENCY_SSP) job.gate.Notify();
  return ack;
}

absl::Status ParameterStore::ResolvePulls(const Job& job, const PushPullView& request,
                                          bool one_message, std::vector<PullItem>* items) const {
  const int64_t step = request.step;
  const size_t width = BytesPerValue(request.pull_encoding);
  const size_t limit = options_.max_message_bytes;
  size_t total = 0;
  absl::flat_hash_set<const Partition*> pulled;
  // A sparse push without rows (a BSP "nothing this step" contribution) may want weights: it
  // gets an empty slice back.
  auto add = [&](const SliceView& s, int64_t gate_step, absl::string_view field,
                 bool from_push) -> absl::Status {
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Partition> p, job.Find(s));
    if (!p->sparse && !s.row_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, " key ", KeyName(s), ": row_ids (",
                                                     s.row_ids.size(),
                                                     ") given for a dense partition"));
    }
    if (p->sparse && s.row_ids.empty() && !from_push) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " key ", KeyName(s), ": row_ids missing for sparse table"));
    }
    // A push key twice is refused by PushToJob before anything is read.
    if (!from_push && !pulled.insert(p.get()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " key ", KeyName(s), ": key appears twice in one request"));
    }
    // Check the size of the answer before anything is read or parked.
    const size_t values =
        p->sparse ? s.row_ids.size() * p->dim : static_cast<size_t>(p->num_elements);
    total += values * width;
    if (limit != 0 && values * width > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat(field, " key ", KeyName(s), ": the answer takes ", values * width,
                       " bytes, over the message limit of ", limit, " bytes; pull fewer rows"));
    }
    if (limit != 0 && one_message && total > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat(field, " key ", KeyName(s), ": the answer takes at least ", total,
                       " bytes, over the message limit of ", limit, " bytes; pull fewer keys"));
    }
    if (job.bsp() && gate_step >= 0) {
      const int64_t version = p->version.load(std::memory_order_acquire);
      if (gate_step > version + 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " key ", KeyName(s), ": pull for step ", gate_step,
                         " is from the future (partition version ", version, ")"));
      }
    }
    PullItem item;
    item.partition = std::move(p);
    item.key.set_tensor(std::string(s.tensor));
    item.key.set_index(s.index);
    item.row_ids.assign(s.row_ids.begin(), s.row_ids.end());
    item.gate_step = gate_step;
    items->push_back(std::move(item));
    return absl::OkStatus();
  };
  for (size_t i = 0; i < request.pull.size(); ++i) {
    TESSERA_RETURN_IF_ERROR(
        add(request.pull[i], step, absl::StrCat("pull[", i, "]"), /*from_push=*/false));
  }
  for (size_t i = 0; i < request.push.size(); ++i) {
    if (!request.push[i].want_weights) continue;
    // The rows of a sparse push are the rows wanted back.
    TESSERA_RETURN_IF_ERROR(
        add(request.push[i], step + 1, absl::StrCat("push[", i, "]"), /*from_push=*/true));
  }
  return absl::OkStatus();
}

void ParameterStore::AnswerWhenOpen(
    std::shared_ptr<Job> job, std::vector<PullItem> items, v1::Encoding encoding,
    std::shared_ptr<const std::atomic<bool>> cancelled,
    std::function<void(absl::StatusOr<std::vector<v1::Slice>>)> done,
    std::shared_ptr<PushPullAnswerSink> sink) {
  ConsistencyGate::Wait wait;
  wait.cancelled = std::move(cancelled);
  if (job->bsp()) {
    for (const PullItem& item : items) {
      if (item.gate_step < 0) continue;
      wait.versions.emplace_back(
          std::shared_ptr<const std::atomic<int64_t>>(item.partition, &item.partition->version),
          item.gate_step);
    }
  } else if (job->gate.mode() == v1::CONSISTENCY_SSP) {
    for (const PullItem& item : items) {
      if (item.gate_step < 0) continue;
      wait.clocks.emplace_back(
          std::shared_ptr<const WorkerClocks>(item.partition, &item.partition->clocks),
          item.gate_step);
    }
  }
  // The wait at the gate, for the metrics (a pull with nothing gated is not timed).
  StoreHistogram* wait_histogram = nullptr;
  if (!wait.versions.empty()) wait_histogram = &counters_->bsp_wait_ns;
  if (!wait.clocks.empty()) wait_histogram = &counters_->ssp_wait_ns;
  const auto parked_at = std::chrono::steady_clock::now();
  auto token = std::make_shared<char>();
  auto answer = [items = std::move(items), encoding, done = std::move(done), sink = std::move(sink),
                 counters = counters_, wait_histogram, parked_at](absl::Status status) {
    if (!status.ok()) {
      done(status);
      return;
    }
    if (wait_histogram != nullptr) {
      wait_histogram->Observe(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - parked_at)
                                  .count());
    }
    std::vector<v1::Slice> slices(items.size());
    int64_t bytes = 0;
    // Dense fp32 answers to a sink share the partition's weights instead of copying them.
    const bool share = sink != nullptr && BytesPerValue(encoding) == 4;
    for (size_t i = 0; i < items.size(); ++i) {
      const Partition& p = *items[i].partition;
      *slices[i].mutable_key() = items[i].key;
      if (share && !p.sparse) {
        SharedWeights weights;
        {
          absl::ReaderMutexLock lock(&p.mu);
          slices[i].set_encoding(v1::ENCODING_FP32);
          slices[i].set_version(p.version.load(std::memory_order_relaxed));
          weights = p.weights;
        }
        bytes += static_cast<int64_t>(weights.bytes().size());
        sink->shared.emplace_back(static_cast<int>(i), std::move(weights));
        continue;
      }
      if (sink != nullptr && sink->take_buffer) {
        std::string buffer = sink->take_buffer();
        buffer.clear();
        slices[i].mutable_data()->swap(buffer);
      }
      absl::ReaderMutexLock lock(&p.mu);
      p.ReadInto(items[i].row_ids, encoding, &slices[i]);
      bytes += static_cast<int64_t>(slices[i].data().size());
    }
    counters->bytes_pulled.fetch_add(bytes, std::memory_order_relaxed);
    done(std::move(slices));
  };
  wait.done = [this, token, answer = std::move(answer)](absl::Status status) mutable {
    if (inline_wait_token == token.get() || !options_.executor) {
      answer(std::move(status));
    } else {
      options_.executor(
          [answer = std::move(answer), status = std::move(status)]() mutable { answer(status); });
    }
  };
  inline_wait_token = token.get();
  job->gate.Park(std::move(wait));
  inline_wait_token = nullptr;
}

absl::StatusOr<std::shared_ptr<ParameterStore::Job>> ParameterStore::FindJobForCaller(
    absl::string_view job_id, uint32_t worker_id, v1::Encoding encoding,
    absl::string_view encoding_field) const {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  if (BytesPerValue(encoding) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(encoding_field, ": unknown encoding ", static_cast<int>(encoding)));
  }
  if (worker_id >= job->gate.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id: ", worker_id, " is out of range for job '", job_id,
                     "' (num_workers ", job->gate.num_workers(), ")"));
  }
  return job;
}

void ParameterStore::PushPull(const v1::PushPullRequest& request, PushPullDone done,
                              std::shared_ptr<const std::atomic<bool>> cancelled) {
  PushPull(ViewOf(request), std::move(done), std::move(cancelled));
}

void ParameterStore::PushPull(const PushPullView& request, PushPullDone done,
                              std::shared_ptr<const std::atomic<bool>> cancelled,
                              std::shared_ptr<PushPullAnswerSink> sink) {
  absl::StatusOr<std::shared_ptr<Job>> job =
      FindJobForCaller(request.job_id, request.worker_id, request.pull_encoding, "pull_encoding");
  if (!job.ok()) {
    done(job.status());
    return;
  }
  if (request.step < 0 || request.step > kMaxStep) {
    done(absl::InvalidArgumentError(
        absl::StrCat("step: must be in [0, ", kMaxStep, "], got ", request.step)));
    return;
  }
  std::vector<PullItem> items;
  absl::Status resolved = ResolvePulls(**job, request, /*one_message=*/true, &items);
  if (!resolved.ok()) {
    done(resolved);
    return;
  }
  absl::StatusOr<PushAck> ack = PushToJob(**job, request);
  if (!ack.ok()) {
    done(ack.status());
    return;
  }
  v1::PushPullResponse response;
  response.set_seq(request.seq);
  response.set_duplicates(ack->duplicates);
  response.set_skipped_non_finite(ack->skipped_non_finite);
  if (items.empty()) {
    done(std::move(response));
    return;
  }
  AnswerWhenOpen(
      *std::move(job), std::move(items), request.pull_encoding, std::move(cancelled),
      [response = std::move(response),
       done = std::move(done)](absl::StatusOr<std::vector<v1::Slice>> slices) mutable {
        if (!slices.ok()) {
          done(slices.status());
          return;
        }
        for (v1::Slice& s : *slices) response.add_weights()->Swap(&s);
        done(std::move(response));
      },
      std::move(sink));
}

void ParameterStore::Pull(const v1::PullRequest& request, PullDone done,
                          std::shared_ptr<const std::atomic<bool>> cancelled) {
  absl::StatusOr<std::shared_ptr<Job>> job =
      FindJobForCaller(request.job_id(), request.worker_id(), request.encoding(), "encoding");
  if (!job.ok()) {
    done(job.status());
    return;
  }
  if (request.step() > kMaxStep) {
    done(absl::InvalidArgumentError(
        absl::StrCat("step: must be <= ", kMaxStep, ", got ", request.step())));
    return;
  }
  // Reuse the PushPull resolution: the keys are pulls for request.step.
  PushPullView as_push_pull;
  as_push_pull.step = request.step() < 0 ? -1 : request.step();
  as_push_pull.pull_encoding = request.encoding();
  as_push_pull.pull.reserve(request.keys_size());
  for (const v1::Slice& k : request.keys()) {
    SliceView s;
    s.tensor = k.key().tensor();
    s.index = k.key().index();
    s.row_ids = absl::MakeConstSpan(k.row_ids().data(), k.row_ids().size());
    as_push_pull.pull.push_back(s);
  }
  std::vector<PullItem> items;
  absl::Status resolved = ResolvePulls(**job, as_push_pull, /*one_message=*/false, &items);
  if (!resolved.ok()) {
    done(resolved);
    return;
  }
  AnswerWhenOpen(*std::move(job), std::move(items), request.encoding(), std::move(cancelled),
                 std::move(done));
}

absl::StatusOr<JobStats> ParameterStore::GetJobStats(absl::string_view job_id) const {
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  JobStats stats;
  stats.duplicates = job->duplicates.load();
  stats.skipped_non_finite = job->skipped_non_finite.load();
  stats.updates_applied = job->updates_applied.load();
  stats.max_staleness_served = job->gate.MaxStalenessServed();
  stats.parked_pulls = job->gate.NumParked();
  return stats;
}

ShardStats ParameterStore::GetShardStats() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::ReaderMutexLock lock(&mu_);
    jobs.reserve(jobs_.size());
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  ShardStats stats;
  stats.jobs = static_cast<int64_t>(jobs.size());
  for (const std::shared_ptr<Job>& job : jobs) {
    stats.parked_pulls += static_cast<int64_t>(job->gate.NumParked());
  }
  const Counters& c = *counters_;
  stats.bytes_pushed = c.bytes_pushed.load(std::memory_order_relaxed);
  stats.bytes_pulled = c.bytes_pulled.load(std::memory_order_relaxed);
  stats.updates_applied = c.updates_applied.load(std::memory_order_relaxed);
  stats.duplicates = c.duplicates.load(std::memory_order_relaxed);
  stats.skipped_non_finite = c.skipped_non_finite.load(std::memory_order_relaxed);
  stats.weight_copies_on_write = c.weight_copies_on_write.load(std::memory_order_relaxed);
  stats.bsp_wait_ns = c.bsp_wait_ns.snapshot();
  stats.ssp_wait_ns = c.ssp_wait_ns.snapshot();
  stats.ssp_staleness = c.ssp_staleness.snapshot();
  return stats;
}

void ParameterStore::CloseAll(const absl::Status& status) {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.ok()) closed_ = status;
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (const std::shared_ptr<Job>& job : jobs) {
    job->gate.Close(status);
    // A Checkpoint call waiting for a step that will never come is answered now; files being
    // written are still answered by the writer.
    RetireCaptures(*job, status);
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints.

// One partition's state copied at its step boundary. The dense weights are a reference, not a
// copy (the partition copies them before its next update while this holds them; the capture is
// charged for them all the same, as the copy may then exist).
struct ParameterStore::PartitionSnapshot {
  v1::PartitionCheckpoint meta;  // everything but the ranges, filled when the file is laid out
  SharedWeights weights;
  std::vector<std::vector<float>> slots;
  std::vector<int64_t> row_ids;
  std::vector<int64_t> row_updates;
  std::vector<float> row_values;
};

// A Checkpoint call waiting for its capture; `cancelled` (optional) is set once nobody wants the
// answer (the RPC was cancelled), and such a waiter is answered CANCELLED and dropped.
struct ParameterStore::CheckpointWaiter {
  CheckpointDone done;
  std::shared_ptr<const std::atomic<bool>> cancelled;

  bool is_cancelled() const {
    return cancelled != nullptr && cancelled->load(std::memory_order_acquire);
  }
  void operator()(absl::StatusOr<v1::CheckpointResponse> result) const { done(std::move(result)); }
};

struct ParameterStore::Capture {
  enum class State { kCapturing, kWriting, kDone };

  explicit Capture(int64_t s, std::shared_ptr<MemoryBudget> b) : step(s), budget(std::move(b)) {}
  ~Capture() { ReleaseMemory(); }
  void ReleaseMemory() {
    budget->Release(charged);
    charged = 0;
    snapshots.clear();
    snapshots.shrink_to_fit();
  }

  const int64_t step;
  const std::shared_ptr<MemoryBudget> budget;
  State state = State::kCapturing;
  absl::Status status;  // the first error; a failed capture is answered with it
  int64_t retain_from_step = 0;
  // Created by a Checkpoint call for a step that is not automatic: it exists only for its waiters
  // and is dropped when the last one is cancelled. Only these count against kMaxPendingCaptures.
  bool registered = false;
  int64_t charged = 0;  // bytes of the copies, reserved in `budget`
  absl::flat_hash_set<const Partition*> captured;
  std::vector<PartitionSnapshot> snapshots;
  v1::CheckpointResponse response;
  std::vector<CheckpointWaiter> waiters;
};

namespace {

// Written captures kept in Job::captures to answer a repeated Checkpoint of the same step.
constexpr size_t kKeptWrittenCaptures = 8;
constexpr int64_t kNoCapture = std::numeric_limits<int64_t>::max();
// Checkpoint calls that may wait for steps not reached yet: distinct steps per job, and calls per
// step.
constexpr size_t kMaxPendingCaptures = 16;
constexpr size_t kMaxCheckpointWaiters = 64;
// How far ahead of the job's completed steps a Checkpoint call may name a step. 2^20 steps is
// days of training at any realistic rate (the coordinator asks a few seconds of steps ahead);
// anything further is a mistake or an attempt to hold a registration forever.
constexpr int64_t kMaxCheckpointStepsAhead = int64_t{1} << 20;
// Automatic checkpoint files of a job that no Checkpoint call named (so none can be committed:
// the coordinator commits only steps it asked every shard for) kept on disk; older ones are
// deleted. They pile up while the coordinator is away; 8 covers a restart of it many times over.
constexpr size_t kMaxUnrequestedCheckpointFiles = 8;

bool IsAutoStep(const v1::JobConfig& config, int64_t step) {
  return config.checkpoint_every_steps() > 0 && step > 0 &&
         step % config.checkpoint_every_steps() == 0;
}

}  // namespace

int64_t ParameterStore::NextCaptureAfter(Job& job, int64_t boundary) {
  if (options_.checkpoint_dir.empty()) return kNoCapture;
  int64_t next = kNoCapture;
  const int64_t every = job.config.checkpoint_every_steps();
  if (every > 0 && boundary < kMaxStep) next = (boundary / every + 1) * every;
  absl::MutexLock lock(&job.ckpt_mu);
  for (auto it = job.captures.upper_bound(boundary); it != job.captures.end(); ++it) {
    if (it->second->state == Capture::State::kCapturing && it->second->status.ok()) {
      next = std::min(next, it->first);
      break;
    }
  }
  return next;
}

void ParameterStore::MaybeCaptureLocked(Job& job, Partition& p) {
  while (p.next_capture != kNoCapture) {
    const int64_t step = p.next_capture;
    const bool reached = job.bsp() ? p.version.load(std::memory_order_relaxed) >= step
                                   : job.gate.SlowestClock(p.clocks, step) >= step;
    if (!reached) return;
    CaptureLocked(job, p, step);
    p.next_capture = NextCaptureAfter(job, step);
  }
}

void ParameterStore::CaptureLocked(Job& job, Partition& p, int64_t step) {
  const int slots = p.num_slots;
  int64_t bytes = static_cast<int64_t>(p.last_applied.size()) * 32;
  if (!p.sparse) {
    bytes += p.num_elements * 4 * (1 + slots);
  } else {
    bytes += static_cast<int64_t>(p.rows.size()) * (int64_t{p.dim} * 4 * (1 + slots) + 16);
  }
  std::shared_ptr<Capture> capture;
  std::vector<CheckpointWaiter> failed_waiters;
  absl::Status failed_status;
  {
    absl::MutexLock lock(&job.ckpt_mu);
    if (job.retired) return;
    auto it = job.captures.find(step);
    if (it == job.captures.end()) {
      if (!IsAutoStep(job.config, step)) return;  // a registration that failed meanwhile
      it = job.captures.emplace(step, std::make_shared<Capture>(step, budget_)).first;
    }
    capture = it->second;
    if (capture->state != Capture::State::kCapturing || !capture->status.ok() ||
        capture->captured.contains(&p)) {
      return;
    }
    if (!budget_->TryReserve(bytes)) {
      capture->status = budget_->Exhausted(absl::StrCat("the checkpoint of job '", job.id,
                                                        "' at step ", step, " (key ", p.name, ")"),
                                           bytes);
      capture->ReleaseMemory();
      // Nothing more is copied. The waiters are answered from the writer thread, after every lock
      // of this thread (p.mu, ckpt_mu) is released: EnqueueWrite never runs a task inline while
      // captures can happen.
      failed_waiters.swap(capture->waiters);
      failed_status = capture->status;
    } else {
      capture->charged += bytes;
    }
  }
  if (!failed_waiters.empty()) {
    EnqueueWrite([waiters = std::move(failed_waiters), failed_status](bool) {
      for (const CheckpointWaiter& w : waiters) w(failed_status);
    });
  }
  if (!failed_status.ok()) return;
  // Copy without ckpt_mu (only p.mu): the partition cannot change meanwhile.
  PartitionSnapshot snap;
  v1::PartitionCheckpoint& meta = snap.meta;
  meta.mutable_key()->set_tensor(p.tensor);
  meta.mutable_key()->set_index(p.index);
  meta.set_sparse(p.sparse);
  const int64_t version = p.version.load(std::memory_order_relaxed);
  meta.set_version(version);
  const bool bsp = job.bsp();
  for (size_t w = 0; w < p.clocks.size(); ++w) {
    const int64_t clock = p.clocks[w].load(std::memory_order_relaxed);
    // BSP: a worker that already staged its push of step S has clock S + 1; at the boundary
    // it had S.
    meta.add_clocks(bsp ? std::min(clock, version) : clock);
  }
  const std::vector<Partition::Seq>& seqs =
      bsp && p.contributors > 0 ? p.boundary_seqs : p.last_applied;
  for (size_t w = 0; w < seqs.size(); ++w) {
    if (!seqs[w].seen) continue;
    v1::CheckpointSeq* seq = meta.add_last_applied();
    seq->set_worker(static_cast<uint32_t>(w));
    seq->set_incarnation(seqs[w].incarnation);
    seq->set_seq(seqs[w].seq);
  }
  if (!p.sparse) {
    meta.set_num_elements(p.num_elements);
    snap.weights = p.weights;  // a reference (copy-on-write)
    snap.slots = p.slots;
  } else {
    if (!meta.mutable_table()->ParseFromString(p.table_decl)) {
      meta.mutable_table()->set_name(p.tensor);  // the declaration was serialized by us
    }
    snap.row_ids.reserve(p.rows.size());
    for (const auto& [id, row] : p.rows) snap.row_ids.push_back(id);
    std::sort(snap.row_ids.begin(), snap.row_ids.end());
    const size_t width = static_cast<size_t>(p.dim) * (1 + slots);
    snap.row_values.resize(snap.row_ids.size() * width);
    snap.row_updates.reserve(snap.row_ids.size());
    for (size_t i = 0; i < snap.row_ids.size(); ++i) {
      const Partition::Row& row = p.rows.find(snap.row_ids[i])->second;
      snap.row_updates.push_back(row.updates);
      std::copy_n(row.values.data(), width, snap.row_values.data() + i * width);
    }
    meta.set_num_rows(snap.row_ids.size());
  }

  std::shared_ptr<Job> job_ref;
  {
    absl::MutexLock lock(&job.ckpt_mu);
    if (job.retired || capture->state != Capture::State::kCapturing || !capture->status.ok()) {
      return;
    }
    capture->captured.insert(&p);
    capture->snapshots.push_back(std::move(snap));
    if (capture->captured.size() < job.num_partitions.load(std::memory_order_acquire)) return;
    capture->state = Capture::State::kWriting;
  }
  // The writer holds the job until the file is written (every Job is owned by a shared_ptr).
  job_ref = job.shared_from_this();
  EnqueueWrite([this, job_ref, capture](bool cancelled) {
    if (cancelled) {
      CancelCapture(*job_ref, *capture,
                    absl::CancelledError("the parameter store is shutting down"));
      return;
    }
    WriteCapture(job_ref, capture);
  });
}

void ParameterStore::EnqueueWrite(std::function<void(bool cancelled)> task) {
  {
    absl::MutexLock lock(&writer_mu_);
    if (!writer_joined_) {
      // Also while stopping: the writer runs every queued task before it exits, and the
      // destructor runs (cancelled) what came in after that. A task never runs inline here, so
      // callers may hold store locks.
      writer_queue_.push_back(std::move(task));
      return;
    }
  }
  // Only without a checkpoint_dir (no writer): nothing is ever captured then, and every caller
  // that gets here holds no lock.
  task(/*cancelled=*/true);
}

void ParameterStore::WriterLoop() {
  // Runs every queued task, also after the stop request, so every write is answered.
  for (;;) {
    std::function<void(bool)> task;
    {
      absl::MutexLock lock(&writer_mu_);
      writer_mu_.Await(absl::Condition(
          +[](ParameterStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->writer_mu_) {
            return s->writer_stop_ || !s->writer_queue_.empty();
          },
          this));
      if (writer_queue_.empty()) return;
      task = std::move(writer_queue_.front());
      writer_queue_.pop_front();
    }
    task(/*cancelled=*/false);
  }
}

void ParameterStore::WriteCapture(const std::shared_ptr<Job>& job,
                                  const std::shared_ptr<Capture>& capture) {
  bool dropped;
  {
    absl::MutexLock lock(&job->ckpt_mu);
    dropped = job->dropped;
  }
  if (dropped) {
    CancelCapture(*job, *capture,
                  absl::AbortedError(absl::StrCat("job '", job->id, "' was dropped")));
    return;
  }
  // The capture is kWriting: nothing else touches its snapshots.
  v1::CheckpointHeader header;
  header.set_format_version(1);
  header.set_job_id(job->id);
  header.set_step(capture->step);
  header.set_shard_index(options_.shard_index);
  header.set_time_unix_ms(absl::ToUnixMillis(absl::Now()));
  *header.mutable_config() = job->config;
  header.set_min_incarnation(job->min_incarnation.load(std::memory_order_acquire));
  {
    absl::MutexLock lock(&job->log_mu);
    for (const v1::CheckpointMembership& m : job->membership_log) *header.add_membership() = m;
  }
  std::vector<PartitionSnapshot>& snaps = capture->snapshots;
  std::sort(snaps.begin(), snaps.end(), [](const PartitionSnapshot& a, const PartitionSnapshot& b) {
    return std::make_pair(a.meta.key().tensor(), a.meta.key().index()) <
           std::make_pair(b.meta.key().tensor(), b.meta.key().index());
  });
  std::vector<absl::string_view> pieces;
  uint64_t offset = 0;
  auto add = [&](const void* data, size_t bytes, v1::CheckpointRange* range) {
    range->set_offset(offset);
    range->set_length(bytes);
    offset += bytes;
    if (bytes > 0) pieces.emplace_back(static_cast<const char*>(data), bytes);
  };
  for (PartitionSnapshot& snap : snaps) {
    v1::PartitionCheckpoint* meta = header.add_partitions();
    *meta = snap.meta;
    if (!snap.meta.sparse()) {
      add(snap.weights.data(), snap.weights.size() * 4, meta->mutable_weights());
      for (const std::vector<float>& slot : snap.slots) {
        add(slot.data(), slot.size() * 4, meta->add_slots());
      }
    } else {
      add(snap.row_ids.data(), snap.row_ids.size() * 8, meta->mutable_row_ids());
      add(snap.row_updates.data(), snap.row_updates.size() * 8, meta->mutable_row_updates());
      add(snap.row_values.data(), snap.row_values.size() * 4, meta->mutable_row_values());
    }
  }
  const std::string path =
      CheckpointPath(options_.checkpoint_dir, job->id, capture->step, options_.shard_index);
  absl::StatusOr<WrittenCheckpoint> written = absl::UnknownError("unset");
  absl::Status dirs = MakeDurableDirs(path.substr(0, path.rfind('/')));
  if (dirs.ok()) {
    written = WriteCheckpointFile(path, header, pieces);
  } else {
    written = dirs;
  }
  int64_t retain = 0;
  std::vector<CheckpointWaiter> waiters;
  absl::Status status;
  v1::CheckpointResponse response;
  {
    absl::MutexLock lock(&job->ckpt_mu);
    capture->ReleaseMemory();
    capture->state = Capture::State::kDone;
    if (written.ok()) {
      response.set_path(path);
      response.set_bytes(written->bytes);
      response.set_crc32c(written->crc32c);
      response.set_step(capture->step);
      capture->response = response;
    } else {
      capture->status = absl::Status(written.status().code(),
                                     absl::StrCat("checkpoint of job '", job->id, "' at step ",
                                                  capture->step, ": ", written.status().message()));
    }
    status = capture->status;
    retain = capture->retain_from_step;
    waiters.swap(capture->waiters);
    // Captures older than this one that are still incomplete can no longer complete; forget
    // them, and keep only the newest written ones.
    std::vector<CheckpointWaiter> superseded;
    absl::Status gone = absl::FailedPreconditionError(
        absl::StrCat("checkpoint of job '", job->id, "': the partitions passed this step without ",
                     "all of them being captured (step ", capture->step, " was written since)"));
    size_t done = 0;
    for (auto it = job->captures.end(); it != job->captures.begin();) {
      --it;
      Capture& c = *it->second;
      const bool stale = it->first < capture->step && c.state == Capture::State::kCapturing;
      if (c.state == Capture::State::kDone) ++done;
      if (stale || (c.state == Capture::State::kDone && done > kKeptWrittenCaptures)) {
        for (CheckpointWaiter& w : c.waiters) superseded.push_back(std::move(w));
        c.waiters.clear();
        it = job->captures.erase(it);
      }
    }
    for (CheckpointWaiter& w : superseded) {
      waiters.push_back(
          {[w = std::move(w), gone](absl::StatusOr<v1::CheckpointResponse>) { w(gone); }, nullptr});
    }
  }
  if (status.ok() && retain > 0) ApplyRetention(*job, retain);
  if (status.ok()) LimitUnrequestedFiles(*job, capture->step);
  for (const CheckpointWaiter& w : waiters) {
    if (status.ok()) {
      w(response);
    } else {
      w(status);
    }
  }
}

void ParameterStore::ApplyRetention(const Job& job, int64_t retain_from_step) {
  const std::string job_dir = absl::StrCat(options_.checkpoint_dir, "/", job.id);
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpointSteps(job_dir, options_.shard_index);
  if (!steps.ok()) return;
  bool removed = false;
  for (int64_t step : *steps) {
    if (step >= retain_from_step) break;
    const std::string path =
        CheckpointPath(options_.checkpoint_dir, job.id, step, options_.shard_index);
    if (::unlink(path.c_str()) == 0) removed = true;
    const std::string dir = path.substr(0, path.rfind('/'));
    ::unlink((path + ".tmp").c_str());
    ::rmdir(dir.c_str());  // only when no other shard's file is left in it
  }
  if (removed) SyncDirectory(job_dir).IgnoreError();
}

void ParameterStore::LimitUnrequestedFiles(Job& job, int64_t written_step) {
  std::vector<int64_t> remove;
  {
    absl::MutexLock lock(&job.ckpt_mu);
    std::set<int64_t>& files = job.unrequested_files;
    if (written_step > job.max_requested_step) files.insert(written_step);
    files.erase(files.begin(), files.upper_bound(job.max_requested_step));
    while (files.size() > kMaxUnrequestedCheckpointFiles) {
      const int64_t step = *files.begin();
      files.erase(files.begin());
      remove.push_back(step);
      // A later Checkpoint of this step must not be answered with the deleted file.
      auto it = job.captures.find(step);
      if (it != job.captures.end() && it->second->state == Capture::State::kDone) {
        job.captures.erase(it);
      }
    }
  }
  if (remove.empty()) return;
  for (int64_t step : remove) {
    const std::string path =
        CheckpointPath(options_.checkpoint_dir, job.id, step, options_.shard_index);
    ::unlink(path.c_str());
    ::rmdir(path.substr(0, path.rfind('/')).c_str());  // only when no other shard's file is left
  }
  SyncDirectory(absl::StrCat(options_.checkpoint_dir, "/", job.id)).IgnoreError();
}

void ParameterStore::CancelCapture(Job& job, Capture& capture, const absl::Status& status) {
  std::vector<CheckpointWaiter> waiters;
  {
    absl::MutexLock lock(&job.ckpt_mu);
    capture.ReleaseMemory();
    capture.state = Capture::State::kDone;
    capture.status = status;
    waiters.swap(capture.waiters);
  }
  for (const CheckpointWaiter& w : waiters) w(status);
}

void ParameterStore::RetireCaptures(Job& job, const absl::Status& status) {
  std::vector<CheckpointWaiter> waiters;
  {
    absl::MutexLock lock(&job.ckpt_mu);
    job.retired = true;
    for (auto& [step, capture] : job.captures) {
      if (capture->state != Capture::State::kCapturing) continue;
      for (CheckpointWaiter& w : capture->waiters) waiters.push_back(std::move(w));
      capture->waiters.clear();
      capture->ReleaseMemory();
    }
  }
  for (const CheckpointWaiter& w : waiters) w(status);
}

int64_t ParameterStore::CompletedSteps(Job& job,
                                       const std::vector<std::shared_ptr<Partition>>& partitions) {
  int64_t completed = 0;
  for (const std::shared_ptr<Partition>& p : partitions) {
    absl::MutexLock lock(&p->mu);
    if (job.bsp()) {
      completed = std::max(completed, p->version.load(std::memory_order_relaxed));
    } else {
      for (const auto& clock : p->clocks) {
        completed = std::max(completed, clock.load(std::memory_order_relaxed));
      }
    }
  }
  return completed;
}

size_t ParameterStore::PruneCancelledWaitersLocked(Job& job,
                                                   std::vector<CheckpointWaiter>* cancelled) {
  size_t pending = 0;
  const absl::Status gone = absl::CancelledError("the Checkpoint call was cancelled");
  for (auto it = job.captures.begin(); it != job.captures.end();) {
    Capture& c = *it->second;
    if (c.state != Capture::State::kCapturing) {
      ++it;
      continue;
    }
    auto keep = std::stable_partition(c.waiters.begin(), c.waiters.end(),
                                      [](const CheckpointWaiter& w) { return !w.is_cancelled(); });
    const bool had_cancelled = keep != c.waiters.end();
    for (auto w = keep; w != c.waiters.end(); ++w) cancelled->push_back(std::move(*w));
    c.waiters.erase(keep, c.waiters.end());
    if (c.registered && c.waiters.empty() && had_cancelled) {
      // Nobody wants this step any more: forget it (a CaptureLocked that holds it sees the status).
      c.status = gone;
      c.ReleaseMemory();
      it = job.captures.erase(it);
      continue;
    }
    if (c.registered || !c.waiters.empty()) ++pending;
    ++it;
  }
  return pending;
}

void ParameterStore::Checkpoint(const v1::CheckpointRequest& request, CheckpointDone done,
                                std::shared_ptr<const std::atomic<bool>> cancelled) {
  if (options_.checkpoint_dir.empty()) {
    done(absl::FailedPreconditionError(
        "checkpoints need a data directory: --data_dir not set on this shard"));
    return;
  }
  absl::Status valid = ValidateJobId(request.job_id());
  if (valid.ok() && (request.step() < 1 || request.step() > kMaxStep)) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("step: must be in [1, ", kMaxStep, "], got ", request.step()));
  }
  if (valid.ok() &&
      (request.retain_from_step() < 0 || request.retain_from_step() > request.step())) {
    valid = absl::InvalidArgumentError(absl::StrCat("retain_from_step: must be in [0, step ",
                                                    request.step(), "], got ",
                                                    request.retain_from_step()));
  }
  if (!valid.ok()) {
    done(valid);
    return;
  }
  absl::StatusOr<std::shared_ptr<Job>> found = FindJob(request.job_id());
  if (!found.ok()) {
    done(found.status());
    return;
  }
  std::shared_ptr<Job> job = *std::move(found);
  const int64_t step = request.step();
  const std::vector<std::shared_ptr<Partition>> partitions = job->AllPartitions();
  // A registration for a step the job will not reach for a very long time would hold its slot
  // (and its RPC) for that long.
  const int64_t completed_now = CompletedSteps(*job, partitions);
  if (step - completed_now > kMaxCheckpointStepsAhead) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "step: ", step, " is more than ", kMaxCheckpointStepsAhead, " steps ahead of job '",
        job->id, "', which has completed ", completed_now, " steps on this shard")));
    return;
  }
  std::shared_ptr<Capture> capture;
  std::shared_ptr<Capture> written;
  std::vector<CheckpointWaiter> pruned;
  absl::Status refused;
  {
    absl::MutexLock lock(&job->ckpt_mu);
    auto it = job->captures.find(step);
    if (job->retired) {
      refused = absl::AbortedError(absl::StrCat("job '", job->id, "' was dropped or restored"));
    } else if (it != job->captures.end() && it->second->state == Capture::State::kDone) {
      written = it->second;
    } else if (it != job->captures.end() && !it->second->status.ok()) {
      refused = it->second->status;
    } else {
      // Each waiting call holds an open RPC until its step comes: bound them, so that requests
      // for far-away steps cannot pile up. Cancelled calls no longer count.
      const size_t pending = PruneCancelledWaitersLocked(*job, &pruned);
      it = job->captures.find(step);
      const bool is_new = it == job->captures.end();
      const bool counts = is_new || (!it->second->registered && it->second->waiters.empty());
      if ((counts && pending >= kMaxPendingCaptures) ||
          (!is_new && it->second->waiters.size() >= kMaxCheckpointWaiters)) {
        refused = absl::ResourceExhaustedError(
            absl::StrCat("step: job '", job->id, "' already has ", pending,
                         " checkpoints waiting for their step (at most ", kMaxPendingCaptures,
                         ", each with at most ", kMaxCheckpointWaiters, " calls waiting)"));
      } else {
        if (is_new) {
          it = job->captures.emplace(step, std::make_shared<Capture>(step, budget_)).first;
          it->second->registered = !IsAutoStep(job->config, step);
        }
        capture = it->second;
        capture->retain_from_step = std::max(capture->retain_from_step, request.retain_from_step());
        capture->waiters.push_back({std::move(done), std::move(cancelled)});
      }
    }
    if (refused.ok()) job->max_requested_step = std::max(job->max_requested_step, step);
  }
  // Every answer below runs without store locks.
  const absl::Status gone = absl::CancelledError("the Checkpoint call was cancelled");
  for (const CheckpointWaiter& w : pruned) w(gone);
  if (!refused.ok()) {
    done(refused);
    return;
  }
  if (written != nullptr) {
    // Written already: answer from the writer (retention is file I/O).
    const int64_t retain = request.retain_from_step();
    EnqueueWrite([this, job, written, retain, done = std::move(done)](bool stopping) {
      if (stopping) {
        done(absl::CancelledError("the parameter store is shutting down"));
        return;
      }
      if (!written->status.ok()) {
        done(written->status);
        return;
      }
      if (retain > 0) ApplyRetention(*job, retain);
      done(written->response);
    });
    return;
  }
  // Per partition: capture now when it sits at the boundary, remember the step when it is before
  // it, and fail the capture when it is past it.
  int64_t completed = 0;
  std::string past;
  for (const std::shared_ptr<Partition>& p : partitions) {
    absl::MutexLock lock(&p->mu);
    const int64_t reached = job->bsp() ? p->version.load(std::memory_order_relaxed)
                                       : job->gate.SlowestClock(p->clocks, step);
    completed = std::max(completed, reached);
    if (reached > step) {
      bool captured;
      {
        absl::MutexLock ckpt_lock(&job->ckpt_mu);
        captured = capture->captured.contains(p.get());
      }
      if (!captured && past.empty()) past = p->name;
      continue;
    }
    if (reached == step) {
      CaptureLocked(*job, *p, step);
    } else {
      p->next_capture = std::min(p->next_capture, step);
    }
  }
  std::vector<CheckpointWaiter> failed;
  absl::Status status;
  bool write_empty = false;
  {
    absl::MutexLock lock(&job->ckpt_mu);
    if (!past.empty() && capture->state == Capture::State::kCapturing) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "step: job '", job->id, "' has already passed step ", step, " on this shard (key ", past,
          " has completed ", completed, " steps); checkpoint a later step"));
      capture->status = status;
      capture->ReleaseMemory();
      failed.swap(capture->waiters);
      auto it = job->captures.find(step);
      if (it != job->captures.end() && it->second == capture) job->captures.erase(it);
    } else if (partitions.empty() && capture->state == Capture::State::kCapturing) {
      capture->state = Capture::State::kWriting;
      write_empty = true;
    }
  }
  for (const CheckpointWaiter& w : failed) w(status);
  if (write_empty) {
    EnqueueWrite([this, job, capture](bool cancelled) {
      if (cancelled) {
        CancelCapture(*job, *capture, absl::CancelledError("the parameter store is shutting down"));
        return;
      }
      WriteCapture(job, capture);
    });
  }
}

absl::StatusOr<v1::RestoreResponse> ParameterStore::Restore(const v1::RestoreRequest& request) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints need a data directory: --data_dir not set on this shard");
  }
  TESSERA_RETURN_IF_ERROR(ValidateJobId(request.job_id()));
  if (request.step() < 1 || request.step() > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: must be in [1, ", kMaxStep, "], got ", request.step()));
  }
  const std::string path = CheckpointPath(options_.checkpoint_dir, request.job_id(), request.step(),
                                          options_.shard_index);
  TESSERA_ASSIGN_OR_RETURN(CheckpointContents contents, ReadCheckpointFile(path));
  const v1::CheckpointHeader& h = contents.header;
  if (h.job_id() != request.job_id() || h.step() != request.step() ||
      h.shard_index() != options_.shard_index) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint file ", path, " holds job '", absl::CHexEscape(h.job_id().substr(0, 160)),
        "' step ", h.step(), " shard ", h.shard_index(), ", not what its name says"));
  }
  // Files of this job already on disk may be committed: the restored job never deletes them as
  // unrequested.
  int64_t protect_through = h.step();
  absl::StatusOr<std::vector<int64_t>> existing = ListCheckpointSteps(
      absl::StrCat(options_.checkpoint_dir, "/", request.job_id()), options_.shard_index);
  if (existing.ok() && !existing->empty()) {
    protect_through = std::max(protect_through, existing->back());
  }
  absl::StatusOr<v1::RestoreResponse> restored =
      RestoreJobFromCheckpoint(contents, request.min_incarnation(), protect_through);
  if (!restored.ok() && restored.status().code() == absl::StatusCode::kDataLoss) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", path, ": ", restored.status().message()));
  }
  return restored;
}

absl::StatusOr<v1::RestoreResponse> ParameterStore::RestoreJobFromCheckpoint(
    const CheckpointContents& contents, uint64_t min_incarnation, int64_t protect_through) {
  const v1::CheckpointHeader& h = contents.header;
  const absl::string_view data = contents.data;
  auto loss = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("checkpoint of step ", h.step(), ": ", what));
  };
  if (h.format_version() != 1) {
    return loss(absl::StrCat("unknown format_version ", h.format_version()));
  }
  if (h.step() < 0 || h.step() > kMaxStep) return loss(absl::StrCat("bad step ", h.step()));
  v1::CreateJobStateRequest request;
  request.set_job_id(h.job_id());
  *request.mutable_config() = h.config();
  for (const v1::PartitionCheckpoint& pc : h.partitions()) {
    if (!pc.sparse()) {
      v1::DensePartitionDecl* d = request.add_partitions();
      *d->mutable_key() = pc.key();
      d->set_num_elements(pc.num_elements());
    } else {
      if (pc.key().tensor() != pc.table().name() || pc.key().index() != 0) {
        return loss(absl::StrCat("table ", pc.table().name(), " has key ", KeyName(pc.key())));
      }
      *request.add_tables() = pc.table();
    }
  }
  absl::StatusOr<kernels::OptimizerParams> dense_params = absl::UnknownError("unset");
  std::vector<kernels::OptimizerParams> table_params;
  absl::Status valid = ValidateJobRequest(request, &dense_params, &table_params);
  if (!valid.ok()) return loss(valid.message());
  const uint32_t workers = h.config().num_workers();
  // Each entry becomes a bit per worker in the gate: no more than the header's own size justifies.
  if (static_cast<uint64_t>(h.membership_size()) * ((workers + 7) / 8) >
      h.ByteSizeLong() * 8 + (uint64_t{1} << 20)) {
    return loss(absl::StrCat(h.membership_size(), " membership entries for ", workers, " workers"));
  }
  for (const v1::CheckpointMembership& m : h.membership()) {
    if (m.effective_step() < 0 || m.effective_step() > kMaxStep || m.live_workers().empty()) {
      return loss(absl::StrCat("bad membership entry at step ", m.effective_step()));
    }
    for (uint32_t w : m.live_workers()) {
      if (w >= workers) return loss(absl::StrCat("membership names worker ", w));
    }
  }
  // A range of exactly `bytes` bytes inside the data section.
  auto check_range = [&](const v1::CheckpointRange& r, uint64_t bytes,
                         absl::string_view what) -> absl::Status {
    if (r.length() != bytes || r.offset() > data.size() || r.length() > data.size() - r.offset()) {
      return loss(absl::StrCat(what, ": range [", r.offset(), ", +", r.length(), ") of a ",
                               data.size(), "-byte data section, expected ", bytes, " bytes"));
    }
    return absl::OkStatus();
  };
  size_t table_i = 0;
  for (const v1::PartitionCheckpoint& pc : h.partitions()) {
    const std::string name = KeyName(pc.key());
    if (pc.version() < 0 || pc.version() > kMaxStep) {
      return loss(absl::StrCat(name, ": bad version ", pc.version()));
    }
    if (pc.clocks_size() != static_cast<int>(workers)) {
      return loss(absl::StrCat(name, ": ", pc.clocks_size(), " clocks for ", workers, " workers"));
    }
    for (int64_t c : pc.clocks()) {
      if (c < 0 || c > kMaxStep) return loss(absl::StrCat(name, ": bad clock ", c));
    }
    for (const v1::CheckpointSeq& seq : pc.last_applied()) {
      if (seq.worker() >= workers)
        return loss(absl::StrCat(name, ": seq of worker ", seq.worker()));
    }
    if (!pc.sparse()) {
      const int slots = kernels::NumSlots(dense_params->kind);
      const uint64_t bytes = static_cast<uint64_t>(pc.num_elements()) * 4;
      TESSERA_RETURN_IF_ERROR(check_range(pc.weights(), bytes, absl::StrCat(name, " weights")));
      if (pc.slots_size() != slots) {
        return loss(absl::StrCat(name, ": ", pc.slots_size(), " slots, the optimizer has ", slots));
      }
      for (const v1::CheckpointRange& r : pc.slots()) {
        TESSERA_RETURN_IF_ERROR(check_range(r, bytes, absl::StrCat(name, " slot")));
      }
    } else {
      const kernels::OptimizerParams& params = table_params[table_i++];
      const uint64_t rows = pc.num_rows();
      if (rows > data.size() / 8) return loss(absl::StrCat(name, ": ", rows, " rows"));
      const uint64_t width = uint64_t{pc.table().dim()} * (1 + kernels::NumSlots(params.kind));
      if (width != 0 && rows > data.size() / 4 / width) {
        return loss(absl::StrCat(name, ": ", rows, " rows of ", width, " values"));
      }
      TESSERA_RETURN_IF_ERROR(check_range(pc.row_ids(), rows * 8, absl::StrCat(name, " row_ids")));
      TESSERA_RETURN_IF_ERROR(
          check_range(pc.row_updates(), rows * 8, absl::StrCat(name, " row_updates")));
      TESSERA_RETURN_IF_ERROR(
          check_range(pc.row_values(), rows * width * 4, absl::StrCat(name, " row_values")));
    }
  }

  // Build the new job aside; nothing of the current one changes until the swap.
  const int64_t fixed = Job::FixedBytes(workers, h.job_id().size());
  if (!budget_->TryReserve(fixed)) {
    return budget_->Exhausted(absl::StrCat("restoring job '", h.job_id(), "'"), fixed);
  }
  auto job = std::make_shared<Job>(h.job_id(), h.config(), dense_params, budget_, fixed, counters_);
  {
    absl::MutexLock lock(&job->ckpt_mu);
    job->retired = true;  // no captures until it is swapped in and its partitions are set
    job->max_requested_step = std::max(protect_through, h.step());
  }
  TESSERA_RETURN_IF_ERROR(AddToJob(*job, request, table_params).status());
  for (const v1::CheckpointMembership& m : h.membership()) {
    std::vector<uint32_t> live(m.live_workers().begin(), m.live_workers().end());
    absl::Status s = job->gate.UpdateMembership(live, m.effective_step());
    if (!s.ok()) return loss(s.message());
    absl::MutexLock lock(&job->log_mu);
    std::vector<v1::CheckpointMembership>& log = job->membership_log;
    while (!log.empty() && log.back().effective_step() >= m.effective_step()) log.pop_back();
    log.push_back(m);
  }
  job->min_incarnation.store(std::max(min_incarnation, h.min_incarnation()));
  auto at = [&](const v1::CheckpointRange& r) { return data.data() + r.offset(); };
  for (const v1::PartitionCheckpoint& pc : h.partitions()) {
    std::shared_ptr<Partition> p;
    {
      absl::ReaderMutexLock lock(&job->mu);
      if (!pc.sparse()) {
        p = job->dense.at(std::make_pair(pc.key().tensor(), pc.key().index()));
      } else {
        p = job->tables.at(pc.key().tensor());
      }
    }
    absl::MutexLock lock(&p->mu);
    p->version.store(pc.version(), std::memory_order_relaxed);
    for (uint32_t w = 0; w < workers; ++w) p->clocks[w].store(pc.clocks(static_cast<int>(w)));
    for (const v1::CheckpointSeq& seq : pc.last_applied()) {
      p->last_applied[seq.worker()] = Partition::Seq{true, seq.incarnation(), seq.seq()};
    }
    if (!pc.sparse()) {
      std::memcpy(p->MutableWeightsLocked(), at(pc.weights()), pc.weights().length());
      for (int s = 0; s < pc.slots_size(); ++s) {
        std::memcpy(p->slots[s].data(), at(pc.slots(s)), pc.slots(s).length());
      }
    } else {
      const size_t rows = pc.num_rows();
      const size_t width = static_cast<size_t>(p->dim) * (1 + p->num_slots);
      const int64_t bytes = static_cast<int64_t>(rows) * p->RowBytes();
      if (!budget_->TryReserve(bytes)) {
        return budget_->Exhausted(absl::StrCat("restoring table ", p->name), bytes);
      }
      p->charged.fetch_add(bytes, std::memory_order_relaxed);
      const char* ids = at(pc.row_ids());
      const char* updates = at(pc.row_updates());
      const char* values = at(pc.row_values());
      p->rows.reserve(rows);
      for (size_t i = 0; i < rows; ++i) {
        int64_t id;
        std::memcpy(&id, ids + 8 * i, 8);
        Partition::Row& row = p->rows[id];
        if (!row.values.empty()) return loss(absl::StrCat(p->name, ": row ", id, " twice"));
        std::memcpy(&row.updates, updates + 8 * i, 8);
        row.values.resize(width);
        std::memcpy(row.values.data(), values + 4 * width * i, 4 * width);
      }
    }
  }
  // Captures continue after the restored step.
  {
    absl::MutexLock lock(&job->ckpt_mu);
    job->retired = false;
  }
  const int64_t next = NextCaptureAfter(*job, h.step());
  for (const std::shared_ptr<Partition>& p : job->AllPartitions()) {
    absl::MutexLock lock(&p->mu);
    p->next_capture = next;
  }

  std::shared_ptr<Job> old;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.ok()) job->gate.Close(closed_);
    std::shared_ptr<Job>& slot = jobs_[h.job_id()];
    old = std::move(slot);
    slot = job;
  }
  if (old != nullptr) {
    const absl::Status replaced = absl::AbortedError(
        absl::StrCat("job '", h.job_id(), "' was restored from its checkpoint of step ", h.step()));
    old->gate.Close(replaced);
    RetireCaptures(*old, replaced);
  }
  v1::RestoreResponse response;
  response.set_step(h.step());
  {
    absl::ReaderMutexLock lock(&job->mu);
    response.set_partitions(static_cast<uint32_t>(job->dense.size()));
    response.set_tables(static_cast<uint32_t>(job->tables.size()));
  }
  return response;
}

}  // namespace tessera::server
