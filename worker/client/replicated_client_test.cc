// ParameterClient with replicas 2 (replica_routing.h): pushes reach every copy with one seq, pulls
// read the acting copy, and a shard the coordinator declares down costs a failover, not the call.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/client/fake_shard_for_test.h"
#include "worker/client/parameter_client.h"
#include "worker/client/replica_routing.h"

namespace tessera {
namespace client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing_fakes::FakeShard;

TEST(ReplicaRoutingTest, CopiesWrapAroundAndTheFirstLiveOneActs) {
  ReplicaRouting r(3, 2);
  EXPECT_THAT(r.Copies(0), ElementsAre(0, 1));
  EXPECT_THAT(r.Copies(2), ElementsAre(2, 0));
  EXPECT_EQ(r.Acting(2), 2);
  EXPECT_TRUE(r.IsCopy(2, 0));
  EXPECT_FALSE(r.IsCopy(2, 1));
  std::vector<int> newly;
  ASSERT_TRUE(r.SetDown({2}, &newly).ok());
  EXPECT_THAT(newly, ElementsAre(2));
  EXPECT_THAT(r.LiveCopies(2), ElementsAre(0));
  EXPECT_EQ(r.Acting(2), 0);
  EXPECT_EQ(r.Acting(1), 1);
  ASSERT_TRUE(r.SetDown({2, 1}, &newly).ok());
  EXPECT_THAT(newly, ElementsAre(1));  // 2 was down already
  EXPECT_EQ(r.Acting(1), -1);
  EXPECT_THAT(r.Down(), ElementsAre(1, 2));
  EXPECT_EQ(r.SetDown({3}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReplicaRoutingTest, ValidateNamesReplicas) {
  EXPECT_TRUE(ReplicaRouting::Validate(2, 2).ok());
  const absl::Status too_many = ReplicaRouting::Validate(1, 2);
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_many.message(), HasSubstr("replicas"));
  EXPECT_EQ(ReplicaRouting::Validate(2, 0).code(), absl::StatusCode::kInvalidArgument);
}

class ReplicatedClientTest : public ::testing::Test {
 protected:
  // A client over `num_shards` fake shards (SGD lr 1) keeping two copies of everything; a shard
  // at a new address (SetFill) is a fresh fake, kept in connected_.
  void MakeClient(int num_shards, std::vector<int> down = {},
                  absl::Duration probe_after = absl::Seconds(1)) {
    ParameterClient::Options o;
    o.probe_after = probe_after;
    o.probe_timeout = absl::Milliseconds(100);
    o.job_id = "job";
    o.worker_id = 1;
    o.incarnation = 3;
    o.partition_bytes = 64;  // 16 floats per partition
    o.replicas = 2;
    o.down_shards = std::move(down);
    o.retry.initial_backoff = absl::Milliseconds(1);
    o.retry.max_backoff = absl::Milliseconds(4);
    o.replica_failover_timeout = absl::Seconds(30);
    o.connect = [this](const std::string& address) -> absl::StatusOr<std::unique_ptr<ShardClient>> {
      auto f = std::make_unique<FakeShard>(address, 1.0f);
      connected_.push_back(f.get());
      return std::unique_ptr<ShardClient>(std::move(f));
    };
    std::vector<std::unique_ptr<ShardClient>> shards;
    fakes_.clear();
    for (int i = 0; i < num_shards; ++i) {
      o.shard_addresses.push_back(absl::StrCat("fake-shard-", i, ":80", i));
      auto f = std::make_unique<FakeShard>(o.shard_addresses.back(), 1.0f);
      fakes_.push_back(f.get());
      shards.push_back(std::move(f));
    }
    auto c = ParameterClient::CreateWithShards(o, std::move(shards));
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // Declares dense tensor "w" of n elements (initial values 0, 1, 2, ...) and sparse table "emb"
  // of dim 2.
  void Declare(int64_t n) {
    initial_.resize(n);
    for (int64_t i = 0; i < n; ++i) initial_[i] = static_cast<float>(i);
    v1::JobConfig config;
    config.set_consistency(v1::CONSISTENCY_ASP);
    config.set_num_workers(1);
    v1::SparseTableDecl emb;
    emb.set_name("emb");
    emb.set_dim(2);
    ASSERT_TRUE(client_->DeclareJob(config, {{"w", {n}, initial_}}, {emb}).ok());
  }

  // Shard `s`'s copy of "w", assembled from the partitions it holds (NaN where it holds none).
  std::vector<float> HeldBy(int s) {
    std::vector<float> w(initial_.size(), std::nanf(""));
    const DenseLayout* layout = *client_->Layout("w");
    for (const auto& [key, values] : fakes_[s]->dense()) {
      const PartitionSpan& p = layout->partitions[key.second];
      std::copy(values.begin(), values.end(), w.begin() + p.offset);
    }
    return w;
  }

  std::vector<FakeShard*> fakes_;
  std::vector<FakeShard*> connected_;
  std::unique_ptr<ParameterClient> client_;
  std::vector<float> initial_;
};

TEST_F(ReplicatedClientTest, EveryPushReachesBothCopiesWithOneSeq) {
  MakeClient(2);
  Declare(100);  // 7 partitions, each on both shards
  std::vector<float> grad(100, 0.5f), out(100, -1.0f);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 14u);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(out[i], initial_[i] - 0.5f) << i;
  // Both shards hold every partition, bit-identical, and saw the same seqs.
  EXPECT_EQ(HeldBy(0), HeldBy(1));
  EXPECT_EQ(HeldBy(0), out);
  std::vector<uint64_t> a = fakes_[0]->seqs(), b = fakes_[1]->seqs();
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 7u);
}

TEST_F(ReplicatedClientTest, ManyTensorPushReachesBothCopies) {
  MakeClient(3);
  Declare(40);
  std::vector<float> grad(40, 2.0f), out(40, -1.0f);
  std::promise<absl::StatusOr<PushPullResult>> p;
  client_->PushPullManyAsync(0, {{"w", grad, absl::MakeSpan(out)}},
                             [&](absl::StatusOr<PushPullResult> r) { p.set_value(std::move(r)); });
  auto r = p.get_future().get();
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 40; ++i) ASSERT_EQ(out[i], initial_[i] - 2.0f) << i;
  // Every partition is on exactly two of the three shards, updated on both.
  const DenseLayout* layout = *client_->Layout("w");
  for (const PartitionSpan& part : layout->partitions) {
    int holders = 0;
    for (int s = 0; s < 3; ++s) {
      const auto held = fakes_[s]->dense();
      auto it = held.find({"w", part.index});
      if (it == held.end()) continue;
      ++holders;
      EXPECT_EQ(it->second[0], initial_[part.offset] - 2.0f) << "shard " << s;
      EXPECT_TRUE(s == part.shard || s == (part.shard + 1) % 3) << s;
    }
    EXPECT_EQ(holders, 2) << part.index;
  }
}

