// A server interceptor that keeps grpc.reflection.v1alpha requests from growing the process's
// generated DescriptorPool (issue #6, test 7).
//
// gRPC's reflection service resolves every requested file and symbol name in
// DescriptorPool::generated_pool(). A name that the pool does not hold is looked up in the
// pool's fallback database and, when that fails too, remembered for good in the pool's
// "known bad" sets (protobuf 3.21 DescriptorPool::Tables::known_bad_files_ / known_bad_symbols_),
// which nothing ever clears: every distinct unknown name a client sends (up to the 4 MiB message
// limit each) stays in memory for the life of the daemon. The guard replaces each requested
// name that is not one of the finite set of names the linked-in .proto files declare with the
// empty name before the service sees it, so the answer is still NOT_FOUND and the pool can
// remember at most that finite set plus "". The answer's original_request echoes "" for such a
// name.
#ifndef TESSERA_COMMON_REFLECTION_GUARD_H_
#define TESSERA_COMMON_REFLECTION_GUARD_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/server_interceptor.h"

namespace tessera {

// The file names and fully-qualified symbol names (packages and their prefixes, messages,
// fields, oneofs, enums, enum values, services, methods, extensions) that the .proto files
// linked into this binary declare, read once from protobuf's generated database without building
// descriptors. Immutable and thread-safe after construction.
class ReflectionNames {
 public:
  // The names of this process, built on first use.
  static const ReflectionNames& Get();

  bool HasFile(absl::string_view name) const { return files_.contains(name); }
  bool HasSymbol(absl::string_view name) const { return symbols_.contains(name); }
  size_t num_files() const { return files_.size(); }
  size_t num_symbols() const { return symbols_.size(); }

 private:
  ReflectionNames();

  absl::flat_hash_set<std::string> files_;
  absl::flat_hash_set<std::string> symbols_;
};

// A factory for ServerBuilder::experimental().SetInterceptorCreators(): its interceptors rewrite
// unknown names in /grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo requests as
// described above and pass every other call through untouched. Thread-safe.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewReflectionGuardFactory();

}  // namespace tessera

#endif  // TESSERA_COMMON_REFLECTION_GUARD_H_
