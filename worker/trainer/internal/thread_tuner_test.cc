// The thread-count tuner: its schedule of blocks (the default, then 1, twice), the step it leaves
// out of each block, the choice of the faster (one thread on a near tie), the line it logs, and
// when it stays out of the way (--threads given, OMP_NUM_THREADS set, one thread only).
#include "worker/trainer/internal/thread_tuner.h"

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace tessera::trainer::internal {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<kernels::Backend> Cpu(int threads) {
  kernels::BackendOptions o;
  o.device = kernels::DeviceChoice::kCpu;
  o.num_threads = threads;
  auto b = kernels::CreateBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// Runs the tuner over its steps with `many_ms` and `one_ms` a step (and a slow first step in
// every block, which must not count); returns the log line and the thread count of each step.
std::string Tune(kernels::Backend* backend, double many_ms, double one_ms,
                 std::vector<int>* threads) {
  ThreadTuner tuner(backend, 0);
  std::string line;
  for (int step = 0; tuner.active(); ++step) {
    tuner.BeforeStep();
    threads->push_back(backend->Threads());
    const double ms =
        step % ThreadTuner::kBlockSteps == 0 ? 100.0 : (backend->Threads() == 1 ? one_ms : many_ms);
    std::optional<std::string> note = tuner.AfterStep(ms / 1e3);
    if (note.has_value()) line = *note;
    EXPECT_LT(step, 100) << "the tuner never finished";
    if (step >= 100) break;
  }
  return line;
}

TEST(ThreadTunerTest, KeepsOneThreadWhenItIsFasterAndSaysWhy) {
  std::unique_ptr<kernels::Backend> backend = Cpu(2);
  ASSERT_NE(backend, nullptr);
  std::vector<int> threads;
  const std::string line = Tune(backend.get(), 3.0, 1.0, &threads);
  const int b = ThreadTuner::kBlockSteps;
  ASSERT_EQ(threads.size(), 4u * b);
  for (int i = 0; i < 4 * b; ++i) EXPECT_EQ(threads[i], (i / b) % 2 == 0 ? 2 : 1) << "step " << i;
  EXPECT_EQ(backend->Threads(), 1);
  EXPECT_EQ(line,
            "threads: 1 of 2, measured on the first 16 steps: 1.000 ms a step with 1 thread, "
            "3.000 ms with 2 (--threads sets the count)");
  EXPECT_THAT(backend->Description(), HasSubstr(", 1 OpenMP threads"));
}

TEST(ThreadTunerTest, KeepsTheDefaultWhenItIsClearlyFasterAndOneThreadOnANearTie) {
  std::unique_ptr<kernels::Backend> backend = Cpu(2);
  ASSERT_NE(backend, nullptr);
  std::vector<int> threads;
  EXPECT_THAT(Tune(backend.get(), 1.0, 1.9, &threads), HasSubstr("threads: 2 of 2"));
  EXPECT_EQ(backend->Threads(), 2);
  threads.clear();
  EXPECT_THAT(Tune(backend.get(), 0.98, 1.0, &threads), HasSubstr("threads: 1 of 2"));
  EXPECT_EQ(backend->Threads(), 1);
}

TEST(ThreadTunerTest, StaysOutOfTheWayWhenTheCountIsGivenOrThereIsOneThread) {
  std::unique_ptr<kernels::Backend> backend = Cpu(2);
  ASSERT_NE(backend, nullptr);
  EXPECT_FALSE(ThreadTuner(backend.get(), 2).active());
  EXPECT_FALSE(ThreadTuner(backend.get(), 1).active());
  EXPECT_FALSE(ThreadTuner(nullptr, 0).active());
  std::unique_ptr<kernels::Backend> one = Cpu(1);
  ASSERT_NE(one, nullptr);
  EXPECT_FALSE(ThreadTuner(one.get(), 0).active());
  setenv("OMP_NUM_THREADS", "2", 1);
  EXPECT_FALSE(ThreadTuner(backend.get(), 0).active());
  unsetenv("OMP_NUM_THREADS");
  EXPECT_TRUE(ThreadTuner(backend.get(), 0).active());
  // An inactive tuner changes nothing.
  ThreadTuner given(backend.get(), 2);
  given.BeforeStep();
  EXPECT_FALSE(given.AfterStep(0.001).has_value());
  EXPECT_EQ(backend->Threads(), 2);
}

TEST(ThreadTunerTest, TheBackendRefusesZeroThreads) {
  std::unique_ptr<kernels::Backend> backend = Cpu(2);
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->SetThreads(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend->Threads(), 2);
}

}  // namespace
}  // namespace tessera::trainer::internal
