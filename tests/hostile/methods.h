// The hostile test's contract: the daemons, the 25 methods and the codes each may answer to each
// kind of request (kMethods, THE table; docs/reliability.md "Hostile input"), and the request
// prototypes by method.
#ifndef TESSERA_TESTS_HOSTILE_METHODS_H_
#define TESSERA_TESTS_HOSTILE_METHODS_H_

#include <array>
#include <cstdint>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/status.h"

namespace tessera::hostile {

namespace pb = google::protobuf;

// --- The daemons and the services ----------------------------------------------------------------

enum DaemonKind { kCoordinator = 0, kShard0 = 1, kShard1 = 2, kWorker = 3, kNumDaemons = 4 };
inline constexpr const char* kDaemonNames[kNumDaemons] = {"coordinator", "shard-0", "shard-1",
                                                          "worker"};

// Which daemons serve a service.
enum ServedBy : uint32_t {
  kByCoordinator = 1u << kCoordinator,
  kByShards = (1u << kShard0) | (1u << kShard1),
  kByAll = (1u << kNumDaemons) - 1,
};

using CodeSet = uint32_t;
constexpr CodeSet C(grpc::StatusCode code) { return CodeSet{1} << static_cast<int>(code); }
inline constexpr CodeSet kOk = C(grpc::StatusCode::OK);
inline constexpr CodeSet kIa = C(grpc::StatusCode::INVALID_ARGUMENT);
inline constexpr CodeSet kNf = C(grpc::StatusCode::NOT_FOUND);
inline constexpr CodeSet kFp = C(grpc::StatusCode::FAILED_PRECONDITION);
inline constexpr CodeSet kRe = C(grpc::StatusCode::RESOURCE_EXHAUSTED);
inline constexpr CodeSet kAe = C(grpc::StatusCode::ALREADY_EXISTS);
inline constexpr CodeSet kDe = C(grpc::StatusCode::DEADLINE_EXCEEDED);
inline constexpr CodeSet kCa = C(grpc::StatusCode::CANCELLED);
inline constexpr CodeSet kAb = C(grpc::StatusCode::ABORTED);
inline constexpr CodeSet kIn = C(grpc::StatusCode::INTERNAL);
inline constexpr CodeSet kDl = C(grpc::StatusCode::DATA_LOSS);
inline constexpr CodeSet kUn = C(grpc::StatusCode::UNIMPLEMENTED);
inline constexpr CodeSet kUa = C(grpc::StatusCode::UNAVAILABLE);

enum class Kind { kGarbage = 0, kInvalid = 1, kRandom = 2, kOversize = 3 };
inline constexpr const char* kKindNames[] = {"garbage", "invalid", "random", "oversize"};

// One method and what its answers may be. This table is the contract the test enforces:
//   garbage   bytes protobuf cannot parse: the library's answer before any handler runs. gRPC
//             1.51's callback API (every Tessera service) answers UNIMPLEMENTED with an empty
//             message (grpcpp/impl/codegen/server_callback_handlers.h), not INTERNAL as its sync
//             API does; the health service "could not parse request", INVALID_ARGUMENT from
//             Check and INTERNAL from Watch; the reflection service (sync, bidi) ends OK
//             without an answer. PushPull, a raw method decoded by the shard with the PushPull
//             codec (common/push_pull_codec.h): INVALID_ARGUMENT, in the request's answer or
//             ending the stream;
//   invalid   a parseable request with one invalid edit: `invalid` (OK never);
//   random    random edits that may leave it valid: `random`;
//   oversize  over the receive limit: RESOURCE_EXHAUSTED from the library.
// A daemon that does not serve the service answers every kind with UNIMPLEMENTED (an oversize
// request may also get RESOURCE_EXHAUSTED first).
// Checkpoint and Restore may answer RESOURCE_EXHAUSTED (too many waiting checkpoint calls, or a
// restore that does not fit the shard's memory). DEADLINE_EXCEEDED is allowed only where the
// request may rightly wait: a pull gated on a step nobody reaches, a checkpoint of a step not
// reached, the open streams (Watch, WatchJob of a live job, WatchTasks). CANCELLED/ABORTED: a
// parked pull when the call ends or the job is dropped.
struct MethodSpec {
  const char* service;
  const char* name;
  uint32_t served_by;
  CodeSet invalid;
  CodeSet random;
  CodeSet garbage = kUn;
  bool long_lived = false;     // a stream that rightly stays open: short deadline
  bool multi_message = false;  // client stream (PushPull): 1-3 requests per call
};

inline constexpr char kPs[] = "tessera.v1.ParameterService";
inline constexpr char kJs[] = "tessera.v1.JobService";
inline constexpr char kCs[] = "tessera.v1.ClusterService";
inline constexpr char kHs[] = "grpc.health.v1.Health";
inline constexpr char kRs[] = "grpc.reflection.v1alpha.ServerReflection";

inline constexpr MethodSpec kMethods[] = {
    // service, method, served by, invalid, random (, garbage, long-lived, multi-message)
    // UNAVAILABLE: a push one step ahead of a BSP partition, or a pull two ahead (what a lagging
    // copy of a replicated job answers until it catches up).
    {kPs, "PushPull", kByShards, kIa | kNf | kFp,
     kOk | kIa | kNf | kFp | kRe | kDe | kCa | kAb | kUa, kIa, false, true},
    {kPs, "Pull", kByShards, kIa | kNf, kOk | kIa | kNf | kRe | kDe | kCa | kAb | kUa},
    {kPs, "Push", kByShards, kIa | kNf | kFp, kOk | kIa | kNf | kFp | kRe | kUa},
    {kPs, "CreateJobState", kByShards, kIa | kFp | kRe, kOk | kIa | kFp | kRe},
    {kPs, "UpdateMembership", kByShards, kIa | kNf, kOk | kIa | kNf},
    {kPs, "DropJob", kByShards, kIa | kNf, kOk | kIa | kNf},
    {kPs, "Checkpoint", kByShards, kIa | kNf | kFp | kRe, kOk | kIa | kNf | kFp | kRe | kDe},
    {kPs, "Restore", kByShards, kIa | kNf | kDl | kFp | kRe, kOk | kIa | kNf | kDl | kFp | kRe},
    {kPs, "ReadCheckpoint", kByShards, kIa | kNf | kFp, kOk | kIa | kNf | kFp},
    {kPs, "Fill", kByShards, kIa, kOk | kIa | kDl | kRe},
    {kJs, "CreateJob", kByCoordinator, kIa, kOk | kIa},
    {kJs, "GetJob", kByCoordinator, kIa | kNf, kOk | kIa | kNf},
    {kJs, "ListJobs", kByCoordinator, kIa, kOk | kIa},
    {kJs, "CancelJob", kByCoordinator, kIa | kNf, kOk | kIa | kNf | kFp},
    {kJs, "WatchJob", kByCoordinator, kIa | kNf, kOk | kIa | kNf | kDe, kUn, true},
    {kJs, "CheckpointJob", kByCoordinator, kIa | kNf | kFp, kIa | kNf | kFp},
    {kCs, "Register", kByCoordinator, kIa | kAe, kOk | kIa | kAe},
    {kCs, "Heartbeat", kByCoordinator, kIa | kNf, kOk | kIa | kNf},
    {kCs, "Deregister", kByCoordinator, kIa | kNf, kOk | kIa | kNf},
    {kCs, "ListMembers", kByCoordinator, 0, kOk},
    {kCs, "WatchTasks", kByCoordinator, kIa | kNf, kIa | kNf | kDe | kAb, kUn, true},
    {kCs, "ReportProgress", kByCoordinator, kIa | kNf, kOk | kIa | kNf},
    // gRPC's health service refuses a service name it cannot hold ("could not parse request").
    {kHs, "Check", kByAll, kNf, kOk | kNf | kIa, kIa},
    {kHs, "Watch", kByAll, 0, kOk | kDe | kIn, kIn, true},
    {kRs, "ServerReflectionInfo", kByAll, 0, kOk, kOk},
};
inline constexpr int kNumMethods = sizeof(kMethods) / sizeof(kMethods[0]);

// The request prototypes, by method index.
class Prototypes {
 public:
  // Builds the prototypes; false (and a line on stderr) when one is missing.
  bool Init();
  const pb::Message* Get(int method) const { return prototypes_[method]; }

 private:
  pb::DescriptorPool pool_;
  pb::DynamicMessageFactory factory_{&pool_};
  std::array<const pb::Message*, kNumMethods> prototypes_{};
};

}  // namespace tessera::hostile

#endif  // TESSERA_TESTS_HOSTILE_METHODS_H_
