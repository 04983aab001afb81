#include "common/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tessera {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  absl::string_view message = status.message();
  if (message.size() <= kMaxStatusMessageBytes) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(message));
  }
  // Messages quote request fields; a hostile request must not make a header that the peer's
  // metadata limit (8 KiB by default) refuses, which would close its whole connection.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      absl::StrCat(message.substr(0, kMaxStatusMessageBytes), "... (",
                                   message.size() - kMaxStatusMessageBytes, " more bytes)"));
}

absl::Status StatusFromCode(int code, absl::string_view message) {
  if (code < 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(absl::StrCat("unknown status code ", code, ": ", message));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return StatusFromCode(status.error_code(), status.error_message());
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view peer) {
  if (status.ok()) return absl::OkStatus();
  return StatusFromCode(status.error_code(), absl::StrCat(peer, ": ", status.error_message()));
}

}  // namespace tessera
