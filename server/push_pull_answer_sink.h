// PushPullAnswerSink: where the weights of a PushPull answer go when the transport sends them
// without copying (server/grpc_parameter_service.cc).
#ifndef TESSERA_SERVER_PUSH_PULL_ANSWER_SINK_H_
#define TESSERA_SERVER_PUSH_PULL_ANSWER_SINK_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "server/shared_weights.h"

namespace tessera::server {

// Where the weight data of one PushPull answer goes, for a transport that sends it without
// copying it into the response (GrpcParameterService). One per request: the caller makes it and
// passes it to ParameterStore::PushPull, the store fills `shared` on the thread that then runs
// `done`, before it runs `done`, and the caller reads it in `done` (or later).
struct PushPullAnswerSink {
  // Optional: gives the string that the data of a slice that is copied (bf16 or fp16 encoded,
  // sparse rows) is written into, so that a transport can reuse buffers (their capacity is kept
  // when large enough); empty strings when unset.
  std::function<std::string()> take_buffer;
  // Filled by the store: for each answered dense slice in fp32, its index in the response's
  // `weights` (whose `data` is left empty) and its values, shared with the partition. Each is the
  // data of that slice bit for bit (little-endian fp32), and stays valid while it is held.
  std::vector<std::pair<int, SharedWeights>> shared;
};

}  // namespace tessera::server

#endif  // TESSERA_SERVER_PUSH_PULL_ANSWER_SINK_H_
