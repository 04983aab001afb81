#include "tests/testlib/fashion_mnist.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace testlib {

bool HaveFashionMnist() {
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    if (access(absl::StrCat(kFashionMnistDir, "/", f).c_str(), R_OK) != 0) return false;
  }
  return true;
}

}  // namespace testlib
}  // namespace tessera
