#include "worker/trainer/distributed_trainer.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/sparse_rows.h"
#include "spec/testing/example_jobs.h"
#include "worker/client/local_shards.h"
#include "worker/client/parameter_client.h"
#include "worker/trainer/internal/batch_rows.h"
#include "worker/trainer/internal/row_exchange.h"
#include "worker/trainer/testing/ranks.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;
using namespace ::tessera::trainer::testing_ranks;  // NOLINT: ranks in one process

// ShardsTest's 641 training examples: with 2 workers rank 0 reads 321 and rank 1 reads 320, so
// with batch 32 rank 0's shard holds 11 batches but every rank must run
// ceil(floor(641 / 2) / 32) = 10 per epoch.
constexpr int kBatch = 32;
constexpr int64_t kStepsPerEpoch = 10;

class DistributedTrainerTest : public ShardsTest {
 protected:
  v1::JobSpec Spec(int workers, int epochs, const std::string& extra = "") {
    v1::JobSpec spec;
    const std::string text = absl::StrCat(spec::examples::BlobsJobText(dir_, 16), R"(
      optimizer { kind: OPTIMIZER_KIND_ADAM learning_rate: 0.01 }
      batch_size: )",
                                          kBatch, R"(
      seed: 7
      partition_bytes: 1024
      num_workers: )",
                                          workers, "\n epochs: ", epochs, "\n", extra);
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
    return spec;
  }

  DistributedOptions Options(const std::string& job_id, const v1::JobSpec& spec, int rank,
                             std::vector<std::string> shards = {}) {
    return RankOptions(job_id, spec, rank, shards.empty() ? shards_->addresses() : shards);
  }

  // BSP against a single-process reference, sparse tables or none (defined below).
  // `cpu_devices`: each rank's --devices cpu:N (1: one device).
  absl::StatusOr<v1::ProgressReport> CheckBspAgainstAReference(const std::string& job,
                                                               const v1::JobSpec& spec,
                                                               size_t expected_tables,
                                                               int cpu_devices = 1);

  static std::unique_ptr<DistributedTrainer> Make(DistributedOptions o) {
    auto t = DistributedTrainer::Create(std::move(o));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }

  static std::vector<float> Weights(const DistributedTrainer& t) {
    std::vector<float> all;
    for (const engine::Parameter& p : t.model().parameters()) {
      if (!p.trainable) continue;
      std::vector<float> v;
      EXPECT_TRUE(t.model().CopyValueToHost(p.name, &v).ok());
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }

  // What the shards hold for the job, pulled ungated in parameter order.
  static std::vector<float> ShardWeights(const std::string& job_id, const DistributedTrainer& t) {
    std::vector<client::DenseTensorSpec> tensors;
    for (const engine::Parameter& p : t.model().parameters()) {
      if (!p.trainable) continue;
      tensors.push_back({p.name, std::vector<int64_t>(p.shape.begin(), p.shape.end()), {}});
    }
    std::vector<float> all;
    for (const std::vector<float>& v : ShardValues(job_id, tensors)) {
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
};

TEST_F(DistributedTrainerTest, BspRanksEndWithIdenticalWeightsEqualToTheShards) {
  const std::string job = "bsp-identical";
  const v1::JobSpec spec = Spec(2, 2);
  FakeCoordinator coordinator(2);
  std::vector<std::unique_ptr<DistributedTrainer>> ranks;
  std::vector<std::vector<v1::ProgressReport>> reports(2);
  for (int r = 0; r < 2; ++r) {
    DistributedOptions o = Options(job, spec, r);
    o.on_progress = [&reports, r](const v1::ProgressReport& p) { reports[r].push_back(p); };
    if (r == 0) {
      o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
    }
    ranks.push_back(Make(std::move(o)));
    ASSERT_NE(ranks.back(), nullptr);
  }
  const std::vector<float> initial = Weights(*ranks[0]);
  ASSERT_EQ(initial, Weights(*ranks[1])) << "every rank starts from the spec's seed";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks[r]->steps_per_epoch(), kStepsPerEpoch);
    EXPECT_EQ(ranks[r]->total_steps(), 2 * kStepsPerEpoch);
  }
  EXPECT_EQ(ranks[0]->train_data().size(), 321);
  EXPECT_EQ(ranks[1]->train_data().size(), 320);

  const std::vector<absl::StatusOr<v1::ProgressReport>> results = RunAll(ranks, &coordinator);

  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(results[0]->phase(), v1::TASK_PHASE_SUCCEEDED);
  EXPECT_EQ(results[1]->phase(), v1::TASK_PHASE_TRAINING_DONE);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks[r]->steps_done(), 2 * kStepsPerEpoch) << "rank " << r;
    EXPECT_EQ(results[r]->step(), 2 * kStepsPerEpoch);
    EXPECT_EQ(results[r]->total_steps(), 2 * kStepsPerEpoch);
    EXPECT_EQ(results[r]->epochs(), 2);
    EXPECT_GT(results[r]->step_times().compute(), 0);
    EXPECT_GT(results[r]->step_times().exchange(), 0);
    EXPECT_GT(results[r]->step_times().round_trip(), 0);
    EXPECT_LE(results[r]->step_times().gate_wait(), results[r]->step_times().round_trip());
    EXPECT_GT(results[r]->loss(), 0) << "rank " << r;
  }
  EXPECT_GE(coordinator.polls(), 1);
  // Under BSP the rank that pushes first waits at the gate for the other.
  EXPECT_GT(results[0]->step_times().gate_wait() + results[1]->step_times().gate_wait(), 0);

  const std::vector<float> w0 = Weights(*ranks[0]);
  const std::vector<float> w1 = Weights(*ranks[1]);
  EXPECT_EQ(w0, w1);
  EXPECT_EQ(w0, ShardWeights(job, *ranks[0]));
  EXPECT_NE(w0, initial);

  // Rank 0's final evaluation; the blobs are easy.
  EXPECT_TRUE(results[0]->evaluated());
  EXPECT_GT(results[0]->test_accuracy(), 0.9);
  EXPECT_FALSE(results[0]->has_test_auc()) << "three classes: no AUC";
  EXPECT_FALSE(results[1]->evaluated());

  // Progress: steps only grow, one report per epoch end, rank 0 evaluates epoch 1 (not the last,
  // whose evaluation is the final one).
  for (int r = 0; r < 2; ++r) {
    int64_t last = 0;
    int evaluated = 0;
    for (const v1::ProgressReport& p : reports[r]) {
      EXPECT_GE(p.step(), last);
      last = p.step();
      EXPECT_EQ(p.rank(), r);
      EXPECT_EQ(p.phase(), v1::TASK_PHASE_TRAINING);
      // Every report comes after at least one step: it carries a training loss, also when it
      // follows another report at once (an epoch end).
      EXPECT_GT(p.loss(), 0) << "rank " << r << " step " << p.step();
      if (p.evaluated()) {
        ++evaluated;
        EXPECT_EQ(p.step(), kStepsPerEpoch);
        EXPECT_GT(p.test_accuracy(), 0.5);
      }
    }
    EXPECT_EQ(last, 2 * kStepsPerEpoch);
    EXPECT_EQ(evaluated, r == 0 ? 1 : 0);
  }
  DropJob(job);
}

