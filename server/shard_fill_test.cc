// Filling a new copy (server/shard_fill.h): three shards of a replicated job (two copies of every
// partition and row) train a few BSP steps with Adam; the state cut for shard 1 from shards 2's
// and 0's snapshots is exactly shard 1's own snapshot, and a fresh store filled with it page by
// page goes on bit-identically to shard 1.
#include "server/shard_fill.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/placement.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint_file.h"
#include "server/parameter_store.h"
#include "server/testing/store_calls.h"

namespace tessera::server {
namespace {

using push_pull_requests::Config;
using push_pull_requests::Dense;
using push_pull_requests::GradSlice;
using push_pull_requests::PullKey;
using push_pull_requests::Request;
using push_pull_requests::RowsSlice;
using store_calls::CheckpointAndWait;
using store_calls::CheckpointOptions;
using store_calls::JobRequest;
using store_calls::MakeCheckpointDir;
using store_calls::PullDense;
using store_calls::PullRows;
using store_calls::Table;
using ::testing::HasSubstr;

constexpr int kShards = 3;
constexpr int kReplicas = 2;
constexpr uint32_t kDim = 3;
const char* const kJob = "fill-j";

struct Partition {
  std::string tensor;
  uint32_t index;
  int home;
};

// Two dense tensors cut in partitions, placed as the client places them.
std::vector<Partition> Partitions() {
  std::vector<Partition> out;
  for (const auto& [tensor, count] : {std::pair<std::string, uint32_t>{"w", 12}, {"b", 5}}) {
    for (uint32_t i = 0; i < count; ++i) {
      out.push_back({tensor, i, ShardOfPartition(kJob, tensor, i, kShards)});
    }
  }
  return out;
}

std::vector<int64_t> Ids() {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 60; ++i) ids.push_back(i * 7919 + 13);
  return ids;
}

std::vector<float> Grad(uint32_t seed, int64_t step, size_t n) {
  std::vector<float> g(n);
  for (size_t k = 0; k < n; ++k) {
    g[k] =
        0.01f * static_cast<float>((seed * 31 + static_cast<uint32_t>(step) * 7 + k) % 17) - 0.08f;
  }
  return g;
}

// The push of `step` that shard `shard` gets: a slice for each partition it holds, and the rows
// of this step's ids that it holds (every third id, shifted by the step).
v1::PushPullRequest StepFor(int shard, int64_t step, uint64_t seq) {
  std::vector<v1::Slice> push;
  for (const Partition& p : Partitions()) {
    if (!HoldsCopyOf(p.home, shard, kShards, kReplicas)) continue;
    push.push_back(
        GradSlice(p.tensor, p.index, Grad(p.index + (p.tensor == "b" ? 50 : 0), step, 4)));
  }
  // Each row's gradient depends on the row and the step only: every copy gets the same.
  std::vector<int64_t> rows;
  std::vector<float> grads;
  for (size_t i = static_cast<size_t>(step) % 3; i < Ids().size(); i += 3) {
    const int64_t id = Ids()[i];
    if (HoldsCopyOf(ShardOfSparseRow(kJob, "emb", id, kShards), shard, kShards, kReplicas)) {
      rows.push_back(id);
      const std::vector<float> g = Grad(static_cast<uint32_t>(id % 1000), step, kDim);
      grads.insert(grads.end(), g.begin(), g.end());
    }
  }
  push.push_back(RowsSlice("emb", rows, grads));
  return Request(kJob, 0, 1, step, seq, push);
}

v1::CreateJobStateRequest JobFor(int shard) {
  v1::CreateJobStateRequest r =
      JobRequest(kJob, Config(v1::CONSISTENCY_BSP, 1, 0.1f, v1::OPTIMIZER_KIND_ADAM));
  for (const Partition& p : Partitions()) {
    if (!HoldsCopyOf(p.home, shard, kShards, kReplicas)) continue;
    const float base = static_cast<float>(p.index) + (p.tensor == "b" ? 0.5f : 0.0f);
    *r.add_partitions() = Dense(p.tensor, p.index, 4, {base, base + 1, base + 2, base + 3});
  }
  *r.add_tables() = Table("emb", kDim, v1::Initializer::KIND_NORMAL, 7);
  return r;
}

// What a file holds, by partition and row, with the bytes of each (seqs aside).
using Content = std::map<std::string, std::string>;
Content ContentOf(const CheckpointContents& c) {
  Content out;
  auto bytes = [&](const v1::CheckpointRange& r) { return c.data.substr(r.offset(), r.length()); };
  for (const v1::PartitionCheckpoint& pc : c.header.partitions()) {
    const std::string name = absl::StrCat(pc.key().tensor(), "/", pc.key().index());
    std::string clocks;
    for (int64_t clock : pc.clocks()) absl::StrAppend(&clocks, clock, ",");
    out[name + " version"] = absl::StrCat(pc.version(), " clocks ", clocks);
    if (!pc.sparse()) {
      std::string values = bytes(pc.weights());
      for (const v1::CheckpointRange& s : pc.slots()) values += bytes(s);
      out[name] = values;
      continue;
    }
    const std::string ids = bytes(pc.row_ids()), updates = bytes(pc.row_updates());
    const std::string values = bytes(pc.row_values()), clocks_of_rows = bytes(pc.row_last_clocks());
    const size_t width = pc.num_rows() > 0 ? values.size() / pc.num_rows() : 0;
    for (uint64_t i = 0; i < pc.num_rows(); ++i) {
      int64_t id;
      std::memcpy(&id, ids.data() + 8 * i, 8);
      out[absl::StrCat(name, " row ", id)] = updates.substr(8 * i, 8) +
                                             clocks_of_rows.substr(8 * i, 8) +
                                             values.substr(width * i, width);
    }
  }
  return out;
}

// Fills `fresh` (shard 1) page by page from shards 2's and 0's files of `step` under `dir`
// (`dir`/shard<i>); only the last page installs it. Returns the last page's answer.
v1::FillResponse FillShard1(ParameterStore& fresh, const std::string& dir, int64_t step) {
  int sources = 0;
  v1::FillResponse answer;
  for (int from : {2, 0}) {
    const std::string path =
        CheckpointPath(absl::StrCat(dir, "/shard", from), kJob, step, static_cast<uint32_t>(from));
    uint64_t offset = 0, size = 0;
    do {
      absl::StatusOr<v1::ReadCheckpointResponse> page = ReadFilePage(path, offset, 1000);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) return answer;
      size = page->file_bytes();
      v1::FillRequest fill;
      fill.set_job_id(kJob);
      fill.set_step(step);
      fill.set_source(static_cast<uint32_t>(sources));
      fill.set_num_sources(2);
      fill.set_offset(offset);
      fill.set_file_bytes(size);
      fill.set_num_shards(kShards);
      fill.set_replicas(kReplicas);
      offset += page->data().size();
      fill.set_data(page->data());
      absl::StatusOr<v1::FillResponse> r = fresh.Fill(fill);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return answer;
      answer = *r;
      EXPECT_EQ(answer.installed(), from == 0 && offset == size);
    } while (offset < size);
    ++sources;
  }
  EXPECT_TRUE(answer.installed());
  return answer;
}

