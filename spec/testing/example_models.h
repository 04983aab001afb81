// The models of examples/fashion_mlp.textproto and examples/fashion_cnn.textproto as ModelSpec
// text, for the tests of spec/ and the tests and benchmarks of the engine (which do not read job
// specs). spec/job_spec_test.cc checks that they match the example files.
#ifndef TESSERA_SPEC_TESTING_EXAMPLE_MODELS_H_
#define TESSERA_SPEC_TESTING_EXAMPLE_MODELS_H_

namespace tessera::spec::examples {

// Fashion-MNIST MLP 784-256-128-100-10 with ReLU.
inline constexpr char kFashionMlp[] = R"pb(
  input_shape: [ 784 ]
  layers { dense { units: 256 } }
  layers { relu {} }
  layers { dense { units: 128 } }
  layers { relu {} }
  layers { dense { units: 100 } }
  layers { relu {} }
  layers { dense { units: 10 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

// Fashion-MNIST CNN: conv5x5x32, max-pool, conv5x5x64, max-pool, dense 1024, dropout 0.4, dense 10.
inline constexpr char kFashionCnn[] = R"pb(
  input_shape: [ 1, 28, 28 ]
  layers { conv2d { filters: 32 kernel_h: 5 kernel_w: 5 padding_h: 2 padding_w: 2 } }
  layers { relu {} }
  layers { max_pool2d { pool_h: 2 pool_w: 2 } }
  layers { conv2d { filters: 64 kernel_h: 5 kernel_w: 5 padding_h: 2 padding_w: 2 } }
  layers { relu {} }
  layers { max_pool2d { pool_h: 2 pool_w: 2 } }
  layers { flatten {} }
  layers { dense { units: 1024 } }
  layers { relu {} }
  layers { dropout { rate: 0.4 } }
  layers { dense { units: 10 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

// Fashion-MNIST CNN with BatchNorm (examples/fashion_cnn_bn.textproto): conv3x3x16, BN, max-pool,
// conv3x3x32, BN, max-pool, dense 128, BN, dense 10.
inline constexpr char kFashionCnnBn[] = R"pb(
  input_shape: [ 1, 28, 28 ]
  layers { conv2d { filters: 16 kernel_h: 3 kernel_w: 3 padding_h: 1 padding_w: 1 } }
  layers { batch_norm {} }
  layers { relu {} }
  layers { max_pool2d { pool_h: 2 pool_w: 2 } }
  layers { conv2d { filters: 32 kernel_h: 3 kernel_w: 3 padding_h: 1 padding_w: 1 } }
  layers { batch_norm {} }
  layers { relu {} }
  layers { max_pool2d { pool_h: 2 pool_w: 2 } }
  layers { flatten {} }
  layers { dense { units: 128 } }
  layers { batch_norm {} }
  layers { relu {} }
  layers { dense { units: 10 } }
  loss: LOSS_SOFTMAX_CROSS_ENTROPY
)pb";

}  // namespace tessera::spec::examples

#endif  // TESSERA_SPEC_TESTING_EXAMPLE_MODELS_H_