// With the overlap a step returns before its answers are in; it still counts as done only once
// they are, that is once every rank has pushed it (the coordinator hands a lost rank's place on
// from the ranks' smallest step). Rank 1 stops before its step 5: rank 0 trains step 5 and then
// waits in step 6's forward pass, and must say 5 steps are done, not 6.
TEST_F(DistributedTrainerTest, AStepCountsAsDoneOnlyOnceEveryRankPushedIt) {
  const std::string job = "bsp-steps-done";
  const v1::JobSpec spec = Spec(2, 1);
  FakeCoordinator coordinator(2);
  absl::Notification reached, release;
  absl::Mutex mu;
  int64_t reported = -1;
  std::vector<std::unique_ptr<DistributedTrainer>> ranks;
  for (int r = 0; r < 2; ++r) {
    DistributedOptions o = Options(job, spec, r);
    if (r == 0) {
      o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
      o.on_progress = [&](const v1::ProgressReport& p) {
        absl::MutexLock lock(&mu);
        reported = std::max<int64_t>(reported, p.step());
      };
    } else {
      o.on_batch = [&](int64_t step, const data::Batch&) {
        if (step != 5) return;
        reached.Notify();
        release.WaitForNotificationWithTimeout(absl::Seconds(20));
      };
    }
    ranks.push_back(Make(std::move(o)));
    ASSERT_NE(ranks.back(), nullptr);
  }
  std::vector<absl::StatusOr<v1::ProgressReport>> results;
  std::thread run([&] { results = RunAll(ranks, &coordinator); });
  ASSERT_TRUE(reached.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Rank 0 trains step 5 and reports 5 steps done; then it needs rank 1's step 5, and a wrong
  // count would run on to 6 at once.
  const auto reported_at_least = [&](int64_t n) {
    absl::MutexLock lock(&mu);
    return reported >= n;
  };
  for (int i = 0; i < 1000 && !reported_at_least(5); ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(300));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(reported, 5);
  }
  EXPECT_EQ(ranks[0]->steps_done(), 5);
  release.Notify();
  run.join();
  ASSERT_EQ(results.size(), 2u);
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(ranks[0]->steps_done(), kStepsPerEpoch);
  EXPECT_EQ(results[0]->step(), kStepsPerEpoch);
  DropJob(job);
}

TEST_F(DistributedTrainerTest, MaxStepsCapsEveryRank) {
  const v1::JobSpec spec = Spec(2, 3, "max_steps: 7");
  for (int r = 0; r < 2; ++r) {
    auto t = Make(Options("caps", spec, r));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->steps_per_epoch(), kStepsPerEpoch);
    EXPECT_EQ(t->total_steps(), 7);
  }
}

TEST_F(DistributedTrainerTest, CancelStopsWithinAStep) {
  const std::string job = "cancel";
  const v1::JobSpec spec = Spec(2, 1000);
  FakeCoordinator coordinator(2);
  std::vector<std::unique_ptr<DistributedTrainer>> ranks;
  for (int r = 0; r < 2; ++r) {
    DistributedOptions o = Options(job, spec, r);
    if (r == 0) {
      o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
    }
    ranks.push_back(Make(std::move(o)));
    ASSERT_NE(ranks.back(), nullptr);
  }
  std::vector<absl::StatusOr<v1::ProgressReport>> results(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { results[r] = ranks[r]->Run(); });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ranks[0]->steps_done() < 5 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GE(ranks[0]->steps_done(), 5);
  const auto cancelled_at = std::chrono::steady_clock::now();
  std::vector<int64_t> steps_at_cancel;
  for (auto& t : ranks) {
    steps_at_cancel.push_back(t->steps_done());
    t->Cancel();
  }
  for (std::thread& t : threads) t.join();
  const double stop_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cancelled_at).count();
  EXPECT_LT(stop_seconds, 1.0);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(results[r].ok());
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(results[r].status().message(), "cancelled");
    EXPECT_FALSE(IsShardError(results[r].status()));
    EXPECT_LE(ranks[r]->steps_done(), steps_at_cancel[r] + 1) << "rank " << r;
    EXPECT_LT(ranks[r]->steps_done(), ranks[r]->total_steps());
  }
  // As the coordinator does: drop the job, which ends the pulls a cancelled step left parked.
  DropJob(job);
  ranks.clear();
}

