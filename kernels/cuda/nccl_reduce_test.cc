// NCCL over one worker's GPUs (kernels/device_reduce.h): every rank's tensors summed into rank
// 0's, the others' left as they were, and mismatched ranks refused. The tests that need a device
// GTEST_SKIP() without one; with one GPU the communicator has one rank (the sum is then rank 0's
// own), so the sum across devices needs two GPUs to be shown. The refusals run everywhere.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kernels/device_reduce.h"

namespace tessera::kernels {
namespace {

using ::testing::HasSubstr;

TEST(NcclReduceTest, RefusesAnEmptyARepeatedOrAMissingDevice) {
  EXPECT_EQ(CreateNcclReduce({}).status().code(), absl::StatusCode::kInvalidArgument);
  const int count = CudaDeviceCount();
  const absl::Status missing = CreateNcclReduce({count}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.message(), HasSubstr(absl::StrCat("cuda:", count, " is not usable")));
  if (count >= 1) {
    const absl::Status twice = CreateNcclReduce({0, 0}).status();
    EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(twice.message(), HasSubstr("named twice"));
  }
}

TEST(NcclReduceTest, SumsEveryRanksTensorsIntoTheFirstRanks) {
  const int count = CudaDeviceCount();
  if (count < 1) GTEST_SKIP() << "no CUDA device: " << CudaUnavailableReason();
  const int n = std::min(count, 4);
  std::vector<int> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  absl::StatusOr<std::unique_ptr<DeviceReduce>> reduce = CreateNcclReduce(devices);
  ASSERT_TRUE(reduce.ok()) << reduce.status();
  ASSERT_EQ((*reduce)->size(), n);

  // Two tensors per rank, of 5 and 300,000 floats (a large one spans NCCL's chunks): rank r's
  // value at i is (r + 1) * (i % 7 + 1).
  const std::vector<int64_t> sizes = {5, 300000};
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::vector<Tensor>> tensors(n);
  for (int r = 0; r < n; ++r) {
    BackendOptions o;
    o.device = DeviceChoice::kCuda;
    o.cuda_device = r;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backends.push_back(std::move(*b));
    for (int64_t size : sizes) {
      absl::StatusOr<Tensor> t = backends[r]->Allocate({size}, DType::kFloat32);
      ASSERT_TRUE(t.ok()) << t.status();
      std::vector<float> host(static_cast<size_t>(size));
      for (int64_t i = 0; i < size; ++i) host[i] = static_cast<float>((r + 1) * (i % 7 + 1));
      ASSERT_TRUE(backends[r]->CopyToDevice(host.data(), *t).ok());
      tensors[r].push_back(*t);
    }
  }
  for (int round = 0; round < 2; ++round) {
    for (int r = 0; r < n; ++r) ASSERT_TRUE(backends[r]->Synchronize().ok());
    const absl::Status summed = (*reduce)->SumToFirst(tensors);
    ASSERT_TRUE(summed.ok()) << summed;
  }
  // A rank with a tensor fewer is refused before anything is issued.
  std::vector<std::vector<Tensor>> short_rank = tensors;
  short_rank.back().pop_back();
  EXPECT_EQ((*reduce)->SumToFirst(short_rank).code(), absl::StatusCode::kInvalidArgument);
  // Two rounds: rank 0 holds its own value plus twice the others' (the second round adds them
  // to the first round's sum); the others hold their own.
  const int64_t others = int64_t{n} * (n + 1) / 2 - 1;
  for (int r = 0; r < n; ++r) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<float> got(static_cast<size_t>(sizes[k]));
      ASSERT_TRUE(backends[r]->CopyToHost(tensors[r][k], got.data()).ok());
      int bad = 0;
      for (int64_t i = 0; i < sizes[k]; ++i) {
        const float unit = static_cast<float>(i % 7 + 1);
        const float want =
            r == 0 ? unit * static_cast<float>(1 + 2 * others) : unit * static_cast<float>(r + 1);
        if (got[i] != want && ++bad <= 5) {
          ADD_FAILURE() << "rank " << r << " tensor " << k << "[" << i << "]: " << got[i]
                        << ", want " << want;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

}  // namespace
}  // namespace tessera::kernels