TEST_F(ReplicatedClientTest, PullsReadTheActingCopyOnly) {
  MakeClient(2, {0});
  Declare(100);
  fakes_[0]->SetDead(true);
  std::vector<float> out(100, -1.0f);
  ASSERT_TRUE(client_->Pull("w", -1, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, initial_);
  EXPECT_EQ(fakes_[0]->pulls(), 0);
  EXPECT_EQ(fakes_[1]->pulls(), 1);
  EXPECT_THAT(fakes_[0]->create_calls(), IsEmpty());  // nothing is declared on a down shard
}

TEST_F(ReplicatedClientTest, ADownShardsWaitingPushIsAnsweredByItsCopy) {
  MakeClient(2);
  Declare(100);
  fakes_[1]->HoldPushPulls();  // a stopped shard: requests wait unanswered
  std::vector<float> grad(100, 1.0f), out(100, -1.0f);
  auto f = client_->PushPull("w", 4, grad, absl::MakeSpan(out));
  ASSERT_EQ(f.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  ASSERT_TRUE(client_->SetDownShards({1}).ok());
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto r = f.get();
  ASSERT_TRUE(r.ok()) << r.status();
  // Shard 0 applied each push once, and its weights answer every partition (shard 1's acting
  // ones through a pull-only request).
  for (int i = 0; i < 100; ++i) ASSERT_EQ(out[i], initial_[i] - 1.0f) << i;
  EXPECT_EQ(HeldBy(0), out);
  EXPECT_THAT(client_->routing().Down(), ElementsAre(1));
  // Later pushes go to shard 0 alone.
  const size_t before = fakes_[1]->seqs().size();
  ASSERT_TRUE(client_->PushPull("w", 5, grad, absl::MakeSpan(out)).get().ok());
  EXPECT_EQ(fakes_[1]->seqs().size(), before);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(out[i], initial_[i] - 2.0f) << i;
}

TEST_F(ReplicatedClientTest, ABlockingPullWaitsForTheFailoverAndReadsTheCopy) {
  MakeClient(2);
  Declare(100);
  fakes_[1]->SetDead(true);  // gone, and the coordinator has not said so yet
  std::thread coordinator([&] {
    absl::SleepFor(absl::Milliseconds(200));  // far past 5 attempts of 1-4 ms backoff
    ASSERT_TRUE(client_->SetDownShards({1}).ok());
  });
  std::vector<float> out(100, -1.0f);
  const absl::Status pulled = client_->Pull("w", -1, absl::MakeSpan(out));
  coordinator.join();
  ASSERT_TRUE(pulled.ok()) << pulled;
  EXPECT_EQ(out, initial_);
  EXPECT_THAT(client_->TakeUnreachableShards(), ElementsAre(1));
}

TEST_F(ReplicatedClientTest, RetryableErrorsAreRetriedAndNamedForTheReport) {
  MakeClient(2);
  Declare(16);                                             // one partition
  fakes_[1]->FailNext(6, absl::StatusCode::kUnavailable);  // more than max_attempts
  std::vector<float> grad(16, 1.0f), out(16);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->retries, 6u);
  EXPECT_THAT(client_->TakeUnreachableShards(), ElementsAre(1));
  EXPECT_THAT(client_->TakeUnreachableShards(), IsEmpty());
  EXPECT_EQ(HeldBy(0), HeldBy(1));
}

// A stopped shard answers nothing: once a call has waited on it past probe_after, a health check
// asks it, and it is named in the reports while that check finds it silent.
TEST_F(ReplicatedClientTest, AShardThatAnswersNoHealthCheckWhileACallWaitsIsNamed) {
  MakeClient(2, {}, absl::Milliseconds(100));
  Declare(100);
  fakes_[1]->HoldPushPulls();
  fakes_[1]->SetSilent(true);
  std::vector<float> grad(100, 1.0f), out(100, -1.0f);
  auto f = client_->PushPull("w", 0, grad, absl::MakeSpan(out));
  EXPECT_THAT(client_->TakeUnreachableShards(), IsEmpty());
  EXPECT_EQ(fakes_[1]->health_checks(), 0);  // no call has waited 100 ms yet
  std::vector<int> named;
  for (int i = 0; i < 100 && named.empty(); ++i) {  // bounded: 5 s
    absl::SleepFor(absl::Milliseconds(50));
    named = client_->TakeUnreachableShards();
  }
  EXPECT_THAT(named, ElementsAre(1));
  EXPECT_EQ(fakes_[0]->health_checks(), 0);  // it answered every call
  ASSERT_TRUE(client_->SetDownShards({1}).ok());
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  ASSERT_TRUE(f.get().ok());
}

// A call that waits at a barrier for another rank waits as long, but its shard answers the check.
TEST_F(ReplicatedClientTest, AShardThatAnswersItsHealthCheckIsNotNamed) {
  MakeClient(2, {}, absl::Milliseconds(50));
  Declare(100);
  fakes_[1]->HoldWeightRequests();
  std::vector<float> grad(100, 1.0f), out(100, -1.0f);
  auto f = client_->PushPull("w", 0, grad, absl::MakeSpan(out));
  for (int i = 0; i < 100 && fakes_[1]->health_checks() < 2; ++i) {  // bounded: 5 s
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_THAT(client_->TakeUnreachableShards(), IsEmpty());
  }
  EXPECT_GE(fakes_[1]->health_checks(), 2);
  EXPECT_THAT(client_->TakeUnreachableShards(), IsEmpty());
  ASSERT_EQ(f.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  fakes_[1]->CancelPending();
  f.wait();
}

TEST_F(ReplicatedClientTest, DataWithEveryCopyDownFailsUnavailable) {
  MakeClient(3, {0, 1});
  v1::JobConfig config;
  config.set_consistency(v1::CONSISTENCY_ASP);
  config.set_num_workers(1);
  std::vector<float> init(200, 0.0f);
  // Declaring needs every partition to have a live copy; home-0 partitions have none.
  ASSERT_TRUE(client_->AttachJob({{"w", {200}, init}}, {}).ok());
  std::vector<float> grad(200, 1.0f), out(200);
  auto r = client_->PushPull("w", 0, grad, absl::MakeSpan(out)).get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("every copy is down"));
}

TEST_F(ReplicatedClientTest, DownShardsAreCheckedAndNeedCopies) {
  MakeClient(2);
  EXPECT_EQ(client_->SetDownShards({2}).code(), absl::StatusCode::kInvalidArgument);
  ParameterClient::Options o;
  o.job_id = "job";
  o.shard_addresses = {"a:1", "b:2"};
  o.down_shards = {1};
  std::vector<std::unique_ptr<ShardClient>> shards;
  shards.push_back(std::make_unique<FakeShard>("a:1", 1.0f));
  shards.push_back(std::make_unique<FakeShard>("b:2", 1.0f));
  auto c = ParameterClient::CreateWithShards(o, std::move(shards));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);  // replicas 1
  o.replicas = 3;
  shards.clear();
  shards.push_back(std::make_unique<FakeShard>("a:1", 1.0f));
  shards.push_back(std::make_unique<FakeShard>("b:2", 1.0f));
  c = ParameterClient::CreateWithShards(o, std::move(shards));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("replicas"));
}