TEST_F(DistributedTrainerTest, UnreachableShardFailsNamingItsAddress) {
  // A port that nothing listens on: bind port 0, read it, close it.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string dead = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  close(fd);

  DistributedOptions o = Options("unreachable", Spec(1, 1), 0, {shards_->addresses()[0], dead});
  o.call_timeout = absl::Seconds(2);
  o.max_attempts = 3;
  auto t = Make(std::move(o));
  ASSERT_NE(t, nullptr);
  absl::StatusOr<v1::ProgressReport> r = t->Run();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr(dead));
  EXPECT_THAT(r.status().message(), HasSubstr("shards: "));
  EXPECT_TRUE(IsShardError(r.status())) << r.status();
}

TEST_F(DistributedTrainerTest, RefusesBadTasks) {
  {
    DistributedOptions o = Options("bad", Spec(2, 1), 0);
    o.task.set_world_size(3);
    auto t = DistributedTrainer::Create(o);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("task.world_size"));
  }
  {
    DistributedOptions o = Options("bad", Spec(2, 1), 2);
    auto t = DistributedTrainer::Create(o);
    ASSERT_FALSE(t.ok());
    EXPECT_THAT(t.status().message(), HasSubstr("task.rank"));
  }
  {
    DistributedOptions o = Options("bad", Spec(2, 1, "consistency: \"eventual\""), 0);
    auto t = DistributedTrainer::Create(o);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("consistency"));
  }
  {
    v1::JobSpec spec = Spec(1, 1);
    spec.mutable_dataset()->set_train_path(dir_ + "/missing.csv");
    auto t = DistributedTrainer::Create(Options("bad", spec, 0));
    ASSERT_FALSE(t.ok());
    EXPECT_THAT(t.status().message(), HasSubstr("missing.csv"));
  }
  {
    v1::JobSpec spec = Spec(1, 1);
    v1::Layer* first = spec.mutable_model()->mutable_layers(0);
    first->set_name("bag");
    first->mutable_embedding_bag()->set_num_rows(10);
    first->mutable_embedding_bag()->set_dim(4);
    auto t = DistributedTrainer::Create(Options("bad", spec, 0));
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("dataset.format"));
  }
}

TEST(DataPositionTest, FollowsEpochOffsetAndPass) {
  struct Case {
    int64_t step, steps_per_epoch, batches_per_pass;
    int32_t epoch;
    int64_t offset;
    int32_t pass;
  };
  const Case cases[] = {
      {0, 10, 11, 0, 0, 0}, {9, 10, 11, 0, 9, 0}, {10, 10, 11, 1, 0, 0}, {23, 10, 10, 2, 3, 0},
      {7, 10, 3, 0, 7, 2},  {15, 10, 3, 1, 5, 1}, {29, 10, 3, 2, 9, 3},  {5, 1, 1, 5, 0, 0},
  };
  for (const Case& c : cases) {
    const v1::DataPosition p = DataPositionAt(c.step, c.steps_per_epoch, c.batches_per_pass, 100);
    EXPECT_EQ(p.epoch(), c.epoch) << c.step;
    EXPECT_EQ(p.batch_offset(), c.offset) << c.step;
    EXPECT_EQ(p.pass(), c.pass) << c.step;
    EXPECT_EQ(p.seed(), 100u + static_cast<uint64_t>(c.pass)) << c.step;
  }
}

// The labels of every batch each rank trained on, by step.
using BatchLog = std::vector<std::map<int64_t, std::vector<int32_t>>>;

