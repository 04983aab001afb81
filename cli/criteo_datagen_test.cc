#include "cli/criteo_datagen.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/data/dataset.h"

namespace tessera::cli {
namespace {

using ::testing::HasSubstr;

class CriteoDatagenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_datagen_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::string dir_;
};

TEST_F(CriteoDatagenTest, WritesCriteoRowsThatTheReaderTakesAndThePlantedBest) {
  CriteoDatagenOptions o;
  o.out_dir = dir_ + "/data";
  o.train_rows = 20000;
  o.seed = 3;
  auto r = GenerateCriteo(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->test_rows, 2000) << "rows / 10, at least 1000";
  // Every line is a Criteo row: 40 fields, label 0/1, hex categories of 8 digits.
  const std::string train = Read(r->train_path);
  std::vector<std::string> lines = absl::StrSplit(train, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 20000u);
  std::map<std::string, int> c1, c26;  // value counts of the smallest and largest vocabulary
  int empty_c = 0;
  for (const std::string& line : lines) {
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    ASSERT_EQ(f.size(), 40u);
    ASSERT_TRUE(f[0] == "0" || f[0] == "1");
    for (int c = 0; c < 26; ++c) {
      const std::string& v = f[14 + c];
      if (v.empty()) {
        ++empty_c;
        continue;
      }
      ASSERT_EQ(v.size(), 8u);
    }
    if (!f[14].empty()) ++c1[f[14]];
    if (!f[39].empty()) ++c26[f[39]];
  }
  EXPECT_LE(c1.size(), 10u);
  EXPECT_GT(c26.size(), 5000u) << "a 10^7 vocabulary: most values rare";
  int top = 0;
  for (const auto& [v, n] : c26) top = std::max(top, n);
  EXPECT_GT(top, 20) << "Zipf: the head value is common";
  EXPECT_NEAR(empty_c / (20000.0 * 26), 0.05, 0.01);
  auto d = data::ReadCriteoDataset(r->train_path, data::ReadOptions{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 20000);
  // The planted model is informative, and the best log loss beats a constant predictor's.
  const double p = r->positive_rate;
  const double constant = -(p * std::log(p) + (1 - p) * std::log(1 - p));
  EXPECT_GT(p, 0.1);
  EXPECT_LT(p, 0.5);
  EXPECT_GT(r->best_test_auc, 0.7);
  EXPECT_LT(r->best_test_auc, 0.95);
  EXPECT_LT(r->best_test_log_loss, constant - 0.05);
  const std::string planted = Read(r->planted_path);
  EXPECT_THAT(planted, HasSubstr("\"model\":\"logistic\""));
  EXPECT_THAT(planted, HasSubstr(absl::StrCat("\"test_rows\":", r->test_rows)));
  EXPECT_THAT(planted, HasSubstr("\"vocabularies\":[10,"));
  EXPECT_THAT(planted, HasSubstr(",10000000]"));
  // No temporary file is left behind.
  EXPECT_NE(access((r->train_path + ".tmp").c_str(), F_OK), 0);
}

TEST_F(CriteoDatagenTest, TheSameSeedGivesTheSameBytesAndTheFmModelDiffers) {
  CriteoDatagenOptions o;
  o.train_rows = 3000;
  o.test_rows = 1000;
  o.out_dir = dir_ + "/a";
  ASSERT_TRUE(GenerateCriteo(o).ok());
  o.out_dir = dir_ + "/b";
  ASSERT_TRUE(GenerateCriteo(o).ok());
  EXPECT_EQ(Read(dir_ + "/a/train.tsv"), Read(dir_ + "/b/train.tsv"));
  EXPECT_EQ(Read(dir_ + "/a/planted.json"), Read(dir_ + "/b/planted.json"));
  o.out_dir = dir_ + "/c";
  o.seed = 2;
  ASSERT_TRUE(GenerateCriteo(o).ok());
  EXPECT_NE(Read(dir_ + "/a/train.tsv"), Read(dir_ + "/c/train.tsv"));
  o.out_dir = dir_ + "/fm";
  o.seed = 1;
  o.factorization_machine = true;
  auto fm = GenerateCriteo(o);
  ASSERT_TRUE(fm.ok());
  EXPECT_THAT(Read(fm->planted_path), HasSubstr("\"model\":\"factorization_machine\""));
  EXPECT_GT(fm->best_test_auc, 0.7);
}

// The count of distinct values of field C26 (vocabulary 10^7) in a train file.
size_t DistinctC26(const std::string& train) {
  std::set<std::string> seen;
  for (absl::string_view line : absl::StrSplit(train, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, '\t');
    if (f.size() == 40 && !f[39].empty()) seen.insert(std::string(f[39]));
  }
  return seen.size();
}

TEST_F(CriteoDatagenTest, ASmallerZipfExponentSpreadsTheIdsOverMoreOfTheVocabulary) {
  CriteoDatagenOptions o;
  o.train_rows = 5000;
  o.test_rows = 1000;
  o.out_dir = dir_ + "/steep";
  ASSERT_TRUE(GenerateCriteo(o).ok());
  o.out_dir = dir_ + "/flat";
  o.zipf_exponent = 0.6;
  auto flat = GenerateCriteo(o);
  ASSERT_TRUE(flat.ok()) << flat.status();
  const size_t steep_ids = DistinctC26(Read(dir_ + "/steep/train.tsv"));
  const size_t flat_ids = DistinctC26(Read(flat->train_path));
  // Expected for 4750 draws of 10^7 values: about 2,560 distinct at 1.05, about 4,740 at 0.6.
  EXPECT_LT(steep_ids, 3200u);
  EXPECT_GT(flat_ids, 4500u);
  EXPECT_THAT(Read(flat->planted_path), HasSubstr("\"zipf_exponent\":0.600000"));
}

TEST_F(CriteoDatagenTest, BadOptionsAreRefusedByName) {
  CriteoDatagenOptions o;
  o.out_dir = dir_ + "/x";
  o.train_rows = 0;
  EXPECT_THAT(std::string(GenerateCriteo(o).status().message()), HasSubstr("--rows"));
  o.train_rows = 10;
  o.test_rows = 0;
  EXPECT_THAT(std::string(GenerateCriteo(o).status().message()), HasSubstr("--test_rows"));
  o.test_rows = 5;
  for (double bad : {0.0, 1.0, 4.5, -1.0}) {
    o.zipf_exponent = bad;
    EXPECT_THAT(std::string(GenerateCriteo(o).status().message()), HasSubstr("--zipf"));
  }
  o.zipf_exponent = 1.05;
  o.out_dir = "/proc/no/such/place";
  auto r = GenerateCriteo(o);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("/proc/no/such/place"));
}

}  // namespace
}  // namespace tessera::cli