TEST_F(ReplicatedClientTest, SparseRowsLiveOnBothCopiesAndExportOnce) {
  MakeClient(3);
  Declare(16);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < 30; ++i) rows.push_back(i * 7919 + 11);
  std::vector<float> grad(rows.size() * 2);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i);
  auto r = client_->PushPullSparse("emb", 0, rows, grad, {}).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 3u);  // one per live shard
  for (size_t i = 0; i < rows.size(); ++i) {
    const int home = ShardOfSparseRow("job", "emb", rows[i], 3);
    for (int s = 0; s < 3; ++s) {
      const auto held = fakes_[s]->sparse_rows();
      const bool copy = s == home || s == (home + 1) % 3;
      ASSERT_EQ(held.count(rows[i]), copy ? 1u : 0u) << "row " << rows[i] << " shard " << s;
      if (copy) {
        EXPECT_EQ(held.at(rows[i])[1], -grad[i * 2 + 1]);
      }
    }
  }
  std::vector<int64_t> ids;
  std::vector<float> values;
  ASSERT_TRUE(client_->PullAllRows("emb", &ids, &values).ok());
  std::vector<int64_t> sorted_ids = ids, sorted_rows = rows;
  std::sort(sorted_ids.begin(), sorted_ids.end());
  std::sort(sorted_rows.begin(), sorted_rows.end());
  EXPECT_EQ(sorted_ids, sorted_rows);  // each row once, though two shards hold it
  ASSERT_EQ(values.size(), rows.size() * 2);

  // With a shard down its rows come from their other copy.
  ASSERT_TRUE(client_->SetDownShards({0}).ok());
  fakes_[0]->SetDead(true);
  std::vector<float> out(rows.size() * 2);
  ASSERT_TRUE(client_->PullSparse("emb", -1, rows, absl::MakeSpan(out)).ok());
  for (size_t i = 0; i < grad.size(); ++i) ASSERT_EQ(out[i], -grad[i]) << i;
  ASSERT_TRUE(client_->PullAllRows("emb", &ids, &values).ok());
  EXPECT_EQ(ids.size(), rows.size());
}

