// End to end with the real binaries: tessera-coordinator, tessera-server shards and
// tessera-worker daemons as child processes on ports picked at run time, driven through the
// `tessera` CLI (and the coordinator's gRPC API where a test needs to look closer).
//
//  - `tessera local` trains the Fashion-MNIST MLP for 2 epochs in BSP, SSP(2) and ASP, each to
//    SUCCEEDED with test accuracy >= 0.84, and exports it; an independent numpy reader
//    (score_safetensors.py) reproduces the reported accuracy within 0.001.
//  - The BatchNorm CNN example trains the same way, its averaged moving statistics are exported,
//    and the numpy reader scoring it in evaluation mode reproduces the reported accuracy.
//  - Workers with --devices cpu:2 show that device in `tessera cluster` and train the MLP.
//  - A cancelled job ends CANCELLED and its workers go back to READY; `tessera local` cancelled
//    by `tessera cancel` or by SIGINT leaves no process behind.
//  - Bad specs are refused with INVALID_ARGUMENT naming the field, and the coordinator serves on.
//  - After the coordinator is SIGKILLed and restarted on the same data_dir, `tessera list` shows
//    every job with its last state.
//
// Every wait is bounded in time. Skips (with a message) only when Fashion-MNIST is missing.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/coordinator_client.h"
#include "cli/local_cluster.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "spec/job_spec_reader.h"
#include "tests/testlib/child_process.h"
#include "tests/testlib/fashion_mnist.h"

#ifndef TESSERA_BIN_DIR
#error "TESSERA_BIN_DIR must name the folder of tessera and the daemons"
#endif
#ifndef TESSERA_SOURCE_DIR
#error "TESSERA_SOURCE_DIR must name the source tree"
#endif
#ifndef TESSERA_PYTHON
#define TESSERA_PYTHON "python3"
#endif

namespace tessera {
namespace {

using cli::CoordinatorClient;
using cli::LocalCluster;
using testlib::CommandResult;
using testlib::kFashionMnistDir;
using testlib::ReadWholeFile;
using testlib::ScratchDirectory;
using testlib::WaitChild;

std::string Tessera() { return absl::StrCat(TESSERA_BIN_DIR, "/tessera"); }

// The `tessera` CLI gets this process's environment as it is.
testlib::SpawnOptions InheritAll() {
  testlib::SpawnOptions options;
  options.scrub_environment = false;
  return options;
}

// `args` run to their end (at most `timeout`) with this process's whole environment.
CommandResult RunCommand(const std::vector<std::string>& args, const std::string& dir,
                         const std::string& tag, absl::Duration timeout = absl::Seconds(30)) {
  return testlib::RunToEnd(args, dir, tag, InheritAll(), timeout);
}

std::string LastLine(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipWhitespace());
  return lines.empty() ? "" : lines.back();
}

bool ParseJob(const std::string& json, v1::Job* job) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  return google::protobuf::util::JsonStringToMessage(json, job, options).ok();
}

v1::JobSpec ExampleSpec() {
  absl::StatusOr<v1::JobSpec> spec = spec::ReadJobSpecFile(
      absl::StrCat(TESSERA_SOURCE_DIR, "/examples/fashion_mlp_2epochs.textproto"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : v1::JobSpec();
}

std::string WriteSpec(const v1::JobSpec& spec, const std::string& path) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(spec, &text);
  std::ofstream(path) << text;
  return path;
}

// A job that runs long enough to be cancelled mid-way.
v1::JobSpec LongSpec(int workers) {
  v1::JobSpec spec = ExampleSpec();
  spec.set_name("long");
  spec.set_epochs(50);
  spec.set_num_workers(workers);
  return spec;
}

// The children of `parent`, from /proc/<pid>/stat.
std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> children;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    const std::string stat = ReadWholeFile(absl::StrCat("/proc/", pid, "/stat"));
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
    int ppid = 0;
    if (fields.size() > 1 && absl::SimpleAtoi(fields[1], &ppid) && ppid == parent) {
      children.push_back(pid);
    }
  }
  return children;
}

bool Exists(pid_t pid) { return std::filesystem::exists(absl::StrCat("/proc/", pid)); }

