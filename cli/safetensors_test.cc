#include "cli/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace tessera::cli {
namespace {

uint64_t ReadU64(const std::string& bytes) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
  return v;
}

float ReadFloat(const std::string& bytes, size_t offset) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<unsigned char>(bytes[offset])) |
                        static_cast<uint32_t>(static_cast<unsigned char>(bytes[offset + 1])) << 8 |
                        static_cast<uint32_t>(static_cast<unsigned char>(bytes[offset + 2])) << 16 |
                        static_cast<uint32_t>(static_cast<unsigned char>(bytes[offset + 3])) << 24;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(SafetensorsTest, EncodesHeaderOffsetsAndLittleEndianValues) {
  std::vector<NamedTensor> tensors = {
      {"dense_1/kernel", {2, 3}, {1, 2, 3, 4, 5, -6.5f}},
      {"dense_1/bias", {2}, {0.25f, -1}},
  };
  absl::StatusOr<std::string> bytes =
      EncodeSafetensors(tensors, {{"job_id", "mlp-1"}, {"format", "tessera"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const uint64_t n = ReadU64(*bytes);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes->size(), 8 + n + 8 * 4);
  std::string header = bytes->substr(8, n);
  while (!header.empty() && header.back() == ' ') header.pop_back();
  EXPECT_EQ(header,
            "{\"dense_1/kernel\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
            "\"dense_1/bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[24,32]},"
            "\"__metadata__\":{\"format\":\"tessera\",\"job_id\":\"mlp-1\"}}");
  const size_t data = 8 + n;
  EXPECT_EQ(ReadFloat(*bytes, data + 0), 1.0f);
  EXPECT_EQ(ReadFloat(*bytes, data + 20), -6.5f);
  EXPECT_EQ(ReadFloat(*bytes, data + 24), 0.25f);
  EXPECT_EQ(ReadFloat(*bytes, data + 28), -1.0f);
}

// A sparse table exports as its row ids (I64) next to its rows (F32).
TEST(SafetensorsTest, Int64TensorsHoldRowIds) {
  NamedTensor ids;
  ids.name = "bag/embeddings.ids";
  ids.shape = {2};
  ids.int64 = true;
  ids.ids = {-2, int64_t{1} << 62};
  std::vector<NamedTensor> tensors = {ids, {"bag/embeddings", {2, 1}, {0.5f, 3}}};
  absl::StatusOr<std::string> bytes = EncodeSafetensors(tensors, {});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const uint64_t n = ReadU64(*bytes);
  ASSERT_EQ(bytes->size(), 8 + n + 16 + 8);
  std::string header = bytes->substr(8, n);
  while (!header.empty() && header.back() == ' ') header.pop_back();
  EXPECT_EQ(header,
            "{\"bag/embeddings.ids\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]},"
            "\"bag/embeddings\":{\"dtype\":\"F32\",\"shape\":[2,1],\"data_offsets\":[16,24]},"
            "\"__metadata__\":{}}");
  EXPECT_EQ(ReadU64(bytes->substr(8 + n, 8)), static_cast<uint64_t>(int64_t{-2}));
  EXPECT_EQ(ReadU64(bytes->substr(8 + n + 8, 8)), uint64_t{1} << 62);
  EXPECT_EQ(ReadFloat(*bytes, 8 + n + 20), 3.0f);
  tensors[0].ids.pop_back();
  EXPECT_EQ(EncodeSafetensors(tensors, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, PadsTheHeaderToEightBytesForEveryLength) {
  for (int len = 1; len <= 16; ++len) {
    absl::StatusOr<std::string> bytes =
        EncodeSafetensors({{std::string(len, 'w'), {1}, {3.0f}}}, {});
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    const uint64_t n = ReadU64(*bytes);
    EXPECT_EQ(n % 8, 0u) << "name length " << len;
    EXPECT_EQ(bytes->size(), 8 + n + 4);
    EXPECT_EQ(ReadFloat(*bytes, 8 + n), 3.0f);
  }
}

TEST(SafetensorsTest, EscapesNamesAndMetadata) {
  absl::StatusOr<std::string> bytes =
      EncodeSafetensors({{"a\"b\\c", {0}, {}}}, {{"note", "line\nnext"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string header = bytes->substr(8, ReadU64(*bytes));
  EXPECT_NE(header.find("\"a\\\"b\\\\c\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find("\"note\":\"line\\u000anext\""), std::string::npos) << header;
}

TEST(SafetensorsTest, RefusesBadTensors) {
  struct Case {
    std::vector<NamedTensor> tensors;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"w", {2, 2}, {1, 2, 3}}}, "tensor \"w\": shape [2,2] needs 4 values, got 3"},
      {{{"w", {1}, {1}}, {"w", {1}, {2}}}, "tensor \"w\": duplicate name"},
      {{{"", {1}, {1}}}, "tensor name"},
      {{{"__metadata__", {1}, {1}}}, "tensor name"},
      {{{"w", {-1}, {}}}, "negative dimension -1"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> bytes = EncodeSafetensors(c.tensors, {});
    ASSERT_FALSE(bytes.ok());
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bytes.status().message().find(c.message), absl::string_view::npos) << bytes.status();
  }
}

TEST(SafetensorsTest, WritesTheFileAtomically) {
  char tmpl[] = "/tmp/tessera-safetensors-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string path = dir + "/model.safetensors";
  {
    std::ofstream old(path);
    old << "old contents";
  }
  std::vector<NamedTensor> tensors = {{"b", {3}, {1, 2, 3}}};
  ASSERT_TRUE(WriteSafetensorsFile(path, tensors, {{"job_id", "j"}}).ok());
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<std::string> expected = EncodeSafetensors(tensors, {{"job_id", "j"}});
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(ss.str(), *expected);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  // A directory that does not exist: INTERNAL naming the path, and nothing left behind.
  absl::Status bad = WriteSafetensorsFile(dir + "/missing/model.safetensors", tensors, {});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInternal);
  EXPECT_NE(bad.message().find("missing/model.safetensors.tmp"), absl::string_view::npos) << bad;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera::cli
