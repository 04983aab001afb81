#include "spec/job_spec.h"

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "spec/job_spec_reader.h"
#include "spec/pipeline_spec.h"
#include "spec/testing/example_models.h"

namespace tessera::spec {
namespace {

using ::testing::HasSubstr;

std::string Example(const char* name) {
  return absl::StrCat(TESSERA_SOURCE_DIR, "/examples/", name);
}

v1::JobSpec Mlp() {
  absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile(Example("fashion_mlp.textproto"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

TEST(JobSpecTest, ExamplesParseAndValidate) {
  for (const char* name : {"fashion_mlp.textproto", "fashion_cnn.textproto",
                           "fashion_cnn_bn.textproto", "fashion_cnn_pipeline.textproto"}) {
    absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile(Example(name));
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
    EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << name << ": " << ValidateJobSpec(*spec);
    EXPECT_EQ(spec->batch_size(), 64);
    EXPECT_EQ(spec->optimizer().kind(), v1::OPTIMIZER_KIND_ADAM);
    EXPECT_EQ(spec->dataset().num_classes(), 10);
    // Distributed too: the coordinator refuses at submission what the workers could not run.
    ValidateOptions distributed;
    distributed.distributed = true;
    EXPECT_TRUE(ValidateJobSpec(*spec, distributed).ok())
        << name << ": " << ValidateJobSpec(*spec, distributed);
  }
  // The pipelined CNN is the CNN with a cut.
  absl::StatusOr<v1::JobSpec> pipelined =
      ReadJobSpecFile(Example("fashion_cnn_pipeline.textproto"));
  ASSERT_TRUE(pipelined.ok()) << pipelined.status();
  EXPECT_EQ(PipelineStageCount(pipelined->model()), 2);
  v1::ModelSpec unsplit = pipelined->model();
  unsplit.clear_pipeline();
  v1::ModelSpec cnn;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(examples::kFashionCnn, &cnn));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(unsplit, cnn));
  // The click-log example: its data is generated (tessera datagen), so files are not checked.
  absl::StatusOr<v1::JobSpec> ctr = ReadJobSpecFile(Example("criteo_hashed.textproto"));
  ASSERT_TRUE(ctr.ok()) << ctr.status();
  ValidateOptions no_files;
  no_files.check_files = false;
  no_files.distributed = true;
  EXPECT_TRUE(ValidateJobSpec(*ctr, no_files).ok()) << ValidateJobSpec(*ctr, no_files);
  // Criteo data needs a hashed table and takes no normalization.
  v1::JobSpec bounded = *ctr;
  bounded.mutable_model()->mutable_layers(0)->mutable_embedding_bag()->set_num_rows(1000);
  EXPECT_THAT(std::string(ValidateJobSpec(bounded, no_files).message()),
              HasSubstr("model.layers[0] (embedding_bag_1): embedding_bag.num_rows must be 0"));
  v1::JobSpec normalized = *ctr;
  normalized.mutable_dataset()->mutable_normalization()->set_divide_by(2);
  EXPECT_THAT(std::string(ValidateJobSpec(normalized, no_files).message()),
              HasSubstr("dataset.normalization: FORMAT_CRITEO values are log(1 + x)"));
  v1::JobSpec dense_model = *ctr;
  dense_model.mutable_model()->mutable_layers()->erase(
      dense_model.mutable_model()->mutable_layers()->begin());
  dense_model.mutable_model()->add_input_shape(16);
  EXPECT_THAT(std::string(ValidateJobSpec(dense_model, no_files).message()),
              HasSubstr("dataset.format: FORMAT_CRITEO examples are sparse"));

  // The multi-input examples, and what their data must give them.
  for (const char* name : {"criteo_dlrm.textproto", "criteo_wide_deep.textproto"}) {
    absl::StatusOr<v1::JobSpec> multi = ReadJobSpecFile(Example(name));
    ASSERT_TRUE(multi.ok()) << name << ": " << multi.status();
    EXPECT_TRUE(ValidateJobSpec(*multi, no_files).ok())
        << name << ": " << ValidateJobSpec(*multi, no_files);
    EXPECT_EQ(multi->model().sparse_features_size(), 26) << name;
    v1::JobSpec fewer = *multi;
    fewer.mutable_model()->mutable_sparse_features()->RemoveLast();
    EXPECT_THAT(std::string(ValidateJobSpec(fewer, no_files).message()),
                HasSubstr("model.sparse_features: FORMAT_CRITEO rows have 26 categorical fields, "
                          "one sparse feature each; the model has 25"));
    v1::JobSpec dense12 = *multi;
    dense12.mutable_model()->set_dense_features(12);
    const std::string dense12_message(ValidateJobSpec(dense12, no_files).message());
    EXPECT_THAT(dense12_message, HasSubstr("dense_features")) << name;
    v1::JobSpec libsvm = *multi;
    libsvm.mutable_dataset()->set_format(v1::DatasetSpec::FORMAT_LIBSVM);
    EXPECT_THAT(std::string(ValidateJobSpec(libsvm, no_files).message()),
                HasSubstr("dataset.format: a multi-input model (model.tables) reads dense features "
                          "and categorical fields, which FORMAT_CRITEO data has"));
    v1::JobSpec momentum = *multi;
    momentum.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
    EXPECT_THAT(std::string(ValidateJobSpec(momentum, no_files).message()),
                HasSubstr("(the model's tables are sparse tables)"));
  }

  v1::JobSpec mlp = Mlp();
  ASSERT_EQ(mlp.model().layers_size(), 7);
  EXPECT_EQ(mlp.model().layers(0).dense().units(), 256);
  EXPECT_EQ(mlp.model().layers(2).dense().units(), 128);
  EXPECT_EQ(mlp.model().layers(4).dense().units(), 100);
  EXPECT_EQ(mlp.model().layers(6).dense().units(), 10);
}

// The engine's tests and benchmarks use copies of the examples' models: keep them the same.
TEST(JobSpecTest, ExampleModelsMatchTheEngineTestCopies) {
  const std::pair<const char*, const char*> cases[] = {
      {"fashion_mlp.textproto", examples::kFashionMlp},
      {"fashion_cnn.textproto", examples::kFashionCnn},
      {"fashion_cnn_bn.textproto", examples::kFashionCnnBn}};
  for (const auto& [file, text] : cases) {
    absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile(Example(file));
    ASSERT_TRUE(spec.ok()) << file << ": " << spec.status();
    v1::ModelSpec copy;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &copy)) << file;
    std::string diff;
    google::protobuf::util::MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&diff);
    EXPECT_TRUE(differencer.Compare(copy, spec->model())) << file << ": " << diff;
  }
}