// Waits until every pid is gone (they were reparented, so someone else reaps them).
std::vector<pid_t> StillThere(const std::vector<pid_t>& pids, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<pid_t> left;
  do {
    left.clear();
    for (pid_t pid : pids) {
      if (Exists(pid)) left.push_back(pid);
    }
    if (left.empty()) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  return left;
}

// Polls GetJob until `done(job)` or the timeout; returns the last record.
template <typename Pred>
v1::Job WaitForJob(CoordinatorClient* client, const std::string& id, absl::Duration timeout,
                   Pred done) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::Job job;
  while (absl::Now() < deadline) {
    absl::StatusOr<v1::Job> got = client->GetJob(id);
    if (got.ok()) {
      job = *got;
      if (done(job)) break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return job;
}

std::unique_ptr<CoordinatorClient> ClientFor(const std::string& address) {
  CoordinatorClient::Options o;
  o.address = address;
  o.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> c = CoordinatorClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::unique_ptr<LocalCluster> StartCluster(int shards, int workers,
                                           const std::vector<std::string>& worker_args = {}) {
  LocalCluster::Options o;
  o.worker_args = worker_args;
  o.bin_dir = TESSERA_BIN_DIR;
  o.num_shards = shards;
  o.num_workers = workers;
  o.worker_threads = 1;
  o.log_level = "info";
  o.start_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(o);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

// --- Training in each consistency mode, export, independent scoring --------------------------

// The numpy reader (score_safetensors.py) scores the exported Fashion-MNIST model on the test
// split from the file alone; exits 0 when its accuracy is within 0.001 of `expect`.
CommandResult ScoreFashionExport(const std::string& model, double expect, const std::string& dir) {
  return RunCommand(
      {TESSERA_PYTHON, absl::StrCat(TESSERA_SOURCE_DIR, "/tests/e2e/score_safetensors.py"),
       "--model", model, "--images", absl::StrCat(kFashionMnistDir, "/t10k-images-idx3-ubyte.gz"),
       "--labels", absl::StrCat(kFashionMnistDir, "/t10k-labels-idx1-ubyte.gz"), "--divide_by",
       "255", "--expect", absl::StrCat(expect), "--tolerance", "0.001"},
      dir, "score", absl::Seconds(120));
}

struct ModeCase {
  const char* name;
  const char* consistency;
  int staleness;
};

void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.name; }

class TrainE2eTest : public ::testing::TestWithParam<ModeCase> {};

TEST_P(TrainE2eTest, LocalTrainsExportsAndTheExportScoresTheSame) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e");
  ASSERT_FALSE(dir.path().empty());
  v1::JobSpec spec = ExampleSpec();
  spec.set_consistency(GetParam().consistency);
  spec.set_staleness(GetParam().staleness);
  const std::string spec_path = WriteSpec(spec, dir.path() + "/spec.textproto");
  const std::string model = dir.path() + "/model.safetensors";

  const absl::Time start = absl::Now();
  CommandResult r =
      RunCommand({Tessera(), "local", "--job", spec_path, "--shards", "2", "--workers", "2",
                  "--threads", "1", "--out", model, "--output", "json"},
                 dir.path(), "local", absl::Seconds(240));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  ASSERT_EQ(r.code, 0) << "stderr:\n" << r.err << "\nstdout:\n" << r.out;
  v1::Job job;
  ASSERT_TRUE(ParseJob(LastLine(r.out), &job)) << r.out;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.epochs(), 2);
  EXPECT_EQ(job.spec().consistency(), GetParam().consistency);
  EXPECT_EQ(job.shard_addresses_size(), 2);
  EXPECT_EQ(job.workers_size(), 2);
  EXPECT_GT(job.step(), 0);
  EXPECT_EQ(job.step(), job.total_steps());
  EXPECT_TRUE(job.evaluated());
  EXPECT_GE(job.test_accuracy(), 0.84) << "test loss " << job.test_loss();
  EXPECT_GT(job.samples_per_second(), 0);
  // Every line before the record is one event, in order, and epoch 1's evaluation is among them.
  int64_t last_seq = 0;
  bool saw_evaluation = false;
  for (absl::string_view line : absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
    if (!absl::StartsWith(line, "{\"event\":")) continue;
    v1::JobEvent event;
    std::string body(line.substr(9, line.size() - 10));
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(body, &event).ok()) << line;
    EXPECT_GT(event.seq(), last_seq) << line;
    last_seq = event.seq();
    if (event.evaluated() && event.epoch() == 1) saw_evaluation = true;
  }
  EXPECT_GT(last_seq, 2);
  EXPECT_TRUE(saw_evaluation) << r.out;
  std::printf("[%s] test accuracy %.4f, test loss %.4f, %lld steps, %.0f samples/s, %.1f s\n",
              GetParam().name, job.test_accuracy(), job.test_loss(),
              static_cast<long long>(job.step()), job.samples_per_second(), seconds);

  ASSERT_TRUE(std::filesystem::exists(model)) << r.err;
  const CommandResult score = ScoreFashionExport(model, job.test_accuracy(), dir.path());
  EXPECT_EQ(score.code, 0) << score.out << score.err;
  std::printf("[%s] numpy scorer: %s\n", GetParam().name, LastLine(score.out).c_str());
  EXPECT_NE(score.out.find("\"examples\": 10000"), std::string::npos) << score.out;
  EXPECT_NE(score.out.find("\"tensors\": [\"dense_1\", \"dense_2\", \"dense_3\", \"dense_4\"]"),
            std::string::npos)
      << score.out;
}

