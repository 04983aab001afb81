// Shape inference of model specs: the shapes of the example models, the parameters and windows
// that the engine builds from, and refused specs. The engine's tests (worker/engine/model_test.cc)
// check that Model::Create refuses the same specs with the same status.
#include "spec/model_spec.h"

#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/testing/example_models.h"

namespace tessera::spec {
namespace {

using examples::kFashionCnn;
using examples::kFashionMlp;

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::ModelSpec Parse(const std::string& text) {
  v1::ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

TEST(ModelSpecTest, UnknownFieldIsRefused) {
  v1::ModelSpec spec = Parse(kFashionMlp);
  std::string wire;
  ASSERT_TRUE(spec.SerializeToString(&wire));
  // Field 99 of the first layer (varint 7): tag = (99 << 3) | 0.
  v1::Layer layer = spec.layers(0);
  std::string layer_wire;
  ASSERT_TRUE(layer.SerializeToString(&layer_wire));
  layer_wire += std::string("\x98\x06\x07", 3);
  v1::Layer with_unknown;
  ASSERT_TRUE(with_unknown.ParseFromString(layer_wire));
  *spec.mutable_layers(0) = with_unknown;
  auto infos = InferModelShapes(spec);
  ASSERT_FALSE(infos.ok());
  EXPECT_EQ(infos.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(infos.status().message()),
              HasSubstr("layers[0]: unknown field number 99"));
}

// 10,000 layers are refused for their depth, at submission, not later on a worker for memory.
TEST(ModelSpecTest, TooDeepAModelIsRefusedForItsDepth) {
  v1::ModelSpec spec = Parse(kFashionMlp);
  const v1::Layer relu = spec.layers(1);
  while (spec.layers_size() < kMaxLayers) *spec.add_layers() = relu;
  EXPECT_TRUE(InferModelShapes(spec).ok());
  while (spec.layers_size() < 10000) *spec.add_layers() = relu;
  auto infos = InferModelShapes(spec);
  EXPECT_EQ(infos.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(infos.status().message(), "layers: a model has at most 1000 layers, got 10000");
}

TEST(ModelSpecTest, ShapesOfTheBenchmarkModels) {
  auto mlp = InferModelShapes(Parse(kFashionMlp));
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  ASSERT_EQ(mlp->layers.size(), 7u);
  EXPECT_EQ(mlp->layers[0].name, "dense_1");
  EXPECT_EQ(mlp->layers[1].name, "relu_1");
  EXPECT_EQ(mlp->layers[6].name, "dense_4");
  EXPECT_THAT(mlp->layers[6].output_shape, ElementsAre(10));

  auto cnn = InferModelShapes(Parse(kFashionCnn));
  ASSERT_TRUE(cnn.ok()) << cnn.status();
  EXPECT_THAT(cnn->layers[0].output_shape, ElementsAre(32, 28, 28));
  EXPECT_THAT(cnn->layers[2].output_shape, ElementsAre(32, 14, 14));
  EXPECT_THAT(cnn->layers[5].output_shape, ElementsAre(64, 7, 7));
  EXPECT_THAT(cnn->layers[6].output_shape, ElementsAre(3136));
  EXPECT_EQ(cnn->layers[9].type, "dropout");
}

TEST(ModelSpecTest, ModelInputAndOutput) {
  auto cnn = InferModelShapes(Parse(kFashionCnn));
  ASSERT_TRUE(cnn.ok()) << cnn.status();
  EXPECT_THAT(cnn->input_shape, ElementsAre(1, 28, 28));
  EXPECT_FALSE(cnn->sparse_input);
  EXPECT_EQ(cnn->output_dim, 10);
  EXPECT_THAT(cnn->layers[0].input_shape, ElementsAre(1, 28, 28));
  EXPECT_THAT(cnn->layers[7].input_shape, ElementsAre(3136));

  auto sparse = InferModelShapes(Parse(R"pb(layers { embedding_bag { num_rows: 1000 dim: 8 } }
                                            layers { dense { units: 1 } }
                                            loss: LOSS_SIGMOID_CROSS_ENTROPY)pb"));
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  EXPECT_TRUE(sparse->sparse_input);
  EXPECT_THAT(sparse->input_shape, ElementsAre(1000));
  EXPECT_THAT(sparse->layers[0].output_shape, ElementsAre(8));
  EXPECT_EQ(sparse->output_dim, 1);
}

// The parameters the engine allocates, in binding order, with their initializers resolved.
TEST(ModelSpecTest, ParametersOfEachKind) {
  auto cnn = InferModelShapes(Parse(kFashionCnn));
  ASSERT_TRUE(cnn.ok()) << cnn.status();
  const LayerInfo& conv = cnn->layers[0];
  ASSERT_EQ(conv.parameters.size(), 2u);
  EXPECT_EQ(conv.parameters[0].suffix, "kernel");
  EXPECT_THAT(conv.parameters[0].shape, ElementsAre(32, 1, 5, 5));
  EXPECT_EQ(conv.parameters[0].init.kind(), v1::WeightInitializer::KIND_GLOROT_UNIFORM);
  EXPECT_EQ(conv.parameters[0].fan_in, 25);
  EXPECT_EQ(conv.parameters[0].fan_out, 800);
  EXPECT_EQ(conv.parameters[1].suffix, "bias");
  EXPECT_THAT(conv.parameters[1].shape, ElementsAre(32));
  EXPECT_EQ(conv.parameters[1].init.kind(), v1::WeightInitializer::KIND_ZEROS);
  EXPECT_TRUE(cnn->layers[1].parameters.empty());  // relu

  const LayerInfo& dense = cnn->layers[7];
  ASSERT_EQ(dense.parameters.size(), 2u);
  EXPECT_THAT(dense.parameters[0].shape, ElementsAre(1024, 3136));
  EXPECT_EQ(dense.parameters[0].fan_in, 3136);
  EXPECT_EQ(dense.parameters[0].fan_out, 1024);

  auto norm = InferModelShapes(Parse(R"pb(input_shape: [ 3, 4, 5 ]
                                          layers { batch_norm {} }
                                          layers { dense { units: 2 } }
                                          loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb"));
  ASSERT_TRUE(norm.ok()) << norm.status();
  const LayerInfo& bn = norm->layers[0];
  EXPECT_EQ(bn.batch_norm.channels, 3);
  EXPECT_EQ(bn.batch_norm.spatial, 20);
  EXPECT_EQ(bn.batch_norm.momentum, 0.1f);
  EXPECT_EQ(bn.batch_norm.epsilon, 1e-5f);
  ASSERT_EQ(bn.parameters.size(), 4u);
  EXPECT_EQ(bn.parameters[0].suffix, "gamma");
  EXPECT_EQ(bn.parameters[0].init.kind(), v1::WeightInitializer::KIND_CONSTANT);
  EXPECT_EQ(bn.parameters[0].init.value(), 1.0f);
  EXPECT_EQ(bn.parameters[1].suffix, "beta");
  EXPECT_EQ(bn.parameters[2].suffix, "moving_mean");
  EXPECT_FALSE(bn.parameters[2].trainable);
  EXPECT_EQ(bn.parameters[3].suffix, "moving_variance");
  EXPECT_FALSE(bn.parameters[3].trainable);
  EXPECT_TRUE(bn.parameters[0].trainable);

  auto sparse = InferModelShapes(Parse(R"pb(layers { embedding_bag { num_rows: 1000 dim: 8 } }
                                            layers { dense { units: 1 } }
                                            loss: LOSS_MEAN_SQUARED_ERROR)pb"));
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  const ParameterShape& table = sparse->layers[0].parameters.at(0);
  EXPECT_EQ(table.suffix, "embeddings");
  EXPECT_THAT(table.shape, ElementsAre(1000, 8));
  EXPECT_TRUE(table.sparse);
  EXPECT_EQ(table.init.kind(), v1::WeightInitializer::KIND_NORMAL);
  EXPECT_EQ(table.init.stddev(), 0.01f);
}

// A hashed table (num_rows 0) has no row count: any id, and its rows start from NORMAL, ZEROS
// or CONSTANT, which the shards and the standalone trainer draw alike.
TEST(ModelSpecTest, HashedTablesAndTheirRowInitializer) {
  auto hashed = InferModelShapes(Parse(R"pb(layers { embedding_bag { dim: 8 } }
                                            layers { dense { units: 1 } }
                                            loss: LOSS_MEAN_SQUARED_ERROR)pb"));
  ASSERT_TRUE(hashed.ok()) << hashed.status();
  EXPECT_TRUE(hashed->sparse_input);
  EXPECT_THAT(hashed->input_shape, ElementsAre(0));
  const ParameterShape& table = hashed->layers[0].parameters.at(0);
  const v1::Initializer init = RowInitializer(table, 7, "embedding_bag_1/embeddings");
  EXPECT_EQ(init.kind(), v1::Initializer::KIND_NORMAL);
  EXPECT_EQ(init.scale(), 0.01f);
  EXPECT_EQ(init.seed(), RowInitializer(table, 7, "embedding_bag_1/embeddings").seed());
  EXPECT_NE(init.seed(), RowInitializer(table, 8, "embedding_bag_1/embeddings").seed());
  EXPECT_NE(init.seed(), RowInitializer(table, 7, "other/embeddings").seed());

  auto bounded =
      InferModelShapes(Parse(R"pb(layers {
                                    embedding_bag {
                                      num_rows: 94
                                      dim: 6
                                      embeddings_initializer { kind: KIND_GLOROT_UNIFORM }
                                    }
                                  }
                                  layers { dense { units: 1 } }
                                  loss: LOSS_MEAN_SQUARED_ERROR)pb"));
  ASSERT_TRUE(bounded.ok()) << bounded.status();
  const v1::Initializer glorot = RowInitializer(bounded->layers[0].parameters.at(0), 1, "t");
  EXPECT_EQ(glorot.kind(), v1::Initializer::KIND_UNIFORM);
  EXPECT_FLOAT_EQ(glorot.scale(), std::sqrt(6.0f / 100.0f));

  auto wide = InferModelShapes(Parse(R"pb(layers { embedding_bag { dim: 65537 } }
                                          layers { dense { units: 1 } }
                                          loss: LOSS_MEAN_SQUARED_ERROR)pb"));
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wide.status().message()),
              HasSubstr("embedding_bag.dim must be <= 65536"));
}

// Defaults of model.proto: conv2d strides 1; pool windows 2, strides the window; a rank-2
// input is one channel.
TEST(ModelSpecTest, WindowsFillDefaults) {
  auto model = InferModelShapes(Parse(R"pb(input_shape: [ 9, 7 ]
                                           layers { conv2d { filters: 4 kernel_h: 3 kernel_w: 2 } }
                                           layers { avg_pool2d { padding_w: 1 } }
                                           layers { flatten {} }
                                           layers { dense { units: 2 } }
                                           loss: LOSS_SOFTMAX_CROSS_ENTROPY)pb"));
  ASSERT_TRUE(model.ok()) << model.status();
  const Window2D& conv = model->layers[0].window;
  EXPECT_EQ(conv.channels, 1);
  EXPECT_EQ(conv.height, 9);
  EXPECT_EQ(conv.width, 7);
  EXPECT_EQ(conv.stride_h, 1);
  EXPECT_EQ(conv.stride_w, 1);
  EXPECT_EQ(conv.out_h, 7);
  EXPECT_EQ(conv.out_w, 6);
  EXPECT_THAT(model->layers[0].output_shape, ElementsAre(4, 7, 6));
  const Window2D& pool = model->layers[1].window;
  EXPECT_EQ(model->layers[1].type, "avg_pool2d");
  EXPECT_EQ(pool.channels, 4);
  EXPECT_EQ(pool.kernel_h, 2);
  EXPECT_EQ(pool.kernel_w, 2);
  EXPECT_EQ(pool.stride_h, 2);
  EXPECT_EQ(pool.stride_w, 2);
  EXPECT_EQ(pool.pad_w, 1);
  // (7 - 2) / 2 + 1 = 3 rows; (6 + 2 - 2) / 2 + 1 = 4 columns.
  EXPECT_THAT(model->layers[1].output_shape, ElementsAre(4, 3, 4));
  EXPECT_THAT(model->layers[2].output_shape, ElementsAre(48));
}

}  // namespace
}  // namespace tessera::spec

namespace tessera::spec {
namespace {

// A DLRM-shaped multi-input model, which each refusal case below breaks once.
constexpr char kDlrm[] = R"pb(
  dense_features: 13
  bottom_layers { dense { units: 8 } }
  bottom_layers { relu {} }
  tables { name: "t0" dim: 8 }
  tables { name: "t1" dim: 8 }
  sparse_features { table: "t0" }
  sparse_features { table: "t1" }
  sparse_features { table: "t0" }
  interaction { kind: KIND_DOT }
  layers { dense { units: 4 } }
  layers { dense { units: 1 } }
  loss: LOSS_SIGMOID_CROSS_ENTROPY
)pb";

v1::ModelSpec ParseModel(const std::string& text) {
  v1::ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

TEST(MultiInputSpecTest, DlrmShapes) {
  absl::StatusOr<ModelShapes> shapes = InferModelShapes(ParseModel(kDlrm));
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  ASSERT_TRUE(shapes->multi_input);
  const MultiInputShapes& m = shapes->multi;
  EXPECT_EQ(m.bottom_width, 8);
  ASSERT_EQ(m.bottom.size(), 2u);
  EXPECT_EQ(m.bottom[0].name, "bottom_dense_1");
  EXPECT_EQ(shapes->layers[0].name, "dense_1");
  EXPECT_EQ(m.tables[0].fields, (std::vector<int>{0, 2}));
  EXPECT_EQ(m.concat_width, 8 + 3 * 8);
  EXPECT_EQ(m.interaction_width, 8 + 4 * 3 / 2);  // u and the pairs of 4 vectors
  EXPECT_EQ(shapes->input_shape, (Shape{14}));
  EXPECT_EQ(shapes->output_dim, 1);
}

TEST(MultiInputSpecTest, WideAndDeepShapes) {
  v1::ModelSpec spec = ParseModel(kDlrm);
  spec.clear_interaction();
  spec.clear_bottom_layers();
  v1::EmbeddingTable* wide = spec.add_tables();
  wide->set_name("wide");
  wide->set_dim(1);
  wide->mutable_initializer()->set_kind(v1::WeightInitializer::KIND_ZEROS);
  spec.set_wide_table("wide");
  absl::StatusOr<ModelShapes> shapes = InferModelShapes(spec);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_EQ(shapes->multi.interaction, v1::Interaction::KIND_CONCAT);
  EXPECT_EQ(shapes->multi.interaction_width, 13 + 3 * 8);
  EXPECT_EQ(shapes->multi.wide_table, 2);
  EXPECT_EQ(shapes->multi.tables[2].fields, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(shapes->multi.tables[2].embeddings.init.kind(), v1::WeightInitializer::KIND_ZEROS);
  EXPECT_EQ(shapes->multi.tables[0].embeddings.init.kind(), v1::WeightInitializer::KIND_NORMAL);
}

TEST(MultiInputSpecTest, BrokenSpecsAreRefusedNamingTheField) {
  struct Case {
    std::string extra;  // appended to kDlrm
    std::string message;
  };
  const std::vector<Case> cases = {
      {"input_shape: 3", "input_shape: must be empty in a multi-input model"},
      {"tables { name: \"t0\" dim: 8 }", "tables[2] (t0): name: used by an earlier table"},
      {"tables { name: \"bad name\" dim: 8 }", "tables[2]"},
      {"tables { name: \"t2\" dim: 0 }", "tables[2] (t2): dim: must be in [1, 65536], got 0"},
      {"tables { name: \"t2\" dim: 8 initializer { kind: KIND_GLOROT_UNIFORM } }",
       "tables[2] (t2): initializer.kind: KIND_GLOROT_UNIFORM needs a row count"},
      {"tables { name: \"t2\" dim: 8 lifecycle { evict_after: -3 } }",
       "tables[2] (t2): lifecycle.evict_after: must be in [0, 1099511627776], got -3"},
      {"tables { name: \"t2\" dim: 8 lifecycle { admit_after: 2000000 } }",
       "tables[2] (t2): lifecycle.admit_after: must be at most 1048576, got 2000000"},
      {"tables { name: \"t2\" dim: 8 }", "tables[2] (t2): no sparse_features[].table names it"},
      {"sparse_features { table: \"nope\" }",
       "sparse_features[3].table: \"nope\" is not in tables"},
      {"sparse_features { table: \"t1\" combiner: COMBINER_MEAN }",
       "sparse_features[3].combiner: the fields of table \"t1\" must share one combiner"},
      {"tables { name: \"t2\" dim: 4 } sparse_features { table: \"t2\" }",
       "interaction.kind: KIND_DOT needs every vector as wide as the bottom layers' output (8), "
       "but sparse_features[3] reads table \"t2\" of dim 4"},
      {"wide_table: \"nope\"", "wide_table: \"nope\" is not in tables"},
      {"wide_table: \"t1\"", "sparse_features[1].table: \"t1\" is the wide_table"},
      {"tables { name: \"w\" dim: 2 } wide_table: \"w\"",
       "wide_table: \"w\" has dim 2, but the model has 1 outputs"},
      {"tables { name: \"w\" dim: 1 } wide_table: \"w\" layers { sigmoid {} }",
       "wide_table: the wide part is added to the last layer's outputs"},
      {"bottom_layers { dense { units: 0 } }",
       "bottom_layers[2] (bottom_dense_2): dense.units must be > 0"},
      {"bottom_layers { embedding_bag { dim: 4 } }", "bottom_layers[2] (bottom_embedding_bag_1)"},
      {"layers { embedding_bag { dim: 4 } }", "embedding_bag has no place in a multi-input model"},
      {"bottom_layers { name: \"t0\" dense { units: 8 } }",
       "bottom_layers[2].name: \"t0\" is used by an earlier layer or table"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelShapes> shapes = InferModelShapes(ParseModel(kDlrm + c.extra));
    ASSERT_FALSE(shapes.ok()) << c.extra;
    EXPECT_EQ(shapes.status().code(), absl::StatusCode::kInvalidArgument) << c.extra;
    EXPECT_THAT(std::string(shapes.status().message()), ::testing::HasSubstr(c.message)) << c.extra;
  }
  v1::ModelSpec negative = ParseModel(kDlrm);
  negative.set_dense_features(-1);
  EXPECT_THAT(std::string(InferModelShapes(negative).status().message()),
              ::testing::HasSubstr("dense_features: must be in [0, 2^31], got -1"));
  v1::ModelSpec bad_kind = ParseModel(kDlrm);
  bad_kind.mutable_interaction()->set_kind(static_cast<v1::Interaction::Kind>(7));
  EXPECT_THAT(std::string(InferModelShapes(bad_kind).status().message()),
              ::testing::HasSubstr("interaction.kind: unknown value 7"));
  // Multi-input fields without tables.
  absl::StatusOr<ModelShapes> plain = InferModelShapes(ParseModel(R"pb(
    input_shape: 4
    dense_features: 4
    layers { dense { units: 2 } }
    loss: LOSS_SOFTMAX_CROSS_ENTROPY
  )pb"));
  ASSERT_FALSE(plain.ok());
  EXPECT_THAT(std::string(plain.status().message()),
              ::testing::HasSubstr("tables: dense_features"));
}

}  // namespace
}  // namespace tessera::spec
