#include "worker/client/parameter_client.h"

#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/encoding.h"
#include "common/placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/client/fake_shard_for_test.h"

namespace tessera {
namespace client {
namespace {

using testing_fakes::FakeShard;

class ParameterClientTest : public ::testing::Test {
 protected:
  // Builds a client over `num_shards` fake shards with SGD lr 1.
  void MakeClient(int num_shards, int64_t partition_bytes = 64, int max_attempts = 5) {
    ParameterClient::Options o;
    o.job_id = "job";
    o.worker_id = 2;
    o.incarnation = 9;
    o.partition_bytes = partition_bytes;
    o.retry.max_attempts = max_attempts;
    o.retry.initial_backoff = absl::Milliseconds(1);
    o.retry.max_backoff = absl::Milliseconds(4);
    std::vector<std::unique_ptr<ShardClient>> shards;
    fakes_.clear();
    for (int i = 0; i < num_shards; ++i) {
      o.shard_addresses.push_back(absl::StrCat("fake-shard-", i, ":70", i));
      auto f = std::make_unique<FakeShard>(o.shard_addresses.back(), 1.0f);
      fakes_.push_back(f.get());
      shards.push_back(std::move(f));
    }
    auto c = ParameterClient::CreateWithShards(o, std::move(shards));
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // Declares tensor "w" of n elements with initial values 0, 1, 2, ...
  void DeclareW(int64_t n) {
    initial_.resize(n);
    for (int64_t i = 0; i < n; ++i) initial_[i] = static_cast<float>(i);
    v1::JobConfig config;
    config.set_consistency(v1::CONSISTENCY_ASP);
    config.set_num_workers(1);
    ASSERT_TRUE(client_->DeclareJob(config, {{"w", {n}, initial_}}, {}).ok());
  }

  std::vector<FakeShard*> fakes_;
  std::unique_ptr<ParameterClient> client_;
  std::vector<float> initial_;
};

TEST_F(ParameterClientTest, RoutesEveryPartitionToItsShardAndReturnsWeights) {
  MakeClient(3);
  DeclareW(1000);  // 16 elements per partition: 63 partitions
  std::vector<float> grad(1000), out(1000, -1.0f);
  for (int i = 0; i < 1000; ++i) grad[i] = static_cast<float>(i % 7);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 63u);
  EXPECT_EQ(r->retries, 0u);
  EXPECT_EQ(r->min_version, 1);
  EXPECT_EQ(r->max_version, 1);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(out[i], initial_[i] - grad[i]) << i;

