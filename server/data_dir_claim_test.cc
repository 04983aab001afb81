#include "server/data_dir_claim.h"

#include <stdlib.h>

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::server {
namespace {

using ::testing::HasSubstr;

std::string TempDir() {
  std::string dir = ::testing::TempDir() + "/claim_XXXXXX";
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  return dir;
}

TEST(DataDirClaimTest, TheIdentityIsMadeOnceAndReadBackOnEveryStart) {
  const std::string dir = TempDir() + "/shard";  // created by the claim
  std::string identity;
  {
    auto claim = DataDirClaim::Claim(dir);
    ASSERT_TRUE(claim.ok()) << claim.status();
    identity = (*claim)->identity();
    EXPECT_EQ(identity.size(), 32u);
    EXPECT_EQ(identity.find_first_not_of("0123456789abcdef"), std::string::npos) << identity;
  }
  auto again = DataDirClaim::Claim(dir);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->identity(), identity);
  // Another directory is another shard.
  auto other = DataDirClaim::Claim(TempDir());
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->identity(), identity);
}

TEST(DataDirClaimTest, ADirectoryInUseIsRefusedUntilItsClaimEnds) {
  const std::string dir = TempDir();
  auto first = DataDirClaim::Claim(dir);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = DataDirClaim::Claim(dir);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("--data_dir: " + dir + " is in use"));
  first->reset();
  EXPECT_TRUE(DataDirClaim::Claim(dir).ok());
}

TEST(DataDirClaimTest, ADamagedIdentityIsRefusedNotReplaced) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/identity") << "not an identity\n";
  auto claim = DataDirClaim::Claim(dir);
  EXPECT_EQ(claim.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(claim.status().message(), HasSubstr("does not hold an identity"));
  std::ifstream in(dir + "/identity");
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "not an identity");
}

}  // namespace
}  // namespace tessera::server