TEST_F(DistributedTrainerTest, ResumedRunDrawsTheSameBatchesAndEndsWithTheSameWeights) {
  // Dropout too: its masks must be a function of (seed, rank, step).
  v1::JobSpec spec = Spec(2, 2);
  {
    auto* model = spec.mutable_model();
    const v1::Layer last = model->layers(2);
    model->mutable_layers(2)->mutable_dropout()->set_rate(0.2f);
    *model->add_layers() = last;
  }
  constexpr int64_t kTotal = 2 * kStepsPerEpoch;
  constexpr int64_t kCut = 13;  // inside epoch 1
  const auto make_ranks = [&](const std::string& job, const v1::JobSpec& s, uint64_t incarnation,
                              int64_t start, FakeCoordinator* coordinator, BatchLog* log,
                              std::vector<std::vector<v1::ProgressReport>>* reports) {
    std::vector<std::unique_ptr<DistributedTrainer>> ranks;
    for (int r = 0; r < 2; ++r) {
      DistributedOptions o = Options(job, s, r);
      o.task.set_incarnation(incarnation);
      o.task.set_start_step(start);
      if (start > 0) {
        // What a coordinator sends: it does not know the rank's split, so pass 0, spec.seed.
        v1::DataPosition* p = o.task.mutable_data_position();
        p->set_epoch(static_cast<int32_t>(start / kStepsPerEpoch));
        p->set_batch_offset(start % kStepsPerEpoch);
        p->set_seed(s.seed());
      }
      o.on_batch = [log, r](int64_t step, const data::Batch& b) { (*log)[r][step] = b.labels; };
      if (reports != nullptr) {
        o.on_progress = [reports, r](const v1::ProgressReport& p) { (*reports)[r].push_back(p); };
      }
      if (r == 0 && coordinator != nullptr) {
        o.report = [coordinator](const v1::ProgressReport& p) { return coordinator->Report(p); };
      }
      ranks.push_back(Make(std::move(o)));
    }
    return ranks;
  };

  // The reference: one uninterrupted run.
  BatchLog reference(2);
  FakeCoordinator c1(2);
  auto ref = make_ranks("resume-ref", spec, 1, 0, &c1, &reference, nullptr);
  ASSERT_NE(ref[0], nullptr);
  ASSERT_NE(ref[1], nullptr);
  for (auto& r : RunAll(ref, &c1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> ref_weights = ShardWeights("resume-ref", *ref[0]);

  // The same job stopped after kCut steps (max_steps), then a new incarnation resumed at kCut.
  BatchLog first(2), second(2);
  v1::JobSpec cut = spec;
  cut.set_max_steps(kCut);
  auto part1 = make_ranks("resume-cut", cut, 1, 0, nullptr, &first, nullptr);
  ASSERT_NE(part1[0], nullptr);
  for (auto& r : RunAll(part1, nullptr)) ASSERT_TRUE(r.ok()) << r.status();
  FakeCoordinator c2(2);
  std::vector<std::vector<v1::ProgressReport>> reports(2);
  auto part2 = make_ranks("resume-cut", spec, 2, kCut, &c2, &second, &reports);
  ASSERT_NE(part2[0], nullptr);
  ASSERT_NE(part2[1], nullptr);
  EXPECT_EQ(part2[0]->start_step(), kCut);
  const std::vector<absl::StatusOr<v1::ProgressReport>> results = RunAll(part2, &c2);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.status();

  EXPECT_EQ(ShardWeights("resume-cut", *part2[0]), ref_weights);
  EXPECT_EQ(Weights(*part2[1]), ref_weights);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(first[r].size(), static_cast<size_t>(kCut));
    ASSERT_EQ(second[r].size(), static_cast<size_t>(kTotal - kCut)) << "rank " << r;
    EXPECT_EQ(second[r].begin()->first, kCut);
    for (int64_t step = 0; step < kTotal; ++step) {
      const auto& got = step < kCut ? first[r][step] : second[r][step];
      EXPECT_EQ(got, reference[r][step]) << "rank " << r << " step " << step;
    }
    EXPECT_EQ(part2[r]->steps_done(), kTotal);
    EXPECT_EQ(results[r]->step(), kTotal);
    EXPECT_EQ(results[r]->epochs(), 2);
    EXPECT_EQ(results[r]->incarnation(), 2u);
    EXPECT_EQ(results[r]->steps_per_epoch(), kStepsPerEpoch);
    ASSERT_FALSE(reports[r].empty());
    EXPECT_GT(reports[r].front().step(), kCut);
    for (const v1::ProgressReport& p : reports[r]) {
      EXPECT_EQ(p.incarnation(), 2u);
      EXPECT_EQ(p.steps_per_epoch(), kStepsPerEpoch);
      EXPECT_GE(p.epochs(), 1) << "epoch 0 was done before the cut";
    }
  }
  EXPECT_EQ(results[0]->phase(), v1::TASK_PHASE_SUCCEEDED);
  EXPECT_GT(results[0]->test_accuracy(), 0.9);

  // A rank 0 that takes over at total_steps trains nothing: it waits, pulls and evaluates.
  FakeCoordinator c3(2);
  c3.MarkDone(1);
  BatchLog none(2);
  DistributedOptions o = Options("resume-cut", spec, 0);
  o.task.set_incarnation(3);
  o.task.set_start_step(kTotal);
  *o.task.mutable_data_position() = part2[0]->DataPosition(kTotal);
  o.report = [&c3](const v1::ProgressReport& p) { return c3.Report(p); };
  o.on_batch = [&none](int64_t step, const data::Batch& b) { none[0][step] = b.labels; };
  auto last = Make(std::move(o));
  ASSERT_NE(last, nullptr);
  absl::StatusOr<v1::ProgressReport> end = last->Run();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(none[0].empty());
  EXPECT_EQ(end->phase(), v1::TASK_PHASE_SUCCEEDED);
  EXPECT_EQ(end->step(), kTotal);
  EXPECT_EQ(end->epochs(), 2);
  EXPECT_EQ(end->incarnation(), 3u);
  EXPECT_EQ(end->test_accuracy(), results[0]->test_accuracy());
  EXPECT_EQ(Weights(*last), ref_weights);
  EXPECT_GE(c3.polls(), 1);
  DropJob("resume-ref");
  DropJob("resume-cut");
}

TEST_F(DistributedTrainerTest, ResumeChecksTheDataPosition) {
  const v1::JobSpec spec = Spec(2, 2);
  const auto create = [&](int64_t start, std::optional<v1::DataPosition> position) {
    DistributedOptions o = Options("position", spec, 1);
    o.task.set_start_step(start);
    if (position.has_value()) *o.task.mutable_data_position() = *position;
    return DistributedTrainer::Create(std::move(o));
  };
  const auto position = [](int32_t epoch, int64_t offset, int32_t pass, uint64_t seed) {
    v1::DataPosition p;
    p.set_epoch(epoch);
    p.set_batch_offset(offset);
    p.set_pass(pass);
    p.set_seed(seed);
    return p;
  };
  struct Case {
    int64_t start;
    std::optional<v1::DataPosition> position;
    std::string error;  // empty: accepted
  };
  const std::vector<Case> cases = {
      {0, std::nullopt, ""},
      {13, position(1, 3, 0, 7), ""},  // pass 0 with spec.seed: the trainer knows the pass
      {13, position(1, 3, 0, 0), ""},
      {10, position(1, 0, 0, 7), ""},
      {20, position(2, 0, 0, 7), ""},
      {13, std::nullopt, "data_position: unset at start_step 13"},
      {13, position(0, 13, 0, 7), "data_position: epoch 0 differs"},
      {13, position(1, 4, 0, 7), "data_position: batch_offset 4 differs"},
      {13, position(1, 3, 2, 9), "data_position: pass 2 differs"},
      {13, position(1, 3, 0, 8), "data_position: seed 8 differs"},
      {21, position(2, 1, 0, 7), "task.start_step: must be in [0, 20]"},
      {-1, std::nullopt, "task.start_step"},
  };
  for (const Case& c : cases) {
    auto t = create(c.start, c.position);
    if (c.error.empty()) {
      EXPECT_TRUE(t.ok()) << c.start << ": " << t.status();
    } else {
      ASSERT_FALSE(t.ok()) << c.start << " " << c.error;
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.error));
    }
  }
}