TEST(JobSpecTest, JsonAndTextprotoGiveTheSameSpec) {
  const v1::JobSpec mlp = Mlp();
  std::string json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(mlp, &json).ok());
  absl::StatusOr<v1::JobSpec> parsed = ParseJobSpec(absl::StrCat("\n  ", json), "spec.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(mlp, *parsed));
}

TEST(JobSpecTest, TextprotoErrorsGiveLineAndColumn) {
  absl::StatusOr<v1::JobSpec> bad = ParseJobSpec("name: \"x\"\nbatch_size: abc\n", "job.txt");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("job.txt:2:13: "));
  absl::StatusOr<v1::JobSpec> unknown = ParseJobSpec("name: \"x\"\n\n  bogus: 1\n", "job.txt");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("job.txt:3:"));
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("bogus"));
}

TEST(JobSpecTest, JsonErrorsNameTheSourceAndPlace) {
  absl::StatusOr<v1::JobSpec> bad =
      ParseJobSpec("{\n  \"name\": \"x\",\n  \"batchSize\": [1]\n}\n", "job.json");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("job.json"));
  absl::StatusOr<v1::JobSpec> syntax =
      ParseJobSpec("{\n  \"name\": \"x\",\n  \"batchSize\": x1\n}\n", "j.json");
  EXPECT_EQ(syntax.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(syntax.status().message()),
              HasSubstr("j.json:3:16: invalid JSON job spec: Unexpected token."));
  absl::StatusOr<v1::JobSpec> unknown = ParseJobSpec("{\"bogus\": 1}", "u.json");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("bogus"));
}

TEST(JobSpecTest, MissingFileIsNotFound) {
  absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile("/nonexistent/job.textproto");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("/nonexistent/job.textproto"));
}

