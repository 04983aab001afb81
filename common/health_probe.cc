#include "common/health_probe.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/byte_buffer.h"

namespace tessera {

absl::Status CheckHealth(grpc::Channel* channel, absl::Time deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  // HealthCheckRequest{service: ""} serialises to no bytes; HealthCheckResponse{status: SERVING}
  // to the two bytes 08 01. Raw bytes keep the health proto out of our build.
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                         grpc::internal::RpcMethod::NORMAL_RPC);
  const grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel, method, &context, request, &response);
  if (!status.ok()) {
    return FromGrpcStatus(status, "health check");
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::DataLossError("health check: unreadable answer");
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (bytes != std::string("\x08\x01", 2)) {
    return absl::FailedPreconditionError("health check: the server answered, but not SERVING");
  }
  return absl::OkStatus();
}

bool IsServing(const std::string& address, absl::Duration timeout,
               const ClientCredentials& credentials) {
  auto channel = credentials.CreateChannel(address);
  return CheckHealth(channel.get(), absl::Now() + timeout).ok();
}

}  // namespace tessera
