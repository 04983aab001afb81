// A client-side probe of a server's grpc.health.v1 service: the check launchers and tests use to
// see that a daemon they started serves (common/child_process.h WaitUntilServing).
#ifndef TESSERA_COMMON_HEALTH_PROBE_H_
#define TESSERA_COMMON_HEALTH_PROBE_H_

#include <string>

#include "absl/time/time.h"
#include "common/security.h"

namespace tessera {

// One grpc.health.v1.Health/Check of the whole server (service ""), over a new channel made with
// `credentials` (default: plaintext, no token). True when it answered SERVING within `timeout`;
// false for NOT_SERVING, an error or no answer. Blocks up to `timeout`; thread-safe.
bool IsServing(const std::string& address, absl::Duration timeout,
               const ClientCredentials& credentials = {});

}  // namespace tessera

#endif  // TESSERA_COMMON_HEALTH_PROBE_H_