TEST(JobSpecTest, DirectoryIsNotASpec) {
  // A directory opens as an empty stream; it must not parse as an empty spec.
  absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile("/tmp");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("job spec file is not a regular file: /tmp"));
}

struct BadSpec {
  const char* what;
  std::function<void(v1::JobSpec*)> mutate;
  const char* message;
};

class ValidateJobSpecTest : public ::testing::TestWithParam<BadSpec> {};

TEST_P(ValidateJobSpecTest, NamesTheField) {
  v1::JobSpec spec = Mlp();
  GetParam().mutate(&spec);
  const absl::Status status = ValidateJobSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateJobSpecTest,
    ::testing::Values(
        BadSpec{"batch", [](v1::JobSpec* s) { s->set_batch_size(0); },
                "batch_size: must be in [1, 1048576], got 0"},
        BadSpec{"file", [](v1::JobSpec* s) { s->mutable_dataset()->set_train_images("/x"); },
                "dataset.train_images: file not found: /x"},
        BadSpec{"test_file", [](v1::JobSpec* s) { s->mutable_dataset()->set_test_labels("/y/z"); },
                "dataset.test_labels: file not found: /y/z"},
        BadSpec{"test_pair", [](v1::JobSpec* s) { s->mutable_dataset()->clear_test_labels(); },
                "dataset.test_labels: must be set with test_images"},
        BadSpec{"lr", [](v1::JobSpec* s) { s->mutable_optimizer()->set_learning_rate(-1); },
                "optimizer.learning_rate"},
        BadSpec{"layer",
                [](v1::JobSpec* s) {
                  s->mutable_model()->mutable_layers(2)->mutable_dense()->set_units(0);
                },
                "model.layers[2]"},
        BadSpec{"classes", [](v1::JobSpec* s) { s->mutable_dataset()->set_num_classes(5); },
                "dataset.num_classes: softmax cross-entropy needs one class per model output "
                "(10), got 5"},
        BadSpec{"format",
                [](v1::JobSpec* s) {
                  s->mutable_dataset()->set_format(v1::DatasetSpec::FORMAT_UNSPECIFIED);
                },
                "dataset.format: must be FORMAT_IDX, FORMAT_LIBSVM, FORMAT_CSV or FORMAT_CRITEO"},
        BadSpec{"sparse",
                [](v1::JobSpec* s) {
                  v1::DatasetSpec* d = s->mutable_dataset();
                  d->set_format(v1::DatasetSpec::FORMAT_LIBSVM);
                  d->set_train_path(d->train_images());
                  d->clear_train_images();
                  d->clear_train_labels();
                  d->clear_test_images();
                  d->clear_test_labels();
                },
                "dataset.format: FORMAT_LIBSVM examples are sparse"},
        BadSpec{"sparse_optimizer",
                [](v1::JobSpec* s) {
                  // A hashed embedding table in front, LIBSVM data, and an optimizer the shards
                  // cannot apply to sparse rows.
                  v1::ModelSpec* m = s->mutable_model();
                  m->clear_input_shape();
                  v1::Layer bag;
                  bag.set_name("bag");
                  bag.mutable_embedding_bag()->set_dim(8);
                  m->mutable_layers()->Add(std::move(bag));
                  std::rotate(m->mutable_layers()->rbegin(), m->mutable_layers()->rbegin() + 1,
                              m->mutable_layers()->rend());
                  v1::DatasetSpec* d = s->mutable_dataset();
                  d->set_format(v1::DatasetSpec::FORMAT_LIBSVM);
                  d->set_train_path(d->train_images());
                  d->clear_train_images();
                  d->clear_train_labels();
                  d->clear_test_images();
                  d->clear_test_labels();
                  s->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_MOMENTUM);
                },
                "optimizer.kind: OPTIMIZER_KIND_MOMENTUM is for dense tensors only; sparse tables "
                "take SGD, ADAGRAD, ADAM or FTRL (the model's table bag/embeddings is a sparse "
                "table)"},
        BadSpec{"device", [](v1::JobSpec* s) { s->set_device("tpu"); },
                "device: must be \"auto\", \"cuda\" or \"cpu\", got \"tpu\""},
        BadSpec{"length", [](v1::JobSpec* s) { s->set_epochs(0); },
                "epochs: epochs or max_steps must be > 0"},
        BadSpec{"negative_epochs", [](v1::JobSpec* s) { s->set_epochs(-2); },
                "epochs: must be >= 0, got -2"},
        BadSpec{"name", [](v1::JobSpec* s) { s->set_name("a b"); }, "name: must be"},
        BadSpec{"schedule",
                [](v1::JobSpec* s) {
                  s->mutable_schedule()->set_kind(v1::LearningRateSchedule::KIND_STEP);
                },
                "schedule."},
        BadSpec{"clip", [](v1::JobSpec* s) { s->mutable_clipping()->set_max_global_norm(-1); },
                "clipping.max_global_norm: must be a finite number >= 0, got -1"},
        BadSpec{
            "stddev",
            [](v1::JobSpec* s) { s->mutable_dataset()->mutable_normalization()->set_stddev(-1); },
            "dataset.normalization.stddev"},
        BadSpec{"eval", [](v1::JobSpec* s) { s->mutable_eval()->set_batch_size(-1); },
                "eval.batch_size"},
        BadSpec{"no_model", [](v1::JobSpec* s) { s->clear_model(); }, "model: must be set"},
        BadSpec{"no_optimizer", [](v1::JobSpec* s) { s->clear_optimizer(); },
                "optimizer: must be set"}),
    [](const ::testing::TestParamInfo<BadSpec>& info) { return std::string(info.param.what); });

