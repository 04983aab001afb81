// Fashion-MNIST for the end-to-end tests that train on it: where Debian's
// dataset-fashion-mnist package installs it, and a GoogleTest skip when it is missing.
#ifndef TESSERA_TESTS_TESTLIB_FASHION_MNIST_H_
#define TESSERA_TESTS_TESTLIB_FASHION_MNIST_H_

namespace tessera {
namespace testlib {

inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// Whether the four IDX files (train and t10k images and labels, gzipped) are readable in
// kFashionMnistDir. Thread-safe.
bool HaveFashionMnist();

}  // namespace testlib
}  // namespace tessera

// In a TEST body (needs gtest/gtest.h): skips the test, with a message, without Fashion-MNIST.
#define TESSERA_SKIP_WITHOUT_FASHION_MNIST()                                               \
  if (!::tessera::testlib::HaveFashionMnist()) {                                           \
    GTEST_SKIP()                                                                           \
        << "Fashion-MNIST is not installed in " << ::tessera::testlib::kFashionMnistDir    \
        << " (Debian package dataset-fashion-mnist; scripts/install-deps.sh installs it)"; \
  }

#endif  // TESSERA_TESTS_TESTLIB_FASHION_MNIST_H_
