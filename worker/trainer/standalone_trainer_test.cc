#include "worker/trainer/standalone_trainer.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/testing/example_jobs.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;

// Three Gaussian blobs in 2-D (class k centred at angle 2 pi k / 3, radius 3), as CSV with the
// label first. The split is deterministic.
class BlobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_trainer_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    spec::examples::WriteBlobsCsv(dir_ + "/train.csv", 600, 1);
    spec::examples::WriteBlobsCsv(dir_ + "/test.csv", 300, 2);
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }

  v1::JobSpec Spec(const std::string& optimizer = "kind: OPTIMIZER_KIND_ADAM learning_rate: 0.01") {
    v1::JobSpec spec;
    const std::string text = absl::StrCat(spec::examples::BlobsJobText(dir_, 16), R"(
      optimizer { )",
                                          optimizer, R"( }
      batch_size: 32
      epochs: 5
      seed: 7
    )");
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec));
    return spec;
  }

  static std::unique_ptr<StandaloneTrainer> Make(TrainerOptions options) {
    options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<StandaloneTrainer>> t =
        StandaloneTrainer::Create(std::move(options));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }

  // All trainable values of the model, in parameter order.
  static std::vector<float> Weights(const StandaloneTrainer& t, bool grads = false) {
    std::vector<float> all;
    for (const engine::Parameter& p : t.model().parameters()) {
      if (!p.trainable) continue;
      std::vector<float> v;
      EXPECT_TRUE(
          (grads ? t.model().CopyGradToHost(p.name, &v) : t.model().CopyValueToHost(p.name, &v))
              .ok());
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }

  std::string dir_;
};

TEST_F(BlobsTest, LearnsTheBlobsAndReportsEveryEpoch) {
  TrainerOptions options;
  options.spec = Spec();
  int step_reports = 0, epoch_reports = 0;
  options.on_progress = [&](const Progress& p) {
    if (p.epoch_end) {
      ++epoch_reports;
      EXPECT_TRUE(p.evaluated);
    } else {
      ++step_reports;
      EXPECT_EQ(p.steps_per_epoch, 19);  // ceil(600 / 32)
      EXPECT_EQ(p.total_steps, 95);
    }
  };
  auto t = Make(options);
  ASSERT_NE(t, nullptr);
  absl::StatusOr<TrainResult> r = t->Run();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device, "cpu");
  EXPECT_EQ(r->epochs, 5);
  EXPECT_EQ(r->steps, 95);
  EXPECT_EQ(r->train_samples, 3000);
  EXPECT_EQ(step_reports, 95);
  EXPECT_EQ(epoch_reports, 5);
  ASSERT_EQ(r->history.size(), 5u);
  EXPECT_TRUE(r->evaluated);
  EXPECT_GT(r->test_accuracy, 0.95);
  EXPECT_LT(r->history.back().train_loss, r->history.front().train_loss);
  EXPECT_EQ(r->test_accuracy, r->history.back().test_accuracy);
  EXPECT_GT(r->samples_per_second, 0);

  // A second Run() is refused; Evaluate() still scores the trained weights.
  EXPECT_EQ(t->Run().status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<internal::SplitScore> eval = t->Evaluate();
  ASSERT_TRUE(eval.ok());
  EXPECT_EQ(eval->result.examples, 300);
  EXPECT_DOUBLE_EQ(static_cast<double>(eval->result.correct) / 300, r->test_accuracy);
  EXPECT_FALSE(eval->auc.has_value()) << "three classes: no AUC";
  EXPECT_FALSE(r->test_auc.has_value());
}

TEST_F(BlobsTest, SameSeedSameRunOtherSeedOtherRun) {
  auto run = [&](uint64_t seed) {
    TrainerOptions options;
    options.spec = Spec();
    options.spec.set_seed(seed);
    options.spec.set_epochs(2);
    auto t = Make(options);
    absl::StatusOr<TrainResult> r = t->Run();
    EXPECT_TRUE(r.ok()) << r.status();
    return std::make_pair(r->history.back().train_loss, Weights(*t));
  };
  const auto a = run(7);
  const auto b = run(7);
  const auto c = run(8);
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(a.second, b.second);
  EXPECT_NE(a.second, c.second);
}

