// Ranks of a distributed job run in one test process against real tessera-server children on
// loopback (worker/trainer/*_test.cc): the shards, each rank's options, the coordinator's side of
// TRAINING_DONE, and a bounded run of every rank.
#ifndef TESSERA_WORKER_TRAINER_TESTING_RANKS_H_
#define TESSERA_WORKER_TRAINER_TESTING_RANKS_H_

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "spec/testing/example_jobs.h"
#include "worker/client/local_shards.h"
#include "worker/client/parameter_client.h"
#include "worker/trainer/distributed_trainer.h"

#ifndef TESSERA_SERVER_BINARY
#error "TESSERA_SERVER_BINARY must name the tessera-server binary"
#endif

namespace tessera::trainer::testing_ranks {

// `n` tessera-server children on loopback ($TESSERA_SERVER_BINARY overrides the built one).
inline absl::StatusOr<std::unique_ptr<client::LocalShards>> StartShards(int n) {
  client::LocalShards::Options o;
  const char* override_path = std::getenv("TESSERA_SERVER_BINARY");
  o.server_path = override_path != nullptr ? override_path : TESSERA_SERVER_BINARY;
  o.num_shards = n;
  return client::LocalShards::Start(o);
}

// A fixture with two shards for the suite and, per test, a scratch folder `dir_` holding blobs
// data: train.csv (641 examples: 321 for rank 0 and 320 for rank 1 of 2) and test.csv (300).
class ShardsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto shards = StartShards(2);
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
    char tmpl[] = "/tmp/tessera_trainer_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    spec::examples::WriteBlobsCsv(dir_ + "/train.csv", 641, 1);
    spec::examples::WriteBlobsCsv(dir_ + "/test.csv", 300, 2);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // What the shards hold for `tensors` of `job_id`, pulled ungated, one vector per tensor (a
  // failure is a test failure, and reads as none).
  static std::vector<std::vector<float>> ShardValues(
      const std::string& job_id, const std::vector<client::DenseTensorSpec>& tensors) {
    client::ParameterClient::Options o;
    o.shard_addresses = shards_->addresses();
    o.job_id = job_id;
    o.partition_bytes = 1024;
    auto c = client::ParameterClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return {};
    EXPECT_TRUE((*c)->AttachJob(tensors, {}).ok());
    std::vector<std::vector<float>> out;
    for (const client::DenseTensorSpec& s : tensors) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      out.emplace_back(static_cast<size_t>(n));
      EXPECT_TRUE((*c)->Pull(s.name, -1, absl::MakeSpan(out.back())).ok()) << s.name;
    }
    return out;
  }

  // Drops `job_id` from the shards (a failure is a test failure).
  static void DropJob(const std::string& job_id) {
    client::ParameterClient::Options o;
    o.shard_addresses = shards_->addresses();
    o.job_id = job_id;
    auto c = client::ParameterClient::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE((*c)->DropJob().ok());
  }

  static inline client::LocalShards* shards_ = nullptr;
  std::string dir_;
};

// Rank `rank` of `spec` against `shards`: incarnation 1, one thread, short timeouts, progress at
// every step.
inline DistributedOptions RankOptions(const std::string& job_id, const v1::JobSpec& spec, int rank,
                                      const std::vector<std::string>& shards) {
  DistributedOptions o;
  o.task.set_job_id(job_id);
  o.task.set_rank(rank);
  o.task.set_world_size(spec.num_workers());
  o.task.set_incarnation(1);
  for (const std::string& s : shards) o.task.add_shard_addresses(s);
  *o.task.mutable_spec() = spec;
  o.num_threads = 1;
  o.call_timeout = absl::Seconds(5);
  o.progress_interval = absl::ZeroDuration();
  o.done_poll_interval = absl::Milliseconds(20);
  return o;
}

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

// Runs every rank of `ranks` to the end (bounded by a watchdog: a BSP step that never completes
// fails the test instead of hanging it); returns their results.
inline std::vector<absl::StatusOr<v1::ProgressReport>> RunAll(
    std::vector<std::unique_ptr<DistributedTrainer>>& ranks, FakeCoordinator* coordinator,
    absl::Duration limit = absl::Seconds(30)) {
  std::vector<absl::StatusOr<v1::ProgressReport>> results(ranks.size(),
                                                          absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      results[r] = ranks[r]->Run();
      if (r != 0 && coordinator != nullptr) coordinator->MarkDone(static_cast<int>(r));
    });
  }
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(limit);
    while (!finished && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!finished) {
      ADD_FAILURE() << "training did not finish in " << limit;
      for (auto& t : ranks) t->Cancel();
    }
  });
  for (std::thread& t : threads) t.join();
  finished = true;
  watchdog.join();
  return results;
}

}  // namespace tessera::trainer::testing_ranks

#endif  // TESSERA_WORKER_TRAINER_TESTING_RANKS_H_
