// The one place where absl::Status and grpc::Status convert into each other.
#ifndef TESSERA_COMMON_GRPC_STATUS_H_
#define TESSERA_COMMON_GRPC_STATUS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace tessera {

// Messages longer than this are cut (with a note of how much) by ToGrpcStatus.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// The same code and message; a message over kMaxStatusMessageBytes is cut to that length plus
// "... (N more bytes)", so an error that quotes a huge request field still fits in a header.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// FromGrpcStatus with "<peer>: " in front of the message, so a caller knows which server failed.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer);

// Same as absl::Status(code, message) for a numeric code from the wire; unknown codes map to
// UNKNOWN.
absl::Status StatusFromCode(int code, absl::string_view message);

}  // namespace tessera

#endif  // TESSERA_COMMON_GRPC_STATUS_H_