TEST_F(DistributedTrainerTest, RankJoiningAtAStepWaitsUntilTheOthersFinishedThePreviousOne) {
  // Rank 1 trains steps 0..4 alone (membership {1} from step 0, {0, 1} from step 5), and rank 0
  // joins at step 5, started first: its pull for step 5 must park until rank 1 finished step 4.
  const std::string job = "join";
  const v1::JobSpec spec = Spec(2, 1);
  FakeCoordinator coordinator(2);
  absl::Mutex mu;
  std::vector<std::pair<int, int64_t>> order;  // (rank, step) as batches are drawn
  const auto log = [&mu, &order](int rank) {
    return [&mu, &order, rank](int64_t step, const data::Batch&) {
      absl::MutexLock lock(&mu);
      order.emplace_back(rank, step);
    };
  };
  DistributedOptions o0 = Options(job, spec, 0);
  o0.task.set_incarnation(2);
  o0.task.set_start_step(5);
  o0.task.mutable_data_position()->set_batch_offset(5);
  o0.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
  o0.on_batch = log(0);
  auto joined = Make(std::move(o0));
  ASSERT_NE(joined, nullptr);
  absl::StatusOr<v1::ProgressReport> joined_result = absl::UnknownError("not run");
  std::thread joined_thread([&] { joined_result = joined->Run(); });

  // Once rank 0 has declared the job, the membership history goes in.
  client::ParameterClient::Options co;
  co.shard_addresses = shards_->addresses();
  co.job_id = job;
  auto control = client::ParameterClient::Create(co);
  ASSERT_TRUE(control.ok());
  absl::Status membership = absl::UnknownError("not tried");
  for (int i = 0; i < 500; ++i) {
    membership = (*control)->UpdateMembership({1}, 0);
    if (membership.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(membership.ok()) << membership;
  ASSERT_TRUE((*control)->UpdateMembership({0, 1}, 5).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(joined->steps_done(), 0) << "rank 0 must wait for step 5's weights";

  DistributedOptions o1 = Options(job, spec, 1);
  o1.on_batch = log(1);
  auto other = Make(std::move(o1));
  ASSERT_NE(other, nullptr);
  absl::StatusOr<v1::ProgressReport> other_result = other->Run();
  coordinator.MarkDone(1);
  joined_thread.join();
  ASSERT_TRUE(joined_result.ok()) << joined_result.status();
  ASSERT_TRUE(other_result.ok()) << other_result.status();
  EXPECT_EQ(joined->steps_done(), kStepsPerEpoch);
  EXPECT_EQ(other->steps_done(), kStepsPerEpoch);
  EXPECT_EQ(joined_result->step(), kStepsPerEpoch);
  EXPECT_EQ(Weights(*joined), Weights(*other));
  EXPECT_EQ(Weights(*joined), ShardWeights(job, *joined));
  // Rank 0's first batch (step 5) came after rank 1 drew step 4's.
  absl::MutexLock lock(&mu);
  const auto first0 = std::find(order.begin(), order.end(), std::make_pair(0, int64_t{5}));
  const auto step4 = std::find(order.begin(), order.end(), std::make_pair(1, int64_t{4}));
  ASSERT_NE(first0, order.end());
  ASSERT_NE(step4, order.end());
  EXPECT_LT(step4 - order.begin(), first0 - order.begin());
  EXPECT_EQ(std::count_if(order.begin(), order.end(), [](const auto& e) { return e.first == 0; }),
            kStepsPerEpoch - 5);
  DropJob(job);
}

// Writes `rows` Criteo lines: small vocabularies (values 0..7 per field, some fields empty), so
// that rows repeat across batches and ranks; the label is C1 < 3.
void WriteSmallCriteo(const std::string& path, int rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::ofstream out(path);
  for (int r = 0; r < rows; ++r) {
    const int c1 = static_cast<int>(rng() % 8), i1 = static_cast<int>(rng() % 5);
    out << (c1 < 3 ? 1 : 0);
    out << '\t' << i1;
    for (int i = 1; i < 13; ++i) out << '\t' << (rng() % 4 == 0 ? "" : std::to_string(rng() % 9));
    out << '\t' << c1;
    for (int c = 1; c < 26; ++c) {
      out << '\t';
      if (rng() % 5 != 0) out << std::hex << (rng() % 8) << std::dec;
    }
    out << '\n';
  }
}

// BSP with 2 ranks and 2 shards against a single-process reference that replays the same
// batches: each step, both ranks' gradients at the same weights, averaged as the shards do
// (dense: the mean; rows: each row's sum over the ranks over 2, one update per row and step),
// for every sparse table of the model (none for a dense one). Returns rank 0's final report.
absl::StatusOr<v1::ProgressReport> DistributedTrainerTest::CheckBspAgainstAReference(
    const std::string& job, const v1::JobSpec& spec, size_t expected_tables, int cpu_devices) {
  FakeCoordinator coordinator(2);
  std::vector<std::unique_ptr<DistributedTrainer>> ranks;
  absl::Mutex mu;
  std::map<std::pair<int64_t, int>, data::Batch> batches;  // (step, rank)
  for (int r = 0; r < 2; ++r) {
    DistributedOptions o = Options(job, spec, r);
    o.cpu_devices = cpu_devices;
    o.on_batch = [&mu, &batches, r](int64_t step, const data::Batch& b) {
      absl::MutexLock lock(&mu);
      batches[{step, r}] = b;
    };
    if (r == 0) {
      o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
    }
    ranks.push_back(Make(std::move(o)));
    if (ranks.back() == nullptr) return absl::InternalError("no rank");
  }
  EXPECT_EQ(ranks[0]->model().sparse_tables().size(), expected_tables);
  const int64_t total = ranks[0]->total_steps();
  std::vector<absl::StatusOr<v1::ProgressReport>> results = RunAll(ranks, &coordinator);
  if (!results[0].ok()) return results[0].status();
  if (!results[1].ok()) return results[1].status();
  EXPECT_EQ(batches.size(), static_cast<size_t>(2 * total));

  // The reference: the same model and seed, rows in host tables with the job's optimizer.
  kernels::BackendOptions cpu;
  cpu.device = kernels::DeviceChoice::kCpu;
  cpu.num_threads = 1;
  auto backend = kernels::CreateBackend(cpu);
  if (!backend.ok()) return backend.status();
  auto model = engine::Model::Create(spec.model(), backend->get(), spec.seed());
  if (!model.ok()) return model.status();
  engine::Model& m = **model;
  const std::vector<engine::SparseTableInfo> tables = m.sparse_tables();
  const kernels::OptimizerParams params = kernels::MakeOptimizerParams(spec.optimizer());
  const std::vector<v1::SparseTableDecl> decls = internal::SparseTableDecls(m, spec);
  std::vector<kernels::SparseRows> rows;
  for (size_t k = 0; k < tables.size(); ++k) {
    rows.emplace_back(static_cast<uint32_t>(tables[k].dim), decls[k].initializer(), params,
                      decls[k].lifecycle());
  }
  std::vector<int> dense;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<std::vector<float>>> slots;  // per dense tensor, its optimizer's slots
  for (int i = 0; i < static_cast<int>(m.parameters().size()); ++i) {
    const engine::Parameter& p = m.parameters()[i];
    if (!p.trainable || p.sparse) continue;
    dense.push_back(i);
    weights.emplace_back();
    EXPECT_TRUE(m.CopyValueToHost(p.name, &weights.back()).ok());
    slots.emplace_back();
    for (int j = 0; j < kernels::NumSlots(spec.optimizer().kind()); ++j) {
      slots.back().emplace_back(weights.back().size(), kernels::SlotInitialValue(params, j));
    }
  }
  internal::RowMapper mapper;
  std::vector<std::set<int64_t>> touched(tables.size());
  for (int64_t step = 0; step < total; ++step) {
    std::vector<std::vector<float>> dense_sum(dense.size());
    std::vector<std::map<int64_t, std::vector<float>>> row_sum(tables.size());
    for (int r = 0; r < 2; ++r) {
      const data::Batch& b = batches[{step, r}];
      std::vector<internal::BatchRows> br(tables.size());
      for (size_t k = 0; k < tables.size(); ++k) {
        EXPECT_TRUE(mapper.Map(b, tables[k], &br[k]).ok());
        std::vector<float> values(br[k].rows.size() * tables[k].dim);
        rows[k].Gather(br[k].rows, values.data());
        EXPECT_TRUE(
            m.SetRows(static_cast<int>(k), static_cast<int64_t>(br[k].rows.size()), values).ok());
      }
      for (size_t k = 0; k < dense.size(); ++k) {
        EXPECT_TRUE(m.CopyValueFromHost(m.parameters()[dense[k]].name, weights[k]).ok());
      }
      std::vector<engine::SparseFieldView> uses;
      auto step_result = m.TrainStep(internal::ViewWithRows(b, m, br, &uses));
      if (!step_result.ok()) return step_result.status();
      for (size_t k = 0; k < dense.size(); ++k) {
        std::vector<float> g;
        EXPECT_TRUE(m.CopyGradToHost(m.parameters()[dense[k]].name, &g).ok());
        if (dense_sum[k].empty()) {
          dense_sum[k] = g;
        } else {
          for (size_t i = 0; i < g.size(); ++i) dense_sum[k][i] += g[i];
        }
      }
      for (size_t k = 0; k < tables.size(); ++k) {
        const size_t dim = static_cast<size_t>(tables[k].dim);
        std::vector<float> g;
        EXPECT_TRUE(m.CopyGradToHost(tables[k].name, &g).ok());
        for (size_t j = 0; j < br[k].rows.size(); ++j) {
          std::vector<float>& sum = row_sum[k][br[k].rows[j]];
          if (sum.empty()) {
            sum.assign(g.begin() + j * dim, g.begin() + (j + 1) * dim);
          } else {
            for (size_t d = 0; d < dim; ++d) sum[d] += g[j * dim + d];
          }
          touched[k].insert(br[k].rows[j]);
        }
      }
    }
    for (size_t k = 0; k < dense.size(); ++k) {
      std::vector<float*> slot;
      for (std::vector<float>& v : slots[k]) slot.push_back(v.data());
      kernels::ApplyUpdateCpu(params, params.learning_rate, step + 1, 0.5f, dense_sum[k].data(),
                              weights[k].data(), slot.data(),
                              static_cast<int64_t>(weights[k].size()));
    }
    for (size_t k = 0; k < tables.size(); ++k) {
      std::vector<int64_t> ids;
      std::vector<float> grads;
      for (const auto& [id, g] : row_sum[k]) {
        ids.push_back(id);
        grads.insert(grads.end(), g.begin(), g.end());
      }
      rows[k].Apply(step + 1, params.learning_rate, 0.5f, ids, grads.data());
    }
  }

  // What the shards hold: every trained row and the dense tensors.
  client::ParameterClient::Options o;
  o.shard_addresses = shards_->addresses();
  o.job_id = job;
  o.partition_bytes = spec.partition_bytes();
  auto c = client::ParameterClient::Create(o);
  if (!c.ok()) return c.status();
  std::vector<client::DenseTensorSpec> tensors;
  for (int i : dense) {
    const engine::Parameter& p = m.parameters()[i];
    tensors.push_back({p.name, std::vector<int64_t>(p.shape.begin(), p.shape.end()), {}});
  }
  EXPECT_TRUE((*c)->AttachJob(tensors, decls).ok());
  const auto near = [](float got, float want) {
    return std::fabs(got - want) <= 1e-5f + 1e-4f * std::fabs(want);
  };
  int bad = 0;
  for (size_t k = 0; k < dense.size(); ++k) {
    std::vector<float> got(weights[k].size());
    EXPECT_TRUE((*c)->Pull(tensors[k].name, -1, absl::MakeSpan(got)).ok());
    for (size_t i = 0; i < got.size(); ++i) {
      if (!near(got[i], weights[k][i]) && ++bad <= 5) {
        ADD_FAILURE() << tensors[k].name << "[" << i << "]: shards " << got[i] << ", reference "
                      << weights[k][i];
      }
    }
  }
  for (size_t k = 0; k < tables.size(); ++k) {
    const size_t dim = static_cast<size_t>(tables[k].dim);
    EXPECT_GT(touched[k].size(), 0u) << tables[k].name;
    // The shards hold exactly the rows the reference holds: every row touched, or under a
    // lifecycle those admitted and not evicted.
    std::vector<int64_t> held_ids;
    std::vector<float> held_values;
    EXPECT_TRUE((*c)->PullAllRows(tables[k].name, &held_ids, &held_values).ok());
    std::set<int64_t> want_held;
    for (const auto& [id, row] : rows[k].rows()) want_held.insert(id);
    EXPECT_EQ(std::set<int64_t>(held_ids.begin(), held_ids.end()), want_held) << tables[k].name;
    if (decls[k].lifecycle().ByteSizeLong() == 0) {
      EXPECT_EQ(rows[k].size(), static_cast<int64_t>(touched[k].size())) << tables[k].name;
    }
    // A lifecycle the spec asks for did its work.
    if (decls[k].lifecycle().admit_after() > 1) {
      EXPECT_GT(rows[k].counts().dropped_gradients(), 0) << tables[k].name;
    }
    if (decls[k].lifecycle().evict_after() > 0) {
      EXPECT_GT(rows[k].counts().evicted(), 0) << tables[k].name;
    }
    const std::vector<int64_t> ids(touched[k].begin(), touched[k].end());
    std::vector<float> got(ids.size() * dim), want(ids.size() * dim);
    EXPECT_TRUE((*c)->PullSparse(tables[k].name, -1, ids, absl::MakeSpan(got)).ok());
    rows[k].Gather(ids, want.data());
    for (size_t i = 0; i < got.size(); ++i) {
      if (!near(got[i], want[i]) && ++bad <= 10) {
        ADD_FAILURE() << tables[k].name << " row " << ids[i / dim] << "[" << i % dim << "]: shards "
                      << got[i] << ", reference " << want[i];
      }
    }
  }
  EXPECT_EQ(bad, 0);
  if (spec.model().tables_size() == 0 && !tables.empty()) {
    EXPECT_GT(touched[0].size(), 390u) << "nearly all of the 400 ids were trained";
  }
  return *results[0];
}

// A dense model overlaps each step's pulls with the next forward pass: every layer must still
// train on the weights of the step before, as a reference that installs them all first does.
// With partition_bytes 1024 the kernels travel alone, in partitions on both shards, and the
// biases batched, so both kinds of push are installed layer by layer.
TEST_F(DistributedTrainerTest, DenseBspWithOverlapMatchesASingleProcessReference) {
  const std::string job = "dense-bsp-overlap";
  v1::JobSpec spec;
  const std::string text = absl::StrCat(spec::examples::BlobsJobText(dir_, 200), R"pb(
    optimizer { kind: OPTIMIZER_KIND_ADAM learning_rate: 0.01 }
    batch_size: 32
    seed: 5
    partition_bytes: 1024
    num_workers: 2
    epochs: 2
  )pb");
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  absl::StatusOr<v1::ProgressReport> result = CheckBspAgainstAReference(job, spec, 0);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->evaluated());
  EXPECT_GT(result->test_accuracy(), 0.9);
  DropJob(job);
}

TEST_F(DistributedTrainerTest, SparseBspMatchesASingleProcessReferenceRowForRow) {
  const std::string job = "sparse-bsp";
  spec::examples::WriteHashedLibsvm(dir_ + "/train.svm", 2000, 5);
  spec::examples::WriteHashedLibsvm(dir_ + "/test.svm", 200, 6);
  v1::JobSpec spec;
  const std::string text = absl::StrCat(spec::examples::HashedJobText(dir_), R"pb(
    optimizer { kind: OPTIMIZER_KIND_ADAGRAD learning_rate: 0.5 }
    batch_size: 16
    seed: 11
    partition_bytes: 1024
    num_workers: 2
    epochs: 3
  )pb");
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  absl::StatusOr<v1::ProgressReport> result = CheckBspAgainstAReference(job, spec, 1);
  ASSERT_TRUE(result.ok()) << result.status();
  // Rank 0 scored the test split with rows pulled per batch; the task is learnable.
  EXPECT_TRUE(result->evaluated());
  EXPECT_GT(result->test_accuracy(), 0.85) << "test loss " << result->test_loss();
  ASSERT_TRUE(result->has_test_auc()) << "a binary task reports its AUC";
  EXPECT_GT(result->test_auc(), 0.9);
  DropJob(job);
}

// A multi-input model with three tables: two deep ones sharing the 26 fields (13 each), a wide
// one over all of them, and DLRM's dot interaction with a bottom MLP, on small Criteo files in
// `dir`.
v1::JobSpec MultiTableSpec(const std::string& dir, const std::string& name) {
  std::string fields;
  for (int c = 0; c < 26; ++c) {
    absl::StrAppend(&fields, "sparse_features { table: \"", c < 13 ? "a" : "b", "\" }\n");
  }
  // Plain strings: clang-format rewrites textproto raw strings, paths included.
  const std::string text =
      absl::StrCat("name: \"", name,
                   "\"\n"
                   "model {\n"
                   "  dense_features: 13\n"
                   "  bottom_layers { dense { units: 4 } }\n"
                   "  bottom_layers { tanh {} }\n"
                   "  tables { name: \"a\" dim: 4 }\n"
                   "  tables { name: \"b\" dim: 4 }\n"
                   "  tables { name: \"w\" dim: 1 initializer { kind: KIND_ZEROS } }\n"
                   "  wide_table: \"w\"\n"
                   "  interaction { kind: KIND_DOT }\n"
                   "  layers { dense { units: 8 } }\n"
                   "  layers { relu {} }\n"
                   "  layers { dense { units: 1 } }\n"
                   "  loss: LOSS_SIGMOID_CROSS_ENTROPY\n",
                   fields,
                   "}\n"
                   "dataset { format: FORMAT_CRITEO train_path: \"",
                   dir, "/train.tsv\" test_path: \"", dir,
                   "/test.tsv\" }\n"
                   "optimizer { kind: OPTIMIZER_KIND_ADAGRAD learning_rate: 0.1 }\n"
                   "batch_size: 32\n"
                   "seed: 13\n"
                   "partition_bytes: 1024\n"
                   "num_workers: 2\n"
                   "epochs: 2\n");
  v1::JobSpec parsed;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &parsed)) << text;
  return parsed;
}