TEST(ShardFillTest, HoldsCopyOfCountsForwardFromTheHome) {
  EXPECT_TRUE(HoldsCopyOf(2, 2, 3, 2));
  EXPECT_TRUE(HoldsCopyOf(2, 0, 3, 2));  // wraps around
  EXPECT_FALSE(HoldsCopyOf(2, 1, 3, 2));
  EXPECT_FALSE(HoldsCopyOf(0, 1, 3, 1));
  EXPECT_TRUE(HoldsCopyOf(0, 1, 2, 2));
}

TEST(ShardFillTest, TheCutOfTheNeighboursIsTheLostShardsOwnSnapshotAndGoesOnTheSame) {
  const std::string dir = MakeCheckpointDir();
  std::vector<std::unique_ptr<ParameterStore>> stores;
  for (int s = 0; s < kShards; ++s) {
    stores.push_back(std::make_unique<ParameterStore>(
        CheckpointOptions(absl::StrCat(dir, "/shard", s), static_cast<uint32_t>(s))));
    ASSERT_TRUE(stores[s]->CreateJobState(JobFor(s)).ok());
  }
  constexpr int64_t kSteps = 4;
  for (int64_t step = 0; step < kSteps; ++step) {
    for (int s = 0; s < kShards; ++s) {
      absl::StatusOr<PushAck> ack =
          stores[s]->Push(StepFor(s, step, static_cast<uint64_t>(100 * s + step + 1)));
      ASSERT_TRUE(ack.ok()) << ack.status();
    }
  }
  std::vector<CheckpointContents> files;
  for (int s = 0; s < kShards; ++s) {
    absl::StatusOr<v1::CheckpointResponse> c = CheckpointAndWait(*stores[s], kJob, kSteps);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(c->path());
    ASSERT_TRUE(file.ok()) << file.status();
    files.push_back(*std::move(file));
  }
  // Shard 1 is lost: its next neighbour holds the copies of its own partitions, the previous one
  // the partitions it keeps copies of.
  absl::StatusOr<CheckpointContents> cut = CutFill({files[2], files[0]}, 1, kShards, kReplicas);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->header.shard_index(), 1u);
  EXPECT_EQ(cut->header.step(), kSteps);
  const Content want = ContentOf(files[1]);
  const Content got = ContentOf(*cut);
  EXPECT_EQ(got.size(), want.size());
  int rows = 0;
  for (const auto& [name, bytes] : want) {
    rows += absl::StrContains(name, " row ") ? 1 : 0;
    auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << name << " is missing from the cut";
    } else {
      EXPECT_EQ(it->second, bytes) << name;
    }
  }
  EXPECT_GT(rows, 20);
  for (const v1::PartitionCheckpoint& pc : cut->header.partitions()) {
    EXPECT_EQ(pc.last_applied_size(), 0) << pc.key().tensor();
  }

  // A fresh shard 1, filled page by page from the files on disk, goes on as shard 1 does.
  ParameterStore fresh(CheckpointOptions(dir + "/fresh", 1));
  v1::FillResponse answer;
  ASSERT_NO_FATAL_FAILURE(answer = FillShard1(fresh, dir, kSteps));
  EXPECT_EQ(answer.tables(), 1u);
  EXPECT_EQ(answer.rows(), static_cast<uint64_t>(rows));
  int dense = 0;
  for (const Partition& p : Partitions()) dense += HoldsCopyOf(p.home, 1, kShards, kReplicas);
  EXPECT_EQ(answer.partitions(), static_cast<uint32_t>(dense));

  ASSERT_TRUE(stores[1]->Push(StepFor(1, kSteps, 999)).ok());
  ASSERT_TRUE(fresh.Push(StepFor(1, kSteps, 999)).ok());
  for (const Partition& p : Partitions()) {
    if (!HoldsCopyOf(p.home, 1, kShards, kReplicas)) continue;
    EXPECT_EQ(PullDense(fresh, kJob, p.tensor, p.index),
              PullDense(*stores[1], kJob, p.tensor, p.index))
        << p.tensor << "/" << p.index;
  }
  std::vector<int64_t> held;
  for (int64_t id : Ids()) {
    if (HoldsCopyOf(ShardOfSparseRow(kJob, "emb", id, kShards), 1, kShards, kReplicas)) {
      held.push_back(id);
    }
  }
  EXPECT_EQ(PullRows(fresh, kJob, "emb", held), PullRows(*stores[1], kJob, "emb", held));
}

