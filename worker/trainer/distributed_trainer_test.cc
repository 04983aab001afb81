#include "worker/trainer/distributed_trainer.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "worker/client/local_shards.h"
#include "worker/client/parameter_client.h"

#ifndef TESSERA_SERVER_BINARY
#error "TESSERA_SERVER_BINARY must name the tessera-server binary"
#endif

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;

// 641 training examples: with 2 workers rank 0 reads 321 and rank 1 reads 320, so with batch 32
// rank 0's shard holds 11 batches but every rank must run ceil(floor(641 / 2) / 32) = 10 per epoch.
constexpr int kTrainExamples = 641;
constexpr int kBatch = 32;
constexpr int64_t kStepsPerEpoch = 10;

// The coordinator's side of TRAINING_DONE for ranks in one process.
class FakeCoordinator {
 public:
  explicit FakeCoordinator(int world) : world_(world) {}
  void MarkDone(int rank) {
    absl::MutexLock lock(&mu_);
    done_.insert(rank);
  }
  absl::StatusOr<v1::ProgressAck> Report(const v1::ProgressReport& r) {
    EXPECT_EQ(r.phase(), v1::TASK_PHASE_TRAINING_DONE);
    absl::MutexLock lock(&mu_);
    done_.insert(r.rank());
    ++polls_;
    v1::ProgressAck ack;
    ack.set_all_workers_done(static_cast<int>(done_.size()) == world_);
    return ack;
  }
  int polls() {
    absl::MutexLock lock(&mu_);
    return polls_;
  }

 private:
  const int world_;
  absl::Mutex mu_;
  std::set<int> done_ ABSL_GUARDED_BY(mu_);
  int polls_ ABSL_GUARDED_BY(mu_) = 0;
};

class DistributedTrainerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    client::LocalShards::Options o;
    const char* override_path = std::getenv("TESSERA_SERVER_BINARY");
    o.server_path = override_path != nullptr ? override_path : TESSERA_SERVER_BINARY;
    o.num_shards = 2;
    auto shards = client::LocalShards::Start(o);
    ASSERT_TRUE(shards.ok()) << shards.status();
    shards_ = std::move(*shards).release();
  }
  static void TearDownTestSuite() {
    if (shards_ != nullptr) {
      EXPECT_TRUE(shards_->Stop(absl::Seconds(10)).ok());
    }
    delete shards_;
    shards_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(shards_, nullptr);
    char tmpl[] = "/tmp/tessera_distributed_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    WriteBlobs(dir_ + "/train.csv", kTrainExamples, 1);
    WriteBlobs(dir_ + "/test.csv", 300, 2);
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }

  // Three Gaussian blobs in 2-D, label first.
  static void WriteBlobs(const std::string& path, int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> noise(0.0, 0.7);
    std::ofstream out(path);
    for (int i = 0; i < n; ++i) {
      const int k = i % 3;
      const double angle = 2 * M_PI * k / 3;
      out << k << "," << 3 * std::cos(angle) + noise(rng) << "," << 3 * std::sin(angle) + noise(rng)
          << "\n";
    }
  }

  v1::JobSpec Spec(int workers, int epochs, const std::string& extra = "") {
    v1::JobSpec spec;
    const std::string text = absl::StrCat(R"(
      name: "blobs"
      model {
        input_shape: [2]
        layers { dense { units: 16 } }
        layers { relu {} }
        layers { dense { units: 3 } }
        loss: LOSS_SOFTMAX_CROSS_ENTROPY
      }
      dataset {
        format: FORMAT_CSV
        train_path: ")",
                                          dir_, R"(/train.csv"
        test_path: ")",
                                          dir_, R"(/test.csv"
        num_classes: 3
      }
      optimizer { kind: OPTIMIZER_KIND_ADAM learning_rate: 0.01 }
      batch_size: )",
                                          kBatch, R"(
      seed: 7
      device: "cpu"
      partition_bytes: 1024
      num_workers: )",
                                          workers, "\n epochs: ", epochs, "\n", extra);
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
    return spec;
  }

  DistributedOptions Options(const std::string& job_id, const v1::JobSpec& spec, int rank,
                             std::vector<std::string> shards = {}) {
    DistributedOptions o;
    o.task.set_job_id(job_id);
    o.task.set_rank(rank);
    o.task.set_world_size(spec.num_workers());
    o.task.set_incarnation(1);
    if (shards.empty()) shards = shards_->addresses();
    for (const std::string& s : shards) o.task.add_shard_addresses(s);
    *o.task.mutable_spec() = spec;
    o.num_threads = 1;
    o.call_timeout = absl::Seconds(5);
    o.progress_interval = absl::ZeroDuration();
    o.done_poll_interval = absl::Milliseconds(20);
    return o;
  }

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
    client::ParameterClient::Options o;
    o.shard_addresses = shards_->addresses();
    o.job_id = job_id;
    o.partition_bytes = 1024;
    auto c = client::ParameterClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    std::vector<client::DenseTensorSpec> tensors;
    for (const engine::Parameter& p : t.model().parameters()) {
      if (!p.trainable) continue;
      tensors.push_back({p.name, std::vector<int64_t>(p.shape.begin(), p.shape.end()), {}});
    }
    EXPECT_TRUE((*c)->AttachJob(tensors, {}).ok());
    std::vector<float> all;
    for (const client::DenseTensorSpec& s : tensors) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      std::vector<float> v(static_cast<size_t>(n));
      EXPECT_TRUE((*c)->Pull(s.name, -1, absl::MakeSpan(v)).ok());
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }

  static void DropJob(const std::string& job_id) {
    client::ParameterClient::Options o;
    o.shard_addresses = shards_->addresses();
    o.job_id = job_id;
    auto c = client::ParameterClient::Create(o);
    ASSERT_TRUE(c.ok());
    EXPECT_TRUE((*c)->DropJob().ok());
  }

  static client::LocalShards* shards_;
  std::string dir_;
};

client::LocalShards* DistributedTrainerTest::shards_ = nullptr;

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

  std::vector<absl::StatusOr<v1::ProgressReport>> results(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      results[r] = ranks[r]->Run();
      if (r != 0) coordinator.MarkDone(r);
    });
  }
  // A watchdog, so a BSP step that never completes fails the test instead of hanging it.
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!finished && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!finished) {
      ADD_FAILURE() << "training did not finish in 30 s";
      for (auto& t : ranks) t->Cancel();
    }
  });
  for (std::thread& t : threads) t.join();
  finished = true;
  watchdog.join();

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
    EXPECT_GT(results[r]->loss(), 0) << "rank " << r;
  }
  EXPECT_GE(coordinator.polls(), 1);

  const std::vector<float> w0 = Weights(*ranks[0]);
  const std::vector<float> w1 = Weights(*ranks[1]);
  EXPECT_EQ(w0, w1);
  EXPECT_EQ(w0, ShardWeights(job, *ranks[0]));
  EXPECT_NE(w0, initial);

  // Rank 0's final evaluation; the blobs are easy.
  EXPECT_TRUE(results[0]->evaluated());
  EXPECT_GT(results[0]->test_accuracy(), 0.9);
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
  auto t = Make(std::move(o));
  ASSERT_NE(t, nullptr);
  absl::StatusOr<v1::ProgressReport> r = t->Run();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr(dead));
  EXPECT_THAT(r.status().message(), HasSubstr("shards: "));
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
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(t.status().message(), HasSubstr("model.layers[0] (bag)"));
  }
}

}  // namespace
}  // namespace tessera::trainer