INSTANTIATE_TEST_SUITE_P(Modes, TrainE2eTest,
                         ::testing::Values(ModeCase{"Bsp", "bsp", 0}, ModeCase{"Ssp2", "ssp", 2},
                                           ModeCase{"Asp", "asp", 0}),
                         [](const ::testing::TestParamInfo<ModeCase>& info) {
                           return std::string(info.param.name);
                         });

// The BatchNorm CNN example on 2 shards and 2 BSP workers: the moving statistics are averaged on
// the shards, exported with the weights, and numpy scoring the file in evaluation mode (moving
// statistics, not batch ones) reproduces the accuracy the job reported.
TEST(BatchNormE2eTest, CnnWithBatchNormExportsItsStatisticsAndScoresTheSame) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e-bn");
  ASSERT_FALSE(dir.path().empty());
  const std::string model = dir.path() + "/model.safetensors";
  CommandResult r = RunCommand(
      {Tessera(), "local", "--job",
       absl::StrCat(TESSERA_SOURCE_DIR, "/examples/fashion_cnn_bn.textproto"), "--shards", "2",
       "--workers", "2", "--threads", "1", "--out", model, "--output", "json"},
      dir.path(), "local", absl::Seconds(280));
  ASSERT_EQ(r.code, 0) << "stderr:\n" << r.err << "\nstdout:\n" << r.out;
  v1::Job job;
  ASSERT_TRUE(ParseJob(LastLine(r.out), &job)) << r.out;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.epochs(), 2);
  EXPECT_TRUE(job.evaluated());
  EXPECT_GE(job.test_accuracy(), 0.88) << "test loss " << job.test_loss();
  std::printf("[cnn-bn] test accuracy %.4f, test loss %.4f, %lld steps, %.0f samples/s\n",
              job.test_accuracy(), job.test_loss(), static_cast<long long>(job.step()),
              job.samples_per_second());
  ASSERT_TRUE(std::filesystem::exists(model)) << r.err;
  const CommandResult score = ScoreFashionExport(model, job.test_accuracy(), dir.path());
  EXPECT_EQ(score.code, 0) << score.out << score.err;
  std::printf("[cnn-bn] numpy scorer: %s\n", LastLine(score.out).c_str());
  EXPECT_NE(score.out.find("\"examples\": 10000"), std::string::npos) << score.out;
  EXPECT_NE(score.out.find("\"tensors\": [\"conv2d_1\", \"batch_norm_1\", \"conv2d_2\", "
                           "\"batch_norm_2\", \"dense_1\", \"batch_norm_3\", \"dense_2\"]"),
            std::string::npos)
      << score.out;
}

