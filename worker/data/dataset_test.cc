#include "worker/data/dataset.h"

#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kFashionDir[] = "/usr/share/datasets/fashion-mnist/";

std::string Fashion(const char* name) { return absl::StrCat(kFashionDir, name); }

ReadOptions FashionOptions() {
  ReadOptions o;
  o.normalization.divide_by = 255.0f;
  o.num_classes = 10;
  return o;
}

// The raw bytes of example i, recovered from the /255-normalised features.
std::vector<uint8_t> PixelBytes(const Dataset& d, int64_t i) {
  std::vector<float> f(d.feature_dim());
  d.CopyFeatures(i, f.data());
  std::vector<uint8_t> bytes(f.size());
  for (size_t j = 0; j < f.size(); ++j) bytes[j] = static_cast<uint8_t>(std::lround(f[j] * 255));
  return bytes;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/tessera_data_test.XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(absl::StrCat("rm -rf '", path_, "'").c_str()); }
  std::string File(const std::string& name) const { return absl::StrCat(path_, "/", name); }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
}

void WriteGzip(const std::string& path, const std::string& contents) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, contents.data(), contents.size()), static_cast<int>(contents.size()));
  gzclose(f);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string Decompress(const std::string& gz_path) {
  gzFile f = gzopen(gz_path.c_str(), "rb");
  std::string out;
  char buf[1 << 16];
  int got;
  while ((got = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, got);
  gzclose(f);
  return out;
}

// An IDX file: ubyte elements, the given dimensions, and the given element bytes.
std::string Idx(const std::vector<uint32_t>& dims, const std::string& elements) {
  std::string s = {0, 0, 0x08, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    s += static_cast<char>(d >> 24);
    s += static_cast<char>(d >> 16);
    s += static_cast<char>(d >> 8);
    s += static_cast<char>(d);
  }
  return s + elements;
}

// ------------------------------------------------------------------------------------------------
// IDX on the real Fashion-MNIST files.

TEST(IdxReaderTest, FashionMnistTrainSplit) {
  auto d = ReadIdxDataset(Fashion("train-images-idx3-ubyte.gz"),
                          Fashion("train-labels-idx1-ubyte.gz"), FashionOptions());
  ASSERT_TRUE(d.ok()) << d.status();
  const Dataset& ds = **d;
  EXPECT_EQ(ds.size(), 60000);
  EXPECT_EQ(ds.total_examples(), 60000);
  EXPECT_EQ(ds.example_shape(), (std::vector<int64_t>{28, 28}));
  EXPECT_EQ(ds.feature_dim(), 784);
  EXPECT_FALSE(ds.sparse());
  // Expected values computed independently with Python:
  //   d = gzip.open('train-images-idx3-ubyte.gz').read(); img = d[16:16+784]
  //   sum(img) == 76247; zlib.crc32(img) == 4067475125
  //   gzip.open('train-labels-idx1-ubyte.gz').read()[8:18].hex() == '09000003000207020505'
  std::vector<uint8_t> first = PixelBytes(ds, 0);
  int64_t sum = 0;
  for (uint8_t b : first) sum += b;
  EXPECT_EQ(sum, 76247);
  EXPECT_EQ(crc32(0, first.data(), first.size()), 4067475125u);
  const std::vector<int> first_labels = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(ds.label(i), first_labels[i]) << i;
  std::vector<int> per_class(10);
  for (int64_t i = 0; i < ds.size(); ++i) ++per_class[ds.label(i)];
  EXPECT_EQ(per_class, std::vector<int>(10, 6000));
  float lo = 1, hi = 0;
  std::vector<float> f(784);
  ds.CopyFeatures(0, f.data());
  for (float v : f) lo = std::min(lo, v), hi = std::max(hi, v);
  EXPECT_GE(lo, 0.0f);
  EXPECT_LE(hi, 1.0f);
}

TEST(IdxReaderTest, FashionMnistTestSplit) {
  auto d = ReadIdxDataset(Fashion("t10k-images-idx3-ubyte.gz"),
                          Fashion("t10k-labels-idx1-ubyte.gz"), FashionOptions());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 10000);
  EXPECT_EQ((*d)->example_shape(), (std::vector<int64_t>{28, 28}));
  // Python: sum(gzip.open('t10k-images-idx3-ubyte.gz').read()[16:16+784]) == 33456,
  // zlib.crc32(...) == 1384319072; labels[8:18].hex() == '09020101060104060507'.
  std::vector<uint8_t> first = PixelBytes(**d, 0);
  int64_t sum = 0;
  for (uint8_t b : first) sum += b;
  EXPECT_EQ(sum, 33456);
  EXPECT_EQ(crc32(0, first.data(), first.size()), 1384319072u);
  const std::vector<int> first_labels = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
  for (int i = 0; i < 10; ++i) EXPECT_EQ((*d)->label(i), first_labels[i]) << i;
}

