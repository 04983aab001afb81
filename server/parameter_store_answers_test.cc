// ParameterStore's answers: gradients in pieces applied and validated as contiguous ones, shared
// answers that keep their weights while the store copies on write, answers into a sink's
// buffers; and the store's statistics and histograms.
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/testing/store_calls.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::push_pull_requests;   // NOLINT: request builders
using namespace ::tessera::server::store_calls;  // NOLINT: store calls

// --- Requests by reference (PushPullView), with data in pieces -------------------------------

// `bytes` cut at random offsets into pieces that point into it.
std::vector<absl::string_view> RandomPieces(absl::string_view bytes, std::mt19937* rng) {
  std::vector<absl::string_view> pieces;
  std::uniform_int_distribution<size_t> len(1, 9000);
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::min(len(*rng), bytes.size() - at);
    pieces.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return pieces;
}

// A PushPull by reference with a sink, as the gRPC service makes it; `done` must run at once.
struct SharedAnswer {
  absl::StatusOr<v1::PushPullResponse> response = absl::InternalError("parked");
  std::shared_ptr<PushPullAnswerSink> sink = std::make_shared<PushPullAnswerSink>();
};

SharedAnswer PushPullShared(ParameterStore& store, const PushPullView& view) {
  SharedAnswer out;
  std::optional<absl::StatusOr<v1::PushPullResponse>> response;
  store.PushPull(
      view, [&response](absl::StatusOr<v1::PushPullResponse> r) { response = std::move(r); },
      nullptr, out.sink);
  if (response.has_value()) out.response = *std::move(response);
  return out;
}

// PushPullShared, with the shared data copied into the response (so it is the whole answer).
absl::StatusOr<v1::PushPullResponse> PushPullViewNow(ParameterStore& store,
                                                     const PushPullView& view) {
  SharedAnswer answer = PushPullShared(store, view);
  if (!answer.response.ok()) return answer.response;
  for (const auto& [index, weights] : answer.sink->shared) {
    if (index < 0 || index >= answer.response->weights_size() ||
        !answer.response->weights(index).data().empty()) {
      return absl::InternalError(absl::StrCat("bad shared slice index ", index));
    }
    answer.response->mutable_weights(index)->set_data(std::string(weights.bytes()));
  }
  return answer.response;
}

// The same pushes, once as protobuf requests and once by reference with the gradient cut into
// random pieces (values straddling pieces, unaligned), give bit-identical weights, for every
// dense optimizer, both fp32 and bf16, and ASP as well as BSP.
TEST(ParameterStoreTest, PiecedGradientsApplyExactlyAsContiguousOnes) {
  const std::vector<v1::OptimizerKind> kinds = {
      v1::OPTIMIZER_KIND_SGD,     v1::OPTIMIZER_KIND_MOMENTUM, v1::OPTIMIZER_KIND_NESTEROV,
      v1::OPTIMIZER_KIND_ADAGRAD, v1::OPTIMIZER_KIND_ADAM,     v1::OPTIMIZER_KIND_ADAMW};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kElements = 200003;  // several gather blocks and a partial one
  for (v1::OptimizerKind kind : kinds) {
    for (v1::Consistency mode : {v1::CONSISTENCY_ASP, v1::CONSISTENCY_BSP}) {
      for (v1::Encoding encoding : {v1::ENCODING_FP32, v1::ENCODING_BF16}) {
        SCOPED_TRACE(absl::StrCat(v1::OptimizerKind_Name(kind), " ", v1::Consistency_Name(mode),
                                  " ", v1::Encoding_Name(encoding)));
        v1::JobConfig config = Config(mode, 1, 0.01f, kind);
        if (kind == v1::OPTIMIZER_KIND_MOMENTUM || kind == v1::OPTIMIZER_KIND_NESTEROV) {
          config.mutable_optimizer()->set_momentum(0.9f);
        }
        ParameterStore contiguous;
        ParameterStore pieced;
        v1::CreateJobStateRequest job = JobRequest("j", config);
        *job.add_partitions() = Dense("w", 0, kElements);
        ASSERT_TRUE(contiguous.CreateJobState(job).ok());
        ASSERT_TRUE(pieced.CreateJobState(job).ok());
        for (int step = 0; step < 3; ++step) {
          std::vector<float> grad(kElements);
          for (float& g : grad) g = normal(rng);
          v1::PushPullRequest request = Request("j", 0, 1, step, static_cast<uint64_t>(step + 1),
                                                {GradSlice("w", 0, grad, true, encoding)});
          std::optional<absl::StatusOr<v1::PushPullResponse>> want;
          contiguous.PushPull(request,
                              [&want](absl::StatusOr<v1::PushPullResponse> r) { want = r; });
          ASSERT_TRUE(want.has_value() && want->ok());
          // Unaligned: the payload starts one byte into its buffer.
          const std::string payload = "x" + request.push(0).data();
          const std::vector<absl::string_view> cut =
              RandomPieces(absl::string_view(payload).substr(1), &rng);
          PushPullView view = ViewOf(request);
          view.push[0].data = absl::string_view();
          view.push[0].pieces = cut;
          absl::StatusOr<v1::PushPullResponse> got = PushPullViewNow(pieced, view);
          ASSERT_TRUE(got.ok()) << got.status();
          ASSERT_EQ(got->weights_size(), 1);
          // Not EXPECT_EQ: a failure would print both 800 KB strings.
          ASSERT_TRUE(got->weights(0).data() == (*want)->weights(0).data())
              << "weights differ at step " << step;
          EXPECT_EQ(got->weights(0).version(), (*want)->weights(0).version());
        }
      }
    }
  }
}