  std::vector<int> covered(1000, 0);
  size_t partitions = 0;
  for (int s = 0; s < 3; ++s) {
    for (const auto& [key, w] : fakes_[s]->dense()) {
      ASSERT_EQ(key.first, "w");
      EXPECT_EQ(ShardOfPartition("job", "w", key.second, 3), s);
      const int64_t offset = key.second * 16;
      EXPECT_EQ(static_cast<int64_t>(w.size()), std::min<int64_t>(16, 1000 - offset));
      for (size_t j = 0; j < w.size(); ++j) {
        ++covered[offset + j];
        EXPECT_EQ(w[j], out[offset + j]);
      }
      ++partitions;
    }
    EXPECT_FALSE(fakes_[s]->dense().empty()) << "shard " << s << " holds no partition";
  }
  EXPECT_EQ(partitions, 63u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(covered[i], 1) << i;

  std::vector<float> pulled(1000);
  int64_t version = -1;
  ASSERT_TRUE(client_->Pull("w", -1, absl::MakeSpan(pulled), &version).ok());
  EXPECT_EQ(pulled, out);
  EXPECT_EQ(version, 1);
}

TEST_F(ParameterClientTest, SeqIncreasesPerRequestAndCarriesIdentity) {
  MakeClient(1, 4);
  DeclareW(3);
  std::vector<float> grad(3, 1.0f);
  ASSERT_TRUE(client_->PushPull("w", 0, grad, {}).get().ok());
  ASSERT_TRUE(client_->PushPull("w", 1, grad, {}).get().ok());
  EXPECT_EQ(fakes_[0]->seqs(), (std::vector<uint64_t>{1, 2, 3, 4, 5, 6}));
}

// `urgent` reaches every request of the call, one tensor's partitions and a batch's alike, and
// only those.
TEST_F(ParameterClientTest, UrgentMarksEveryRequestOfTheCall) {
  MakeClient(2, 16);
  DeclareW(10);  // 4 elements per partition: 3 partitions
  std::vector<float> grad(10, 1.0f), out(10);
  const auto run = [&](bool many, bool urgent) {
    std::promise<absl::Status> done;
    const auto callback = [&](absl::StatusOr<PushPullResult> r) { done.set_value(r.status()); };
    if (many) {
      client_->PushPullManyAsync(0, {{"w", grad, absl::MakeSpan(out)}}, callback, urgent);
    } else {
      client_->PushPullAsync("w", 0, grad, absl::MakeSpan(out), callback, urgent);
    }
    return done.get_future().get();
  };
  // The marks of the requests the shards got since the last call.
  std::vector<size_t> read(fakes_.size(), 0);
  const auto marks = [&] {
    std::vector<bool> fresh;
    for (size_t i = 0; i < fakes_.size(); ++i) {
      const std::vector<bool> u = fakes_[i]->urgent();
      fresh.insert(fresh.end(), u.begin() + static_cast<std::ptrdiff_t>(read[i]), u.end());
      read[i] = u.size();
    }
    return fresh;
  };
  ASSERT_TRUE(run(false, true).ok());
  EXPECT_EQ(marks(), std::vector<bool>(3, true)) << "one request per partition, all urgent";
  ASSERT_TRUE(run(true, false).ok());
  const std::vector<bool> bulk = marks();
  ASSERT_FALSE(bulk.empty());
  EXPECT_EQ(bulk, std::vector<bool>(bulk.size(), false)) << "a plain batch is bulk";
  ASSERT_TRUE(run(true, true).ok());
  const std::vector<bool> urgent = marks();
  EXPECT_EQ(urgent, std::vector<bool>(bulk.size(), true)) << "one request per shard, all urgent";
}

TEST_F(ParameterClientTest, DeclareJobBatchesUnderTheRequestLimit) {
  ParameterClient::Options o;
  o.job_id = "job";
  o.shard_addresses = {"fake:1"};
  o.partition_bytes = 4000;
  o.max_request_bytes = 10000;
  auto fake = std::make_unique<FakeShard>("fake:1", 1.0f);
  FakeShard* f = fake.get();
  std::vector<std::unique_ptr<ShardClient>> shards;
  shards.push_back(std::move(fake));
  auto c = ParameterClient::CreateWithShards(o, std::move(shards));
  ASSERT_TRUE(c.ok());
  std::vector<float> init(10000, 0.5f);
  v1::SparseTableDecl table;
  table.set_name("emb");
  table.set_dim(4);
  ASSERT_TRUE((*c)->DeclareJob(v1::JobConfig(), {{"w", {10000}, init}}, {table}).ok());
  // 10 partitions of 4000 bytes, two per batch.
  const auto calls = f->create_calls();
  ASSERT_EQ(calls.size(), 5u);
  int partitions = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_LE(calls[i].ByteSizeLong(), 10000u) << "batch " << i;
    EXPECT_EQ(calls[i].job_id(), "job");
    EXPECT_EQ(calls[i].tables_size(), i == 0 ? 1 : 0);
    partitions += calls[i].partitions_size();
  }
  EXPECT_EQ(partitions, 10);
  EXPECT_EQ(f->dense().size(), 10u);
}

TEST_F(ParameterClientTest, RetriesTransportErrorsWithTheSameSeq) {
  MakeClient(1, 64);
  DeclareW(16);  // one partition
  fakes_[0]->FailNext(3, absl::StatusCode::kUnavailable);
  std::vector<float> grad(16, 2.0f), out(16);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->retries, 3u);
  EXPECT_EQ(fakes_[0]->seqs(), (std::vector<uint64_t>{1, 1, 1, 1}));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(out[i], initial_[i] - 2.0f);
}

TEST_F(ParameterClientTest, RetriesDeadlineExceededAndResponseUnavailable) {
  MakeClient(1, 64);
  DeclareW(16);
  fakes_[0]->FailNext(2, absl::StatusCode::kDeadlineExceeded);
  std::vector<float> grad(16, 1.0f);
  ASSERT_TRUE(client_->PushPull("w", 0, grad, {}).get().ok());
  fakes_[0]->FailNext(1, absl::StatusCode::kUnavailable, /*in_response=*/true);
  ASSERT_TRUE(client_->PushPull("w", 1, grad, {}).get().ok());
  EXPECT_EQ(fakes_[0]->seqs(), (std::vector<uint64_t>{1, 1, 1, 2, 2}));
}

TEST_F(ParameterClientTest, LostResponseRetriedIsAppliedExactlyOnce) {
  MakeClient(2, 64);
  DeclareW(64);
  for (FakeShard* f : fakes_) f->DropResponses(2);
  std::vector<float> grad(64, 3.0f), out(64);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->retries, 2u);
  EXPECT_GE(r->duplicates, 1u);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(out[i], initial_[i] - 3.0f) << i;
}

TEST_F(ParameterClientTest, GivesUpAfterMaxAttemptsWithTheAddress) {
  MakeClient(1, 64, /*max_attempts=*/3);
  DeclareW(16);
  fakes_[0]->FailNext(10, absl::StatusCode::kUnavailable);
  std::vector<float> grad(16, 1.0f);
  auto r = client_->PushPull("w", 4, grad, {}).get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("fake-shard-0:700"), absl::string_view::npos) << r.status();
  EXPECT_NE(r.status().message().find("partition 0 step 4"), absl::string_view::npos) << r.status();
  EXPECT_EQ(fakes_[0]->seqs().size(), 3u);
}

