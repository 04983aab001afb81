// The pushes a shard being filled keeps until its fill is installed (server/fill_journal.h): two
// shards of a replicated BSP job with two workers (both shards hold every partition and row); the
// second is lost, and a fresh store filled from the first's snapshot while the workers push on
// ends up bit-identical to the second.
#include "server/fill_journal.h"

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint_file.h"
#include "server/memory_budget.h"
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

const char* const kJob = "journal-j";
constexpr uint32_t kPartitions = 3;
constexpr uint32_t kDim = 3;
constexpr int64_t kFillStep = 3;

std::vector<int64_t> Ids() { return {5, 17, 90001, 123456789, 42}; }

std::vector<float> Grad(uint32_t seed, int64_t step, size_t n) {
  std::vector<float> g(n);
  for (size_t k = 0; k < n; ++k) {
    g[k] =
        0.01f * static_cast<float>((seed * 13 + static_cast<uint32_t>(step) * 5 + k) % 11) - 0.05f;
  }
  return g;
}

// Worker `worker`'s push of `step`: every partition, and three of the ids (by step).
v1::PushPullRequest StepOf(uint32_t worker, int64_t step) {
  std::vector<v1::Slice> push;
  for (uint32_t p = 0; p < kPartitions; ++p) {
    push.push_back(GradSlice("w", p, Grad(worker * 7 + p, step, 4)));
  }
  std::vector<int64_t> rows;
  std::vector<float> grads;
  for (size_t i = static_cast<size_t>(step + worker) % 2; i < Ids().size(); i += 2) {
    rows.push_back(Ids()[i]);
    const std::vector<float> g = Grad(worker + static_cast<uint32_t>(i), step, kDim);
    grads.insert(grads.end(), g.begin(), g.end());
  }
  push.push_back(RowsSlice("emb", rows, grads));
  return Request(kJob, worker, 1, step, 1000 * worker + static_cast<uint64_t>(step) + 1, push);
}

v1::CreateJobStateRequest Job() {
  v1::CreateJobStateRequest r =
      JobRequest(kJob, Config(v1::CONSISTENCY_BSP, 2, 0.1f, v1::OPTIMIZER_KIND_ADAM));
  for (uint32_t p = 0; p < kPartitions; ++p) {
    const float base = static_cast<float>(p);
    *r.add_partitions() = Dense("w", p, 4, {base, base + 1, base + 2, base + 3});
  }
  *r.add_tables() = Table("emb", kDim, v1::Initializer::KIND_NORMAL, 3);
  return r;
}

v1::FillRequest Open(const std::string& job, int64_t step) {
  v1::FillRequest r;
  r.set_job_id(job);
  r.set_step(step);
  r.set_open(true);
  return r;
}

// Fills `target` (shard 1 of 2, two copies) from shard 0's file of `step` under `source_dir`,
// page by page; the answer to the last page.
absl::StatusOr<v1::FillResponse> FillFrom(ParameterStore& target, const std::string& source_dir,
                                          int64_t step) {
  const std::string path = CheckpointPath(source_dir, kJob, step, 0);
  uint64_t offset = 0, size = 0;
  v1::FillResponse answer;
  do {
    absl::StatusOr<v1::ReadCheckpointResponse> page = ReadFilePage(path, offset, 700);
    if (!page.ok()) return page.status();
    size = page->file_bytes();
    v1::FillRequest fill;
    fill.set_job_id(kJob);
    fill.set_step(step);
    fill.set_source(0);
    fill.set_num_sources(1);
    fill.set_offset(offset);
    fill.set_file_bytes(size);
    fill.set_num_shards(2);
    fill.set_replicas(2);
    offset += page->data().size();
    fill.set_data(page->data());
    absl::StatusOr<v1::FillResponse> r = target.Fill(fill);
    if (!r.ok()) return r.status();
    answer = *r;
  } while (offset < size);
  return answer;
}

void ExpectSameState(ParameterStore& got, ParameterStore& want) {
  for (uint32_t p = 0; p < kPartitions; ++p) {
    EXPECT_EQ(PullDense(got, kJob, "w", p), PullDense(want, kJob, "w", p)) << "w/" << p;
  }
  EXPECT_EQ(PullRows(got, kJob, "emb", Ids()), PullRows(want, kJob, "emb", Ids()));
}