// Filling a down shard (docs/reliability.md "Filling a new copy"): it gets every push of the
// fill's step and later, none before, is not read until it is up, and a NOT_FOUND from it (the
// job not installed yet) is sent again.
TEST_F(ReplicatedClientTest, AFilledShardGetsEveryPushFromItsStepAndIsReadOnceUp) {
  MakeClient(2);
  Declare(100);  // 7 partitions, each on both shards
  ASSERT_TRUE(client_->SetDownShards({1}).ok());
  std::vector<float> grad(100, 1.0f), out(100);
  for (int64_t step = 0; step < 2; ++step) {
    ASSERT_TRUE(client_->PushPull("w", step, grad, absl::MakeSpan(out)).get().ok());
  }
  const size_t before = fakes_[1]->seqs().size();
  absl::StatusOr<ParameterClient::FillReport> report = client_->SetFill(1, fakes_[1]->address(), 3);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->from_step, 3);
  EXPECT_FALSE(report->missed);
  ASSERT_TRUE(client_->PushPull("w", 2, grad, absl::MakeSpan(out)).get().ok());
  EXPECT_EQ(fakes_[1]->seqs().size(), before);  // step 2 is in the fill's snapshot
  fakes_[1]->FailNext(3, absl::StatusCode::kNotFound, /*in_response=*/true);
  auto r = client_->PushPull("w", 3, grad, absl::MakeSpan(out)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->retries, 3u);
  // Shard 1 applied step 3 once (it missed 0..2); the weights read are shard 0's.
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(out[i], initial_[i] - 4.0f) << i;
    ASSERT_EQ(HeldBy(1)[i], initial_[i] - 1.0f) << i;
  }
  EXPECT_EQ(fakes_[1]->pulls(), 0);
  EXPECT_EQ(client_->fill_report().from_step, 3);
  // The fill is over: shard 1 is up, and acts for its own partitions again.
  ASSERT_TRUE(client_->SetDownShards({}).ok());
  EXPECT_EQ(client_->routing().filling(), -1);
  ASSERT_TRUE(client_->Pull("w", -1, absl::MakeSpan(out)).ok());
  EXPECT_EQ(fakes_[1]->pulls(), 1);
  const DenseLayout* layout = *client_->Layout("w");
  for (const PartitionSpan& p : layout->partitions) {
    const float want = initial_[p.offset] - (p.shard == 1 ? 1.0f : 4.0f);
    EXPECT_EQ(out[p.offset], want) << "partition " << p.index;
  }
}

