// ParameterStore's checkpoints: restore then replay bit for bit, automatic captures and
// retention, validation, waiting captures, refusals without store locks, deleted files, mutated
// headers, SSP captures.
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

// --- Checkpoint and Restore (issue #6) --------------------------------------------------------

// A BSP job with two dense partitions (Adam: two slots) and an Adagrad table, two workers.
v1::CreateJobStateRequest CheckpointJob(const std::string& id, int64_t every = 0) {
  v1::JobConfig config = Config(v1::CONSISTENCY_BSP, 2, 0.01f, v1::OPTIMIZER_KIND_ADAM);
  config.set_checkpoint_every_steps(every);
  v1::CreateJobStateRequest r = JobRequest(id, config);
  std::vector<float> init(1000);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.001f * static_cast<float>(i);
  *r.add_partitions() = Dense("w", 0, 1000, init);
  *r.add_partitions() = Dense("w", 1, 37);
  v1::SparseTableDecl* t = r.add_tables();
  t->set_name("emb");
  t->set_dim(4);
  t->mutable_initializer()->set_kind(v1::Initializer::KIND_UNIFORM);
  t->mutable_initializer()->set_scale(0.1f);
  t->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.05f);
  return r;
}

std::vector<float> StepGrad(size_t n, int64_t step, uint32_t worker, uint32_t salt) {
  std::mt19937 rng(static_cast<uint32_t>(step * 131 + worker * 7 + salt));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) x = d(rng);
  return g;
}

// Both workers push step `step` of the deterministic gradient stream.
void PushStep(ParameterStore& store, const std::string& job, int64_t step, uint64_t incarnation,
              uint64_t seq) {
  for (uint32_t w = 0; w < 2; ++w) {
    std::vector<int64_t> rows = {static_cast<int64_t>(step % 5), 7, static_cast<int64_t>(w) + 20};
    auto pushed = store.Push(Request(
        job, w, incarnation, step, seq,
        {GradSlice("w", 0, StepGrad(1000, step, w, 1)), GradSlice("w", 1, StepGrad(37, step, w, 2)),
         RowsSlice("emb", rows, StepGrad(12, step, w, 3))}));
    ASSERT_TRUE(pushed.ok()) << "step " << step << " worker " << w << ": " << pushed.status();
  }
}

