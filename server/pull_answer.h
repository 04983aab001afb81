// PullAnswerer: answers resolved pulls (ResolvePulls) once the job's consistency gate opens for
// them. A pull that must wait is parked at the gate as a continuation and never blocks a thread;
// when it opens, each partition is read under its reader lock (dense fp32 answers to a sink are
// shared, not copied: PushPullAnswerSink).
#ifndef TESSERA_SERVER_PULL_ANSWER_H_
#define TESSERA_SERVER_PULL_ANSWER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/consistency_gate.h"
#include "server/push_pull_answer_sink.h"
#include "server/request_validation.h"
#include "server/shard_counters.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::server {

// Owned by the store; it must outlive every pull it parks (the store closes its gates first).
// Thread-safe.
class PullAnswerer {
 public:
  using Executor = std::function<void(std::function<void()>)>;
  using Done = std::function<void(absl::StatusOr<std::vector<v1::Slice>>)>;

  // `executor` runs the answer of a pull that was parked, once its gate opens (empty: inline on
  // the thread that opened it); `counters` gets the bytes pulled and the gate wait times.
  PullAnswerer(Executor executor, std::shared_ptr<ShardCounters> counters);

  // Answers `items` in `encoding` once `gate` opens for them: `done` runs exactly once, inline
  // when nothing waits (or the gate is closed, or `cancelled` is set), otherwise from the
  // executor, with slice i answering item i, or the gate's Close() status, or CANCELLED. With a
  // `sink`, dense fp32 answers share the partition's weights (their `data` stays empty; see
  // PushPullAnswerSink) and the other slices' data is written into sink->take_buffer strings.
  // `waited` (may be empty) gets the nanoseconds the pull waited at the gate, on the thread that
  // runs `done`, just before it, when the pull was gated. Never blocks.
  void AnswerWhenOpen(ConsistencyGate& gate, std::vector<PullItem> items, v1::Encoding encoding,
                      std::shared_ptr<const std::atomic<bool>> cancelled, Done done,
                      std::shared_ptr<PushPullAnswerSink> sink = nullptr,
                      std::function<void(int64_t)> waited = {}) const;

 private:
  const Executor executor_;
  const std::shared_ptr<ShardCounters> counters_;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_PULL_ANSWER_H_