TEST_F(ReplicatedClientTest, AFillAfterAPushOfItsStepIsMissed) {
  MakeClient(2);
  Declare(16);
  ASSERT_TRUE(client_->SetDownShards({1}).ok());
  std::vector<float> grad(16, 1.0f), out(16);
  ASSERT_TRUE(client_->PushPull("w", 5, grad, absl::MakeSpan(out)).get().ok());
  absl::StatusOr<ParameterClient::FillReport> late = client_->SetFill(1, fakes_[1]->address(), 5);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(late->missed);
  absl::StatusOr<ParameterClient::FillReport> ahead = client_->SetFill(1, fakes_[1]->address(), 6);
  ASSERT_TRUE(ahead.ok());
  EXPECT_FALSE(ahead->missed);
  EXPECT_EQ(client_->SetFill(0, fakes_[0]->address(), 9).status().code(),
            absl::StatusCode::kInvalidArgument);  // shard 0 is not down
  EXPECT_EQ(client_->SetFill(2, "x:1", 9).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ReplicatedClientTest, AFillGivenUpEndsItsWritesAndTheirPushesStand) {
  MakeClient(2);
  Declare(100);
  ASSERT_TRUE(client_->SetDownShards({1}).ok());
  ASSERT_TRUE(client_->SetFill(1, fakes_[1]->address(), 0).ok());
  fakes_[1]->HoldPushPulls();
  std::vector<float> grad(100, 1.0f), out(100);
  auto f = client_->PushPull("w", 0, grad, absl::MakeSpan(out));
  ASSERT_EQ(f.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  ASSERT_TRUE(client_->SetFill(-1, "", 0).ok());
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto r = f.get();
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 100; ++i) ASSERT_EQ(out[i], initial_[i] - 1.0f) << i;
  EXPECT_EQ(client_->routing().filling(), -1);
  EXPECT_EQ(client_->fill_report().from_step, 0);
}

TEST_F(ReplicatedClientTest, AShardFilledAtANewAddressGetsANewTransport) {
  MakeClient(2);
  Declare(16);
  ASSERT_TRUE(client_->SetDownShards({1}).ok());
  ASSERT_TRUE(client_->SetFill(1, "fake-shard-1:9999", 1).ok());
  ASSERT_EQ(connected_.size(), 1u);
  FakeShard* fresh = connected_[0];
  EXPECT_EQ(fresh->address(), "fake-shard-1:9999");
  fresh->FailNext(1, absl::StatusCode::kNotFound, /*in_response=*/true);  // not installed yet
  v1::CreateJobStateRequest installed;  // what the fill installs there
  installed.set_job_id("job");
  installed.add_partitions()->mutable_key()->set_tensor("w");
  installed.mutable_partitions(0)->set_num_elements(16);
  ASSERT_TRUE(fresh->CreateJobState(installed, absl::InfiniteFuture()).ok());
  std::vector<float> grad(16, 1.0f), out(16);
  ASSERT_TRUE(client_->PushPull("w", 1, grad, absl::MakeSpan(out)).get().ok());
  EXPECT_EQ(fresh->seqs().size(), 2u);  // refused once, then taken
  EXPECT_EQ(fresh->dense().at({"w", 0}), std::vector<float>(16, -1.0f));
  EXPECT_EQ(fakes_[1]->seqs().size(), 0u);  // the old address got nothing
  // Without a way to connect, a new address is refused.
  ParameterClient::Options o = client_->options();
  o.connect = nullptr;
  o.down_shards = {1};
  std::vector<std::unique_ptr<ShardClient>> shards;
  shards.push_back(std::make_unique<FakeShard>(o.shard_addresses[0], 1.0f));
  shards.push_back(std::make_unique<FakeShard>(o.shard_addresses[1], 1.0f));
  auto bare = ParameterClient::CreateWithShards(o, std::move(shards));
  ASSERT_TRUE(bare.ok()) << bare.status();
  absl::StatusOr<ParameterClient::FillReport> refused = (*bare)->SetFill(1, "elsewhere:1", 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("elsewhere:1"));
}

TEST_F(ReplicatedClientTest, SparseWeightsOutNeedsOneCopy) {
  MakeClient(2);
  Declare(16);
  std::vector<int64_t> rows = {5};
  std::vector<float> grad(2), out(2);
  auto r = client_->PushPullSparse("emb", 0, rows, grad, absl::MakeSpan(out)).get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("weights_out"));
}

}  // namespace
}  // namespace client
}  // namespace tessera