// Workers started with --devices cpu:2 register that device (`tessera cluster` shows it), split
// each batch over two CPU replicas, and train the MLP to the accuracy one device reaches; the
// same workers run the MLP cut into a pipeline of two stages, one per device, just as well.
TEST(CpuReplicasE2eTest, WorkersWithTwoCpuDevicesTrainAsReplicasAndAsAPipeline) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e-replicas");
  std::unique_ptr<LocalCluster> cluster = StartCluster(1, 2, {"--devices", "cpu:2"});
  ASSERT_NE(cluster, nullptr);
  const std::string address = cluster->coordinator_address();
  CommandResult members =
      RunCommand({Tessera(), "cluster", "--coordinator", address}, dir.path(), "cluster");
  ASSERT_EQ(members.code, 0) << members.err;
  int shown = 0;
  for (absl::string_view line : absl::StrSplit(members.out, '\n')) {
    if (absl::StrContains(line, " worker ") && absl::StrContains(line, " cpu:2 ")) ++shown;
  }
  EXPECT_EQ(shown, 2) << members.out;

  v1::JobSpec spec = ExampleSpec();
  spec.set_epochs(1);
  const std::string spec_path = WriteSpec(spec, dir.path() + "/spec.textproto");
  CommandResult r = RunCommand(
      {Tessera(), "submit", spec_path, "--coordinator", address, "--watch", "--output", "json"},
      dir.path(), "submit", absl::Seconds(240));
  ASSERT_EQ(r.code, 0) << "stderr:\n" << r.err << "\nstdout:\n" << r.out;
  v1::Job job;
  ASSERT_TRUE(ParseJob(LastLine(r.out), &job)) << r.out;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.step(), job.total_steps());
  EXPECT_GE(job.test_accuracy(), 0.8) << "test loss " << job.test_loss();
  std::printf("[cpu:2] test accuracy %.4f, %.0f samples/s\n", job.test_accuracy(),
              job.samples_per_second());
  // Each worker trained its rank on the replicas, not on one device.
  int split = 0;
  for (int i = 0; i < 2; ++i) {
    const std::string log = ReadWholeFile(absl::StrCat(cluster->work_dir(), "/worker-", i, ".log"));
    if (absl::StrContains(log, "splits each batch over 2 CPU replicas")) ++split;
  }
  EXPECT_EQ(split, 2);

  spec.mutable_model()->mutable_pipeline()->add_stage_starts("dense_2");
  spec.set_name("fashion-mlp-pipeline");
  const std::string pipelined = WriteSpec(spec, dir.path() + "/pipeline.textproto");
  r = RunCommand(
      {Tessera(), "submit", pipelined, "--coordinator", address, "--watch", "--output", "json"},
      dir.path(), "submit", absl::Seconds(240));
  ASSERT_EQ(r.code, 0) << "stderr:\n" << r.err << "\nstdout:\n" << r.out;
  ASSERT_TRUE(ParseJob(LastLine(r.out), &job)) << r.out;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.step(), job.total_steps());
  EXPECT_GE(job.test_accuracy(), 0.8) << "test loss " << job.test_loss();
  std::printf("[cpu:2 pipeline] test accuracy %.4f, %.0f samples/s\n", job.test_accuracy(),
              job.samples_per_second());
  int staged = 0;
  for (int i = 0; i < 2; ++i) {
    const std::string log = ReadWholeFile(absl::StrCat(cluster->work_dir(), "/worker-", i, ".log"));
    if (absl::StrContains(log, "runs the model as a pipeline of 2 stages on 2 CPU devices")) {
      ++staged;
    }
  }
  EXPECT_EQ(staged, 2);
}

// --- Click logs: a sparse table end to end ---------------------------------------------------