TEST_F(BlobsTest, SgdStepIsTheOptimizerFormulaWithWarmupAndMaxSteps) {
  TrainerOptions options;
  options.spec = Spec("kind: OPTIMIZER_KIND_SGD learning_rate: 0.5");
  options.spec.set_max_steps(1);
  options.spec.mutable_schedule()->set_warmup_steps(4);  // first update uses lr * 1/4
  auto t = Make(options);
  const std::vector<float> before = Weights(*t);
  absl::StatusOr<TrainResult> r = t->Run();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->steps, 1);
  EXPECT_EQ(r->epochs, 1);
  EXPECT_EQ(r->train_samples, 32);
  const std::vector<float> after = Weights(*t);
  const std::vector<float> grad = Weights(*t, /*grads=*/true);
  ASSERT_EQ(before.size(), after.size());
  double grad_norm = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_FLOAT_EQ(after[i], before[i] - 0.125f * grad[i]) << i;
    grad_norm += double(grad[i]) * grad[i];
  }
  EXPECT_GT(grad_norm, 0);
}

TEST_F(BlobsTest, ClippingBoundsTheUpdateNorm) {
  TrainerOptions options;
  options.spec = Spec("kind: OPTIMIZER_KIND_SGD learning_rate: 0.5");
  options.spec.set_max_steps(1);
  options.spec.mutable_clipping()->set_max_global_norm(0.01f);
  auto t = Make(options);
  const std::vector<float> before = Weights(*t);
  ASSERT_TRUE(t->Run().ok());
  const std::vector<float> after = Weights(*t);
  const std::vector<float> grad = Weights(*t, true);
  double update = 0, g = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    update += (double(after[i]) - before[i]) * (double(after[i]) - before[i]);
    g += double(grad[i]) * grad[i];
  }
  ASSERT_GT(std::sqrt(g), 0.01);  // the clip is active
  EXPECT_NEAR(std::sqrt(update), 0.5 * 0.01, 1e-5);
}

TEST_F(BlobsTest, TargetAccuracyStopsEarlyAndEpochOverrideWins) {
  TrainerOptions options;
  options.spec = Spec();
  options.epochs = 50;
  options.target_accuracy = 0.5;
  auto t = Make(options);
  absl::StatusOr<TrainResult> r = t->Run();
  ASSERT_TRUE(r.ok());
  EXPECT_LT(r->epochs, 50);
  EXPECT_GE(r->test_accuracy, 0.5);
  // Only the last evaluation reached the target.
  for (size_t i = 0; i + 1 < r->history.size(); ++i) EXPECT_LT(r->history[i].test_accuracy, 0.5);
}

TEST_F(BlobsTest, DataThatDoesNotFitTheModelIsRefused) {
  TrainerOptions options;
  options.spec = Spec();
  options.spec.mutable_model()->set_input_shape(0, 3);
  absl::StatusOr<std::unique_ptr<StandaloneTrainer>> t = StandaloneTrainer::Create(options);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("model.input_shape: [3] takes 3 features but the training data has 2"));
}

TEST_F(BlobsTest, BadSpecAndBadDataAreErrors) {
  TrainerOptions options;
  options.spec = Spec();
  options.spec.mutable_dataset()->set_train_path(dir_ + "/missing.csv");
  absl::StatusOr<std::unique_ptr<StandaloneTrainer>> t = StandaloneTrainer::Create(options);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("dataset.train_path: file not found: " + dir_ + "/missing.csv"));

  std::ofstream(dir_ + "/bad.csv") << "0,1,2\n1,x,3\n";
  options.spec = Spec();
  options.spec.mutable_dataset()->set_test_path(dir_ + "/bad.csv");
  t = StandaloneTrainer::Create(options);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("bad.csv:2, column 2"));

  options.spec = Spec();
  options.device = "tpu";
  EXPECT_THAT(std::string(StandaloneTrainer::Create(options).status().message()),
              HasSubstr("device: must be"));
}