TEST(IdxReaderTest, ShardsOfTheRealFileAreDisjointAndCovering) {
  const std::string images = Fashion("t10k-images-idx3-ubyte.gz");
  const std::string labels = Fashion("t10k-labels-idx1-ubyte.gz");
  auto full = ReadIdxDataset(images, labels, FashionOptions());
  ASSERT_TRUE(full.ok()) << full.status();
  int64_t covered = 0;
  for (int rank = 0; rank < 3; ++rank) {
    ReadOptions o = FashionOptions();
    o.rank = rank;
    o.world = 3;
    auto shard = ReadIdxDataset(images, labels, o);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ((*shard)->size(), rank == 0 ? 3334 : 3333);
    EXPECT_EQ((*shard)->total_examples(), 10000);
    covered += (*shard)->size();
    // Shard example i is file example rank + 3 i.
    for (int64_t i : {int64_t{0}, int64_t{1}, (*shard)->size() - 1}) {
      EXPECT_EQ(PixelBytes(**shard, i), PixelBytes(**full, rank + 3 * i)) << rank << " " << i;
      EXPECT_EQ((*shard)->label(i), (*full)->label(rank + 3 * i));
    }
  }
  EXPECT_EQ(covered, 10000);
}

TEST(IdxReaderTest, NormalisationIsApplied) {
  TempDir dir;
  WriteFile(dir.File("im"), Idx({2, 2}, std::string("\x00\xff\x33\x66", 4)));
  WriteFile(dir.File("lb"), Idx({2}, std::string("\x01\x00", 2)));
  ReadOptions o;
  o.normalization = {255.0f, 0.5f, 0.25f};
  o.num_classes = 2;
  auto d = ReadIdxDataset(dir.File("im"), dir.File("lb"), o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->example_shape(), (std::vector<int64_t>{2}));
  Batch b;
  const int64_t idx[] = {1, 0};
  (*d)->Gather(idx, &b);
  ASSERT_EQ(b.features.size(), 4u);
  EXPECT_FLOAT_EQ(b.features[0], (0x33 / 255.0f - 0.5f) / 0.25f);
  EXPECT_FLOAT_EQ(b.features[1], (0x66 / 255.0f - 0.5f) / 0.25f);
  EXPECT_FLOAT_EQ(b.features[2], -2.0f);
  EXPECT_FLOAT_EQ(b.features[3], 2.0f);
  EXPECT_EQ(b.labels, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(b.targets, (std::vector<float>{0.0f, 1.0f}));
}

// ------------------------------------------------------------------------------------------------
// IDX errors, on damaged copies of the real files.

TEST(IdxReaderTest, MissingFileIsNotFoundAndNamesIt) {
  auto d = ReadIdxDataset("/nonexistent/images.gz", Fashion("t10k-labels-idx1-ubyte.gz"),
                          FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("/nonexistent/images.gz"));
}

TEST(IdxReaderTest, TruncatedGzipIsDataLossNamingFileAndOffset) {
  TempDir dir;
  const std::string gz = ReadFile(Fashion("t10k-images-idx3-ubyte.gz"));
  const std::string cut = dir.File("cut-images.gz");
  WriteFile(cut, gz.substr(0, gz.size() / 2));
  auto d = ReadIdxDataset(cut, Fashion("t10k-labels-idx1-ubyte.gz"), FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(d.status().message()),
              AllOf(HasSubstr(cut), HasSubstr("truncated at byte ")));
}

TEST(IdxReaderTest, TruncatedPlainFileReportsTheExactOffset) {
  TempDir dir;
  const std::string raw = Decompress(Fashion("t10k-images-idx3-ubyte.gz"));
  ASSERT_EQ(raw.size(), 7840016u);
  const std::string cut = dir.File("cut-images");
  WriteFile(cut, raw.substr(0, 1000));
  auto d = ReadIdxDataset(cut, Fashion("t10k-labels-idx1-ubyte.gz"), FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
  // Example 1 starts at byte 16 + 784 = 800; 200 of its 784 bytes are there.
  EXPECT_THAT(
      std::string(d.status().message()),
      AllOf(HasSubstr(cut), HasSubstr("truncated at byte 1000"), HasSubstr("from byte 800")));
}

TEST(IdxReaderTest, TruncatedHeaderIsDataLoss) {
  TempDir dir;
  WriteFile(dir.File("lb"), std::string("\x00\x00\x08\x01\x00\x00", 6));
  auto d = ReadIdxDataset(Fashion("t10k-images-idx3-ubyte.gz"), dir.File("lb"), FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(d.status().message()),
              AllOf(HasSubstr(dir.File("lb")), HasSubstr("truncated at byte 6")));
}

TEST(IdxReaderTest, CorruptGzipIsDataLoss) {
  TempDir dir;
  std::string gz = ReadFile(Fashion("t10k-images-idx3-ubyte.gz"));
  for (size_t i = gz.size() / 2; i < gz.size() / 2 + 64; ++i) gz[i] = static_cast<char>(~gz[i]);
  const std::string bad = dir.File("bad-images.gz");
  WriteFile(bad, gz);
  auto d = ReadIdxDataset(bad, Fashion("t10k-labels-idx1-ubyte.gz"), FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(d.status().message()), AllOf(HasSubstr(bad), HasSubstr("byte")));
}

TEST(IdxReaderTest, BadMagicIsInvalidArgumentAtByteZero) {
  TempDir dir;
  std::string raw = Decompress(Fashion("t10k-labels-idx1-ubyte.gz"));
  raw[0] = 0x1f;
  WriteGzip(dir.File("lb.gz"), raw);
  auto d =
      ReadIdxDataset(Fashion("t10k-images-idx3-ubyte.gz"), dir.File("lb.gz"), FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              AllOf(HasSubstr(dir.File("lb.gz")), HasSubstr("bad magic number at byte 0")));
}

TEST(IdxReaderTest, CountMismatchNamesBothFiles) {
  TempDir dir;
  WriteFile(dir.File("lb"), Idx({3}, std::string("\x01\x02\x03", 3)));
  auto d = ReadIdxDataset(Fashion("t10k-images-idx3-ubyte.gz"), dir.File("lb"), FashionOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              AllOf(HasSubstr("t10k-images-idx3-ubyte.gz holds 10000 examples"),
                    HasSubstr(dir.File("lb")), HasSubstr("3 labels")));
}

TEST(IdxReaderTest, TrailingDataAndBadLabelsAreRefused) {
  TempDir dir;
  WriteFile(dir.File("im"), Idx({2, 1}, std::string("\x01\x02", 2)));
  WriteFile(dir.File("lb_trailing"), Idx({2}, std::string("\x01\x00\x07", 3)));
  WriteFile(dir.File("lb_range"), Idx({2}, std::string("\x01\x0a", 2)));
  ReadOptions o;
  o.num_classes = 10;
  auto trailing = ReadIdxDataset(dir.File("im"), dir.File("lb_trailing"), o);
  EXPECT_EQ(trailing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(trailing.status().message()),
              HasSubstr("unexpected trailing data at byte 10"));
  auto range = ReadIdxDataset(dir.File("im"), dir.File("lb_range"), o);
  EXPECT_EQ(range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(range.status().message()),
              AllOf(HasSubstr("label 1 at byte 9"), HasSubstr("label 10 is not a class id")));
}

TEST(IdxReaderTest, HugeDimensionsInAHeaderAreATruncationNotAHugeAllocation) {
  // Headers that claim 4 billion labels (32 GiB of doubles) or 16 examples of 65535 x 65535
  // (68 GB of bytes, 274 GB as floats) over a few bytes of data: the reader must stop at the end
  // of the data with DATA_LOSS instead of allocating what the header claims.
  TempDir dir;
  std::string labels_huge = Idx({0xffffffffu}, std::string(24, '\0'));
  labels_huge[2] = 0x0E;  // double
  WriteFile(dir.File("lb_huge"), labels_huge);
  std::string labels(16, '\x01');
  WriteFile(dir.File("lb"), Idx({16}, labels));
  WriteFile(dir.File("im_huge"), Idx({16, 65535, 65535}, std::string(100, '\x07')));
  std::string floats_huge = Idx({16, 65535, 65535}, std::string(100, '\0'));
  floats_huge[2] = 0x0D;  // float
  WriteFile(dir.File("im_huge_f"), floats_huge);
  WriteFile(dir.File("im"), Idx({16, 2}, std::string(32, '\x07')));
  ReadOptions o;
  o.num_classes = 10;

  auto d = ReadIdxDataset(dir.File("im"), dir.File("lb_huge"), o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(d.status().message()),
              AllOf(HasSubstr(dir.File("lb_huge")), HasSubstr("truncated at byte 32"),
                    HasSubstr("expected 34359738360 bytes of labels from byte 8, got 24")));
  for (const char* images : {"im_huge", "im_huge_f"}) {
    d = ReadIdxDataset(dir.File(images), dir.File("lb"), o);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss) << images;
    EXPECT_THAT(std::string(d.status().message()),
                AllOf(HasSubstr(dir.File(images)), HasSubstr("truncated at byte 116"),
                      HasSubstr("of example data from byte 16, got 100")));
  }
  // The same files with honest headers still read.
  auto ok = ReadIdxDataset(dir.File("im"), dir.File("lb"), o);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->size(), 16);
  EXPECT_EQ((*ok)->feature_dim(), 2);
}