// SSP: worker `worker`'s push of `step` to shard `shard`, in gradients of sixteenths (with the
// learning rate and SSP's 1/2 every update is exact in fp32, so that the order in which the
// copies apply the pushes does not change a bit).
v1::PushPullRequest SspStepFor(int shard, uint32_t worker, int64_t step) {
  auto grad = [&](uint32_t seed, size_t n) {
    std::vector<float> g(n);
    for (size_t k = 0; k < n; ++k) {
      g[k] = static_cast<float>(static_cast<int>((seed * 5 + worker * 3 + step * 7 + k) % 9) - 4) /
             16.0f;
    }
    return g;
  };
  std::vector<v1::Slice> push;
  for (const Partition& p : Partitions()) {
    if (!HoldsCopyOf(p.home, shard, kShards, kReplicas)) continue;
    push.push_back(GradSlice(p.tensor, p.index, grad(p.index + (p.tensor == "b" ? 50 : 0), 4)));
  }
  std::vector<int64_t> rows;
  std::vector<float> grads;
  for (size_t i = static_cast<size_t>(step + worker) % 2; i < Ids().size(); i += 2) {
    const int64_t id = Ids()[i];
    if (HoldsCopyOf(ShardOfSparseRow(kJob, "emb", id, kShards), shard, kShards, kReplicas)) {
      rows.push_back(id);
      const std::vector<float> g = grad(static_cast<uint32_t>(id % 1000), kDim);
      grads.insert(grads.end(), g.begin(), g.end());
    }
  }
  push.push_back(RowsSlice("emb", rows, grads));
  // One seq per (worker, step), the same on every copy.
  return Request(kJob, worker, 1, step, 100 * static_cast<uint64_t>(step) + worker + 1, push);
}

