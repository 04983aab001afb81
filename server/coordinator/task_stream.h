// TaskStream: a worker's WatchTasks stream as the coordinator sees it. The gRPC adapter
// (grpc_coordinator_service.cc) implements it with a write reactor; tests fake it.
#ifndef TESSERA_SERVER_COORDINATOR_TASK_STREAM_H_
#define TESSERA_SERVER_COORDINATOR_TASK_STREAM_H_

#include "absl/status/status.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

// Implementations never block: Send queues. Thread-safe. The coordinator calls Send and Close
// while holding its own lock, so they must never call into the coordinator.
class TaskStream {
 public:
  virtual ~TaskStream() = default;
  virtual void Send(const v1::TaskEvent& event) = 0;
  // Ends the stream with `status` once the queued events are written.
  virtual void Close(const absl::Status& status) = 0;
  // The stream has ended (the worker went away, or Close finished). The coordinator polls this
  // on every tick, so a transport never calls back into the coordinator from its callbacks.
  virtual bool closed() const = 0;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_TASK_STREAM_H_
