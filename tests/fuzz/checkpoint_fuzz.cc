// libFuzzer target: checkpoint parsing and the restore path (issue #6). Any bytes go through
// ParseCheckpoint; a file that verifies is turned into a job by the same code Restore uses. Neither
// may crash, leak or allocate more than the input justifies (the store's memory cap is small).
// Built and wired by tests/fuzz/CMakeLists.txt.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "server/checkpoint_file.h"
#include "server/parameter_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tessera::server::ParameterStore;
  absl::StatusOr<tessera::server::CheckpointContents> contents = tessera::server::ParseCheckpoint(
      absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!contents.ok()) return 0;
  tessera::server::ParameterStoreOptions options;
  options.max_memory_bytes = int64_t{256} << 20;
  ParameterStore store(options);
  store.RestoreJobFromCheckpoint(*contents, /*min_incarnation=*/1).IgnoreError();
  return 0;
}