v1::CreateJobStateRequest SspJobFor(int shard) {
  v1::CreateJobStateRequest r = JobFor(shard);
  *r.mutable_config() =
      Config(v1::CONSISTENCY_SSP, 2, 0.5f, v1::OPTIMIZER_KIND_SGD, /*staleness=*/3);
  *r.mutable_tables(0) = Table("emb", kDim, v1::Initializer::KIND_CONSTANT, 7);
  return r;
}

// Under SSP a neighbour is snapshotted at S once its slowest worker reaches S, so a faster
// worker's push of S can be in one source's snapshot and not in the other's, and it is in the
// journal of the shard being filled too. The catch-up applies it only where the cut lacks it:
// the filled shard ends up as the shard that got every push.
TEST(ShardFillTest, UnderSspAFasterWorkersPushInOneSourceIsAppliedOnceOverTheCut) {
  const std::string dir = MakeCheckpointDir();
  std::vector<std::unique_ptr<ParameterStore>> stores;
  for (int s = 0; s < kShards; ++s) {
    stores.push_back(std::make_unique<ParameterStore>(
        CheckpointOptions(absl::StrCat(dir, "/shard", s), static_cast<uint32_t>(s))));
    ASSERT_TRUE(stores[s]->CreateJobState(SspJobFor(s)).ok());
  }
  ParameterStore fresh(CheckpointOptions(dir + "/fresh", 1));
  auto push = [&](int shard, uint32_t worker, int64_t step) {
    ParameterStore& store = shard < 0 ? fresh : *stores[shard];
    absl::StatusOr<PushAck> ack = store.Push(SspStepFor(shard < 0 ? 1 : shard, worker, step));
    ASSERT_TRUE(ack.ok()) << ack.status();
  };
  constexpr int64_t kFill = 4;
  for (int64_t step = 0; step < kFill - 1; ++step) {
    for (uint32_t w = 0; w < 2; ++w) {
      for (int s = 0; s < kShards; ++s) push(s, w, step);
    }
  }
  for (int s = 0; s < kShards; ++s) push(s, 0, kFill - 1);  // worker 0 runs ahead
  // The fill of step kFill: the fresh shard keeps the pushes of kFill on; both sources are to
  // snapshot kFill.
  v1::FillRequest open;
  open.set_job_id(kJob);
  open.set_step(kFill);
  open.set_open(true);
  ASSERT_TRUE(fresh.Fill(open).ok());
  std::vector<absl::StatusOr<v1::CheckpointResponse>> snapshots(kShards,
                                                                absl::UnknownError("none"));
  std::vector<absl::Notification> done(kShards);
  for (int s : {2, 0}) {
    v1::CheckpointRequest r;
    r.set_job_id(kJob);
    r.set_step(kFill);
    stores[s]->Checkpoint(r, [&, s](absl::StatusOr<v1::CheckpointResponse> result) {
      snapshots[s] = std::move(result);
      done[s].Notify();
    });
  }
  // Worker 0's push of kFill reaches shard 2 before worker 1 completes kFill - 1 there (its
  // snapshot holds it), and shard 0 only after (its snapshot does not).
  push(2, 0, kFill);
  push(1, 0, kFill);
  push(-1, 0, kFill);
  for (int s : {2, 1, 0}) push(s, 1, kFill - 1);
  push(0, 0, kFill);
  for (int s : {2, 0}) {
    ASSERT_TRUE(done[s].WaitForNotificationWithTimeout(absl::Seconds(30)));
    ASSERT_TRUE(snapshots[s].ok()) << snapshots[s].status();
  }
  for (int64_t step = kFill; step < kFill + 2; ++step) {
    for (uint32_t w = 0; w < 2; ++w) {
      if (step == kFill && w == 0) continue;
      for (int s : {2, 1, 0, -1}) push(s, w, step);
    }
  }

  v1::FillResponse answer;
  ASSERT_NO_FATAL_FAILURE(answer = FillShard1(fresh, dir, kFill));
  EXPECT_EQ(answer.journaled(), 4u);
  // Worker 0's push of kFill, on the 6 partitions homed at shard 1 (copies from shard 2's
  // snapshot), and its rows homed there.
  int homed_here = 0;
  for (const Partition& p : Partitions()) homed_here += p.home == 1;
  EXPECT_EQ(answer.held_slices(), static_cast<uint64_t>(homed_here));
  EXPECT_GT(answer.held_rows(), 0u);
  auto expect_same = [&](const std::string& when) {
    for (const Partition& p : Partitions()) {
      if (!HoldsCopyOf(p.home, 1, kShards, kReplicas)) continue;
      EXPECT_EQ(PullDense(fresh, kJob, p.tensor, p.index),
                PullDense(*stores[1], kJob, p.tensor, p.index))
          << p.tensor << "/" << p.index << " " << when;
    }
    std::vector<int64_t> held;
    for (int64_t id : Ids()) {
      if (HoldsCopyOf(ShardOfSparseRow(kJob, "emb", id, kShards), 1, kShards, kReplicas)) {
        held.push_back(id);
      }
    }
    EXPECT_EQ(PullRows(fresh, kJob, "emb", held), PullRows(*stores[1], kJob, "emb", held)) << when;
  };
  expect_same("after the fill");
  // It goes on as a copy: the next steps are admitted and applied the same.
  for (uint32_t w = 0; w < 2; ++w) {
    for (int s : {1, -1}) push(s, w, kFill + 2);
  }
  expect_same("a step later");
  // A resend of the push the cut held from shard 2's snapshot is a duplicate, not applied.
  absl::StatusOr<PushAck> again = fresh.Push(SspStepFor(1, 0, kFill));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_GT(again->duplicates, 0);
  expect_same("after a resend");
}