// Two shards that trained the first kFillStep steps; the first has its snapshot of kFillStep.
struct Shards {
  std::string dir = MakeCheckpointDir();
  ParameterStore acting{CheckpointOptions(dir + "/s0", 0)};
  ParameterStore reference{CheckpointOptions(dir + "/s1", 1)};
  ParameterStore filled{CheckpointOptions(dir + "/fresh", 1)};

  void Train() {
    ASSERT_TRUE(acting.CreateJobState(Job()).ok());
    ASSERT_TRUE(reference.CreateJobState(Job()).ok());
    for (int64_t step = 0; step < kFillStep; ++step) {
      for (uint32_t w = 0; w < 2; ++w) {
        ASSERT_TRUE(acting.Push(StepOf(w, step)).ok());
        ASSERT_TRUE(reference.Push(StepOf(w, step)).ok());
      }
    }
    absl::StatusOr<v1::CheckpointResponse> c = CheckpointAndWait(acting, kJob, kFillStep);
    ASSERT_TRUE(c.ok()) << c.status();
  }
  // Pushes to `filled`, which must take it as new.
  void PushFilled(uint32_t worker, int64_t step) {
    absl::StatusOr<PushAck> ack = filled.Push(StepOf(worker, step));
    ASSERT_TRUE(ack.ok()) << ack.status();
    EXPECT_EQ(ack->duplicates, 0);
  }
  void PushReference(uint32_t worker, int64_t step) {
    absl::StatusOr<PushAck> ack = reference.Push(StepOf(worker, step));
    ASSERT_TRUE(ack.ok()) << ack.status();
  }
  void PushBoth(uint32_t worker, int64_t step) {
    PushFilled(worker, step);
    PushReference(worker, step);
  }
};

TEST(FillJournalStoreTest, PushesKeptWhileTheFilesAreCopiedAreAppliedAtTheInstall) {
  Shards s;
  ASSERT_NO_FATAL_FAILURE(s.Train());
  ASSERT_TRUE(s.filled.Fill(Open(kJob, kFillStep)).ok());
  // Acknowledged and kept: the store does not hold the job yet. Worker 0's push of the next step
  // comes before worker 1's push of this one (its copy to this shard was slower).
  s.PushFilled(0, kFillStep);
  EXPECT_EQ(s.filled.GetJobStats(kJob).status().code(), absl::StatusCode::kNotFound);
  s.PushFilled(0, kFillStep + 1);
  s.PushFilled(1, kFillStep);
  for (auto [worker, step] :
       {std::pair<uint32_t, int64_t>{0, kFillStep}, {1, kFillStep}, {0, kFillStep + 1}}) {
    s.PushReference(worker, step);
  }
  // A push before the fill's step is no part of it: the job is unknown here.
  EXPECT_EQ(s.filled.Push(StepOf(1, kFillStep - 1)).status().code(), absl::StatusCode::kNotFound);

  absl::StatusOr<v1::FillResponse> filled = FillFrom(s.filled, s.dir + "/s0", kFillStep);
  ASSERT_TRUE(filled.ok()) << filled.status();
  EXPECT_TRUE(filled->installed());
  EXPECT_EQ(filled->journaled(), 3u);
  ExpectSameState(s.filled, s.reference);
  // The copy carries on as the shard it replaces.
  s.PushBoth(1, kFillStep + 1);
  for (uint32_t w = 0; w < 2; ++w) s.PushBoth(w, kFillStep + 2);
  ExpectSameState(s.filled, s.reference);
  absl::StatusOr<JobStats> stats = s.filled.GetJobStats(kJob);
  ASSERT_TRUE(stats.ok()) << stats.status();
}

