// Process-level pieces every daemon's main() uses: logging set-up, the port file, and waiting for
// SIGINT or SIGTERM (and handling SIGHUP reloads meanwhile).
#ifndef TESSERA_COMMON_PROCESS_H_
#define TESSERA_COMMON_PROCESS_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera {

// Configures the default spdlog logger: a terminal format on a TTY, "<N>"-prefixed lines for
// journald when JOURNAL_STREAM is set. INVALID_ARGUMENT for an unknown level name
// (trace, debug, info, warn, error, critical, off).
absl::Status InitLogging(absl::string_view level);

// Writes `port` followed by a newline to `path` atomically (temp file, fsync, rename), so a reader
// never sees a partial number.
absl::Status WritePortFile(const std::string& path, int port);

// libgomp reads OMP_WAIT_POLICY once, when it loads, and by default its idle threads spin. Two
// spinning OpenMP pools on a shared core slow each other 10-100x (measured: a 1.3 ms MLP step
// took 60 ms), so a daemon that uses OpenMP re-executes itself with OMP_WAIT_POLICY=passive when
// the variable is unset. Returns only when no re-exec was needed or it failed (then it logs
// nothing and the process carries on with the default). Call first thing in main().
void ExecWithPassiveOpenMpWait(char** argv);

// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts afterwards.
// Call first thing in main(), before any thread exists.
void BlockShutdownSignals();

// BlockShutdownSignals() and SIGHUP too (a daemon's reload signal), so that only
// WaitForShutdownSignal() sees them. Call first thing in a daemon's main(), before any thread
// exists.
void BlockDaemonSignals();

// Waits until SIGINT or SIGTERM arrives and returns its number. Each SIGHUP meanwhile calls
// `on_reload` (on this thread; ignored when null) and the wait goes on. Every
// kTrimIntervalSeconds without a signal it calls ReleaseFreeMemory().
// REQUIRES: BlockDaemonSignals().
int WaitForShutdownSignal(const std::function<void()>& on_reload = nullptr);
inline constexpr int kTrimIntervalSeconds = 1;

// Gives the memory that glibc's malloc holds free back to the kernel (malloc_trim(0): the free
// pages of every arena, not only the top of the main heap). A daemon's RPC threads each get an
// arena, and a large transient buffer (a 1 MiB bytes field, a 20,000-element repeated field, a
// message near the receive limit) freed below a chunk still in use stays resident otherwise:
// under hostile requests that kept 75% of a shard's arena memory free but resident (issue #6,
// test 7). Takes each arena's lock in turn, for microseconds; thread-safe.
void ReleaseFreeMemory();

// Makes every thread allocate from glibc's main arena (M_ARENA_MAX 1), whose free memory
// ReleaseFreeMemory() can give back in full: malloc_trim never shrinks the top of a per-thread
// arena, and under hostile requests a shard's RPC threads left three such arenas 4-6 MiB large and
// over 95% free (issue #6, test 7). Small blocks still come from each thread's tcache without a
// lock. Does nothing when MALLOC_ARENA_MAX or GLIBC_TUNABLES is set (the operator's choice wins).
// Call first thing in a daemon's main(), before any thread exists.
void ConfigureDaemonAllocator();

// Turns off Abseil's mutex deadlock detection (absl::OnDeadlockCycle::kIgnore). Debian's Abseil is
// built without NDEBUG, so by default every absl::Mutex acquisition also records the lock-order
// graph (GraphCycles): 3% of all CPU in a 32-worker BSP run here (docs/benchmarks.md "Scale").
// The tests keep the detection on, so a lock-order inversion still fails them. Call first thing in
// a binary's main(), before any thread exists.
void ConfigureReleaseMutexes();

// OK when `mu` can be taken (shared) within `within`; DEADLINE_EXCEEDED naming `what` otherwise.
// The daemons' liveness probe for their central lock (systemd::SystemdWatchdog::Start). The lock
// is taken on a detached helper thread, which goes on waiting after a timeout.
// REQUIRES: *mu outlives the helper: call WaitForMutexProbes() before destroying it
// (SystemdWatchdog::Stop() does).
absl::Status MutexResponds(absl::Mutex* mu, absl::Duration within, absl::string_view what);
// Waits until every MutexResponds helper has finished, at most `timeout`; false on timeout (a
// lock that stays held: the helper then still waits on it).
bool WaitForMutexProbes(absl::Duration timeout);

}  // namespace tessera

#endif  // TESSERA_COMMON_PROCESS_H_