// The same for the multi-input model of MultiTableSpec.
TEST_F(DistributedTrainerTest, MultiTableBspMatchesASingleProcessReferenceRowForRow) {
  const std::string job = "multi-bsp";
  WriteSmallCriteo(dir_ + "/train.tsv", 1200, 5);
  WriteSmallCriteo(dir_ + "/test.tsv", 200, 6);
  const v1::JobSpec spec = MultiTableSpec(dir_, job);
  absl::StatusOr<v1::ProgressReport> result = CheckBspAgainstAReference(job, spec, 3);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->evaluated());
  ASSERT_TRUE(result->has_test_auc());
  EXPECT_GT(result->test_auc(), 0.7) << "the label is C1 < 3";
  DropJob(job);
}

// The same with each rank's batches split over CPU replicas (--devices cpu:2 and cpu:4): every
// replica holds the batch's rows, and the rank still pushes one summed gradient per row.
TEST_F(DistributedTrainerTest, MultiTableBspOnCpuReplicasMatchesTheReferenceRowForRow) {
  WriteSmallCriteo(dir_ + "/train.tsv", 1200, 5);
  WriteSmallCriteo(dir_ + "/test.tsv", 200, 6);
  for (int n : {2, 4}) {
    SCOPED_TRACE(absl::StrCat("cpu:", n));
    const std::string job = absl::StrCat("multi-replicas-", n);
    const v1::JobSpec spec = MultiTableSpec(dir_, job);
    absl::StatusOr<v1::ProgressReport> result = CheckBspAgainstAReference(job, spec, 3, n);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE(result->has_test_auc());
    EXPECT_GT(result->test_auc(), 0.7) << "the label is C1 < 3";
    DropJob(job);
  }
}