TEST(FillJournalStoreTest, AKeptPushOfALaterStepWaitsForThePushThatCompletesItsStep) {
  Shards s;
  ASSERT_NO_FATAL_FAILURE(s.Train());
  ASSERT_TRUE(s.filled.Fill(Open(kJob, kFillStep)).ok());
  s.PushFilled(0, kFillStep);
  s.PushFilled(0, kFillStep + 1);
  // Worker 1's pushes are still to come when the fill is installed: the push of the next step
  // waits for its push of the fill's step, and the fill's call goes on until it has applied both.
  absl::StatusOr<v1::FillResponse> filled;
  std::thread fill([&] { filled = FillFrom(s.filled, s.dir + "/s0", kFillStep); });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!s.filled.GetJobStats(kJob).ok() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  // Installed; worker 1's copy of the later step came first.
  s.PushFilled(1, kFillStep + 1);
  s.PushFilled(1, kFillStep);
  fill.join();
  ASSERT_TRUE(filled.ok()) << filled.status();
  EXPECT_EQ(filled->journaled(), 4u);
  for (auto [worker, step] : {std::pair<uint32_t, int64_t>{0, kFillStep},
                              {1, kFillStep},
                              {0, kFillStep + 1},
                              {1, kFillStep + 1}}) {
    s.PushReference(worker, step);
  }
  ExpectSameState(s.filled, s.reference);
  // Its retry is a duplicate: it was applied once.
  absl::StatusOr<PushAck> again = s.filled.Push(StepOf(0, kFillStep + 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->duplicates, kPartitions + 1);
  ExpectSameState(s.filled, s.reference);
}

TEST(FillJournalStoreTest, AKeptPushThatCannotApplyFailsTheFillAndDropsTheJob) {
  Shards s;
  ASSERT_NO_FATAL_FAILURE(s.Train());
  ASSERT_TRUE(s.filled.Fill(Open(kJob, kFillStep)).ok());
  ASSERT_TRUE(
      s.filled.Push(Request(kJob, 0, 1, kFillStep, 7, {GradSlice("nope", 0, {1, 2})})).ok());
  absl::StatusOr<v1::FillResponse> filled = FillFrom(s.filled, s.dir + "/s0", kFillStep);
  ASSERT_FALSE(filled.ok());
  EXPECT_THAT(filled.status().message(), HasSubstr("replaying the push of worker 0 of step 3"));
  EXPECT_THAT(filled.status().message(), HasSubstr("nope"));
  // What the copy would lack a push of is not kept.
  EXPECT_EQ(s.filled.GetJobStats(kJob).status().code(), absl::StatusCode::kNotFound);
}

TEST(FillJournalStoreTest, AFullJournalRefusesAPushSoThatItIsSentAgain) {
  ParameterStoreOptions options;
  options.max_memory_bytes = 1 << 20;
  ParameterStore store(options);
  ASSERT_TRUE(store.Fill(Open(kJob, 4)).ok());
  const std::vector<float> big(150000, 0.5f);  // 600 kB: one fits the budget, two do not
  ASSERT_TRUE(store.Push(Request(kJob, 0, 1, 4, 1, {GradSlice("w", 0, big)})).ok());
  const absl::Status full =
      store.Push(Request(kJob, 1, 1, 4, 2, {GradSlice("w", 0, big)})).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(full.message(), HasSubstr("journal of pushes is full; send again"));
}

TEST(FillJournalStoreTest, OpeningNamesABadFieldAndDroppingTheJobForgetsWhatWasKept) {
  ParameterStore store;
  const absl::Status bad_id = store.Fill(Open("../x", 4)).status();
  EXPECT_EQ(bad_id.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_id.message(), HasSubstr("job_id"));
  const absl::Status bad_step = store.Fill(Open(kJob, 0)).status();
  EXPECT_EQ(bad_step.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_step.message(), HasSubstr("step: must be >= 1"));

  ASSERT_TRUE(store.Fill(Open(kJob, 4)).ok());
  ASSERT_TRUE(store.Push(StepOf(0, 4)).ok());
  // The job is not held here, but its journal goes.
  EXPECT_EQ(store.DropJob(kJob).code(), absl::StatusCode::kNotFound);
  const absl::Status after = store.Push(StepOf(1, 4)).status();
  EXPECT_EQ(after.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(after.message(), HasSubstr("unknown job"));
}

PushPullView ViewWithPieces(const std::vector<absl::string_view>& pieces, int64_t step) {
  PushPullView view;
  view.job_id = kJob;
  view.worker_id = 1;
  view.incarnation = 2;
  view.step = step;
  view.seq = 9;
  SliceView slice;
  slice.tensor = "w";
  slice.index = 4;
  slice.encoding = v1::ENCODING_FP32;
  slice.pieces = absl::MakeConstSpan(pieces);
  view.push.push_back(slice);
  return view;
}

TEST(FillJournalTest, ADrainStopsWhenItsJournalIsForgottenOrNothingAppliesForTheStall) {
  auto budget = std::make_shared<MemoryBudget>(1 << 20);
  FillJournal journal(budget);
  const std::vector<absl::string_view> pieces = {"abcd"};
  ASSERT_TRUE(journal.Open(kJob, 5).ok());
  ASSERT_EQ(journal.Keep(ViewWithPieces(pieces, 5)), FillJournal::Kept::kKept);
  ASSERT_TRUE(*journal.Install(kJob, 5));
  int64_t applied = 0;
  const absl::Status stalled = journal.Drain(
      kJob, [](const v1::PushPullRequest&) { return absl::UnavailableError("not yet"); },
      absl::Milliseconds(50), &applied);
  EXPECT_EQ(stalled.code(), absl::StatusCode::kDeadlineExceeded) << stalled;
  EXPECT_EQ(applied, 0);
  EXPECT_EQ(journal.kept_bytes(), 0);
  EXPECT_TRUE(budget->TryReserve(1 << 20));  // every byte given back
  budget->Release(1 << 20);
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 5)), FillJournal::Kept::kNotOpen);

  // Forgotten (the job dropped) while it drains: ABORTED, and nothing more is applied.
  ASSERT_TRUE(journal.Open(kJob, 5).ok());
  ASSERT_EQ(journal.Keep(ViewWithPieces(pieces, 5)), FillJournal::Kept::kKept);
  ASSERT_EQ(journal.Keep(ViewWithPieces(pieces, 6)), FillJournal::Kept::kKept);
  ASSERT_TRUE(*journal.Install(kJob, 5));
  int calls = 0;
  const absl::Status aborted = journal.Drain(
      kJob,
      [&](const v1::PushPullRequest&) {
        ++calls;
        journal.Forget(kJob);
        return absl::UnavailableError("not yet");
      },
      absl::Seconds(5), &applied);
  EXPECT_EQ(aborted.code(), absl::StatusCode::kAborted) << aborted;
  EXPECT_LE(calls, 2);
  EXPECT_EQ(journal.kept_bytes(), 0);
}

