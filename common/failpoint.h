// Failpoints: named places where a daemon can be made to misbehave on purpose, to test (and to
// reproduce) faults that signals cannot make, such as a training loop that hangs while every
// other thread of the worker, its heartbeats included, goes on. FreeBSD's fail(9), etcd's gofail
// and TiKV's fail-rs are the model.
//
// All are off unless the environment variable TESSERA_FAILPOINTS is set when the process starts:
// a comma-separated list of NAME=ACTION. Two actions:
// - hang@N: the failpoint blocks at the hit whose value is N ("trainer.rank1.step=hang@40": rank 1
//   hangs before its step 40, the 41st; a rank handed over later, at a step past 40, does not);
// - at@N: the code at the failpoint misbehaves in its own named way at the hit whose value is N.
// An entry that does not parse is logged once and ignored. Failpoints:
// - "trainer.rank<R>.step" (hang): the step rank R is about to train
//   (worker/trainer/distributed_trainer.cc);
// - "worker.rank<R>.fill" (at): the how-manieth shard fill rank R hears of; at N, rank R hears of
//   that fill late: it takes it only once its reports are past the fill's step, as a rank whose
//   ack came late would, and so has missed it (worker/daemon/worker_daemon.cc).
#ifndef TESSERA_COMMON_FAILPOINT_H_
#define TESSERA_COMMON_FAILPOINT_H_

#include <cstdint>
#include <functional>

#include "absl/strings/string_view.h"

namespace tessera::failpoint {

// Blocks when failpoint `name` is set to hang@`value`, until `cancelled()` returns true (polled
// every 50 ms); returns at once otherwise, and always when TESSERA_FAILPOINTS is unset. Logs a
// warning when it starts to hang. Thread-safe.
void MaybeHang(absl::string_view name, int64_t value, const std::function<bool()>& cancelled);

// True when failpoint `name` is set to at@`value` (logs a warning each time); false otherwise,
// and always when TESSERA_FAILPOINTS is unset. Thread-safe.
bool Hit(absl::string_view name, int64_t value);

}  // namespace tessera::failpoint

#endif  // TESSERA_COMMON_FAILPOINT_H_