std::vector<float> AllWeights(ParameterStore& store, const std::string& job) {
  std::vector<float> out = PullDense(store, job, "w", 0);
  std::vector<float> w1 = PullDense(store, job, "w", 1);
  out.insert(out.end(), w1.begin(), w1.end());
  auto rows = PullNow(store, job, {PullKey("emb", 0, {0, 1, 2, 3, 4, 7, 20, 21, 99})});
  EXPECT_TRUE(rows.ok()) << rows.status();
  if (rows.ok()) {
    std::vector<float> r = Floats((*rows)[0]);
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ParameterStoreCheckpointTest, RestoreThenReplayGivesTheSameWeightsBitForBit) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir, 3));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-a")).ok());
  constexpr int64_t kSteps = 12;
  constexpr int64_t kAt = 5;
  // Registered ahead: captured when the job reaches boundary 5, answered once written.
  v1::CheckpointRequest ask;
  ask.set_job_id("job-a");
  ask.set_step(kAt);
  absl::Notification written;
  absl::StatusOr<v1::CheckpointResponse> response = absl::UnknownError("unanswered");
  store.Checkpoint(ask, [&](absl::StatusOr<v1::CheckpointResponse> r) {
    response = std::move(r);
    written.Notify();
  });
  for (int64_t s = 0; s < kSteps; ++s) PushStep(store, "job-a", s, 1, static_cast<uint64_t>(s + 1));
  ASSERT_TRUE(written.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->step(), kAt);
  EXPECT_EQ(response->path(), dir + "/job-a/ckpt-5/shard-3");
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(response->path());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(response->bytes(), 28 + file->header.ByteSizeLong() + file->data.size());
  EXPECT_EQ(file->header.partitions_size(), 3);
  for (const v1::PartitionCheckpoint& p : file->header.partitions()) {
    EXPECT_EQ(p.version(), kAt) << p.key().tensor();
    EXPECT_EQ(p.last_applied_size(), 2);
  }
  const std::vector<float> uninterrupted = AllWeights(store, "job-a");

  // A parked pull of the state being replaced fails with ABORTED.
  v1::PullRequest parked;
  parked.set_job_id("job-a");
  parked.set_step(kSteps + 1);
  *parked.add_keys() = PullKey("w", 1);
  std::optional<absl::Status> parked_result;
  store.Pull(parked, [&](absl::StatusOr<std::vector<v1::Slice>> r) { parked_result = r.status(); });
  EXPECT_FALSE(parked_result.has_value());

  v1::RestoreRequest restore;
  restore.set_job_id("job-a");
  restore.set_step(kAt);
  restore.set_min_incarnation(100);
  absl::StatusOr<v1::RestoreResponse> restored = store.Restore(restore);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), kAt);
  EXPECT_EQ(restored->partitions(), 2u);
  EXPECT_EQ(restored->tables(), 1u);
  ASSERT_TRUE(parked_result.has_value());
  EXPECT_EQ(parked_result->code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(BitEqual(AllWeights(store, "job-a"), uninterrupted));

  // A straggler of the old incarnation is refused; the rewound workers replay steps 5..11.
  auto straggler =
      store.Push(Request("job-a", 0, 1, kAt, 99, {GradSlice("w", 1, StepGrad(37, kAt, 0, 2))}));
  EXPECT_EQ(straggler.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(straggler.status().message(), HasSubstr("incarnation"));
  // A pull for step 5 is open at once (version 5), one for 6 is not.
  EXPECT_TRUE(PullNow(store, "job-a", {PullKey("w", 0)}).ok());
  for (int64_t s = kAt; s < kSteps; ++s) {
    PushStep(store, "job-a", s, 100, static_cast<uint64_t>(s + 1));
  }
  EXPECT_TRUE(BitEqual(AllWeights(store, "job-a"), uninterrupted));
}

TEST(ParameterStoreCheckpointTest, AutomaticCapturesAndRetention) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-b", /*every=*/3)).ok());
  for (int64_t s = 0; s < 10; ++s) PushStep(store, "job-b", s, 1, static_cast<uint64_t>(s + 1));
  // Step 9 was captured by itself: this call only waits for its file and applies retention.
  absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(store, "job-b", 9, 6);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step(), 9);
  EXPECT_EQ(*ListCheckpointSteps(dir + "/job-b", 0), (std::vector<int64_t>{6, 9}));
  // The capture at 6 is complete and holds version 6 everywhere.
  absl::StatusOr<CheckpointContents> six = ReadCheckpointFile(dir + "/job-b/ckpt-6/shard-0");
  ASSERT_TRUE(six.ok()) << six.status();
  for (const v1::PartitionCheckpoint& p : six->header.partitions()) EXPECT_EQ(p.version(), 6);
}

TEST(ParameterStoreCheckpointTest, PassedStepIsFailedPreconditionWithTheCompletedSteps) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-c")).ok());
  for (int64_t s = 0; s < 4; ++s) PushStep(store, "job-c", s, 1, static_cast<uint64_t>(s + 1));
  absl::StatusOr<v1::CheckpointResponse> late = CheckpointAndWait(store, "job-c", 2);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("completed 4 steps"));
  // The boundary the job sits at is captured at once.
  absl::StatusOr<v1::CheckpointResponse> now = CheckpointAndWait(store, "job-c", 4);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->step(), 4);
  // Mid-step (worker 0 staged step 4): the capture still holds the boundary's state.
  ASSERT_TRUE(
      store.Push(Request("job-c", 0, 1, 4, 5, {GradSlice("w", 1, StepGrad(37, 4, 0, 2))})).ok());
  v1::UpdateMembershipRequest m;
  m.set_job_id("job-c");
  m.add_live_workers(0);
  m.add_live_workers(1);
  m.set_effective_step(0);
  absl::StatusOr<v1::UpdateMembershipResponse> membership = store.UpdateMembership(m);
  ASSERT_TRUE(membership.ok()) << membership.status();
  EXPECT_EQ(membership->completed_steps(), 4);
}