// A rank that missed the fill wrote none of its pushes here: its step stays incomplete, the next
// one waits (UNAVAILABLE), and the one after is refused as from the future. That is named as the
// miss it is, FAILED_PRECONDITION, not as a bad push.
TEST(FillJournalTest, APushBehindAStepThatNeverCompletesNamesTheMissedFill) {
  auto budget = std::make_shared<MemoryBudget>(1 << 20);
  FillJournal journal(budget);
  const std::vector<absl::string_view> pieces = {"abcd"};
  ASSERT_TRUE(journal.Open(kJob, 5).ok());
  for (int64_t step : {5, 6, 7}) {
    ASSERT_EQ(journal.Keep(ViewWithPieces(pieces, step)), FillJournal::Kept::kKept);
  }
  ASSERT_TRUE(*journal.Install(kJob, 5));
  int64_t applied = 0;
  const auto bsp = [](const v1::PushPullRequest& r) {
    if (r.step() == 5) return absl::OkStatus();  // staged: step 5 waits for the other rank
    if (r.step() == 6) return absl::UnavailableError("one ahead");
    return absl::InvalidArgumentError("step 7 is from the future");
  };
  const absl::Status missed = journal.Drain(kJob, bsp, absl::Seconds(5), &applied);
  EXPECT_EQ(missed.code(), absl::StatusCode::kFailedPrecondition) << missed;
  EXPECT_THAT(missed.message(), HasSubstr("step 7 is from the future"));
  EXPECT_THAT(missed.message(), HasSubstr("a rank that missed the fill"));
  EXPECT_EQ(applied, 1);
  EXPECT_EQ(journal.kept_bytes(), 0);

  // A bad push with nothing waiting before it keeps its own code.
  ASSERT_TRUE(journal.Open(kJob, 5).ok());
  ASSERT_EQ(journal.Keep(ViewWithPieces(pieces, 5)), FillJournal::Kept::kKept);
  ASSERT_TRUE(*journal.Install(kJob, 5));
  const absl::Status bad = journal.Drain(
      kJob, [](const v1::PushPullRequest&) { return absl::InvalidArgumentError("bad key"); },
      absl::Seconds(5), &applied);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_THAT(bad.message(), ::testing::Not(HasSubstr("missed the fill")));
}

