#include "server/checkpoint_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera::server {
namespace {

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir() + "/ckptfileXXXXXX";
  char* made = ::mkdtemp(tmpl.data());
  EXPECT_NE(made, nullptr);
  return tmpl;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteAllTo(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

v1::CheckpointHeader Header() {
  v1::CheckpointHeader h;
  h.set_format_version(1);
  h.set_job_id("job-1");
  h.set_step(50);
  h.set_shard_index(2);
  v1::PartitionCheckpoint* p = h.add_partitions();
  p->mutable_key()->set_tensor("w");
  p->set_num_elements(3);
  p->mutable_weights()->set_offset(0);
  p->mutable_weights()->set_length(12);
  return h;
}

TEST(Crc32cTest, CheckVectorAndContinuation) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c("56789", Crc32c("1234")), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(CheckpointFileTest, WriteThenReadRoundTrips) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/shard-2";
  const std::string a = "0123456789";
  const std::string b = "ab";
  const absl::string_view pieces[] = {a, b};
  absl::StatusOr<WrittenCheckpoint> written = WriteCheckpointFile(path, Header(), pieces);
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string bytes = ReadAll(path);
  EXPECT_EQ(written->bytes, bytes.size());
  EXPECT_EQ(bytes.substr(0, 8), "TSCKPT01");
  EXPECT_EQ(written->crc32c, Crc32c(absl::string_view(bytes).substr(0, bytes.size() - 4)));
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);  // renamed away

  absl::StatusOr<CheckpointContents> read = ReadCheckpointFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->data, a + b);
  EXPECT_EQ(read->header.job_id(), "job-1");
  EXPECT_EQ(read->header.step(), 50);
  EXPECT_EQ(read->header.partitions(0).weights().length(), 12u);
}

TEST(CheckpointFileTest, MissingFileIsNotFoundAndNamesThePath) {
  const std::string dir = MakeTempDir();
  absl::StatusOr<CheckpointContents> read = ReadCheckpointFile(dir + "/nope");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find(dir + "/nope"), std::string::npos);
}

TEST(CheckpointFileTest, EveryCorruptionIsDataLoss) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/f";
  const std::string data(1000, 'x');
  const absl::string_view pieces[] = {data};
  ASSERT_TRUE(WriteCheckpointFile(path, Header(), pieces).ok());
  const std::string good = ReadAll(path);
  ASSERT_TRUE(ParseCheckpoint(good).ok());
  struct Case {
    std::string name;
    std::string bytes;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"empty", "", "short"});
  cases.push_back({"magic", "XSCKPT01" + good.substr(8), "magic"});
  cases.push_back({"truncated", good.substr(0, good.size() - 1), "sizes disagree"});
  cases.push_back({"appended", good + "garbage", "sizes disagree"});
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x01;
  cases.push_back({"flipped data", flipped, "CRC mismatch"});
  std::string huge = good;
  huge[15] = '\x7f';  // header length ~ 2^63
  cases.push_back({"huge header length", huge, "short"});
  for (const Case& c : cases) {
    absl::StatusOr<CheckpointContents> parsed = ParseCheckpoint(c.bytes);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << c.name;
    EXPECT_NE(parsed.status().message().find(c.message), std::string::npos)
        << c.name << ": " << parsed.status();
    WriteAllTo(path, c.bytes);
    absl::StatusOr<CheckpointContents> read = ReadCheckpointFile(path);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << c.name;
    EXPECT_NE(read.status().message().find(path), std::string::npos) << c.name;
  }
  // Every truncation is refused.
  for (size_t n = 0; n < good.size(); n += 7) {
    EXPECT_EQ(ParseCheckpoint(absl::string_view(good).substr(0, n)).status().code(),
              absl::StatusCode::kDataLoss)
        << n;
  }
}