// ------------------------------------------------------------------------------------------------
// LIBSVM.

TEST(LibsvmReaderTest, ReadsSparseExamples) {
  TempDir dir;
  WriteFile(dir.File("a.svm"),
            "+1 1:0.5 3:2 # a comment\n"
            "\n"
            "-1 2:4\r\n"
            "1\n");
  ReadOptions o;
  o.num_classes = 2;
  o.normalization.divide_by = 2.0f;
  auto d = ReadLibsvmDataset(dir.File("a.svm"), o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE((*d)->sparse());
  EXPECT_EQ((*d)->size(), 3);
  EXPECT_EQ((*d)->feature_dim(), 3);  // largest 1-based index 3 -> ids 0..2
  Batch b;
  const int64_t idx[] = {0, 1, 2};
  (*d)->Gather(idx, &b);
  EXPECT_EQ(b.sparse_offsets, (std::vector<int64_t>{0, 2, 3, 3}));
  EXPECT_EQ(b.sparse_ids, (std::vector<int64_t>{0, 2, 1}));
  EXPECT_EQ(b.sparse_values, (std::vector<float>{0.25f, 1.0f, 2.0f}));
  EXPECT_EQ(b.labels, (std::vector<int32_t>{1, 0, 1}));
  EXPECT_TRUE(b.features.empty());
}

TEST(LibsvmReaderTest, ZeroBasedAndFixedFeatureCount) {
  TempDir dir;
  WriteFile(dir.File("a.svm"), "0.5 0:1 7:1\n");
  ReadOptions o;
  o.zero_based = true;
  o.num_features = 100;
  auto d = ReadLibsvmDataset(dir.File("a.svm"), o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->feature_dim(), 100);
  EXPECT_FLOAT_EQ((*d)->target(0), 0.5f);
}

struct BadLine {
  std::string contents;
  std::string expected;  // in the message, after "<path>:"
  int num_classes;
};

class LibsvmBadLineTest : public ::testing::TestWithParam<BadLine> {};

TEST_P(LibsvmBadLineTest, NamesFileAndLine) {
  TempDir dir;
  const std::string path = dir.File("bad.svm");
  WriteFile(path, GetParam().contents);
  ReadOptions o;
  o.num_classes = GetParam().num_classes;
  o.num_features = 10;
  auto d = ReadLibsvmDataset(path, o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr(absl::StrCat(path, ":", GetParam().expected)));
}

INSTANTIATE_TEST_SUITE_P(
    Lines, LibsvmBadLineTest,
    ::testing::Values(BadLine{"1 1:1\n1 2:x\n", "2: feature 1 (3 bytes) is not index:value", 0},
                      BadLine{"1 1:1\nabc 2:1\n", "2: label (3 bytes) is not a number", 0},
                      BadLine{"1 1:1\n\n1 3:1 2:1\n", "3: feature index 2 does not increase", 0},
                      BadLine{"1 0:1\n", "1: feature index 0 is below the first index 1", 0},
                      BadLine{"1 11:1\n", "1: feature index 11 is beyond num_features 10", 0},
                      BadLine{"1 1:1\n3 1:1\n", "2: label 3 is not a class id in [0, 2)", 2},
                      BadLine{"1 1:1\n1 2\n", "2: feature 1 (1 byte) is not index:value", 0},
                      // index - 1 would overflow.
                      BadLine{"1 -9223372036854775808:1\n",
                              "1: feature index -9223372036854775808 is below the first index 1",
                              0}));

TEST(LibsvmReaderTest, LargestIndexDoesNotOverflowTheFeatureCount) {
  TempDir dir;
  const std::string path = dir.File("big.svm");
  WriteFile(path, "1 0:1 9223372036854775807:1\n");
  ReadOptions o;
  o.zero_based = true;  // the feature count would be 2^63
  auto d = ReadLibsvmDataset(path, o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr(absl::StrCat(path, ":1: feature index 9223372036854775807 is too large")));
}

// ------------------------------------------------------------------------------------------------
// CSV.

TEST(CsvReaderTest, ReadsDenseExamplesWithHeaderAndLabelColumn) {
  TempDir dir;
  WriteFile(dir.File("a.csv"),
            "x1,x2,label\n"
            "1,2,0\n"
            "3,4.5,2\n");
  ReadOptions o;
  o.has_header = true;
  o.label_column = 2;
  o.num_classes = 3;
  auto d = ReadCsvDataset(dir.File("a.csv"), o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 2);
  EXPECT_EQ((*d)->feature_dim(), 2);
  Batch b;
  const int64_t idx[] = {1, 0};
  (*d)->Gather(idx, &b);
  EXPECT_EQ(b.features, (std::vector<float>{3.0f, 4.5f, 1.0f, 2.0f}));
  EXPECT_EQ(b.labels, (std::vector<int32_t>{2, 0}));
}

TEST(CsvReaderTest, BadFieldNamesLineAndColumn) {
  TempDir dir;
  const std::string path = dir.File("bad.csv");
  WriteFile(path, "0,1,2\n1,2,oops\n");
  auto d = ReadCsvDataset(path, ReadOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(d.status().message()),
      HasSubstr(absl::StrCat(path, ":2, column 3: the field (4 bytes) is not a finite number")));
}

TEST(CsvReaderTest, RaggedRowNamesLine) {
  TempDir dir;
  const std::string path = dir.File("bad.csv");
  WriteFile(path, "0,1,2\n1,2,3\n\n1,2\n");
  auto d = ReadCsvDataset(path, ReadOptions());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr(absl::StrCat(path, ":4: 2 fields, but earlier rows have 3")));
}

