// Writing models as safetensors (https://github.com/huggingface/safetensors), the single-file
// format that `tessera export` produces and PyTorch, JAX and numpy readers load directly.
//
// Layout: an 8-byte little-endian header length N; N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<value>", ...}}
// padded with spaces to a multiple of 8; then every tensor's raw little-endian float32 values,
// back to back, in the order given (offsets are relative to the end of the header); int64
// tensors ("I64") are raw little-endian int64 values.
#ifndef TESSERA_CLI_SAFETENSORS_H_
#define TESSERA_CLI_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::cli {

// One tensor, row-major: float32 ("F32"), or int64 ("I64": a sparse table's row ids).
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;  // F32: NumElements(shape) values
  bool int64 = false;
  std::vector<int64_t> ids = {};  // I64: NumElements(shape) values
};

// The whole file as bytes. INVALID_ARGUMENT naming the tensor for an empty or duplicate name, a
// negative dimension, or a value count that does not match the shape; "__metadata__" is reserved.
absl::StatusOr<std::string> EncodeSafetensors(const std::vector<NamedTensor>& tensors,
                                              const std::map<std::string, std::string>& metadata);

// Encodes and writes to `path` atomically: `path`.tmp, fsync, rename over `path`, fsync of the
// directory, so a reader sees the old file or the whole new one. Blocks on file I/O. Errors:
// those of EncodeSafetensors; INTERNAL naming the path and errno's text for a failed write.
absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<NamedTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata);

// JSON string literal for `s` (quotes included), escaping '"', '\\' and control characters.
std::string JsonQuote(const std::string& s);

}  // namespace tessera::cli

#endif  // TESSERA_CLI_SAFETENSORS_H_