// Validation reads the pieces too: the byte count is their total, and a NaN that straddles two
// pieces is found.
TEST(ParameterStoreTest, PiecedGradientsAreValidatedLikeContiguousOnes) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 4);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  v1::PushPullRequest request = Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, NAN, 2, 3}, true)});
  const std::string& data = request.push(0).data();
  // The NaN is bytes [4, 8): cut at 6.
  const std::vector<absl::string_view> nan_pieces = {absl::string_view(data.data(), 6),
                                                     absl::string_view(data.data() + 6, 10)};
  PushPullView view = ViewOf(request);
  view.push[0].data = absl::string_view();
  view.push[0].pieces = nan_pieces;
  absl::StatusOr<v1::PushPullResponse> r = PushPullViewNow(store, view);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("NaN"));

  const std::vector<absl::string_view> short_pieces = {absl::string_view(data.data(), 6),
                                                       absl::string_view(data.data() + 6, 7)};
  view.push[0].pieces = short_pieces;
  r = PushPullViewNow(store, view);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("16 bytes"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("got 13 bytes"));

  // A good pieced push (values straddling) applies: w = -0.5 * g.
  v1::PushPullRequest good = Request("j", 0, 1, 0, 2, {GradSlice("w", 0, {2, 4, 6, 8}, true)});
  const std::string& g = good.push(0).data();
  const std::vector<absl::string_view> good_pieces = {
      absl::string_view(g.data(), 3), absl::string_view(g.data() + 3, 1),
      absl::string_view(g.data() + 4, 9), absl::string_view(g.data() + 13, 3)};
  PushPullView good_view = ViewOf(good);
  good_view.push[0].data = absl::string_view();
  good_view.push[0].pieces = good_pieces;
  r = PushPullViewNow(store, good_view);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->weights_size(), 1);
  EXPECT_EQ(Floats(r->weights(0)), (std::vector<float>{-1, -2, -3, -4}));
}

// --- Answers by reference (copy-on-write weights) --------------------------------------------

std::vector<float> Values(const SharedWeights& w) {
  return std::vector<float>(w.data(), w.data() + w.size());
}