TEST(CsvReaderTest, LabelColumnBeyondRowAndEmptyFile) {
  TempDir dir;
  WriteFile(dir.File("a.csv"), "1,2\n");
  WriteFile(dir.File("empty.csv"), "\n\n");
  ReadOptions o;
  o.label_column = 5;
  auto d = ReadCsvDataset(dir.File("a.csv"), o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("label_column 5 is beyond the 2"));
  auto e = ReadCsvDataset(dir.File("empty.csv"), ReadOptions());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("no examples"));
}

TEST(CsvReaderTest, GzipCsvIsRead) {
  TempDir dir;
  WriteGzip(dir.File("a.csv.gz"), "1,0.5\n0,0.25\n");
  auto d = ReadCsvDataset(dir.File("a.csv.gz"), ReadOptions());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 2);
  EXPECT_FLOAT_EQ((*d)->target(1), 0.0f);
}

// ------------------------------------------------------------------------------------------------
// Sharding for the text formats.

TEST(ShardingTest, TextShardsAreDisjointAndCovering) {
  TempDir dir;
  std::string csv, svm;
  for (int i = 0; i < 10; ++i) {
    csv += absl::StrCat(i, ",", i * 10, "\n");
    svm += absl::StrCat(i, " 1:", i * 10, "\n");
  }
  WriteFile(dir.File("a.csv"), csv);
  WriteFile(dir.File("a.svm"), svm);
  for (bool use_csv : {true, false}) {
    std::multiset<float> seen;
    for (int rank = 0; rank < 3; ++rank) {
      ReadOptions o;
      o.rank = rank;
      o.world = 3;
      auto d =
          use_csv ? ReadCsvDataset(dir.File("a.csv"), o) : ReadLibsvmDataset(dir.File("a.svm"), o);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ((*d)->size(), rank == 0 ? 4 : 3);
      EXPECT_EQ((*d)->total_examples(), 10);
      for (int64_t i = 0; i < (*d)->size(); ++i) {
        EXPECT_EQ((*d)->target(i), rank + 3 * i);
        seen.insert((*d)->target(i));
      }
    }
    EXPECT_EQ(seen, (std::multiset<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})) << use_csv;
  }
}

