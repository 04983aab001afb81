// The host all-reduce of SyncBN: every device of a step gets the sum, round after round; a device
// that fails releases the others with its error; a size mismatch is an error for all.
#include "worker/trainer/internal/host_all_reduce.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tessera::trainer::internal {
namespace {

TEST(HostAllReduceTest, EveryDeviceGetsTheSumOfEveryRound) {
  HostAllReduce all;
  constexpr int kDevices = 3;
  constexpr int kRounds = 50;
  all.Begin(kDevices);
  std::vector<std::vector<double>> got(kDevices);
  std::vector<std::thread> threads;
  for (int d = 0; d < kDevices; ++d) {
    threads.emplace_back([&, d] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<double> v = {static_cast<double>(d + 1), static_cast<double>(r * 10 + d)};
        ASSERT_TRUE(all.Sum(absl::MakeSpan(v)).ok());
        got[d].push_back(v[0]);
        got[d].push_back(v[1]);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_EQ(got[d].size(), 2u * kRounds);
    for (int r = 0; r < kRounds; ++r) {
      EXPECT_EQ(got[d][2 * r], 6.0) << "device " << d << " round " << r;
      EXPECT_EQ(got[d][2 * r + 1], 30.0 * r + 3.0) << "device " << d << " round " << r;
    }
  }
}

TEST(HostAllReduceTest, AFailedDeviceReleasesTheOthersUntilTheNextStep) {
  HostAllReduce all;
  all.Begin(2);
  absl::Status waited;
  std::thread waiter([&] {
    std::vector<double> v = {1.0};
    waited = all.Sum(absl::MakeSpan(v));
  });
  all.Abort(absl::InvalidArgumentError("batch.labels[3]: 7 is outside [0, 3)"));
  waiter.join();
  EXPECT_EQ(waited, absl::InvalidArgumentError("batch.labels[3]: 7 is outside [0, 3)"));
  std::vector<double> late = {2.0};
  EXPECT_EQ(all.Sum(absl::MakeSpan(late)).code(), absl::StatusCode::kInvalidArgument);
  // The next step starts clean.
  all.Begin(1);
  EXPECT_TRUE(all.Sum(absl::MakeSpan(late)).ok());
  EXPECT_EQ(late[0], 2.0);
}

TEST(HostAllReduceTest, DevicesThatDisagreeOnTheSizeFailTheRound) {
  HostAllReduce all;
  all.Begin(2);
  absl::Status first, second;
  std::thread a([&] {
    std::vector<double> v = {1.0, 2.0};
    first = all.Sum(absl::MakeSpan(v));
  });
  std::thread b([&] {
    std::vector<double> v = {1.0};
    second = all.Sum(absl::MakeSpan(v));
  });
  a.join();
  b.join();
  EXPECT_EQ(first.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(second.code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace tessera::trainer::internal