// A dense fp32 answer to a sink shares the partition's weights. While it is held, an update
// copies them first (the held answer keeps its values bit for bit, later answers see the new
// ones); once nothing holds them, updates write in place again.
TEST(ParameterStoreTest, SharedAnswersKeepTheirWeightsAndTheStoreCopiesOnWrite) {
  constexpr int kN = 5000;
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  std::vector<float> initial(kN);
  for (int i = 0; i < kN; ++i) initial[i] = static_cast<float>(i);
  *job.add_partitions() = Dense("w", 0, kN, initial);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  const std::vector<float> ones(kN, 1.0f);
  // w after k updates of g = 1 with SGD at 0.5 (exact in fp32).
  auto after = [&](int k) {
    std::vector<float> w = initial;
    for (float& v : w) v -= 0.5f * static_cast<float>(k);
    return w;
  };

  const v1::PushPullRequest first = Request("j", 0, 1, 0, 1, {GradSlice("w", 0, ones, true)});
  SharedAnswer a = PushPullShared(store, ViewOf(first));
  ASSERT_TRUE(a.response.ok()) << a.response.status();
  ASSERT_EQ(a.response->weights_size(), 1);
  EXPECT_TRUE(a.response->weights(0).data().empty());
  EXPECT_EQ(a.response->weights(0).encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(a.response->weights(0).version(), 1);
  EXPECT_EQ(a.response->weights(0).key().tensor(), "w");
  ASSERT_EQ(a.sink->shared.size(), 1u);
  EXPECT_EQ(a.sink->shared[0].first, 0);
  SharedWeights held = std::move(a.sink->shared[0].second);
  EXPECT_EQ(Values(held), after(1));
  const std::string held_bytes(held.bytes());
  ShardStats stats = store.GetShardStats();
  EXPECT_EQ(stats.weight_copies_on_write, 0);  // nothing held the weights at the update
  EXPECT_EQ(stats.bytes_pulled, kN * 4);

  // An update while the answer is held: copied first.
  absl::StatusOr<PushAck> pushed = store.Push(Request("j", 0, 1, 1, 2, {GradSlice("w", 0, ones)}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_TRUE(held.bytes() == held_bytes) << "the held answer changed under the update";
  EXPECT_EQ(PullDense(store, "j", "w", 0), after(2));
  // A second update finds the copy unshared: in place.
  pushed = store.Push(Request("j", 0, 1, 2, 3, {GradSlice("w", 0, ones)}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_TRUE(held.bytes() == held_bytes) << "the held answer changed under the update";

  // A pull by reference now shares the partition's new buffer, not the held one.
  v1::PushPullRequest pull = Request("j", 0, 1, 3, 4, {}, {PullKey("w", 0)});
  pull.set_pull_encoding(v1::ENCODING_FP32);
  SharedAnswer b = PushPullShared(store, ViewOf(pull));
  ASSERT_TRUE(b.response.ok()) << b.response.status();
  ASSERT_EQ(b.sink->shared.size(), 1u);
  EXPECT_NE(b.sink->shared[0].second.data(), held.data());
  EXPECT_EQ(Values(b.sink->shared[0].second), after(3));
  EXPECT_EQ(b.response->weights(0).version(), 3);
  EXPECT_EQ(store.GetShardStats().bytes_pulled, 2 * kN * 4 + kN * 4);  // PullDense, both shares

  // Both released: the next update writes in place, no copy.
  held.reset();
  b.sink->shared.clear();
  pushed = store.Push(Request("j", 0, 1, 3, 5, {GradSlice("w", 0, ones)}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store.GetShardStats().weight_copies_on_write, 1);
  EXPECT_EQ(PullDense(store, "j", "w", 0), after(4));
}

// Only dense fp32 answers are shared: bf16 answers and sparse rows are encoded into the sink's
// buffers (capacity reused), as the typed overload answers them.
TEST(ParameterStoreTest, EncodedAndSparseAnswersToASinkAreCopiedIntoItsBuffers) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 4, {1, 2, 3, 4});
  auto* table = job.add_tables();
  table->set_name("emb");
  table->set_dim(2);
  table->mutable_initializer()->set_kind(v1::Initializer::KIND_CONSTANT);
  table->mutable_initializer()->set_value(0.25f);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  for (v1::Encoding encoding : {v1::ENCODING_BF16, v1::ENCODING_FP32}) {
    SCOPED_TRACE(v1::Encoding_Name(encoding));
    v1::PushPullRequest request =
        Request("j", 0, 1, 0, 1, {}, {PullKey("w", 0), PullKey("emb", 0, {3, 9})});
    request.set_pull_encoding(encoding);
    int taken = 0;
    auto sink = std::make_shared<PushPullAnswerSink>();
    sink->take_buffer = [&taken] {
      ++taken;
      std::string s;
      s.reserve(1 << 16);
      return s;
    };
    std::optional<absl::StatusOr<v1::PushPullResponse>> got;
    store.PushPull(
        ViewOf(request), [&got](absl::StatusOr<v1::PushPullResponse> r) { got = std::move(r); },
        nullptr, sink);
    ASSERT_TRUE(got.has_value() && got->ok());
    std::optional<absl::StatusOr<v1::PushPullResponse>> want;
    store.PushPull(request, [&want](absl::StatusOr<v1::PushPullResponse> r) { want = r; });
    ASSERT_TRUE(want.has_value() && want->ok());
    ASSERT_EQ((*got)->weights_size(), 2);
    EXPECT_EQ((*got)->weights(1).SerializeAsString(), (*want)->weights(1).SerializeAsString());
    EXPECT_GE((*got)->weights(1).data().capacity(), size_t{1} << 16);
    EXPECT_EQ(Floats((*got)->weights(1)), (std::vector<float>{0.25f, 0.25f, 0.25f, 0.25f}));
    if (encoding == v1::ENCODING_BF16) {
      EXPECT_EQ(taken, 2);
      EXPECT_TRUE(sink->shared.empty());
      EXPECT_EQ((*got)->weights(0).SerializeAsString(), (*want)->weights(0).SerializeAsString());
    } else {
      EXPECT_EQ(taken, 1);  // the sparse rows only
      ASSERT_EQ(sink->shared.size(), 1u);
      EXPECT_EQ(sink->shared[0].first, 0);
      EXPECT_TRUE((*got)->weights(0).data().empty());
      EXPECT_EQ(sink->shared[0].second.bytes(), (*want)->weights(0).data());
    }
  }
}

// Pushes on several threads while other threads hold answers by reference and release them
// after reading: every answer still has exactly the weights of its version (SGD of g = 1 at 0.5
// from 0: every value is -0.5 * version), however the releases and updates interleave.
TEST(ParameterStoreTest, SharedAnswersStayExactUnderConcurrentUpdates) {
  constexpr int kN = 1 << 16;
  constexpr int kThreads = 2;
  constexpr int kPushes = 150;
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("j", Config(v1::CONSISTENCY_ASP, kThreads, 0.5f));
  *job.add_partitions() = Dense("w", 0, kN);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  absl::Mutex mu;
  std::deque<std::pair<int64_t, SharedWeights>> held;  // guarded by mu
  int pushers_left = kThreads;                         // guarded by mu
  std::atomic<int> bad{0};
  std::atomic<int> checked{0};
  auto check = [&](int64_t version, const SharedWeights& w) {
    const float want = -0.5f * static_cast<float>(version);
    for (size_t i = 0; i < w.size(); ++i) {
      if (w.data()[i] != want) {
        bad.fetch_add(1);
        return;
      }
    }
    checked.fetch_add(1);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const v1::PushPullRequest request =
          Request("j", static_cast<uint32_t>(t), 1, 0, 0,
                  {GradSlice("w", 0, std::vector<float>(kN, 1.0f), true)});
      for (int i = 0; i < kPushes; ++i) {
        PushPullView view = ViewOf(request);
        view.seq = static_cast<uint64_t>(i + 1);
        SharedAnswer a = PushPullShared(store, view);
        if (!a.response.ok() || a.sink->shared.size() != 1) {
          bad.fetch_add(1);
          continue;
        }
        absl::MutexLock lock(&mu);
        held.emplace_back(a.response->weights(0).version(), std::move(a.sink->shared[0].second));
      }
      absl::MutexLock lock(&mu);
      --pushers_left;
    });
  }
  // Two releasers: read each held answer, then drop it (on a thread other than its pusher's).
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&] {
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      for (;;) {
        std::pair<int64_t, SharedWeights> answer;
        {
          absl::MutexLock lock(&mu);
          auto ready = [&] { return !held.empty() || pushers_left == 0; };
          if (!mu.AwaitWithDeadline(absl::Condition(&ready), deadline)) return;
          if (held.empty()) return;
          answer = std::move(held.front());
          held.pop_front();
        }
        check(answer.first, answer.second);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(checked.load(), kThreads * kPushes);
  const std::vector<float> final_weights = PullDense(store, "j", "w", 0);
  ASSERT_EQ(final_weights.size(), static_cast<size_t>(kN));
  EXPECT_EQ(final_weights[0], -0.5f * kThreads * kPushes);
  // Each copy-on-write is one update that found an answer still held.
  EXPECT_LE(store.GetShardStats().weight_copies_on_write, kThreads * kPushes);
}

// --- Shard-wide counters (metrics) ----------------------------------------------------------

// The number of observations in `h` at or below `bound` (a bound of the histogram).
uint64_t AtOrBelow(const StoreHistogram::Snapshot& h, int64_t bound) {
  uint64_t n = 0;
  for (size_t i = 0; i < h.bounds.size() && h.bounds[i] <= bound; ++i) n += h.counts[i];
  return n;
}

TEST(ParameterStoreStatsTest, CountsBytesUpdatesDuplicatesAndBspWaits) {
  ParameterStore store;
  v1::CreateJobStateRequest r = JobRequest("j", Config(v1::CONSISTENCY_BSP, 2, 0.5f));
  *r.add_partitions() = Dense("w", 0, 4);
  ASSERT_TRUE(store.CreateJobState(r).ok());
  EXPECT_EQ(store.GetShardStats().jobs, 1);

  // Worker 0 pushes step 0 (staged) and pulls for step 1, which waits for worker 1.
  ASSERT_TRUE(store.Push(Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})})).ok());
  v1::PullRequest pull;
  pull.set_job_id("j");
  pull.set_step(1);
  pull.set_encoding(v1::ENCODING_FP32);
  *pull.add_keys() = PullKey("w", 0);
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> pulled;
  store.Pull(pull, [&pulled](absl::StatusOr<std::vector<v1::Slice>> w) { pulled = std::move(w); });
  ASSERT_FALSE(pulled.has_value());
  ShardStats stats = store.GetShardStats();
  EXPECT_EQ(stats.bytes_pushed, 16);
  EXPECT_EQ(stats.updates_applied, 0);
  EXPECT_EQ(stats.parked_pulls, 1);
  EXPECT_EQ(stats.bsp_wait_ns.count, 0u);
  EXPECT_EQ(stats.bytes_pulled, 0);

  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(store.Push(Request("j", 1, 1, 0, 1, {GradSlice("w", 0, {3, 3, 3, 3})})).ok());
  ASSERT_TRUE(pulled.has_value());
  ASSERT_TRUE(pulled->ok()) << pulled->status();
  stats = store.GetShardStats();
  EXPECT_EQ(stats.bytes_pushed, 32);
  EXPECT_EQ(stats.updates_applied, 1);
  EXPECT_EQ(stats.parked_pulls, 0);
  EXPECT_EQ(stats.bytes_pulled, 16);
  ASSERT_EQ(stats.bsp_wait_ns.count, 1u);
  EXPECT_GE(stats.bsp_wait_ns.sum, 20'000'000);  // it waited at least the 20 ms sleep
  EXPECT_LT(stats.bsp_wait_ns.sum, 60'000'000'000);
  EXPECT_EQ(AtOrBelow(stats.bsp_wait_ns, 10'000'000), 0u);
  EXPECT_EQ(stats.ssp_wait_ns.count, 0u);
  EXPECT_EQ(stats.ssp_staleness.count, 0u);

  // A retry of worker 0's push is a duplicate: counted, not applied, its bytes not counted.
  auto ack = store.Push(Request("j", 0, 1, 0, 1, {GradSlice("w", 0, {1, 1, 1, 1})}));
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->duplicates, 1u);
  stats = store.GetShardStats();
  EXPECT_EQ(stats.duplicates, 1);
  EXPECT_EQ(stats.bytes_pushed, 32);
  EXPECT_EQ(stats.updates_applied, 1);

  // An ungated pull is answered at once and not timed; its bytes count.
  ASSERT_TRUE(PullNow(store, "j", {PullKey("w", 0)}).ok());
  stats = store.GetShardStats();
  EXPECT_EQ(stats.bytes_pulled, 32);
  EXPECT_EQ(stats.bsp_wait_ns.count, 1u);

  // The counters are the shard's: they outlive the job.
  ASSERT_TRUE(store.DropJob("j").ok());
  stats = store.GetShardStats();
  EXPECT_EQ(stats.jobs, 0);
  EXPECT_EQ(stats.updates_applied, 1);
  EXPECT_EQ(stats.duplicates, 1);
}

