// libFuzzer target: checkpoint parsing and the restore path (issue #6). Any bytes go through
// ParseCheckpoint; a file that verifies is turned into a job by the same code Restore uses. Neither
// may crash, leak or allocate more than the input justifies (the store's memory cap is small).
// Built and wired by tests/fuzz/CMakeLists.txt.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "server/checkpoint_file.h"
#include "server/parameter_store.h"

namespace {

void ParseAndRestore(absl::string_view bytes) {
  using tessera::server::ParameterStore;
  absl::StatusOr<tessera::server::CheckpointContents> contents =
      tessera::server::ParseCheckpoint(bytes);
  if (!contents.ok()) return;
  tessera::server::ParameterStoreOptions options;
  options.max_memory_bytes = int64_t{256} << 20;
  ParameterStore store(options);
  store.RestoreJobFromCheckpoint(*contents, /*min_incarnation=*/1).IgnoreError();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  // As they come: almost every mutation breaks the trailing CRC32C, which is refused first.
  ParseAndRestore(bytes);
  // With the CRC made right again, so that mutations reach the header and the restore path.
  if (size >= 4) {
    std::string fixed(bytes);
    const uint32_t crc = tessera::server::Crc32c(absl::string_view(fixed.data(), size - 4));
    for (int i = 0; i < 4; ++i) fixed[size - 4 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
    ParseAndRestore(fixed);
  }
  return 0;
}