TEST_F(BlobsTest, MaxStepsNeedingMoreEpochsThanAnIntIsRefused) {
  TrainerOptions options;
  options.spec = Spec();
  options.spec.set_epochs(0);
  options.spec.set_max_steps(INT64_MAX);
  auto t = Make(options);
  ASSERT_NE(t, nullptr);
  absl::StatusOr<TrainResult> r = t->Run();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("max_steps: 9223372036854775807 steps of 19 per epoch take"));
}

TEST_F(BlobsTest, BatchesThatCannotFitAreRefusedAtCreate) {
  // The largest batch is the evaluation's: min(1000, 300 test examples).
  TrainerOptions options;
  options.spec = Spec();
  options.memory_limit_bytes = 64 << 10;
  absl::StatusOr<std::unique_ptr<StandaloneTrainer>> t = StandaloneTrainer::Create(options);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("batch_size: a batch of 300 needs"));
  options.spec.mutable_eval()->set_batch_size(10);
  t = StandaloneTrainer::Create(options);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE((*t)->Run().ok());
}

TEST_F(BlobsTest, JsonHoldsTheRequiredFields) {
  TrainerOptions options;
  options.spec = Spec();
  options.spec.set_epochs(1);
  auto t = Make(options);
  absl::StatusOr<TrainResult> r = t->Run();
  ASSERT_TRUE(r.ok());
  const std::string json = TrainResultJson(*r, options.spec);
  for (const char* key : {"\"test_accuracy\":", "\"test_loss\":", "\"epochs\":1,", "\"steps\":19,",
                          "\"samples_per_second\":", "\"device\":\"cpu\"", "\"job\":\"blobs\"",
                          "\"history\":[{\"epoch\":1,"}) {
    EXPECT_THAT(json, HasSubstr(key));
  }
  EXPECT_EQ(json.find('\n'), std::string::npos);
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
}

// No --threads: the first steps measure the default against 1 thread, and the run says which it
// kept, once; the same run with the count given says nothing.
TEST_F(BlobsTest, WithoutAThreadCountTheFirstStepsChooseItAndSayWhich) {
  // On a thread of its own: OpenMP keeps the thread count per thread, and the other tests set
  // this one's to 1.
  std::vector<std::string> notes;
  int available = 0, chosen = 0;
  absl::StatusOr<TrainResult> r = absl::UnknownError("not run");
  std::thread([&] {
    kernels::BackendOptions o;
    o.device = kernels::DeviceChoice::kCpu;
    auto probe = kernels::CreateBackend(o);
    if (!probe.ok()) return;
    available = (*probe)->Threads();
    if (available < 2) return;
    TrainerOptions options;
    options.spec = Spec();
    options.on_note = [&notes](const std::string& line) { notes.push_back(line); };
    absl::StatusOr<std::unique_ptr<StandaloneTrainer>> tuned = StandaloneTrainer::Create(options);
    if (!tuned.ok()) {
      r = tuned.status();
      return;
    }
    r = (*tuned)->Run();
    chosen = (*tuned)->backend().Threads();
  }).join();
  if (available < 2) GTEST_SKIP() << "one CPU thread: nothing to choose from";
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->steps, 95);
  EXPECT_GT(r->test_accuracy, 0.9);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0],
              ::testing::MatchesRegex(
                  "threads: [0-9]+ of [0-9]+, measured on the first 16 steps: .* ms a "
                  "step with 1 thread, .* ms with [0-9]+ \\(--threads sets the count\\)"));
  EXPECT_TRUE(chosen == 1 || chosen == available) << chosen;
  // With the count given there is nothing to choose and nothing to say.
  notes.clear();
  TrainerOptions given;
  given.spec = Spec();
  given.on_note = [&notes](const std::string& line) { notes.push_back(line); };
  auto t = Make(given);  // --threads 1
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->Run().ok());
  EXPECT_TRUE(notes.empty());
}