// Generated Criteo data, a click-through example on 2 shards and 2 workers, its export (each
// table as ids and rows, the model spec in the metadata), and numpy scoring the test split from
// the file alone to the reported AUC: the hashed single-table model, DLRM and Wide & Deep.
class CriteoE2eTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CriteoE2eTest, TablesTrainExportAndScoreTheSameInNumpy) {
  ScratchDirectory dir("tessera-e2e-criteo");
  ASSERT_FALSE(dir.path().empty());
  CommandResult gen = RunCommand({Tessera(), "datagen", "criteo", "--rows", "100000", "--test_rows",
                                  "10000", "--out", dir.path() + "/data", "--output", "json"},
                                 dir.path(), "datagen", absl::Seconds(60));
  ASSERT_EQ(gen.code, 0) << gen.err;
  EXPECT_NE(gen.out.find("\"best_test_auc\":"), std::string::npos) << gen.out;
  absl::StatusOr<v1::JobSpec> spec = spec::ReadJobSpecFile(
      absl::StrCat(TESSERA_SOURCE_DIR, "/examples/", GetParam(), ".textproto"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->mutable_dataset()->set_train_path(dir.path() + "/data/train.tsv");
  spec->mutable_dataset()->set_test_path(dir.path() + "/data/test.tsv");
  const std::string spec_path = WriteSpec(*spec, dir.path() + "/spec.textproto");
  const std::string model = dir.path() + "/model.safetensors";
  CommandResult r =
      RunCommand({Tessera(), "local", "--job", spec_path, "--shards", "2", "--workers", "2",
                  "--threads", "1", "--out", model, "--output", "json"},
                 dir.path(), "local", absl::Seconds(240));
  ASSERT_EQ(r.code, 0) << "stderr:\n" << r.err << "\nstdout:\n" << r.out;
  v1::Job job;
  ASSERT_TRUE(ParseJob(LastLine(r.out), &job)) << r.out;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  ASSERT_TRUE(job.has_test_auc()) << r.out;
  // Convergence, within a stated margin of the planted model: one epoch of 10^5 rows, most of the
  // long-tail values seen once or never, comes within 0.1 of its test AUC and log loss.
  const auto planted = [&](const std::string& key) {
    const size_t at = gen.out.find(absl::StrCat("\"", key, "\":"));
    double v = 0;
    EXPECT_NE(at, std::string::npos) << key;
    if (at == std::string::npos) return v;
    const size_t begin = at + key.size() + 3;
    EXPECT_TRUE(
        absl::SimpleAtod(gen.out.substr(begin, gen.out.find_first_of(",}", begin) - begin), &v))
        << gen.out;
    return v;
  };
  const double best_auc = planted("best_test_auc");
  const double best_loss = planted("best_test_log_loss");
  EXPECT_GT(job.test_auc(), best_auc - 0.1) << "planted " << best_auc;
  EXPECT_LT(job.test_loss(), best_loss + 0.1) << "planted " << best_loss;
  std::printf(
      "[%s] test AUC %.4f (planted %.4f), log loss %.4f (planted %.4f), %lld steps, "
      "%.0f samples/s\n",
      GetParam(), job.test_auc(), best_auc, job.test_loss(), best_loss,
      static_cast<long long>(job.step()), job.samples_per_second());
  CommandResult score =
      RunCommand({TESSERA_PYTHON, absl::StrCat(TESSERA_SOURCE_DIR, "/tests/e2e/score_criteo.py"),
                  "--model", model, "--data", dir.path() + "/data/test.tsv", "--expect_auc",
                  absl::StrCat(job.test_auc()), "--tolerance", "0.001"},
                 dir.path(), "score", absl::Seconds(120));
  EXPECT_EQ(score.code, 0) << score.out << score.err;
  std::printf("[%s] numpy scorer: %s\n", GetParam(), LastLine(score.out).c_str());
  EXPECT_NE(score.out.find("\"examples\": 10000"), std::string::npos) << score.out;
}

INSTANTIATE_TEST_SUITE_P(Examples, CriteoE2eTest,
                         ::testing::Values("criteo_hashed", "criteo_dlrm", "criteo_wide_deep"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

// --- Cancel ---------------------------------------------------------------------------------

TEST(ClusterE2eTest, CancelEndsCancelledAndWorkersGoBackToReady) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e");
  std::unique_ptr<LocalCluster> cluster = StartCluster(2, 2);
  ASSERT_NE(cluster, nullptr);
  const std::string address = cluster->coordinator_address();
  std::unique_ptr<CoordinatorClient> client = ClientFor(address);
  ASSERT_NE(client, nullptr);

  const std::string spec_path = WriteSpec(LongSpec(2), dir.path() + "/long.textproto");
  CommandResult submitted =
      RunCommand({Tessera(), "submit", spec_path, "--coordinator", address}, dir.path(), "submit");
  ASSERT_EQ(submitted.code, 0) << submitted.err;
  const std::string id(absl::StripAsciiWhitespace(submitted.out));
  ASSERT_FALSE(id.empty());

  v1::Job running = WaitForJob(client.get(), id, absl::Seconds(60), [](const v1::Job& j) {
    return j.state() == v1::JOB_STATE_RUNNING && j.step() > 0;
  });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  ASSERT_GT(running.step(), 0);

  CommandResult cancel =
      RunCommand({Tessera(), "cancel", id, "--coordinator", address, "--output", "json"},
                 dir.path(), "cancel");
  ASSERT_EQ(cancel.code, 0) << cancel.err;
  v1::Job after;
  ASSERT_TRUE(ParseJob(LastLine(cancel.out), &after)) << cancel.out;
  EXPECT_EQ(after.state(), v1::JOB_STATE_CANCELLED);

  CommandResult get = RunCommand(
      {Tessera(), "get", id, "--coordinator", address, "--output", "json"}, dir.path(), "get");
  ASSERT_EQ(get.code, 0) << get.err;
  v1::Job got;
  ASSERT_TRUE(ParseJob(LastLine(get.out), &got)) << get.out;
  EXPECT_EQ(got.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_LT(got.step(), got.total_steps());

  // The shards dropped the cancelled job's weights: export says so.
  CommandResult exported = RunCommand({Tessera(), "export", id, "--coordinator", address, "--out",
                                       dir.path() + "/cancelled.safetensors"},
                                      dir.path(), "export-cancelled");
  EXPECT_EQ(exported.code, 1) << exported.err;
  EXPECT_NE(exported.err.find("no longer holds job '" + id + "'"), std::string::npos)
      << exported.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/cancelled.safetensors"));

  // `tessera watch` of a cancelled job ends at once with status 1.
  CommandResult watch =
      RunCommand({Tessera(), "watch", id, "--coordinator", address}, dir.path(), "watch");
  EXPECT_EQ(watch.code, 1) << watch.err;
  EXPECT_NE(watch.out.find("CANCELLED"), std::string::npos) << watch.out;

  // Both workers go back to READY.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  int ready = 0;
  std::string last;
  while (absl::Now() < deadline) {
    absl::StatusOr<std::vector<v1::Member>> members = client->ListMembers();
    ASSERT_TRUE(members.ok()) << members.status();
    ready = 0;
    last.clear();
    for (const v1::Member& m : *members) {
      absl::StrAppend(&last, m.id(), "=", v1::MemberState_Name(m.state()), " ");
      if (m.role() == v1::MEMBER_ROLE_WORKER && m.state() == v1::MEMBER_STATE_READY &&
          m.job_id().empty()) {
        ++ready;
      }
    }
    if (ready == 2) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(ready, 2) << last;
  CommandResult members =
      RunCommand({Tessera(), "cluster", "--coordinator", address}, dir.path(), "cluster");
  EXPECT_EQ(members.code, 0);
  std::printf("%s", members.out.c_str());

  const std::vector<pid_t> pids = cluster->live_pids();
  EXPECT_EQ(pids.size(), 5u);
  EXPECT_TRUE(cluster->Stop(absl::Seconds(15)).ok());
  for (pid_t pid : pids) EXPECT_FALSE(Exists(pid)) << pid;
}

// `tessera local` stopped by `tessera cancel` (exit 1) and by SIGINT (exit 130): the job ends
// CANCELLED and none of its children is left.
TEST(ClusterE2eTest, LocalLeavesNoProcessBehind) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e");
  const std::string spec_path = WriteSpec(LongSpec(2), dir.path() + "/long.textproto");
  for (const bool by_signal : {false, true}) {
    SCOPED_TRACE(by_signal ? "SIGINT" : "tessera cancel");
    ChildProcess local = testlib::SpawnChild(
        {Tessera(), "local", "--job", spec_path, "--threads", "1", "--output", "json"}, dir.path(),
        by_signal ? "local-sigint" : "local-cancel", InheritAll());
    // Progress goes to stderr with --output json; wait for the job's id and address there.
    std::string address, id, work_dir;
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline && id.empty()) {
      const std::string err = ReadWholeFile(local.stderr_path());
      for (absl::string_view line : absl::StrSplit(err, '\n')) {
        if (absl::ConsumePrefix(&line, "tessera local: coordinator ")) {
          address = std::string(line.substr(0, line.find(',')));
          const size_t logs = line.find("logs in ");
          if (logs != absl::string_view::npos) work_dir = std::string(line.substr(logs + 8));
        }
        if (absl::ConsumePrefix(&line, "tessera local: job ")) {
          id = std::string(line.substr(0, line.find(' ')));
        }
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_FALSE(id.empty()) << ReadWholeFile(local.stderr_path());
    ASSERT_FALSE(address.empty());
    ASSERT_FALSE(work_dir.empty());
    EXPECT_TRUE(std::filesystem::exists(work_dir)) << work_dir;
    std::unique_ptr<CoordinatorClient> client = ClientFor(address);
    ASSERT_NE(client, nullptr);
    v1::Job running = WaitForJob(client.get(), id, absl::Seconds(60), [](const v1::Job& j) {
      return j.state() == v1::JOB_STATE_RUNNING && j.step() > 0;
    });
    ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << ReadWholeFile(local.stderr_path());

    const std::vector<pid_t> children = ChildrenOf(local.pid());
    EXPECT_EQ(children.size(), 5u) << "coordinator, 2 shards, 2 workers";

    int code = 0;
    if (by_signal) {
      kill(local.pid(), SIGINT);
      code = WaitChild(&local, absl::Seconds(60));
      EXPECT_EQ(code, 130) << ReadWholeFile(local.stderr_path());
    } else {
      CommandResult cancel =
          RunCommand({Tessera(), "cancel", id, "--coordinator", address}, dir.path(), "cancel");
      EXPECT_EQ(cancel.code, 0) << cancel.err;
      code = WaitChild(&local, absl::Seconds(60));
      EXPECT_EQ(code, 1) << ReadWholeFile(local.stderr_path());
    }
    v1::Job last;
    ASSERT_TRUE(ParseJob(LastLine(ReadWholeFile(local.stdout_path())), &last))
        << ReadWholeFile(local.stdout_path()) << ReadWholeFile(local.stderr_path());
    EXPECT_EQ(last.id(), id);
    EXPECT_EQ(last.state(), v1::JOB_STATE_CANCELLED);

    const std::vector<pid_t> left = StillThere(children, absl::Seconds(5));
    EXPECT_TRUE(left.empty()) << "left behind: " << absl::StrJoin(left, ", ");
    EXPECT_FALSE(std::filesystem::exists(work_dir)) << work_dir;
  }
}

// --- Validation -----------------------------------------------------------------------------

TEST(ClusterE2eTest, BadSpecsAreRefusedAndTheCoordinatorServesOn) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e");
  std::unique_ptr<LocalCluster> cluster = StartCluster(1, 1);
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<CoordinatorClient> client = ClientFor(cluster->coordinator_address());
  ASSERT_NE(client, nullptr);

  struct BadSpec {
    std::string what;
    v1::JobSpec spec;
    std::string field;  // the message must start with this
  };
  std::vector<BadSpec> cases;
  {
    v1::JobSpec s = ExampleSpec();
    s.set_num_workers(1);
    // A layer kind this coordinator does not know: what a newer client's layer looks like.
    v1::Layer* layer = s.mutable_model()->mutable_layers(1);
    layer->Clear();
    layer->GetReflection()->MutableUnknownFields(layer)->AddLengthDelimited(99, "");
    cases.push_back({"unknown layer", s, "model.layers[1]"});
  }
  {
    v1::JobSpec s = ExampleSpec();
    s.set_num_workers(1);
    v1::ModelSpec* m = s.mutable_model();
    m->clear_input_shape();
    m->add_input_shape(1);
    m->add_input_shape(28);
    m->add_input_shape(28);
    m->mutable_layers(0)->clear_dense();
    v1::Conv2D* conv = m->mutable_layers(0)->mutable_conv2d();
    conv->set_filters(4);
    conv->set_kernel_h(40);
    conv->set_kernel_w(40);
    cases.push_back({"impossible shapes", s, "model.layers[0]"});
  }
  {
    v1::JobSpec s = ExampleSpec();
    s.set_num_workers(1);
    s.mutable_dataset()->set_train_images("/nonexistent/train-images-idx3-ubyte.gz");
    cases.push_back({"missing dataset file", s, "dataset.train_images"});
  }
  {
    v1::JobSpec s = ExampleSpec();
    s.set_num_workers(0);
    cases.push_back({"num_workers 0", s, "num_workers"});
  }
  // Issue #16: only files under the coordinator's --dataset_root (by default /usr/share/datasets
  // and its data directory), whatever ".." says.
  for (const char* path : {"/etc/passwd", "/usr/share/datasets/../../../etc/passwd"}) {
    v1::JobSpec s = ExampleSpec();
    s.set_num_workers(1);
    s.mutable_dataset()->set_train_images(path);
    cases.push_back(
        {path, s, absl::StrCat("dataset.train_images: ", path, " is outside the dataset folders")});
  }
  {
    v1::JobSpec s = ExampleSpec();
    s.set_num_workers(1);
    s.set_consistency("eventual");
    cases.push_back({"unknown consistency", s, "consistency"});
  }
  for (const BadSpec& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<v1::Job> job = client->CreateJob(c.spec);
    ASSERT_FALSE(job.ok()) << "accepted as " << job->id();
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
    // The client puts "<address>: " in front of the coordinator's message.
    EXPECT_TRUE(absl::StrContains(job.status().message(),
                                  absl::StrCat(cluster->coordinator_address(), ": ", c.field)))
        << job.status();
  }
  absl::StatusOr<std::vector<v1::Job>> jobs = client->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_TRUE(jobs->empty()) << "a refused spec was queued";

  // Through the CLI: refused locally (exit 64, nothing sent) or by the coordinator (the dataset
  // files are checked where they live).
  const std::string address = cluster->coordinator_address();
  CommandResult local_refusal = RunCommand(
      {Tessera(), "submit", WriteSpec(cases[3].spec, dir.path() + "/w0"), "--coordinator", address},
      dir.path(), "submit-w0");
  EXPECT_EQ(local_refusal.code, 64);
  EXPECT_NE(local_refusal.err.find("num_workers: must be in [1, 1024], got 0"), std::string::npos)
      << local_refusal.err;
  CommandResult remote_refusal = RunCommand(
      {Tessera(), "submit", WriteSpec(cases[2].spec, dir.path() + "/nf"), "--coordinator", address},
      dir.path(), "submit-nf");
  EXPECT_EQ(remote_refusal.code, 64);
  EXPECT_NE(remote_refusal.err.find("dataset.train_images"), std::string::npos)
      << remote_refusal.err;

  // The coordinator still serves: a valid job runs to the end.
  v1::JobSpec good = ExampleSpec();
  good.set_num_workers(1);
  good.set_epochs(0);
  good.set_max_steps(20);
  absl::StatusOr<v1::Job> job = client->CreateJob(good);
  ASSERT_TRUE(job.ok()) << job.status();
  CommandResult watch =
      RunCommand({Tessera(), "watch", job->id(), "--coordinator", address, "--output", "json"},
                 dir.path(), "watch", absl::Seconds(120));
  EXPECT_EQ(watch.code, 0) << watch.err;
  v1::Job done;
  ASSERT_TRUE(ParseJob(LastLine(watch.out), &done)) << watch.out;
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.step(), 20);
  EXPECT_TRUE(cluster->Stop(absl::Seconds(15)).ok());
}

// --- Recovery -------------------------------------------------------------------------------

TEST(ClusterE2eTest, ListShowsEveryJobAfterTheCoordinatorIsKilledAndRestarted) {
  TESSERA_SKIP_WITHOUT_FASHION_MNIST();
  ScratchDirectory dir("tessera-e2e");
  std::unique_ptr<LocalCluster> cluster = StartCluster(1, 1);
  ASSERT_NE(cluster, nullptr);
  const std::string address = cluster->coordinator_address();
  std::unique_ptr<CoordinatorClient> client = ClientFor(address);
  ASSERT_NE(client, nullptr);

  // SUCCEEDED: a short job.
  v1::JobSpec short_spec = ExampleSpec();
  short_spec.set_name("short");
  short_spec.set_num_workers(1);
  short_spec.set_epochs(0);
  short_spec.set_max_steps(10);
  absl::StatusOr<v1::Job> done = client->CreateJob(short_spec);
  ASSERT_TRUE(done.ok()) << done.status();
  v1::Job finished = WaitForJob(client.get(), done->id(), absl::Seconds(90),
                                [](const v1::Job& j) { return cli::IsTerminal(j.state()); });
  ASSERT_EQ(finished.state(), v1::JOB_STATE_SUCCEEDED) << finished.reason();
  // CANCELLED: a long job, cancelled while it runs.
  absl::StatusOr<v1::Job> cancelled = client->CreateJob(LongSpec(1));
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  v1::Job running = WaitForJob(client.get(), cancelled->id(), absl::Seconds(60),
                               [](const v1::Job& j) { return j.step() > 0; });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << running.reason();
  ASSERT_TRUE(client->CancelJob(cancelled->id()).ok());
  // PENDING: needs two workers, and the cluster has one.
  v1::JobSpec pending_spec = ExampleSpec();
  pending_spec.set_name("pending");
  pending_spec.set_num_workers(2);
  absl::StatusOr<v1::Job> pending = client->CreateJob(pending_spec);
  ASSERT_TRUE(pending.ok()) << pending.status();
  v1::Job waiting = WaitForJob(client.get(), pending->id(), absl::Seconds(10),
                               [](const v1::Job& j) { return !j.reason().empty(); });
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  CommandResult get = RunCommand({Tessera(), "get", pending->id(), "--coordinator", address},
                                 dir.path(), "get-pending");
  EXPECT_EQ(get.code, 0) << get.err;
  EXPECT_NE(get.out.find("state:      PENDING\nreason:     waiting for 2 idle workers"),
            std::string::npos)
      << get.out;

  auto list = [&](const char* tag) {
    std::map<std::string, v1::JobState> states;
    CommandResult r = RunCommand({Tessera(), "list", "--coordinator", address, "--output", "json"},
                                 dir.path(), tag);
    EXPECT_EQ(r.code, 0) << r.err;
    v1::ListJobsResponse parsed;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(LastLine(r.out), &parsed, options).ok())
        << r.out;
    for (const v1::Job& j : parsed.jobs()) states[j.id()] = j.state();
    return states;
  };
  const std::map<std::string, v1::JobState> before = list("list-before");
  const std::map<std::string, v1::JobState> expected = {{done->id(), v1::JOB_STATE_SUCCEEDED},
                                                        {cancelled->id(), v1::JOB_STATE_CANCELLED},
                                                        {pending->id(), v1::JOB_STATE_PENDING}};
  EXPECT_EQ(before, expected);

  ASSERT_TRUE(cluster->KillCoordinator().ok());
  CommandResult unreachable =
      RunCommand({Tessera(), "list", "--coordinator", address}, dir.path(), "list-down");
  EXPECT_EQ(unreachable.code, 69);
  EXPECT_NE(unreachable.err.find(address), std::string::npos) << unreachable.err;

  ASSERT_TRUE(cluster->RestartCoordinator().ok());
  EXPECT_EQ(list("list-after"), expected);
  CommandResult text =
      RunCommand({Tessera(), "list", "--coordinator", address}, dir.path(), "list-text");
  EXPECT_EQ(text.code, 0);
  std::printf("%s", text.out.c_str());
  cluster->Stop(absl::Seconds(15)).IgnoreError();
}

}  // namespace
}  // namespace tessera