TEST(ReadOptionsTest, BadOptionsNameTheField) {
  ReadOptions o;
  o.rank = 3;
  o.world = 3;
  EXPECT_THAT(std::string(ValidateReadOptions(o).message()), HasSubstr("rank"));
  o = ReadOptions();
  o.normalization.stddev = 0;
  EXPECT_THAT(std::string(ValidateReadOptions(o).message()), HasSubstr("normalization.stddev"));
  o = ReadOptions();
  o.normalization.divide_by = 0;
  EXPECT_EQ(ValidateReadOptions(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateReadOptions(ReadOptions()).ok());
}

// ------------------------------------------------------------------------------------------------
// Criteo TSV.

// A Criteo line: label, 13 integers, 26 categories (empty strings stay empty).
std::string CriteoLine(int label, const std::vector<std::string>& ints,
                       const std::vector<std::string>& cats) {
  std::string line = std::to_string(label);
  for (int i = 0; i < kCriteoIntegerFields; ++i) {
    line += "\t" + (i < static_cast<int>(ints.size()) ? ints[i] : std::string());
  }
  for (int c = 0; c < kCriteoCategoricalFields; ++c) {
    line += "\t" + (c < static_cast<int>(cats.size()) ? cats[c] : std::string());
  }
  return line + "\n";
}

TEST(CriteoReaderTest, EachExampleIsOneBagOfHashedFieldIds) {
  TempDir dir;
  WriteFile(dir.File("c.tsv"), CriteoLine(1, {"3", "", "-1", "0", "7"}, {"68fd1e64", "", "0aF"}) +
                                   CriteoLine(0, {}, {}));
  auto d = ReadCriteoDataset(dir.File("c.tsv"), ReadOptions{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 2);
  EXPECT_EQ((*d)->total_examples(), 2);
  EXPECT_TRUE((*d)->sparse());
  EXPECT_EQ((*d)->feature_dim(), 0) << "hashed ids";
  Batch b;
  (*d)->Gather({0, 1}, &b);
  // I1 = 3 and I5 = 7 (empty, -1 and 0 add nothing), then C1 and C3.
  EXPECT_EQ(b.sparse_offsets, (std::vector<int64_t>{0, 4, 4}));
  EXPECT_EQ(b.sparse_ids,
            (std::vector<int64_t>{CriteoFeatureId(0, 0), CriteoFeatureId(4, 0),
                                  CriteoFeatureId(13, 0x68fd1e64), CriteoFeatureId(15, 0xaf)}));
  ASSERT_EQ(b.sparse_values.size(), 4u);
  EXPECT_FLOAT_EQ(b.sparse_values[0], std::log1p(3.0f));
  EXPECT_FLOAT_EQ(b.sparse_values[1], std::log1p(7.0f));
  EXPECT_EQ(b.sparse_values[2], 1.0f);
  EXPECT_EQ(b.targets, (std::vector<float>{1, 0}));
  // The same value in two fields is two features.
  EXPECT_NE(CriteoFeatureId(13, 5), CriteoFeatureId(14, 5));
  for (int64_t id : b.sparse_ids) EXPECT_GE(id, 0);
}

TEST(CriteoReaderTest, AsFieldsEachExampleIsDenseFeaturesAndOneBagPerCategory) {
  TempDir dir;
  WriteFile(dir.File("c.tsv"), CriteoLine(1, {"3", "", "-1", "0", "7"}, {"68fd1e64", "", "0aF"}) +
                                   CriteoLine(0, {}, {"", "1"}));
  ReadOptions o;
  o.criteo_fields = true;
  auto d = ReadCriteoDataset(dir.File("c.tsv"), o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE((*d)->sparse());
  EXPECT_EQ((*d)->feature_dim(), 13);
  ASSERT_EQ((*d)->num_fields(), 26);
  Batch b;
  (*d)->Gather({1, 0}, &b);  // in that order
  ASSERT_EQ(b.features.size(), 26u);
  for (int i = 0; i < 13; ++i) EXPECT_EQ(b.features[i], 0.0f) << "example 1 has no integers";
  EXPECT_FLOAT_EQ(b.features[13 + 0], std::log1p(3.0f));
  EXPECT_EQ(b.features[13 + 1], 0.0f);  // empty
  EXPECT_EQ(b.features[13 + 2], 0.0f);  // -1
  EXPECT_FLOAT_EQ(b.features[13 + 4], std::log1p(7.0f));
  ASSERT_EQ(b.fields.size(), 26u);
  EXPECT_EQ(b.fields[0].offsets, (std::vector<int64_t>{0, 0, 1}));
  EXPECT_EQ(b.fields[0].ids, (std::vector<int64_t>{CriteoFeatureId(13, 0x68fd1e64)}));
  EXPECT_EQ(b.fields[1].offsets, (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(b.fields[1].ids, (std::vector<int64_t>{CriteoFeatureId(14, 1)}));
  EXPECT_EQ(b.fields[2].ids, (std::vector<int64_t>{CriteoFeatureId(15, 0xaf)}));
  EXPECT_EQ(b.fields[25].offsets, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_TRUE(b.sparse_ids.empty());
  EXPECT_EQ(b.targets, (std::vector<float>{0, 1}));
}

TEST(CriteoReaderTest, RanksReadDisjointByteRangesThatCoverTheFile) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 101; ++i) {
    text += CriteoLine(i % 2, {std::to_string(i + 1)},
                       {absl::StrCat(absl::Hex(i * 7919 + (i % 3 == 0 ? 123456789 : 0)))});
  }
  WriteFile(dir.File("c.tsv"), text);
  WriteGzip(dir.File("c.tsv.gz"), text);
  for (const std::string name : {"c.tsv", "c.tsv.gz"}) {
    std::vector<float> seen;  // I1 - 1 = the line number, in the order the ranks hold them
    for (int rank = 0; rank < 3; ++rank) {
      ReadOptions o;
      o.rank = rank;
      o.world = 3;
      auto d = ReadCriteoDataset(dir.File(name), o);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ((*d)->total_examples(), 101);
      EXPECT_GT((*d)->size(), 25) << "about a third each";
      std::vector<int64_t> all((*d)->size());
      for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
      Batch b;
      (*d)->Gather(all, &b);
      for (int64_t e = 0; e < b.size; ++e) {
        seen.push_back(std::round(std::expm1(b.sparse_values[b.sparse_offsets[e]])) - 1);
      }
    }
    ASSERT_EQ(seen.size(), 101u) << name;
    for (int i = 0; i < 101; ++i) EXPECT_EQ(seen[i], i) << name;
  }
}

TEST(CriteoReaderTest, MalformedLinesAreRefusedByLineWithoutEchoingThem) {
  TempDir dir;
  const std::string good = CriteoLine(1, {"1"}, {"ab"});
  const struct {
    std::string text, want;
  } cases[] = {
      {good + "1\t2\t3\n", "c.tsv:2: 3 tab-separated fields, Criteo TSV has 40"},
      {good + CriteoLine(1, {"x1"}, {}), "c.tsv:2: integer feature I1 (2 bytes) is not an integer"},
      {CriteoLine(1, {}, {"", "zz"}), "c.tsv:1: categorical field C2 (2 bytes) is not 1 to 16"},
      {CriteoLine(1, {}, {"0123456789abcdef0"}), "categorical field C1 (17 bytes)"},
      {good + "\n" + good, "c.tsv:2: empty line"},
      {CriteoLine(3, {}, {}), "c.tsv:1: label 3 is not a class id in [0, 2)"},
  };
  for (const auto& c : cases) {
    WriteFile(dir.File("c.tsv"), c.text);
    ReadOptions o;
    o.num_classes = 2;
    auto d = ReadCriteoDataset(dir.File("c.tsv"), o);
    ASSERT_FALSE(d.ok()) << c.want;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    EXPECT_THAT(std::string(d.status().message()), HasSubstr(c.want));
    EXPECT_THAT(std::string(d.status().message()), Not(HasSubstr("zz")));
  }
  EXPECT_EQ(ReadCriteoDataset(dir.File("absent.tsv"), ReadOptions{}).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tessera::data