TEST(ParameterStoreCheckpointTest, ValidatesEveryField) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-d")).ok());
  struct Case {
    std::string job;
    int64_t step;
    int64_t retain;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"../etc", 5, 0, absl::StatusCode::kInvalidArgument, "job_id:"},
      {"a/b", 5, 0, absl::StatusCode::kInvalidArgument, "job_id:"},
      {"", 5, 0, absl::StatusCode::kInvalidArgument, "job_id:"},
      {"job-d", 0, 0, absl::StatusCode::kInvalidArgument, "step:"},
      {"job-d", -3, 0, absl::StatusCode::kInvalidArgument, "step:"},
      {"job-d", std::numeric_limits<int64_t>::max(), 0, absl::StatusCode::kInvalidArgument,
       "step:"},
      {"job-d", 5, -1, absl::StatusCode::kInvalidArgument, "retain_from_step:"},
      {"job-d", 5, 6, absl::StatusCode::kInvalidArgument, "retain_from_step:"},
      {"nope", 5, 0, absl::StatusCode::kNotFound, "nope"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(store, c.job, c.step, c.retain);
    EXPECT_EQ(r.status().code(), c.code) << c.job << " " << c.step << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
  v1::RestoreRequest restore;
  restore.set_job_id("job-d");
  restore.set_step(7);
  EXPECT_EQ(store.Restore(restore).status().code(), absl::StatusCode::kNotFound);
  restore.set_step(-1);
  EXPECT_EQ(store.Restore(restore).status().code(), absl::StatusCode::kInvalidArgument);
  restore.set_step(7);
  restore.set_job_id("..");
  EXPECT_EQ(store.Restore(restore).status().code(), absl::StatusCode::kInvalidArgument);
  // CreateJobState refuses a job id that could not become a directory.
  EXPECT_EQ(store.CreateJobState(CheckpointJob("x/../../y")).status().code(),
            absl::StatusCode::kInvalidArgument);

  ParameterStore no_dir;
  ASSERT_TRUE(no_dir.CreateJobState(CheckpointJob("job-d")).ok());
  absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(no_dir, "job-d", 5);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("--data_dir not set"));
  restore.set_job_id("job-d");
  EXPECT_EQ(no_dir.Restore(restore).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ParameterStoreCheckpointTest, WaitingCheckpointsEndWithDropAndShutdown) {
  const std::string dir = MakeCheckpointDir();
  std::optional<absl::Status> dropped;
  std::optional<absl::Status> shut;
  int exhausted = 0;
  int answered = 0;
  {
    ParameterStore store(CheckpointOptions(dir));
    ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-e")).ok());
    ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-f")).ok());
    v1::CheckpointRequest r;
    r.set_job_id("job-e");
    r.set_step(100);
    store.Checkpoint(r, [&](absl::StatusOr<v1::CheckpointResponse> c) { dropped = c.status(); });
    r.set_job_id("job-f");
    store.Checkpoint(r, [&](absl::StatusOr<v1::CheckpointResponse> c) { shut = c.status(); });
    EXPECT_FALSE(dropped.has_value());
    ASSERT_TRUE(store.DropJob("job-e").ok());
    ASSERT_TRUE(dropped.has_value());
    EXPECT_EQ(dropped->code(), absl::StatusCode::kAborted);
    EXPECT_FALSE(shut.has_value());
    // Calls waiting for far-away steps are bounded.
    for (int64_t step = 200; step < 240; ++step) {
      r.set_step(step);
      store.Checkpoint(r, [&](absl::StatusOr<v1::CheckpointResponse> c) {
        ++answered;
        if (c.status().code() == absl::StatusCode::kResourceExhausted) ++exhausted;
      });
    }
    EXPECT_EQ(exhausted, 40 - 15);  // step 100 already waits: 15 more fit
    EXPECT_EQ(answered, exhausted);
  }
  ASSERT_TRUE(shut.has_value());
  EXPECT_EQ(shut->code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(answered, 40);  // the 15 that waited end with the shutdown
}

// A step far ahead of the job is refused (it would hold a registration for the life of the job),
// and cancelled calls stop counting: their registrations are forgotten and new ones fit again.
TEST(ParameterStoreCheckpointTest, FarStepsAreRefusedAndCancelledWaitersAreDropped) {
  const std::string dir = MakeCheckpointDir();
  // Declared before the store, which may still answer into them when it is destroyed.
  std::vector<std::optional<absl::Status>> answers(16);
  std::vector<std::optional<absl::Status>> later(16);
  int exhausted = 0;
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-x")).ok());
  for (int64_t s = 0; s < 3; ++s) PushStep(store, "job-x", s, 1, static_cast<uint64_t>(s + 1));
  const int64_t ahead = int64_t{1} << 20;
  absl::StatusOr<v1::CheckpointResponse> far = CheckpointAndWait(store, "job-x", 3 + ahead + 1);
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument) << far.status();
  EXPECT_THAT(far.status().message(), HasSubstr("step:"));
  EXPECT_THAT(far.status().message(), HasSubstr("completed 3 steps"));
  far = CheckpointAndWait(store, "job-x", int64_t{1000000000000});
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument) << far.status();

  // 16 registrations (the last at the bound itself) fill the job's slots.
  std::vector<std::shared_ptr<std::atomic<bool>>> flags;
  for (int i = 0; i < 16; ++i) {
    flags.push_back(std::make_shared<std::atomic<bool>>(false));
    v1::CheckpointRequest r;
    r.set_job_id("job-x");
    r.set_step(i == 15 ? 3 + ahead : 100 + i);
    store.Checkpoint(
        r, [&answers, i](absl::StatusOr<v1::CheckpointResponse> c) { answers[i] = c.status(); },
        flags.back());
  }
  for (int i = 0; i < 16; ++i) EXPECT_FALSE(answers[i].has_value()) << i << ": " << *answers[i];
  absl::StatusOr<v1::CheckpointResponse> refused = CheckpointAndWait(store, "job-x", 50);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  // Their callers go away: the next call answers them CANCELLED, forgets their steps, and fits.
  for (const auto& f : flags) f->store(true);
  absl::StatusOr<v1::CheckpointResponse> now = CheckpointAndWait(store, "job-x", 3);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->step(), 3);
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(answers[i].has_value()) << i;
    EXPECT_EQ(answers[i]->code(), absl::StatusCode::kCancelled) << i << ": " << *answers[i];
  }
  // The forgotten steps are not captured: only step 3 has a file after the job passes 100..114.
  for (int64_t s = 3; s < 120; ++s) PushStep(store, "job-x", s, 1, static_cast<uint64_t>(s + 1));
  absl::StatusOr<v1::CheckpointResponse> passed = CheckpointAndWait(store, "job-x", 105);
  EXPECT_EQ(passed.status().code(), absl::StatusCode::kFailedPrecondition) << passed.status();
  EXPECT_EQ(*ListCheckpointSteps(dir + "/job-x", 0), (std::vector<int64_t>{3}));
  // 16 new registrations fit again.
  for (int i = 0; i < 16; ++i) {
    v1::CheckpointRequest r;
    r.set_job_id("job-x");
    r.set_step(200 + i);
    store.Checkpoint(r, [&later, &exhausted, i](absl::StatusOr<v1::CheckpointResponse> c) {
      later[i] = c.status();
      if (c.status().code() == absl::StatusCode::kResourceExhausted) ++exhausted;
    });
  }
  EXPECT_EQ(exhausted, 0);
  ASSERT_TRUE(store.DropJob("job-x").ok());
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(later[i].has_value()) << i;
    EXPECT_EQ(later[i]->code(), absl::StatusCode::kAborted) << i << ": " << *later[i];
  }
}

