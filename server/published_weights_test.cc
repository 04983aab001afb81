// Weight deltas on a shard (server/published_weights.h): whole weights first, then TOPK deltas that
// take a worker's copy to the shard's published weights bit for bit; what a delta leaves out goes
// with later ones; INT8 deltas keep the copy within half a quantisation step; a worker that missed
// a step, a rewind, a refused budget and a delta larger than the weights all get whole weights.
// Through the store: the deltas of a BSP PushPull, sparse rows in fp32 beside them.
#include "server/published_weights.h"

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/gradient_compression.h"
#include "common/testing/push_pull_requests.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/testing/store_calls.h"

namespace tessera::server {
namespace {

using namespace ::tessera::push_pull_requests;   // NOLINT: request builders
using namespace ::tessera::server::store_calls;  // NOLINT: store calls

// A worker's side: its copy and id, updated from each answer as HeldWeights does.
struct Worker {
  uint64_t id = 0;
  std::vector<float> copy;

  void Take(const v1::Slice& answer) {
    if (answer.encoding() == v1::ENCODING_TOPK) {
      ASSERT_NE(id, 0u);
      ASSERT_TRUE(CheckCompressed(v1::ENCODING_TOPK, answer.data(), copy.size()).ok());
      AddTopK(answer.data(), copy.data());
    } else if (answer.encoding() == v1::ENCODING_INT8) {
      ASSERT_NE(id, 0u);
      if (!answer.data().empty()) {
        ASSERT_TRUE(CheckInt8(answer.data(), copy.size()).ok());
        AddInt8(answer.data(), copy.data(), copy.size());
      }
    } else {
      ASSERT_EQ(answer.encoding(), v1::ENCODING_FP32);
      copy = Floats(answer);
    }
    id = answer.weights_id();
  }
};

v1::Slice Ask(PublishedWeights& published, const std::vector<float>& w, int64_t version,
              uint64_t held, double fraction, v1::Encoding encoding = v1::ENCODING_TOPK) {
  v1::Slice slice;
  published.Answer(SharedWeights(w), version, held, encoding, fraction, &slice);
  EXPECT_EQ(slice.version(), version);
  return slice;
}

TEST(PublishedWeightsTest, WholeWeightsFirstThenDeltasThatRebuildThePublishedWeights) {
  PublishedWeights published(nullptr);
  std::vector<float> w = {1, 2, 3, 4, 5, 6, 7, 8};
  Worker a, b;
  v1::Slice first = Ask(published, w, 1, 0, 0.25);
  EXPECT_EQ(first.encoding(), v1::ENCODING_FP32);
  ASSERT_NE(first.weights_id(), 0u);
  a.Take(first);
  b.Take(Ask(published, w, 1, 0, 0.25));
  EXPECT_EQ(a.copy, w);
  EXPECT_EQ(b.id, a.id);

  // Step 2 changes every value; the delta carries the 2 largest changes.
  const std::vector<float> change = {0.5f, -4, 0.25f, 3, -0.125f, 1, 0, -0.75f};
  for (size_t i = 0; i < w.size(); ++i) w[i] += change[i];
  const v1::Slice delta = Ask(published, w, 2, a.id, 0.25);
  ASSERT_EQ(delta.encoding(), v1::ENCODING_TOPK);
  EXPECT_EQ(delta.data().size(), 2 * 8u);
  const uint64_t before = a.id;
  a.Take(delta);
  EXPECT_NE(a.id, before);
  EXPECT_EQ(a.copy, (std::vector<float>{1, -2, 3, 7, 5, 6, 7, 8}));
  // The second worker gets the same bytes.
  const v1::Slice again = Ask(published, w, 2, b.id, 0.25);
  EXPECT_EQ(again.data(), delta.data());
  b.Take(again);
  EXPECT_EQ(b.copy, a.copy);
  EXPECT_EQ(b.id, a.id);
  // Asked again at the same version: nothing to add.
  const v1::Slice none = Ask(published, w, 2, a.id, 0.25);
  EXPECT_EQ(none.encoding(), v1::ENCODING_TOPK);
  EXPECT_TRUE(none.data().empty());
  EXPECT_EQ(none.weights_id(), a.id);

  // The weights stay; each later step sends the next largest of what is left (error feedback),
  // so 6 values left at 2 per step take 3 more steps, and then the copy is the weights.
  for (int64_t v = 3; v <= 5; ++v) a.Take(Ask(published, w, v, a.id, 0.25));
  EXPECT_EQ(a.copy, w);
  // A worker that missed those steps gets the published weights whole.
  const v1::Slice whole = Ask(published, w, 5, b.id, 0.25);
  EXPECT_EQ(whole.encoding(), v1::ENCODING_FP32);
  b.Take(whole);
  EXPECT_EQ(b.copy, a.copy);
  EXPECT_EQ(b.id, a.id);
}

TEST(PublishedWeightsTest, TheWorkersTrailTheWeightsByWhatTheDeltasLeftOut) {
  PublishedWeights published(nullptr);
  const size_t n = 1000;
  std::vector<float> w(n);
  for (size_t i = 0; i < n; ++i) w[i] = std::sin(static_cast<float>(i));
  Worker a;
  a.Take(Ask(published, w, 1, 0, 0.1));
  // The same deltas without error feedback: the top-k of each step's own change.
  std::vector<float> plain = w;
  double l1 = 0, plain_l1 = 0;
  for (int64_t v = 2; v <= 40; ++v) {
    std::vector<float> change(n);
    for (size_t i = 0; i < n; ++i) {
      change[i] = -0.01f * std::cos(static_cast<float>(i * v));
      w[i] += change[i];
    }
    std::string top;
    EncodeCompressed(v1::ENCODING_TOPK, change.data(), n, 100, &top);
    AddTopK(top, plain.data());
    const v1::Slice d = Ask(published, w, v, a.id, 0.1);
    ASSERT_EQ(d.encoding(), v1::ENCODING_TOPK);
    EXPECT_EQ(d.data().size(), 100 * 8u);
    a.Take(d);
    // The copy is published weights: a worker joining now gets exactly it.
    Worker late;
    late.Take(Ask(published, w, v, 0, 0.1));
    ASSERT_EQ(late.copy, a.copy) << "version " << v;
  }
  for (size_t i = 0; i < n; ++i) {
    l1 += std::fabs(w[i] - a.copy[i]);
    plain_l1 += std::fabs(w[i] - plain[i]);
  }
  // Without the feedback the misses of every step add up; with it, what is left is what the
  // latest steps have not sent yet.
  EXPECT_LT(l1, 0.5 * plain_l1) << "with feedback " << l1 << ", without " << plain_l1;
}

// INT8 deltas carry every value of the change, quantised per block of 256: the copy trails the
// weights by at most half a step of each block's scale, the step's miss goes out with the next
// (once the weights stop moving the copy closes in on them), every worker's copy is the published
// weights bit for bit, and a change holding NaN publishes the weights whole.
TEST(PublishedWeightsTest, Int8DeltasKeepTheCopyWithinHalfAStepOfTheWeights) {
  PublishedWeights published(nullptr);
  const size_t n = 1000;  // 4 blocks, the last of 232 values
  std::vector<float> w(n);
  for (size_t i = 0; i < n; ++i) w[i] = std::sin(static_cast<float>(i));
  Worker a;
  a.Take(Ask(published, w, 1, 0, 0, v1::ENCODING_INT8));
  ASSERT_EQ(a.copy, w);
  float largest_change = 0;
  for (int64_t v = 2; v <= 30; ++v) {
    for (size_t i = 0; i < n; ++i) {
      const float change = 0.01f * std::cos(static_cast<float>(i * v)) * (i < 500 ? 1.0f : 0.1f);
      w[i] += change;
      largest_change = std::max(largest_change, std::fabs(change));
    }
    const v1::Slice d = Ask(published, w, v, a.id, 0, v1::ENCODING_INT8);
    ASSERT_EQ(d.encoding(), v1::ENCODING_INT8);
    ASSERT_EQ(d.data().size(), Int8Bytes(n));
    EXPECT_EQ(d.data().size(), 4 * 4 + n);
    a.Take(d);
    Worker late;
    late.Take(Ask(published, w, v, 0, 0, v1::ENCODING_INT8));
    ASSERT_EQ(late.copy, a.copy) << "version " << v;
    // Each block's scale is its largest change plus the miss carried over, / 127.
    for (size_t i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(w[i] - a.copy[i]), 2 * largest_change / 254) << v << " " << i;
    }
  }
  // The weights stay: each publish quantises the miss itself, 127 times finer each time.
  double before = 0, after = 0;
  for (size_t i = 0; i < n; ++i) before += std::fabs(w[i] - a.copy[i]);
  const uint64_t held = a.id;
  a.Take(Ask(published, w, 31, held, 0, v1::ENCODING_INT8));
  for (size_t i = 0; i < n; ++i) after += std::fabs(w[i] - a.copy[i]);
  EXPECT_GT(before, 0);
  EXPECT_LT(after, before / 50) << before << " -> " << after;
  // A worker holding the same state but asking for TOPK deltas gets whole weights.
  const v1::Slice other = Ask(published, w, 31, held, 0.1, v1::ENCODING_TOPK);
  EXPECT_EQ(other.encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(Floats(other), a.copy);
  // NaN in the weights: published whole, so the next answer to a holder is FP32 with them.
  w[7] = NAN;
  const v1::Slice whole = Ask(published, w, 32, a.id, 0, v1::ENCODING_INT8);
  EXPECT_EQ(whole.encoding(), v1::ENCODING_FP32);
  a.Take(whole);
  EXPECT_TRUE(std::isnan(a.copy[7]));
  EXPECT_EQ(a.copy[8], w[8]);
}

TEST(PublishedWeightsTest, RewindRefusedBudgetAndLargeDeltasAnswerWholeWeights) {
  {
    PublishedWeights published(nullptr);
    std::vector<float> w = {1, 2, 3, 4};
    Worker a;
    a.Take(Ask(published, w, 5, 0, 0.5));
    w[0] = 9;
    a.Take(Ask(published, w, 6, a.id, 0.5));
    // Weights from before (a job rebuilt at an older step): whole, as they are.
    const std::vector<float> old = {4, 3, 2, 1};
    const v1::Slice rewound = Ask(published, old, 3, a.id, 0.5);
    EXPECT_EQ(rewound.encoding(), v1::ENCODING_FP32);
    EXPECT_EQ(Floats(rewound), old);
  }
  {
    auto budget = std::make_shared<MemoryBudget>(16);  // under 2 x 4 values
    PublishedWeights published(budget);
    const std::vector<float> w = {1, 2, 3, 4};
    const v1::Slice plain = Ask(published, w, 1, 0, 0.5);
    EXPECT_EQ(plain.encoding(), v1::ENCODING_FP32);
    EXPECT_EQ(plain.weights_id(), 0u);
    EXPECT_EQ(Floats(plain), w);
    EXPECT_EQ(published.charged(), 0);
    EXPECT_EQ(budget->used(), 0);
  }
  {
    auto budget = std::make_shared<MemoryBudget>(1 << 20);
    {
      PublishedWeights published(budget);
      std::vector<float> w = {1, 2, 3, 4};
      Worker a;
      a.Take(Ask(published, w, 1, 0, 1.0));
      EXPECT_EQ(budget->used(), 32);
      // A delta of every value (8 bytes each) is larger than the weights: whole weights.
      for (float& x : w) x += 1;
      const v1::Slice d = Ask(published, w, 2, a.id, 1.0);
      EXPECT_EQ(d.encoding(), v1::ENCODING_FP32);
      EXPECT_EQ(Floats(d), w);
    }
    EXPECT_EQ(budget->used(), 0);
  }
}

// A job `id` on `store`: one dense partition "w"/0 of 8 values and a table "emb" of width 2.
void CreateDeltaJob(ParameterStore& store, const std::string& id, v1::JobConfig config) {
  v1::CreateJobStateRequest job = JobRequest(id, config);
  *job.add_partitions() = Dense("w", 0, 8);
  *job.add_tables() = Table("emb", 2, v1::Initializer::KIND_CONSTANT, 1);
  ASSERT_TRUE(store.CreateJobState(job).ok());
}

// One BSP PushPull of worker 0 of job `id` pulling in `pull_encoding`: the gradient `dense` of
// "w"/0 (naming `held` weights) and one row of "emb", both wanting weights back.
absl::StatusOr<v1::PushPullResponse> PushPullDelta(ParameterStore& store, const std::string& id,
                                                   int64_t step, uint64_t seq, v1::Slice dense,
                                                   uint64_t held, v1::Encoding pull_encoding) {
  dense.set_want_weights(true);
  dense.set_weights_id(held);
  v1::Slice rows = RowsSlice("emb", {3}, {1.0f, 2.0f});
  rows.set_want_weights(true);
  v1::PushPullRequest r = Request(id, 0, 1, step, seq, {dense, rows});
  r.set_pull_encoding(pull_encoding);
  std::optional<absl::StatusOr<v1::PushPullResponse>> answer;
  store.PushPull(r, [&](absl::StatusOr<v1::PushPullResponse> a) { answer = std::move(a); });
  EXPECT_TRUE(answer.has_value());
  return answer.value_or(absl::UnknownError("no answer"));
}

// Through the store: a BSP PushPull asking for TOPK weights gets whole weights with an id at
// first, then a delta that the next request's id unlocks; a table's rows beside it come in fp32.
TEST(PublishedWeightsTest, StorePushPullAnswersDeltasForDensePartitionsAndFp32Rows) {
  ParameterStore store;
  v1::JobConfig config = Config(v1::CONSISTENCY_BSP, 1, 1.0f);
  config.set_pull_topk_fraction(0.25);
  ASSERT_NO_FATAL_FAILURE(CreateDeltaJob(store, "d", config));
  auto push_pull = [&](int64_t step, uint64_t seq, const std::vector<float>& g, uint64_t held) {
    return PushPullDelta(store, "d", step, seq, GradSlice("w", 0, g), held, v1::ENCODING_TOPK);
  };
  absl::StatusOr<v1::PushPullResponse> a = push_pull(0, 1, std::vector<float>(8, 1.0f), 0);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->weights_size(), 2);
  EXPECT_EQ(a->weights(0).encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(Floats(a->weights(0)), std::vector<float>(8, -1.0f));
  EXPECT_EQ(a->weights(1).encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(Floats(a->weights(1)), (std::vector<float>{-0.75f, -1.75f}));
  const uint64_t id = a->weights(0).weights_id();
  ASSERT_NE(id, 0u);
  a = push_pull(1, 2, {1, 5, 1, 1, 1, 1, -3, 1}, id);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->weights(0).encoding(), v1::ENCODING_TOPK);
  std::vector<float> copy(8, -1.0f);
  AddTopK(a->weights(0).data(), copy.data());
  EXPECT_EQ(copy, (std::vector<float>{-1, -6, -1, -1, -1, -1, 2, -1}));
  EXPECT_EQ(a->weights(1).encoding(), v1::ENCODING_FP32);
  // The 2 largest changes came; the shard's own weights (an ungated FP32 pull) are ahead.
  EXPECT_EQ(PullDense(store, "d", "w", 0), (std::vector<float>{-2, -6, -2, -2, -2, -2, 2, -2}));
}

// Through the store in INT8: whole weights with an id, then a quantised delta that takes the copy
// to within half a step of the shard's weights; the table's rows beside it in fp32; a gradient
// pushed in INT8 is refused naming the slice.
TEST(PublishedWeightsTest, StorePushPullAnswersInt8DeltasAndRefusesInt8Gradients) {
  ParameterStore store;
  ASSERT_NO_FATAL_FAILURE(CreateDeltaJob(store, "q", Config(v1::CONSISTENCY_BSP, 1, 1.0f)));
  auto push_pull = [&](int64_t step, uint64_t seq, const std::vector<float>& g, uint64_t held,
                       v1::Encoding push_encoding) {
    v1::Slice dense = GradSlice("w", 0, g);
    if (push_encoding != v1::ENCODING_FP32) {
      dense.set_encoding(push_encoding);
      dense.mutable_data()->resize(Int8Bytes(g.size()));
    }
    return PushPullDelta(store, "q", step, seq, dense, held, v1::ENCODING_INT8);
  };
  absl::StatusOr<v1::PushPullResponse> a =
      push_pull(0, 1, std::vector<float>(8, 1.0f), 0, v1::ENCODING_FP32);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->weights(0).encoding(), v1::ENCODING_FP32);
  std::vector<float> copy = Floats(a->weights(0));
  EXPECT_EQ(copy, std::vector<float>(8, -1.0f));
  const uint64_t id = a->weights(0).weights_id();
  ASSERT_NE(id, 0u);
  a = push_pull(1, 2, {1, 5, 1, 1, 1, 1, -3, 0.01f}, id, v1::ENCODING_FP32);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->weights(0).encoding(), v1::ENCODING_INT8);
  ASSERT_TRUE(CheckInt8(a->weights(0).data(), 8).ok());
  AddInt8(a->weights(0).data(), copy.data(), 8);
  const std::vector<float> w = PullDense(store, "q", "w", 0);
  ASSERT_EQ(w, (std::vector<float>{-2, -6, -2, -2, -2, -2, 2, -1.01f}));
  for (size_t i = 0; i < 8; ++i) EXPECT_LE(std::fabs(copy[i] - w[i]), 0.5f * 5 / 127) << i;
  EXPECT_NE(copy, w);  // -1.01 is not a step of 5 / 127 away from -1
  EXPECT_EQ(a->weights(1).encoding(), v1::ENCODING_FP32);
  const absl::StatusOr<v1::PushPullResponse> bad =
      push_pull(2, 3, std::vector<float>(8, 1.0f), a->weights(0).weights_id(), v1::ENCODING_INT8);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("ENCODING_INT8 is for weight deltas in pulls"),
            std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace tessera::server