TEST(FillJournalTest, KeepsOnlyPushesOfItsJobFromItsStepAndGivesTheBytesBack) {
  auto budget = std::make_shared<MemoryBudget>(1 << 20);
  FillJournal journal(budget);
  const std::vector<absl::string_view> pieces = {"abcd", "efgh"};
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 5)), FillJournal::Kept::kNotOpen);
  ASSERT_TRUE(journal.Open(kJob, 5).ok());
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 4)), FillJournal::Kept::kNotOpen);
  PushPullView pulls = ViewWithPieces(pieces, 5);
  pulls.pull.push_back(SliceView{});
  EXPECT_EQ(journal.Keep(pulls), FillJournal::Kept::kNotOpen);
  PushPullView wants = ViewWithPieces(pieces, 5);
  wants.push[0].want_weights = true;
  EXPECT_EQ(journal.Keep(wants), FillJournal::Kept::kNotOpen);
  PushPullView other = ViewWithPieces(pieces, 5);
  other.job_id = "other";
  EXPECT_EQ(journal.Keep(other), FillJournal::Kept::kNotOpen);
  EXPECT_EQ(journal.kept_bytes(), 0);

  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 5)), FillJournal::Kept::kKept);
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 6)), FillJournal::Kept::kKept);
  const int64_t kept = journal.kept_bytes();
  EXPECT_GT(kept, 16);
  EXPECT_FALSE(budget->TryReserve((1 << 20) - kept + 1));  // charged to the shard's budget
  int64_t applied = 0;
  // Not installed: nothing drains.
  ASSERT_TRUE(journal.Drain(kJob, nullptr, absl::Seconds(5), &applied).ok());
  EXPECT_EQ(applied, 0);
  EXPECT_EQ(journal.kept_bytes(), kept);

  absl::StatusOr<bool> installed = journal.Install(kJob, 5);
  ASSERT_TRUE(installed.ok() && *installed);
  // Installed, not caught up yet: a push still comes here.
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 7)), FillJournal::Kept::kKept);
  std::vector<int64_t> steps;
  bool refused = false;
  // The push of step 6 cannot apply yet; those of steps 5 and 7 can (the gate would say; here
  // the function does). One of step 8 comes in while the first pass applies.
  ASSERT_TRUE(journal
                  .Drain(
                      kJob,
                      [&](const v1::PushPullRequest& r) {
                        if (r.step() == 5) {
                          EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 8)),
                                    FillJournal::Kept::kKept);
                        }
                        if (r.step() == 6 && !refused) {
                          refused = true;
                          return absl::UnavailableError("step 6 is one ahead");
                        }
                        steps.push_back(r.step());
                        EXPECT_EQ(r.push(0).data(), "abcdefgh");  // the pieces joined
                        EXPECT_EQ(r.push(0).key().index(), 4u);
                        EXPECT_EQ(r.worker_id(), 1u);
                        EXPECT_EQ(r.incarnation(), 2u);
                        EXPECT_EQ(r.seq(), 9u);
                        return absl::OkStatus();
                      },
                      absl::Seconds(5), &applied)
                  .ok());
  // Steps 5 and 7; then on the next pass 6 (kept from the first) and 8 (come meanwhile).
  EXPECT_EQ(steps, (std::vector<int64_t>{5, 7, 6, 8}));
  EXPECT_EQ(applied, 4);
  EXPECT_EQ(journal.kept_bytes(), 0);
  // Caught up: closed, the job's pushes go the ordinary way.
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 9)), FillJournal::Kept::kNotOpen);
  EXPECT_TRUE(budget->TryReserve(1 << 20));  // every byte given back
  budget->Release(1 << 20);

  // Installed at another step: its pushes belong to another fill.
  ASSERT_TRUE(journal.Open(kJob, 8).ok());
  EXPECT_EQ(journal.Keep(ViewWithPieces(pieces, 8)), FillJournal::Kept::kKept);
  const absl::StatusOr<bool> wrong = journal.Install(kJob, 9);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(journal.kept_bytes(), 0);
  EXPECT_FALSE(*journal.Install(kJob, 9));  // nothing open any more

  // At most kMaxOpen journals; none of them is dropped for another.
  for (size_t j = 0; j < FillJournal::kMaxOpen; ++j) {
    ASSERT_TRUE(journal.Open(absl::StrCat("j", j), 3).ok());
  }
  EXPECT_EQ(journal.Open("one-more", 3).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(journal.Open("j0", 4).ok());  // opened again in its own place
  journal.Forget("j1");
  EXPECT_TRUE(journal.Open("one-more", 3).ok());
}

}  // namespace
}  // namespace tessera::server
