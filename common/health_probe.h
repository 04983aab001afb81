// A client-side probe of a server's grpc.health.v1 service: the check launchers and tests use to
// see that a daemon they started serves (common/child_process.h WaitUntilServing).
#ifndef TESSERA_COMMON_HEALTH_PROBE_H_
#define TESSERA_COMMON_HEALTH_PROBE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "grpcpp/channel.h"

namespace tessera {

// One grpc.health.v1.Health/Check of the whole server (service ""), over a new channel made with
// `credentials` (default: plaintext, no token). True when it answered SERVING within `timeout`;
// false for NOT_SERVING, an error or no answer. Blocks up to `timeout`; thread-safe.
bool IsServing(const std::string& address, absl::Duration timeout,
               const ClientCredentials& credentials = {});

// The same check over an existing channel, by `deadline`: OK when SERVING, FAILED_PRECONDITION
// when the server answered another status (NOT_SERVING while it drains), else the call's error
// (DEADLINE_EXCEEDED: nothing answered in time; UNAVAILABLE: no connection).
absl::Status CheckHealth(grpc::Channel* channel, absl::Time deadline);

}  // namespace tessera

#endif  // TESSERA_COMMON_HEALTH_PROBE_H_