TEST(ProgressPrinterTest, PlainLinesAtEveryTenthAndAtEpochEnd) {
  std::FILE* f = std::tmpfile();
  ProgressPrinter printer(f, /*terminal=*/false);
  Progress p;
  p.epoch = 1;
  p.epochs = 1;
  p.steps_per_epoch = 100;
  p.total_steps = 100;
  for (int s = 1; s <= 100; ++s) {
    p.step_in_epoch = p.step = s;
    printer.Report(p);
  }
  p.epoch_end = true;
  p.evaluated = true;
  p.test_accuracy = 0.875;
  printer.Report(p);
  printer.Finish();
  std::rewind(f);
  std::string text;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, got);
  std::fclose(f);
  int lines = 0;
  for (char c : text) lines += c == '\n';
  EXPECT_EQ(lines, 10);  // steps 10, 20, ..., 90, then the epoch line
  EXPECT_THAT(text, HasSubstr("epoch 1/1 step 50/100"));
  EXPECT_THAT(text, HasSubstr("test loss 0.0000 acc 0.8750"));
  EXPECT_EQ(text.find('\r'), std::string::npos);
}

TEST(ProgressPrinterTest, DurationFormat) {
  EXPECT_EQ(FormatDuration(65), "1:05");
  EXPECT_EQ(FormatDuration(3 * 3600 + 61), "3:01:01");
  EXPECT_EQ(FormatDuration(-1), "?");
}

// A hashed table standalone: the rows live in the trainer's row table, created only for the ids
// a batch touched, and the model holds only the last batch's rows.
TEST_F(BlobsTest, HashedEmbeddingsKeepOnlyTouchedRows) {
  spec::examples::WriteHashedLibsvm(dir_ + "/train.svm", 2000, 5);
  spec::examples::WriteHashedLibsvm(dir_ + "/test.svm", 200, 6);
  TrainerOptions options;
  const std::string text = absl::StrCat(spec::examples::HashedJobText(dir_), R"pb(
    optimizer { kind: OPTIMIZER_KIND_ADAGRAD learning_rate: 0.2 }
    batch_size: 16
    epochs: 3
    seed: 11
  )pb");
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &options.spec));
  std::unique_ptr<StandaloneTrainer> t = Make(options);
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->tables().size(), 1u);
  EXPECT_EQ(t->tables()[0].size(), 0);
  absl::StatusOr<TrainResult> r = t->Run();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->test_accuracy, 0.85);
  // A binary task: the AUC of the whole test split, recomputed here from the model's outputs.
  ASSERT_TRUE(r->test_auc.has_value());
  EXPECT_GT(*r->test_auc, 0.9);
  EXPECT_THAT(TrainResultJson(*r, options.spec), HasSubstr(absl::StrCat("\"test_auc\":")));
  // The training split's distinct ids, each a row now; evaluation created none.
  std::set<int64_t> train_ids;
  std::ifstream in(dir_ + "/train.svm");
  std::string token;
  while (in >> token) {
    const size_t colon = token.find(':');
    if (colon != std::string::npos) train_ids.insert(std::stoll(token.substr(0, colon)));
  }
  EXPECT_EQ(t->tables()[0].size(), static_cast<int64_t>(train_ids.size()));
  std::set<int64_t> held;
  for (const auto& [id, row] : t->tables()[0].rows()) held.insert(id);
  EXPECT_EQ(held, train_ids);
  // The model's copy: the last evaluation batch's rows only (at most 6 per example).
  const engine::Parameter* table = t->model().FindParameter("embedding_bag_1/embeddings");
  ASSERT_NE(table, nullptr);
  std::set<int64_t> test_ids;  // the last evaluation batch is the whole test split
  std::ifstream test_in(dir_ + "/test.svm");
  while (test_in >> token) {
    const size_t colon = token.find(':');
    if (colon != std::string::npos) test_ids.insert(std::stoll(token.substr(0, colon)));
  }
  EXPECT_EQ(table->shape[0], static_cast<int64_t>(test_ids.size()));
}

}  // namespace
}  // namespace tessera::trainer