v1::JobSpec DistributedMlp() {
  v1::JobSpec spec = Mlp();
  spec.set_num_workers(2);
  return spec;
}

ValidateOptions Distributed() {
  ValidateOptions options;
  options.distributed = true;
  return options;
}

class ValidateDistributedTest : public ::testing::TestWithParam<BadSpec> {};

TEST_P(ValidateDistributedTest, NamesTheField) {
  v1::JobSpec spec = DistributedMlp();
  GetParam().mutate(&spec);
  const absl::Status status = ValidateJobSpec(spec, Distributed());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().message));
  // A standalone run ignores the distributed fields.
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateDistributedTest,
    ::testing::Values(
        BadSpec{"no_workers", [](v1::JobSpec* s) { s->set_num_workers(0); },
                "num_workers: must be in [1, 1024], got 0"},
        BadSpec{"negative_workers", [](v1::JobSpec* s) { s->set_num_workers(-3); },
                "num_workers: must be in [1, 1024], got -3"},
        BadSpec{"consistency", [](v1::JobSpec* s) { s->set_consistency("eventual"); },
                "consistency: must be \"bsp\", \"ssp\", \"asp\" or \"hybrid\", got "
                "\"eventual\""},
        BadSpec{"ssp_without_k", [](v1::JobSpec* s) { s->set_consistency("ssp"); },
                "staleness: ssp needs a staleness in [1, 1000000], got 0"},
        BadSpec{"hybrid_without_k", [](v1::JobSpec* s) { s->set_consistency("hybrid"); },
                "staleness: hybrid needs a staleness in [1, 1000000], got 0"},
        BadSpec{"hybrid_without_a_table",
                [](v1::JobSpec* s) {
                  s->set_consistency("hybrid");
                  s->set_staleness(2);
                },
                "consistency: hybrid keeps the dense parameters synchronous and lets the "
                "embedding tables lag; the model has no embedding table"},
        BadSpec{"k_without_ssp", [](v1::JobSpec* s) { s->set_staleness(2); },
                "staleness: only ssp and hybrid take a staleness, got 2 with bsp"},
        BadSpec{"partition", [](v1::JobSpec* s) { s->set_partition_bytes(100); },
                "partition_bytes: must be 0 (4 MiB) or in [1024, 1073741824], got 100"},
        BadSpec{"encoding", [](v1::JobSpec* s) { s->set_wire_encoding("int8"); },
                "wire_encoding: must be \"fp32\", \"bf16\", \"fp16\", \"sign1\" or \"topk\", got "
                "\"int8\""},
        BadSpec{"checkpoint", [](v1::JobSpec* s) { s->set_checkpoint_every_steps(-1); },
                "checkpoint_every_steps: must be >= 0, got -1"},
        BadSpec{"stall_timeout_short", [](v1::JobSpec* s) { s->set_stall_timeout_seconds(4); },
                "stall_timeout_seconds: must be 0 (300 s) or in [5, 604800], got 4"},
        BadSpec{"stall_timeout_negative", [](v1::JobSpec* s) { s->set_stall_timeout_seconds(-1); },
                "stall_timeout_seconds: must be 0 (300 s) or in [5, 604800], got -1"},
        BadSpec{"stall_policy", [](v1::JobSpec* s) { s->set_stall_policy("kill"); },
                "stall_policy: must be \"warn\" or \"evict\", got \"kill\""},
        BadSpec{"replication", [](v1::JobSpec* s) { s->set_replication(3); },
                "replication: must be 0 or 1 (one copy) or 2 (a primary and a backup), got 3"}),
    [](const ::testing::TestParamInfo<BadSpec>& info) { return std::string(info.param.what); });