// A shard process that restarted holds no job in memory, but the checkpoint files of an ended job
// are still on disk: DropJob (NOT_FOUND, which settles the coordinator's owed drop) removes them.
TEST(ParameterStoreCheckpointTest, DropJobOfAJobNotInMemoryRemovesItsFiles) {
  const std::string dir = MakeCheckpointDir();
  {
    ParameterStore store(CheckpointOptions(dir));
    ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-z")).ok());
    PushStep(store, "job-z", 0, 1, 1);
    const absl::StatusOr<v1::CheckpointResponse> written = CheckpointAndWait(store, "job-z", 1);
    ASSERT_TRUE(written.ok()) << written.status();
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/job-z"));
  {
    ParameterStore restarted(CheckpointOptions(dir));
    EXPECT_EQ(restarted.DropJob("job-z").code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(restarted.DropJob("..").code(), absl::StatusCode::kNotFound);  // no file name
  }  // the writer thread has run the removal
  EXPECT_FALSE(std::filesystem::exists(dir + "/job-z"));
  EXPECT_TRUE(std::filesystem::exists(dir));
}

// A refused Checkpoint is answered with no store lock held: its callback may call the store again
// (before the fix it ran under the job's checkpoint lock, and this deadlocked).
TEST(ParameterStoreCheckpointTest, RefusalsAreAnsweredWithoutStoreLocks) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-y")).ok());
  v1::CheckpointRequest r;
  r.set_job_id("job-y");
  for (int64_t step = 100; step < 116; ++step) {
    r.set_step(step);
    store.Checkpoint(r, [](absl::StatusOr<v1::CheckpointResponse>) {});
  }
  auto first = std::make_shared<std::optional<absl::Status>>();
  auto second = std::make_shared<std::optional<absl::Status>>();
  auto done = std::make_shared<absl::Notification>();
  std::thread caller([&store, first, second, done] {
    v1::CheckpointRequest again;
    again.set_job_id("job-y");
    again.set_step(50);
    store.Checkpoint(
        again, [&store, first, second, done, again](absl::StatusOr<v1::CheckpointResponse> c) {
          *first = c.status();
          store.Checkpoint(again, [second, done](absl::StatusOr<v1::CheckpointResponse> c2) {
            *second = c2.status();
            done->Notify();
          });
        });
  });
  if (!done->WaitForNotificationWithTimeout(absl::Seconds(10))) {
    // The caller is stuck on a store lock: nothing can end this process cleanly.
    ADD_FAILURE() << "a Checkpoint callback that calls the store again deadlocked";
    std::_Exit(1);
  }
  caller.join();
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ((*first)->code(), absl::StatusCode::kResourceExhausted) << **first;
  ASSERT_TRUE(second->has_value());
  EXPECT_EQ((*second)->code(), absl::StatusCode::kResourceExhausted) << **second;
}

// A dropped job's files are deleted (by the writer, after its queued writes), and automatic files
// nobody asked for are bounded: the oldest beyond 8 go, never one at or below a requested step.
TEST(ParameterStoreCheckpointTest, DroppedJobsAndUnrequestedAutomaticFilesAreDeleted) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-g", /*every=*/1)).ok());
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-h")).ok());
  // The writer runs its tasks in order: a checkpoint of job-h answered means every earlier write
  // (and deletion) is done.
  int64_t h_step = 0;
  auto flush = [&] {
    PushStep(store, "job-h", h_step, 1, static_cast<uint64_t>(h_step + 1));
    ++h_step;
    absl::StatusOr<v1::CheckpointResponse> r = CheckpointAndWait(store, "job-h", h_step);
    ASSERT_TRUE(r.ok()) << r.status();
  };
  for (int64_t s = 0; s < 4; ++s) PushStep(store, "job-g", s, 1, static_cast<uint64_t>(s + 1));
  flush();
  absl::StatusOr<v1::CheckpointResponse> four = CheckpointAndWait(store, "job-g", 4);
  ASSERT_TRUE(four.ok()) << four.status();
  for (int64_t s = 4; s < 20; ++s) PushStep(store, "job-g", s, 1, static_cast<uint64_t>(s + 1));
  flush();
  EXPECT_EQ(*ListCheckpointSteps(dir + "/job-g", 0),
            (std::vector<int64_t>{1, 2, 3, 4, 13, 14, 15, 16, 17, 18, 19, 20}));
  // A deleted step is not answered from memory with its old path.
  absl::StatusOr<v1::CheckpointResponse> gone = CheckpointAndWait(store, "job-g", 6);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  absl::StatusOr<v1::CheckpointResponse> kept = CheckpointAndWait(store, "job-g", 14);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->path(), dir + "/job-g/ckpt-14/shard-0");

  ASSERT_TRUE(store.DropJob("job-g").ok());
  flush();
  EXPECT_EQ(::access((dir + "/job-g").c_str(), F_OK), -1);
  EXPECT_EQ(::access((dir + "/job-h/ckpt-1/shard-0").c_str(), F_OK), 0);
}

