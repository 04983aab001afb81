// Process-level pieces every daemon's main() uses: logging set-up, the port file, and waiting for
// SIGINT or SIGTERM.
#ifndef TESSERA_COMMON_PROCESS_H_
#define TESSERA_COMMON_PROCESS_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace tessera {

// Configures the default spdlog logger: a terminal format on a TTY, "<N>"-prefixed lines for
// journald when JOURNAL_STREAM is set. INVALID_ARGUMENT for an unknown level name
// (trace, debug, info, warn, error, critical, off).
absl::Status InitLogging(absl::string_view level);

// Writes `port` followed by a newline to `path` atomically (temp file, fsync, rename), so a reader
// never sees a partial number.
absl::Status WritePortFile(const std::string& path, int port);

// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts afterwards.
// Call first thing in main(), before any thread exists.
void BlockShutdownSignals();

// Waits until SIGINT or SIGTERM arrives and returns its number. REQUIRES: BlockShutdownSignals().
int WaitForShutdownSignal();

}  // namespace tessera

#endif  // TESSERA_COMMON_PROCESS_H_