TEST(ShardFillTest, SourcesOfAnotherStepAreDataLoss) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir, 0));
  ASSERT_TRUE(store.CreateJobState(JobFor(0)).ok());
  ASSERT_TRUE(store.Push(StepFor(0, 0, 1)).ok());
  absl::StatusOr<v1::CheckpointResponse> one = CheckpointAndWait(store, kJob, 1);
  ASSERT_TRUE(store.Push(StepFor(0, 1, 2)).ok());
  absl::StatusOr<v1::CheckpointResponse> two = CheckpointAndWait(store, kJob, 2);
  ASSERT_TRUE(one.ok() && two.ok());
  absl::StatusOr<CheckpointContents> a = ReadCheckpointFile(one->path());
  absl::StatusOr<CheckpointContents> b = ReadCheckpointFile(two->path());
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<CheckpointContents> cut = CutFill({*a, *b}, 1, kShards, kReplicas);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(cut.status().message(), HasSubstr("step 1"));
  EXPECT_EQ(CutFill({}, 1, kShards, kReplicas).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CutFill({*a}, 3, kShards, kReplicas).status().code(),
            absl::StatusCode::kInvalidArgument);
}

v1::FillRequest Page(uint32_t source, uint64_t offset, const std::string& data, uint64_t file_bytes,
                     int64_t step = 5) {
  v1::FillRequest p;
  p.set_job_id("j");
  p.set_step(step);
  p.set_source(source);
  p.set_num_sources(2);
  p.set_offset(offset);
  p.set_data(data);
  p.set_file_bytes(file_bytes);
  p.set_num_shards(3);
  p.set_replicas(2);
  return p;
}