// The restore path checks every header field against the data before it reads: mutated headers
// (with a valid CRC, as a fuzzer would make them) are OK or DATA_LOSS, never a crash.
TEST(ParameterStoreCheckpointTest, MutatedHeadersAreRefusedWithDataLoss) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  ASSERT_TRUE(store.CreateJobState(CheckpointJob("job-g")).ok());
  for (int64_t s = 0; s < 3; ++s) PushStep(store, "job-g", s, 1, static_cast<uint64_t>(s + 1));
  absl::StatusOr<v1::CheckpointResponse> c = CheckpointAndWait(store, "job-g", 3);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(c->path());
  ASSERT_TRUE(file.ok());
  const std::string header = file->header.SerializeAsString();
  std::mt19937 rng(7);
  int restored = 0;
  int refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string mutated = header;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      mutated[rng() % mutated.size()] = static_cast<char>(rng());
    }
    CheckpointContents contents;
    if (!contents.header.ParseFromString(mutated)) continue;
    contents.data = file->data;
    ParameterStoreOptions options;
    options.max_memory_bytes = int64_t{64} << 20;
    ParameterStore target(options);
    absl::StatusOr<v1::RestoreResponse> r = target.RestoreJobFromCheckpoint(contents, 1);
    if (r.ok()) {
      ++restored;
    } else {
      ++refused;
      EXPECT_TRUE(r.status().code() == absl::StatusCode::kDataLoss ||
                  r.status().code() == absl::StatusCode::kResourceExhausted)
          << r.status();
    }
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(restored, 0);  // some flips land in values that do not matter (weights, times)
}