TEST_F(ParameterClientTest, NonRetryableResponseErrorIsNotRetriedAndNamesTheShard) {
  MakeClient(1, 64);
  DeclareW(16);
  fakes_[0]->FailNext(1, absl::StatusCode::kInvalidArgument, /*in_response=*/true);
  std::vector<float> grad(16, 1.0f);
  auto r = client_->PushPull("w", 0, grad, {}).get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("fake-shard-0:700"), absl::string_view::npos) << r.status();
  EXPECT_NE(r.status().message().find("injected response failure"), absl::string_view::npos);
  EXPECT_EQ(fakes_[0]->seqs().size(), 1u);
}

TEST_F(ParameterClientTest, ValidatesSizesAndNames) {
  MakeClient(1, 64);
  DeclareW(16);
  std::vector<float> grad(15), out(16);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("15"), absl::string_view::npos);
  std::vector<float> grad16(16);
  EXPECT_EQ(client_->PushPull("nope", 0, grad16, {}).get().status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->PushPull("w", -1, grad16, {}).get().status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> small(3);
  EXPECT_EQ(client_->Pull("w", -1, absl::MakeSpan(small)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(fakes_[0]->seqs().empty());
}

TEST_F(ParameterClientTest, CreateRejectsBadOptions) {
  ParameterClient::Options o;
  o.job_id = "j";
  EXPECT_EQ(ParameterClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.shard_addresses = {"127.0.0.1:1"};
  o.partition_bytes = 2;
  auto r = ParameterClient::Create(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("partition_bytes"), absl::string_view::npos);
  o.partition_bytes = 64;
  o.retry.max_attempts = 0;
  EXPECT_EQ(ParameterClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.retry.max_attempts = 1;
  o.push_encoding = static_cast<v1::Encoding>(42);
  EXPECT_EQ(ParameterClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ParameterClientTest, Bf16PushAndPullOfExactValues) {
  ParameterClient::Options o;
  o.job_id = "job";
  o.shard_addresses = {"a:1", "b:2"};
  o.partition_bytes = 32;
  o.push_encoding = v1::ENCODING_BF16;
  o.pull_encoding = v1::ENCODING_BF16;
  std::vector<std::unique_ptr<ShardClient>> shards;
  shards.push_back(std::make_unique<FakeShard>("a:1", 1.0f));
  shards.push_back(std::make_unique<FakeShard>("b:2", 1.0f));
  auto c = ParameterClient::CreateWithShards(o, std::move(shards));
  ASSERT_TRUE(c.ok());
  std::vector<float> init(40, 8.0f), grad(40), out(40);
  for (int i = 0; i < 40; ++i) grad[i] = static_cast<float>(i % 5) * 0.5f;
  ASSERT_TRUE((*c)->DeclareJob(v1::JobConfig(), {{"w", {4, 10}, init}}, {}).ok());
  ASSERT_TRUE((*c)->PushPull("w", 0, grad, absl::MakeSpan(out)).get().ok());
  for (int i = 0; i < 40; ++i) EXPECT_EQ(out[i], 8.0f - grad[i]);
}

// An fp32 gradient is lent to the transport, not copied: each partition's push data is a view of
// the caller's gradient at the partition's offset, in PushPull and PushPullMany alike. bf16 is
// encoded into the request instead.
TEST_F(ParameterClientTest, Fp32GradientIsLentToTheTransportNotCopied) {
  MakeClient(2, 64);  // 16 values per partition
  DeclareW(40);
  std::vector<float> grad(40), out(40);
  for (int i = 0; i < 40; ++i) grad[i] = static_cast<float>(i % 3);
  ASSERT_TRUE(client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get().ok());
  for (int i = 0; i < 40; ++i) ASSERT_EQ(out[i], initial_[i] - grad[i]) << i;
  std::set<const char*> starts;
  for (FakeShard* f : fakes_) {
    for (const std::vector<absl::string_view>& call : f->lent()) {
      ASSERT_EQ(call.size(), 1u);
      const char* base = reinterpret_cast<const char*>(grad.data());
      ASSERT_GE(call[0].data(), base);
      const size_t offset = static_cast<size_t>(call[0].data() - base);
      EXPECT_EQ(offset % 64, 0u);
      EXPECT_EQ(call[0].size(), std::min<size_t>(64, 160 - offset));
      starts.insert(call[0].data());
    }
  }
  EXPECT_EQ(starts.size(), 3u);  // partitions at 0, 64 and 128 bytes

  std::vector<size_t> calls_before;
  for (FakeShard* f : fakes_) calls_before.push_back(f->lent().size());
  std::promise<absl::StatusOr<PushPullResult>> many;
  client_->PushPullManyAsync(1, {{"w", grad, absl::MakeSpan(out)}},
                             [&](absl::StatusOr<PushPullResult> r) { many.set_value(r); });
  ASSERT_TRUE(many.get_future().get().ok());
  for (int i = 0; i < 40; ++i) ASSERT_EQ(out[i], initial_[i] - 2 * grad[i]) << i;
  size_t lent_slices = 0;
  for (size_t k = 0; k < fakes_.size(); ++k) {
    const std::vector<std::vector<absl::string_view>> calls = fakes_[k]->lent();
    for (size_t call = calls_before[k]; call < calls.size(); ++call) {
      for (absl::string_view v : calls[call]) {
        EXPECT_GE(v.data(), reinterpret_cast<const char*>(grad.data()));
        EXPECT_LE(v.data() + v.size(), reinterpret_cast<const char*>(grad.data() + grad.size()));
        ++lent_slices;
      }
    }
  }
  EXPECT_EQ(lent_slices, 3u);
}

TEST_F(ParameterClientTest, Bf16PushIsEncodedIntoTheRequest) {
  ParameterClient::Options o;
  o.job_id = "job";
  o.shard_addresses = {"a:1"};
  o.push_encoding = v1::ENCODING_BF16;
  std::vector<std::unique_ptr<ShardClient>> shards;
  auto fake = std::make_unique<FakeShard>("a:1", 1.0f);
  FakeShard* f = fake.get();
  shards.push_back(std::move(fake));
  auto c = ParameterClient::CreateWithShards(o, std::move(shards));
  ASSERT_TRUE(c.ok());
  std::vector<float> init(8, 4.0f), grad(8, 0.5f), out(8);
  ASSERT_TRUE((*c)->DeclareJob(v1::JobConfig(), {{"w", {8}, init}}, {}).ok());
  ASSERT_TRUE((*c)->PushPull("w", 0, grad, absl::MakeSpan(out)).get().ok());
  for (float v : out) EXPECT_EQ(v, 3.5f);
  ASSERT_EQ(f->lent().size(), 1u);
  EXPECT_TRUE(f->lent()[0].empty());
}

TEST_F(ParameterClientTest, SparseRowsRouteByRowAndComeBackInPlace) {
  MakeClient(3, 64);
  v1::SparseTableDecl table;
  table.set_name("emb");
  table.set_dim(2);
  ASSERT_TRUE(client_->DeclareJob(v1::JobConfig(), {}, {table}).ok());
  const std::vector<int64_t> rows = {5, 1000000007, -3, 42, 77, 12};
  std::vector<float> grad(rows.size() * 2), out(rows.size() * 2);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i + 1);
  auto r = client_->PushPullSparse("emb", 0, rows, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t i = 0; i < grad.size(); ++i) EXPECT_EQ(out[i], -grad[i]) << i;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int s = ShardOfSparseRow("job", "emb", rows[i], 3);
    auto held = fakes_[s]->sparse_rows();
    ASSERT_EQ(held.count(rows[i]), 1u) << "row " << rows[i] << " not on shard " << s;
    EXPECT_EQ(held[rows[i]][1], -grad[i * 2 + 1]);
  }
  std::vector<float> pulled(out.size());
  ASSERT_TRUE(client_->PullSparse("emb", -1, rows, absl::MakeSpan(pulled)).ok());
  EXPECT_EQ(pulled, out);
  EXPECT_EQ(client_->PullSparse("nope", -1, rows, absl::MakeSpan(pulled)).code(),
            absl::StatusCode::kNotFound);
}

struct BackoffCase {
  int retry;
  double unit;
  absl::Duration expected;
};

TEST_F(ParameterClientTest, PushPullManySendsOneRequestPerShard) {
  MakeClient(3, 64);  // 16 values per partition
  std::vector<float> a0(40), b0(10), c0(5);
  for (size_t i = 0; i < a0.size(); ++i) a0[i] = 100.0f + static_cast<float>(i);
  for (size_t i = 0; i < b0.size(); ++i) b0[i] = 200.0f + static_cast<float>(i);
  for (size_t i = 0; i < c0.size(); ++i) c0[i] = 300.0f + static_cast<float>(i);
  v1::JobConfig config;
  config.set_consistency(v1::CONSISTENCY_ASP);
  config.set_num_workers(1);
  ASSERT_TRUE(
      client_->DeclareJob(config, {{"a", {40}, a0}, {"b", {10}, b0}, {"c", {5}, c0}}, {}).ok());
  std::set<int> shards;
  for (const char* name : {"a", "b", "c"}) {
    for (const PartitionSpan& p : (*client_->Layout(name))->partitions) shards.insert(p.shard);
  }
  std::vector<size_t> seqs_before;
  for (FakeShard* f : fakes_) seqs_before.push_back(f->seqs().size());

  std::vector<float> ga(40, 1.0f), gb(10, 2.0f), gc(5, 3.0f);
  std::vector<float> wa(40, -1.0f), wb(10, -1.0f), wc(5, -1.0f);
  std::promise<absl::StatusOr<PushPullResult>> promise;
  client_->PushPullManyAsync(
      0,
      {{"a", ga, absl::MakeSpan(wa)}, {"b", gb, absl::MakeSpan(wb)}, {"c", gc, absl::MakeSpan(wc)}},
      [&](absl::StatusOr<PushPullResult> r) { promise.set_value(std::move(r)); });
  absl::StatusOr<PushPullResult> r = promise.get_future().get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, shards.size());
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(fakes_[s]->seqs().size() - seqs_before[s], shards.count(s)) << "shard " << s;
  }
  for (size_t i = 0; i < 40; ++i) ASSERT_EQ(wa[i], a0[i] - 1.0f) << i;
  for (size_t i = 0; i < 10; ++i) ASSERT_EQ(wb[i], b0[i] - 2.0f) << i;
  for (size_t i = 0; i < 5; ++i) ASSERT_EQ(wc[i], c0[i] - 3.0f) << i;

  // Push only: applied, nothing written back.
  std::vector<float> empty;
  std::promise<absl::StatusOr<PushPullResult>> push_only;
  client_->PushPullManyAsync(1, {{"b", gb, absl::Span<float>()}},
                             [&](absl::StatusOr<PushPullResult> r) { push_only.set_value(r); });
  ASSERT_TRUE(push_only.get_future().get().ok());
  std::vector<float> pulled(10);
  ASSERT_TRUE(client_->Pull("b", -1, absl::MakeSpan(pulled)).ok());
  for (size_t i = 0; i < 10; ++i) ASSERT_EQ(pulled[i], b0[i] - 4.0f) << i;

  const auto refused = [&](std::vector<ParameterClient::TensorUpdate> tensors) {
    std::promise<absl::StatusOr<PushPullResult>> p;
    client_->PushPullManyAsync(2, std::move(tensors),
                               [&](absl::StatusOr<PushPullResult> r) { p.set_value(r); });
    return p.get_future().get().status();
  };
  absl::Status twice = refused({{"b", gb, {}}, {"b", gb, {}}});
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(twice.message()), ::testing::HasSubstr("'b' appears twice"));
  absl::Status size = refused({{"a", gb, {}}});
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(size.message()), ::testing::HasSubstr("gradient has 10 values"));
  EXPECT_EQ(refused({{"nope", gb, {}}}).code(), absl::StatusCode::kNotFound);
}