TEST(FillAssemblerTest, CollectsPagesInOrderAndRefusesTheRest) {
  auto budget = std::make_shared<MemoryBudget>(100);
  FillAssembler fills(budget);
  std::vector<std::string> files;
  // A page before the first one of a fill.
  absl::StatusOr<bool> early = fills.Add(Page(0, 4, "xx", 6), &files);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(early.status().message(), HasSubstr("offset"));

  ASSERT_EQ(fills.Add(Page(0, 0, "abcd", 6), &files).value_or(true), false);
  EXPECT_EQ(fills.buffered_bytes(), 4u);
  // Out of order: the fill is dropped.
  absl::StatusOr<bool> gap = fills.Add(Page(0, 5, "f", 6), &files);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gap.status().message(), HasSubstr("expected offset 4"));
  EXPECT_EQ(fills.buffered_bytes(), 0u);

  ASSERT_EQ(fills.Add(Page(0, 0, "abcd", 6), &files).value_or(true), false);
  ASSERT_EQ(fills.Add(Page(0, 4, "ef", 6), &files).value_or(true), false);
  ASSERT_EQ(fills.Add(Page(1, 0, "123", 5), &files).value_or(true), false);
  absl::StatusOr<bool> last = fills.Add(Page(1, 3, "45", 5), &files);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(*last);
  EXPECT_EQ(files, (std::vector<std::string>{"abcdef", "12345"}));
  EXPECT_EQ(fills.buffered_bytes(), 0u);

  // A page past its file, a bad shape, and one past the budget.
  EXPECT_EQ(fills.Add(Page(0, 0, "abcdefg", 6), &files).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::FillRequest shape = Page(0, 0, "ab", 6);
  shape.set_replicas(4);
  EXPECT_THAT(fills.Add(shape, &files).status().message(), HasSubstr("replicas"));
  EXPECT_EQ(fills.Add(Page(0, 0, std::string(101, 'z'), 200), &files).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fills.buffered_bytes(), 0u);
  ASSERT_EQ(fills.Add(Page(0, 0, "ab", 6), &files).value_or(true), false);
  fills.Forget("j");
  EXPECT_EQ(fills.buffered_bytes(), 0u);
  EXPECT_EQ(fills.Add(Page(0, 0, "ab", 6, /*step=*/0), &files).status().code(),
            absl::StatusCode::kInvalidArgument);

  // At most kMaxPending fills at once: one more drops the oldest.
  for (size_t j = 0; j <= FillAssembler::kMaxPending; ++j) {
    v1::FillRequest p = Page(0, 0, "ab", 6);
    p.set_job_id(absl::StrCat("job-", j));
    ASSERT_TRUE(fills.Add(p, &files).ok());
  }
  EXPECT_EQ(fills.buffered_bytes(), 2 * FillAssembler::kMaxPending);
  v1::FillRequest next = Page(0, 2, "cd", 6);
  next.set_job_id("job-0");
  EXPECT_EQ(fills.Add(next, &files).status().code(), absl::StatusCode::kInvalidArgument);
  next.set_job_id("job-1");
  EXPECT_TRUE(fills.Add(next, &files).ok());
}

TEST(ShardFillTest, ReadCheckpointNamesWhatIsWrong) {
  ParameterStore without;
  v1::ReadCheckpointRequest r;
  r.set_job_id(kJob);
  r.set_step(1);
  r.set_max_bytes(100);
  EXPECT_EQ(without.ReadCheckpoint(r).status().code(), absl::StatusCode::kFailedPrecondition);
  ParameterStore store(CheckpointOptions(MakeCheckpointDir(), 0));
  EXPECT_EQ(store.ReadCheckpoint(r).status().code(), absl::StatusCode::kNotFound);
  r.set_max_bytes(0);
  EXPECT_THAT(store.ReadCheckpoint(r).status().message(), HasSubstr("max_bytes"));
  r.set_max_bytes(100);
  r.set_job_id("../x");
  EXPECT_EQ(store.ReadCheckpoint(r).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::server