// The same with row lifecycles: table "a" admits an id on its third sighting, the wide table
// evicts every row not updated in the step (evict_after 1), so that both paths run at every
// step on the shards and in the reference alike.
TEST_F(DistributedTrainerTest, MultiTableBspWithAdmissionAndEvictionMatchesTheReference) {
  const std::string job = "multi-lifecycle";
  WriteSmallCriteo(dir_ + "/train.tsv", 1200, 5);
  WriteSmallCriteo(dir_ + "/test.tsv", 200, 6);
  v1::JobSpec spec = MultiTableSpec(dir_, job);
  spec.mutable_model()->mutable_tables(0)->mutable_lifecycle()->set_admit_after(3);
  spec.mutable_model()->mutable_tables(2)->mutable_lifecycle()->set_evict_after(1);
  absl::StatusOr<v1::ProgressReport> result = CheckBspAgainstAReference(job, spec, 3);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->evaluated());
  DropJob(job);
}

// Hybrid consistency (PERSIA's): the dense layers BSP, the tables SSP(2). Both ranks train every
// step, and the model learns as under BSP.
TEST_F(DistributedTrainerTest, HybridTrainsTheMultiTableModel) {
  const std::string job = "multi-hybrid";
  WriteSmallCriteo(dir_ + "/train.tsv", 1200, 5);
  WriteSmallCriteo(dir_ + "/test.tsv", 200, 6);
  v1::JobSpec spec = MultiTableSpec(dir_, job);
  spec.set_consistency("hybrid");
  spec.set_staleness(2);
  FakeCoordinator coordinator(2);
  std::vector<std::unique_ptr<DistributedTrainer>> ranks;
  for (int r = 0; r < 2; ++r) {
    DistributedOptions o = Options(job, spec, r);
    if (r == 0) {
      o.report = [&coordinator](const v1::ProgressReport& p) { return coordinator.Report(p); };
    }
    ranks.push_back(Make(std::move(o)));
    ASSERT_NE(ranks.back(), nullptr);
  }
  const int64_t total = ranks[0]->total_steps();
  std::vector<absl::StatusOr<v1::ProgressReport>> results = RunAll(ranks, &coordinator);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    EXPECT_EQ(results[r]->step(), total) << "rank " << r;
  }
  EXPECT_TRUE(results[0]->evaluated());
  ASSERT_TRUE(results[0]->has_test_auc());
  EXPECT_GT(results[0]->test_auc(), 0.7) << "the label is C1 < 3";
  DropJob(job);
}

}  // namespace
}  // namespace tessera::trainer