TEST(ParameterStoreCheckpointTest, SspCapturesWhenTheSlowestWorkerReachesTheStep) {
  const std::string dir = MakeCheckpointDir();
  ParameterStore store(CheckpointOptions(dir));
  v1::JobConfig config = Config(v1::CONSISTENCY_SSP, 2, 1.0f, v1::OPTIMIZER_KIND_SGD, 2);
  config.set_checkpoint_every_steps(2);
  v1::CreateJobStateRequest r = JobRequest("ssp", config);
  *r.add_partitions() = Dense("w", 0, 2);
  ASSERT_TRUE(store.CreateJobState(r).ok());
  // Worker 0 runs ahead to clock 3; worker 1 reaches 2 last: then step 2 is captured, holding
  // worker 0's third push too (its seq is in the table).
  for (int64_t s = 0; s < 3; ++s) {
    ASSERT_TRUE(store.Push(Request("ssp", 0, 1, s, s + 1, {GradSlice("w", 0, {1, 1})})).ok());
  }
  for (int64_t s = 0; s < 2; ++s) {
    ASSERT_TRUE(store.Push(Request("ssp", 1, 1, s, s + 1, {GradSlice("w", 0, {2, 2})})).ok());
  }
  absl::StatusOr<v1::CheckpointResponse> c = CheckpointAndWait(store, "ssp", 2);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<CheckpointContents> file = ReadCheckpointFile(c->path());
  ASSERT_TRUE(file.ok());
  const v1::PartitionCheckpoint& p = file->header.partitions(0);
  EXPECT_EQ(p.version(), 5);
  EXPECT_EQ(p.clocks(0), 3);
  EXPECT_EQ(p.clocks(1), 2);
  // w = -(3 * 1 + 2 * 2) / 2 per element (SSP scales by 1 / num_live).
  float w[2];
  std::memcpy(w, file->data.data() + p.weights().offset(), 8);
  EXPECT_EQ(w[0], -3.5f);
  EXPECT_EQ(w[1], -3.5f);
}

}  // namespace
}  // namespace tessera::server
