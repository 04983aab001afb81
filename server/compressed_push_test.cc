// Compressed pushes on a shard (SIGN1, TOPK; common/gradient_compression.h): applied as the
// decoded gradient, in ASP and averaged in BSP, from pieces as from one buffer, and refused with
// INVALID_ARGUMENT naming the key when malformed, on a sparse table, or asked for as weights.
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/gradient_compression.h"
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

v1::Slice Compressed(const std::string& tensor, uint32_t index, v1::Encoding encoding,
                     const std::vector<float>& x, size_t top_k = 0, bool want = false) {
  v1::Slice s;
  *s.mutable_key() = Key(tensor, index);
  s.set_encoding(encoding);
  s.set_want_weights(want);
  EncodeCompressed(encoding, x.data(), x.size(), top_k, s.mutable_data());
  return s;
}

std::vector<float> Decoded(const v1::Slice& s, size_t n) {
  std::vector<float> out(n);
  DecodeCompressed(s.encoding(), s.data(), out.data(), n);
  return out;
}

TEST(CompressedPushTest, AspAppliesTheDecodedGradient) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("c", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 10);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  const std::vector<float> g = {1, -2, 3, -4, 0.5f, 6, -7, 8, 0.25f, -10};
  const v1::Slice sign = Compressed("w", 0, v1::ENCODING_SIGN1, g);
  ASSERT_TRUE(store.Push(Request("c", 0, 1, 0, 1, {sign})).ok());
  const v1::Slice top = Compressed("w", 0, v1::ENCODING_TOPK, g, 3);
  ASSERT_TRUE(store.Push(Request("c", 0, 1, 1, 2, {top})).ok());
  const std::vector<float> a = Decoded(sign, 10), b = Decoded(top, 10);
  std::vector<float> want(10);
  for (size_t i = 0; i < 10; ++i) want[i] = (0.0f - 0.5f * a[i]) - 0.5f * b[i];
  EXPECT_EQ(PullDense(store, "c", "w", 0), want);
  // TOPK kept -10, 8 and -7 only.
  EXPECT_EQ(b, (std::vector<float>{0, 0, 0, 0, 0, 0, -7, 8, 0, -10}));
}

TEST(CompressedPushTest, BspAveragesTheRanksDecodedGradients) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("b", Config(v1::CONSISTENCY_BSP, 2, 1.0f));
  *job.add_partitions() = Dense("w", 0, 4);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  const v1::Slice s0 = Compressed("w", 0, v1::ENCODING_SIGN1, {1, -1, 2, -2});  // scale 1.5
  const v1::Slice s1 = Compressed("w", 0, v1::ENCODING_TOPK, {0, 4, 0, 1}, 1);  // 4 at index 1
  ASSERT_TRUE(store.Push(Request("b", 0, 1, 0, 1, {s0})).ok());
  ASSERT_TRUE(store.Push(Request("b", 1, 1, 0, 1, {s1})).ok());
  EXPECT_EQ(PullDense(store, "b", "w", 0),
            (std::vector<float>{-0.75f, -(-1.5f + 4.0f) / 2, -0.75f, 0.75f}));
}

TEST(CompressedPushTest, MalformedSparseOrPulledCompressionIsInvalidArgumentNamingTheKey) {
  ParameterStore store;
  v1::CreateJobStateRequest job = JobRequest("m", Config(v1::CONSISTENCY_ASP, 1, 0.5f));
  *job.add_partitions() = Dense("w", 0, 10);
  *job.add_tables() = Table("emb", 4, v1::Initializer::KIND_ZEROS, 1);
  ASSERT_TRUE(store.CreateJobState(job).ok());
  v1::Slice short_sign = Compressed("w", 0, v1::ENCODING_SIGN1, std::vector<float>(10, 1.0f));
  short_sign.mutable_data()->pop_back();
  auto ack = store.Push(Request("m", 0, 1, 0, 1, {short_sign}));
  EXPECT_EQ(ack.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ack.status().message(), HasSubstr("push[0] key w/0: expected 6 bytes"));

  v1::Slice bad_index = Compressed("w", 0, v1::ENCODING_TOPK, std::vector<float>(10, 1.0f), 2);
  const uint32_t ten = 10;
  std::memcpy(bad_index.mutable_data()->data() + 8, &ten, 4);
  ack = store.Push(Request("m", 0, 1, 0, 1, {bad_index}));
  EXPECT_THAT(ack.status().message(), HasSubstr("index 10 is not below 10"));

  v1::Slice rows = Compressed("emb", 0, v1::ENCODING_SIGN1, std::vector<float>(4, 1.0f));
  rows.add_row_ids(7);
  ack = store.Push(Request("m", 0, 1, 0, 1, {rows}));
  EXPECT_EQ(ack.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ack.status().message(), HasSubstr("is for dense partitions"));

  v1::PullRequest pull;
  pull.set_job_id("m");
  pull.set_step(-1);
  pull.set_encoding(v1::ENCODING_SIGN1);
  *pull.add_keys() = PullKey("w", 0);
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> answer;
  store.Pull(pull, [&](absl::StatusOr<std::vector<v1::Slice>> r) { answer = std::move(r); });
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(answer->status().message(), HasSubstr("compresses pushed gradients only"));
  // Nothing was applied.
  EXPECT_EQ(PullDense(store, "m", "w", 0), std::vector<float>(10, 0.0f));
}

TEST(CompressedPushTest, ANonFiniteScaleFollowsTheJobsPolicy) {
  for (auto policy : {v1::NON_FINITE_POLICY_REJECT, v1::NON_FINITE_POLICY_SKIP}) {
    ParameterStore store;
    v1::JobConfig config = Config(v1::CONSISTENCY_ASP, 1, 0.5f);
    config.set_non_finite_policy(policy);
    v1::CreateJobStateRequest job = JobRequest("n", config);
    *job.add_partitions() = Dense("w", 0, 3);
    ASSERT_TRUE(store.CreateJobState(job).ok());
    const v1::Slice s = Compressed("w", 0, v1::ENCODING_SIGN1, {1.0f, NAN, 2.0f});
    auto ack = store.Push(Request("n", 0, 1, 0, 1, {s}));
    if (policy == v1::NON_FINITE_POLICY_REJECT) {
      EXPECT_EQ(ack.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(ack.status().message(), HasSubstr("NaN or Inf"));
    } else {
      ASSERT_TRUE(ack.ok()) << ack.status();
      EXPECT_EQ(ack->skipped_non_finite, 1u);
    }
    EXPECT_EQ(PullDense(store, "n", "w", 0), std::vector<float>(3, 0.0f));
  }
}

}  // namespace
}  // namespace tessera::server