TEST(ParameterStoreStatsTest, SspStalenessAndWaits) {
  ParameterStore store;
  v1::CreateJobStateRequest r =
      JobRequest("j", Config(v1::CONSISTENCY_SSP, 2, 0.5f, v1::OPTIMIZER_KIND_SGD, 2));
  *r.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(r).ok());
  // Worker 0 runs ahead: steps 0, 1, 2 while worker 1's clock is 0 (staleness 0, 1, 2).
  for (int64_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(store.Push(Request("j", 0, 1, step, step + 1, {GradSlice("w", 0, {1, 1})})).ok());
  }
  ShardStats stats = store.GetShardStats();
  EXPECT_EQ(stats.updates_applied, 3);
  ASSERT_EQ(stats.ssp_staleness.count, 3u);
  EXPECT_EQ(stats.ssp_staleness.sum, 0 + 1 + 2);
  EXPECT_EQ(AtOrBelow(stats.ssp_staleness, 0), 1u);
  EXPECT_EQ(AtOrBelow(stats.ssp_staleness, 1), 2u);
  EXPECT_EQ(AtOrBelow(stats.ssp_staleness, 2), 3u);

  // Worker 0 pulls for step 3: it needs the slowest clock >= 1, so it waits for worker 1.
  v1::PullRequest pull;
  pull.set_job_id("j");
  pull.set_step(3);
  *pull.add_keys() = PullKey("w", 0);
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> pulled;
  store.Pull(pull, [&pulled](absl::StatusOr<std::vector<v1::Slice>> w) { pulled = std::move(w); });
  ASSERT_FALSE(pulled.has_value());
  EXPECT_EQ(store.GetShardStats().parked_pulls, 1);
  ASSERT_TRUE(store.Push(Request("j", 1, 1, 0, 1, {GradSlice("w", 0, {1, 1})})).ok());
  ASSERT_TRUE(pulled.has_value());
  stats = store.GetShardStats();
  EXPECT_EQ(stats.ssp_staleness.count, 4u);
  EXPECT_EQ(stats.ssp_staleness.sum, 3);  // worker 1's push at the slowest clock: 0
  EXPECT_EQ(stats.ssp_wait_ns.count, 1u);
  EXPECT_EQ(stats.bsp_wait_ns.count, 0u);
  EXPECT_EQ(stats.bytes_pushed, 4 * 8);
  EXPECT_EQ(stats.bytes_pulled, 8);
}

TEST(StoreHistogramTest, BucketsAreInclusiveUpperBounds) {
  StoreHistogram h({1, 10, 100});
  for (int64_t v : {0, 1, 2, 10, 11, 100, 101, 5000}) h.Observe(v);
  const StoreHistogram::Snapshot s = h.snapshot();
  EXPECT_EQ(s.counts, (std::vector<uint64_t>{2, 2, 2, 2}));
  EXPECT_EQ(s.count, 8u);
  EXPECT_EQ(s.sum, 0 + 1 + 2 + 10 + 11 + 100 + 101 + 5000);
}

}  // namespace
}  // namespace tessera::server