TEST_F(ParameterClientTest, DestructorCancelsCallsInFlightInsteadOfWaitingForTheirDeadline) {
  MakeClient(2, 64);
  DeclareW(40);
  std::vector<FakeShard::Tally> tallies(fakes_.size());
  for (size_t k = 0; k < fakes_.size(); ++k) {
    fakes_[k]->HoldPushPulls();
    fakes_[k]->TallyOnDestroy(&tallies[k]);
  }
  std::vector<float> grad(40, 1.0f), weights(40, 0.0f);
  absl::Notification done;
  absl::StatusOr<PushPullResult> result;
  client_->PushPullAsync("w", 0, grad, absl::MakeSpan(weights),
                         [&](absl::StatusOr<PushPullResult> r) {
                           result = std::move(r);
                           done.Notify();
                         });
  EXPECT_FALSE(done.HasBeenNotified());
  const absl::Time start = absl::Now();
  client_.reset();  // the default call_timeout is 30 s: it must not wait for it
  fakes_.clear();   // destroyed with the client
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_TRUE(done.HasBeenNotified());
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled) << result.status();
  // Cancelled calls are not retried: each partition was sent exactly once.
  size_t sent = 0;
  for (const FakeShard::Tally& t : tallies) {
    EXPECT_EQ(t.cancel_pending_calls, 1);
    sent += t.push_pulls;
  }
  EXPECT_EQ(sent, 40 * sizeof(float) / 64 + (40 * sizeof(float) % 64 != 0));
}

TEST(RetryBackoffTest, CappedExponentialWithJitter) {
  RetryPolicy p;
  p.initial_backoff = absl::Milliseconds(10);
  p.max_backoff = absl::Milliseconds(100);
  p.multiplier = 2.0;
  p.jitter = 0.5;
  const std::vector<BackoffCase> cases = {
      {1, 0.5, absl::Milliseconds(10)},  {2, 0.5, absl::Milliseconds(20)},
      {3, 0.5, absl::Milliseconds(40)},  {4, 0.5, absl::Milliseconds(80)},
      {5, 0.5, absl::Milliseconds(100)}, {30, 0.5, absl::Milliseconds(100)},
      {1, 0.0, absl::Milliseconds(5)},   {5, 0.0, absl::Milliseconds(50)},
      {2, 0.75, absl::Milliseconds(25)},
  };
  for (const BackoffCase& c : cases) {
    EXPECT_EQ(RetryBackoff(p, c.retry, c.unit), c.expected)
        << "retry " << c.retry << " unit " << c.unit;
  }
}

}  // namespace
}  // namespace client
}  // namespace tessera
