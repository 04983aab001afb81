// Runs the real tessera-worker binary: convergence of the MLP example and the error paths.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class WorkerBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_worker_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }

  RunResult Run(const std::string& args) {
    const std::string cmd =
        absl::StrCat(TESSERA_WORKER_BINARY, " ", args, " >", dir_, "/out.txt 2>", dir_, "/err.txt");
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = ReadFile(dir_ + "/out.txt");
    r.err = ReadFile(dir_ + "/err.txt");
    return r;
  }

  std::string dir_;
};

std::string Example(const char* name) {
  return absl::StrCat(TESSERA_SOURCE_DIR, "/examples/", name);
}

// The last line of `out`.
std::string LastLine(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  const size_t nl = s.rfind('\n');
  return nl == std::string::npos ? s : s.substr(nl + 1);
}

double JsonNumber(const std::string& json, const std::string& key) {
  std::smatch m;
  const std::regex re("\"" + key + "\":(-?[0-9.eE+-]+)");
  if (!std::regex_search(json, m, re)) {
    ADD_FAILURE() << "no numeric " << key << " in " << json;
    return -1;
  }
  return std::stod(m[1]);
}

// Convergence: the MLP example reaches 0.84 test accuracy after 2 epochs on the CPU.
TEST_F(WorkerBinaryTest, MlpExampleConvergesInTwoEpochsOnCpu) {
  const RunResult r = Run(absl::StrCat("--standalone --job ", Example("fashion_mlp.textproto"),
                                       " --epochs 2 --device cpu --threads 1 --output json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // stdout is exactly one JSON line; progress went to stderr.
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;
  const std::string json = LastLine(r.out);
  EXPECT_GE(JsonNumber(json, "test_accuracy"), 0.84) << json;
  EXPECT_LT(JsonNumber(json, "test_loss"), 0.5) << json;
  EXPECT_EQ(JsonNumber(json, "epochs"), 2);
  EXPECT_EQ(JsonNumber(json, "steps"), 2 * 938);  // ceil(60000 / 64) per epoch
  EXPECT_EQ(JsonNumber(json, "train_samples"), 120000);
  EXPECT_GT(JsonNumber(json, "samples_per_second"), 0);
  EXPECT_THAT(json, HasSubstr("\"device\":\"cpu\""));
  EXPECT_THAT(r.err, HasSubstr("epoch 2/2: train loss"));
}

TEST_F(WorkerBinaryTest, BadSpecFailsNamingTheField) {
  std::string spec = ReadFile(Example("fashion_mlp.textproto"));
  const std::string from = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
  spec.replace(spec.find(from), from.size(), "/nonexistent/train.gz");
  std::ofstream(dir_ + "/bad.textproto") << spec;
  const RunResult r = Run(absl::StrCat("--standalone --job ", dir_, "/bad.textproto"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: dataset.train_images: file not found: "
                               "/nonexistent/train.gz"));
  const RunResult j =
      Run(absl::StrCat("--standalone --job ", dir_, "/bad.textproto --output json"));
  EXPECT_EQ(j.exit_code, 1);
  EXPECT_THAT(j.out, HasSubstr("{\"error\":{\"code\":\"INVALID_ARGUMENT\",\"message\":\"dataset."
                               "train_images: file not found: /nonexistent/train.gz\"}}"));
}

TEST_F(WorkerBinaryTest, UnparsableSpecGivesLineAndColumn) {
  std::ofstream(dir_ + "/bad.textproto") << "name: \"x\"\nbatch_size: abc\n";
  const RunResult r = Run(absl::StrCat("--standalone --job ", dir_, "/bad.textproto"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("INVALID_ARGUMENT: ", dir_, "/bad.textproto:2:13: ")));
}

TEST_F(WorkerBinaryTest, UsageErrorsExit64) {
  const RunResult no_mode = Run(absl::StrCat("--job ", Example("fashion_mlp.textproto")));
  EXPECT_EQ(no_mode.exit_code, 64);
  EXPECT_THAT(no_mode.err, HasSubstr("need --standalone"));
  const RunResult no_job = Run("--standalone");
  EXPECT_EQ(no_job.exit_code, 64);
  EXPECT_THAT(no_job.err, HasSubstr("--job FILE"));
  const RunResult bad_device = Run("--standalone --job x --device tpu");
  EXPECT_EQ(bad_device.exit_code, 64);
  EXPECT_THAT(bad_device.err, HasSubstr("--device"));
  const RunResult missing = Run("--standalone --job /nonexistent/job.textproto");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("NOT_FOUND: job spec file not found: /nonexistent/"));
}

}  // namespace