// Taking the buffer, the parse hands back the data section in that same allocation: a restore
// holds one copy of the file's data, not two.
TEST(CheckpointFileTest, ParsingABufferKeepsItsDataInPlace) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/f";
  std::string data(100000, 'x');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  const absl::string_view pieces[] = {data};
  ASSERT_TRUE(WriteCheckpointFile(path, Header(), pieces).ok());
  std::string bytes = ReadAll(path);
  const absl::StatusOr<CheckpointContents> copied = ParseCheckpoint(bytes);
  ASSERT_TRUE(copied.ok()) << copied.status();
  const char* buffer = bytes.data();
  absl::StatusOr<CheckpointContents> moved = ParseCheckpointBuffer(std::move(bytes));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->data, data);
  EXPECT_EQ(moved->data.data(), buffer);
  EXPECT_EQ(moved->header.SerializeAsString(), copied->header.SerializeAsString());
  std::string torn = ReadAll(path);
  torn[torn.size() / 2] ^= 1;
  EXPECT_EQ(ParseCheckpointBuffer(std::move(torn)).status().code(), absl::StatusCode::kDataLoss);
  absl::StatusOr<CheckpointContents> read = ReadCheckpointFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->data, data);
}

TEST(CheckpointFileTest, WriteErrorIsInternalAndLeavesNoTemp) {
  const std::string dir = MakeTempDir();
  const absl::string_view pieces[] = {"x"};
  absl::StatusOr<WrittenCheckpoint> written =
      WriteCheckpointFile(dir + "/missing-dir/shard-0", Header(), pieces);
  EXPECT_EQ(written.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(written.status().message().find("missing-dir"), std::string::npos);
}

TEST(CheckpointFileTest, ListsStepsAndRemovesTemporaryFiles) {
  const std::string root = MakeTempDir();
  const absl::string_view pieces[] = {"abc"};
  for (int64_t step : {10, 200, 30}) {
    const std::string path = CheckpointPath(root, "job-1", step, 1);
    ASSERT_TRUE(MakeDurableDirs(path.substr(0, path.rfind('/'))).ok());
    ASSERT_TRUE(WriteCheckpointFile(path, Header(), pieces).ok());
  }
  // Another shard's file and a leftover temporary do not count.
  const std::string other = CheckpointPath(root, "job-1", 400, 0);
  ASSERT_TRUE(MakeDurableDirs(other.substr(0, other.rfind('/'))).ok());
  WriteAllTo(other, "x");
  WriteAllTo(CheckpointPath(root, "job-1", 400, 1) + ".tmp", "torn");
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpointSteps(root + "/job-1", 1);
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(*steps, (std::vector<int64_t>{10, 30, 200}));
  // A shard removes only its own leftover: shard 0 leaves shard 1's temporary alone.
  absl::StatusOr<int> removed = RemoveTemporaryCheckpointFiles(root, 0);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 0);
  EXPECT_EQ(::access((CheckpointPath(root, "job-1", 400, 1) + ".tmp").c_str(), F_OK), 0);
  removed = RemoveTemporaryCheckpointFiles(root, 1);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 1);
  WriteAllTo(CheckpointPath(root, "job-1", 400, 1) + ".tmp", "torn");
  removed = RemoveTemporaryCheckpointFiles(root, -1);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 1);
  EXPECT_NE(::access((CheckpointPath(root, "job-1", 400, 1) + ".tmp").c_str(), F_OK), 0);
  EXPECT_TRUE(ListCheckpointSteps(root + "/absent", 1)->empty());
}

TEST(CheckpointFileTest, JobIdsMustBeSafeFileNames) {
  for (const char* good : {"job-1", "a", "A.b_c-9", "j..k"}) {
    EXPECT_TRUE(ValidateJobId(good).ok()) << good;
  }
  for (std::string bad :
       {std::string(""), std::string("."), std::string(".."), std::string("a/b"),
        std::string("../x"), std::string("a b"), std::string("a\0b", 3), std::string(161, 'a')}) {
    absl::Status s = ValidateJobId(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message().substr(0, 7), "job_id:") << bad;
  }
  EXPECT_TRUE(ValidateJobId(std::string(160, 'a')).ok());
}

}  // namespace
}  // namespace tessera::server