TEST(JobSpecTest, StallTimeoutAndPolicyDefaults) {
  v1::JobSpec spec = DistributedMlp();
  EXPECT_EQ(StallTimeout(spec), absl::Seconds(300));
  EXPECT_FALSE(EvictsStalledRanks(spec));
  spec.set_stall_timeout_seconds(5);
  spec.set_stall_policy("EVICT");
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(StallTimeout(spec), absl::Seconds(5));
  EXPECT_TRUE(EvictsStalledRanks(spec));
  spec.set_stall_policy("warn");
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_FALSE(EvictsStalledRanks(spec));
}

TEST(JobSpecTest, ReplicasFollowReplication) {
  v1::JobSpec spec = DistributedMlp();
  EXPECT_EQ(Replicas(spec), 1);
  spec.set_replication(2);
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(Replicas(spec), 2);
}

TEST(JobSpecTest, JobConfigFollowsTheSpec) {
  v1::JobSpec spec = DistributedMlp();
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  v1::JobConfig config = MakeJobConfig(spec);
  EXPECT_EQ(config.consistency(), v1::CONSISTENCY_BSP);
  EXPECT_EQ(config.staleness(), 0u);
  EXPECT_EQ(config.num_workers(), 2u);
  EXPECT_EQ(config.optimizer().kind(), spec.optimizer().kind());
  EXPECT_FLOAT_EQ(config.optimizer().learning_rate(), spec.optimizer().learning_rate());
  EXPECT_EQ(PushEncoding(spec), v1::ENCODING_FP32);
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_FP32);
  EXPECT_EQ(PartitionBytes(spec), 4 << 20);

  spec.set_consistency("SSP");
  spec.set_staleness(3);
  spec.set_wire_encoding("bf16");
  spec.set_partition_bytes(65536);
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  config = MakeJobConfig(spec);
  EXPECT_EQ(config.consistency(), v1::CONSISTENCY_SSP);
  EXPECT_EQ(config.staleness(), 3u);
  EXPECT_EQ(PushEncoding(spec), v1::ENCODING_BF16);
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_BF16);
  EXPECT_EQ(PartitionBytes(spec), 65536);

  spec.set_consistency("asp");
  spec.set_staleness(0);
  spec.set_wire_encoding("fp16");
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(MakeJobConfig(spec).consistency(), v1::CONSISTENCY_ASP);
  spec.set_consistency("hybrid");
  spec.set_staleness(3);
  EXPECT_EQ(MakeJobConfig(spec).consistency(), v1::CONSISTENCY_HYBRID);
  EXPECT_EQ(MakeJobConfig(spec).staleness(), 3u);
  EXPECT_EQ(PushEncoding(spec), v1::ENCODING_FP16);
  spec.set_num_workers(0);
  EXPECT_EQ(NumWorkers(spec), 1);
}

TEST(JobSpecTest, CompressedEncodingsPushCompressedAndPullBf16) {
  v1::JobSpec spec = DistributedMlp();
  spec.set_wire_encoding("SIGN1");
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(PushEncoding(spec), v1::ENCODING_SIGN1);
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_BF16);
  spec.set_wire_encoding("topk");
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(PushEncoding(spec), v1::ENCODING_TOPK);
  EXPECT_EQ(TopKFraction(spec), 0.01);
  spec.set_topk_fraction(0.05);
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(TopKFraction(spec), 0.05);
  for (const double bad : {-0.1, 1.5}) {
    spec.set_topk_fraction(bad);
    const absl::Status s = ValidateJobSpec(spec, Distributed());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("topk_fraction"), std::string::npos) << s;
  }
  spec.set_topk_fraction(0.05);
  spec.set_wire_encoding("sign1");
  const absl::Status s = ValidateJobSpec(spec, Distributed());
  EXPECT_NE(s.message().find("applies to \"topk\" only"), std::string::npos) << s;
  spec.clear_topk_fraction();
  spec.set_wire_encoding("int8");
  EXPECT_NE(ValidateJobSpec(spec, Distributed()).message().find("\"sign1\" or \"topk\""),
            std::string::npos);
}

