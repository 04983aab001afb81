// Dataset paths are confined (issue #16): a distributed job's paths are absolute, and a daemon
// with --dataset_root reads only files in those folders, whatever "..", or a link, says.
#include "spec/dataset_spec.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::spec {
namespace {

using ::testing::HasSubstr;

class DatasetRootsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/roots_XXXXXX";
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
    char resolved[PATH_MAX];
    ASSERT_NE(::realpath(dir_.c_str(), resolved), nullptr);
    dir_ = resolved;  // as the links resolve: no "//" from TempDir()
    ASSERT_EQ(::mkdir((dir_ + "/data").c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((dir_ + "/secret").c_str(), 0755), 0);
    std::ofstream(dir_ + "/data/train.csv") << "0,1\n1,2\n";
    std::ofstream(dir_ + "/secret/key") << "1,2\n";
    ASSERT_EQ(::symlink((dir_ + "/secret/key").c_str(), (dir_ + "/data/link.csv").c_str()), 0);
  }

  absl::Status Check(const std::string& train_path, bool check_files = true) {
    v1::DatasetSpec d;
    d.set_format(v1::DatasetSpec::FORMAT_CSV);
    d.set_train_path(train_path);
    DatasetChecks checks;
    checks.check_files = check_files;
    checks.absolute_paths = true;
    checks.roots = {dir_ + "/data"};
    return ValidateDataset(d, checks);
  }

  std::string dir_;
};

TEST_F(DatasetRootsTest, OnlyFilesInTheRootsAreRead) {
  EXPECT_TRUE(Check(dir_ + "/data/train.csv").ok()) << Check(dir_ + "/data/train.csv");
  EXPECT_TRUE(Check(dir_ + "/data/./train.csv").ok());
  const absl::Status outside = Check(dir_ + "/secret/key");
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outside.message(), "dataset.train_path: " + dir_ +
                                   "/secret/key is outside the dataset folders this "
                                   "daemon reads (--dataset_root " +
                                   dir_ + "/data)");
  // ".." is resolved before anything is looked at.
  EXPECT_THAT(Check(dir_ + "/data/../secret/key").message(), HasSubstr("is outside"));
  // A file that does not exist outside the roots: the same answer, so nothing is learnt of
  // what is there.
  EXPECT_THAT(Check("/etc/no-such-file").message(), HasSubstr("is outside"));
  EXPECT_THAT(Check(dir_ + "/data/missing.csv").message(), HasSubstr("file not found"));
  // A link in a root that leads out of them.
  EXPECT_THAT(Check(dir_ + "/data/link.csv").message(),
              HasSubstr("(a link to " + dir_ + "/secret/key) is outside"));
  // A folder that only starts like a root is not in it.
  EXPECT_THAT(Check(dir_ + "/database").message(), HasSubstr("is outside"));
  // Without the file checks (the coordinator's --check_dataset_files=false), as written.
  EXPECT_TRUE(Check(dir_ + "/data/elsewhere.csv", false).ok());
  EXPECT_THAT(Check("/etc/passwd", false).message(), HasSubstr("is outside"));
}

TEST_F(DatasetRootsTest, ADistributedJobsPathsAreAbsolute) {
  const absl::Status relative = Check("data/train.csv");
  EXPECT_EQ(relative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(relative.message(),
            "dataset.train_path: must be an absolute path (the workers read it on their own "
            "hosts), got \"data/train.csv\"");
}

TEST(DatasetFoldersTest, EachFolderOnce) {
  v1::DatasetSpec d;
  d.set_train_images("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
  d.set_train_labels("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz");
  d.set_test_images("/tmp/x/../y/t10k-images");
  EXPECT_EQ(DatasetFolders(d),
            (std::vector<std::string>{"/usr/share/datasets/fashion-mnist", "/tmp/y"}));
}

}  // namespace
}  // namespace tessera::spec