TEST(JobSpecTest, PullEncodingDeltaTopkNeedsBspOrHybridAndAFraction) {
  v1::JobSpec spec = DistributedMlp();
  spec.set_wire_encoding("topk");
  spec.set_pull_encoding("delta_topk");
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_TOPK);
  EXPECT_EQ(PullTopKFraction(spec), 0.1);
  EXPECT_EQ(MakeJobConfig(spec).pull_topk_fraction(), 0.1);
  spec.set_pull_topk_fraction(0.2);
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(MakeJobConfig(spec).pull_topk_fraction(), 0.2);
  spec.set_pull_encoding("BF16");  // the pull encoding wins over wire_encoding's bf16 default
  spec.clear_pull_topk_fraction();
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_BF16);
  EXPECT_EQ(MakeJobConfig(spec).pull_topk_fraction(), 0.0);
  spec.set_pull_encoding("fp32");
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_FP32);
  spec.set_pull_encoding("delta_int8");  // every value of the change, quantised; no fraction
  ASSERT_TRUE(ValidateJobSpec(spec, Distributed()).ok());
  EXPECT_EQ(PullEncoding(spec), v1::ENCODING_INT8);
  EXPECT_EQ(MakeJobConfig(spec).pull_topk_fraction(), 0.0);

  struct Bad {
    std::function<void(v1::JobSpec*)> edit;
    std::string message;
  };
  for (const Bad& bad : std::vector<Bad>{
           {[](v1::JobSpec* s) { s->set_pull_encoding("topk"); },
            "pull_encoding: must be \"fp32\", \"bf16\", \"fp16\", \"delta_topk\" or "
            "\"delta_int8\", got \"topk\""},
           {[](v1::JobSpec* s) {
              s->set_pull_encoding("delta_int8");
              s->set_consistency("asp");
            },
            "pull_encoding: \"delta_int8\" needs consistency \"bsp\" or \"hybrid\", got \"asp\""},
           {[](v1::JobSpec* s) {
              s->set_pull_encoding("delta_int8");
              s->set_pull_topk_fraction(0.5);
            },
            "it applies to \"delta_topk\" only"},
           {[](v1::JobSpec* s) {
              s->set_pull_encoding("delta_topk");
              s->set_consistency("ssp");
              s->set_staleness(2);
            },
            "pull_encoding: \"delta_topk\" needs consistency \"bsp\" or \"hybrid\", got \"ssp\""},
           {[](v1::JobSpec* s) { s->set_pull_topk_fraction(0.5); },
            "pull_topk_fraction: set to 0.5 but pull_encoding is \"\""},
           {[](v1::JobSpec* s) {
              s->set_pull_encoding("delta_topk");
              s->set_pull_topk_fraction(2);
            },
            "pull_topk_fraction: must be in (0, 1]"},
       }) {
    v1::JobSpec broken = DistributedMlp();
    bad.edit(&broken);
    const absl::Status s = ValidateJobSpec(broken, Distributed());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_NE(s.message().find(bad.message), std::string::npos) << s << "\nwant: " << bad.message;
  }
}

TEST(JobSpecTest, FileChecksCanBeSkipped) {
  v1::JobSpec spec = Mlp();
  spec.mutable_dataset()->set_train_images("/elsewhere/images.gz");
  ValidateOptions options;
  options.check_files = false;
  EXPECT_TRUE(ValidateJobSpec(spec, options).ok());
  // A path no file system can hold is refused even unchecked (the coordinator stores the spec).
  spec.mutable_dataset()->set_train_images(std::string(70000, 'p'));
  const absl::Status long_path = ValidateJobSpec(spec, options);
  EXPECT_EQ(long_path.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(long_path.message(), "dataset.train_images: a path of 70000 bytes"))
      << long_path;
}

}  // namespace
}  // namespace tessera::spec
