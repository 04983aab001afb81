#include "tests/hostile/methods.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/text_format.h"
#include "tessera/v1/job.grpc.pb.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::hostile {
namespace {

// grpc.health.v1 and grpc.reflection.v1alpha requests, for the methods whose generated code
// Debian does not ship (only what the requests need).
constexpr char kExtraProtos[] = R"pb(
  file {
    name: "hostile/health.proto"
    package: "grpc.health.v1"
    syntax: "proto3"
    message_type {
      name: "HealthCheckRequest"
      field { name: "service" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
    }
  }
  file {
    name: "hostile/reflection.proto"
    package: "grpc.reflection.v1alpha"
    syntax: "proto3"
    message_type {
      name: "ExtensionRequest"
      field { name: "containing_type" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
      field { name: "extension_number" number: 2 label: LABEL_OPTIONAL type: TYPE_INT32 }
    }
    message_type {
      name: "ServerReflectionRequest"
      field { name: "host" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
      field {
        name: "file_by_filename"
        number: 3
        label: LABEL_OPTIONAL
        type: TYPE_STRING
        oneof_index: 0
      }
      field {
        name: "file_containing_symbol"
        number: 4
        label: LABEL_OPTIONAL
        type: TYPE_STRING
        oneof_index: 0
      }
      field {
        name: "file_containing_extension"
        number: 5
        label: LABEL_OPTIONAL
        type: TYPE_MESSAGE
        type_name: ".grpc.reflection.v1alpha.ExtensionRequest"
        oneof_index: 0
      }
      field {
        name: "all_extension_numbers_of_type"
        number: 6
        label: LABEL_OPTIONAL
        type: TYPE_STRING
        oneof_index: 0
      }
      field {
        name: "list_services"
        number: 7
        label: LABEL_OPTIONAL
        type: TYPE_STRING
        oneof_index: 0
      }
      oneof_decl { name: "message_request" }
    }
  }
)pb";

}  // namespace

bool Prototypes::Init() {
  pb::FileDescriptorSet set;
  if (!pb::TextFormat::ParseFromString(kExtraProtos, &set)) return false;
  for (const pb::FileDescriptorProto& file : set.file()) {
    if (pool_.BuildFile(file) == nullptr) return false;
  }
  auto generated = [](const pb::Message& m) { return &m; };
  auto dynamic = [this](const char* name) -> const pb::Message* {
    const pb::Descriptor* d = pool_.FindMessageTypeByName(name);
    return d == nullptr ? nullptr : factory_.GetPrototype(d);
  };
  for (int i = 0; i < kNumMethods; ++i) {
    const std::string name = absl::StrCat(kMethods[i].service, "/", kMethods[i].name);
    const pb::Message* p = nullptr;
    const std::string m = kMethods[i].name;
    if (m == "PushPull" || m == "Push") p = generated(v1::PushPullRequest::default_instance());
    if (m == "Pull") p = generated(v1::PullRequest::default_instance());
    if (m == "CreateJobState") p = generated(v1::CreateJobStateRequest::default_instance());
    if (m == "UpdateMembership") p = generated(v1::UpdateMembershipRequest::default_instance());
    if (m == "DropJob") p = generated(v1::DropJobRequest::default_instance());
    if (m == "Checkpoint") p = generated(v1::CheckpointRequest::default_instance());
    if (m == "Restore") p = generated(v1::RestoreRequest::default_instance());
    if (m == "ReadCheckpoint") p = generated(v1::ReadCheckpointRequest::default_instance());
    if (m == "Fill") p = generated(v1::FillRequest::default_instance());
    if (m == "CreateJob") p = generated(v1::CreateJobRequest::default_instance());
    if (m == "GetJob") p = generated(v1::GetJobRequest::default_instance());
    if (m == "ListJobs") p = generated(v1::ListJobsRequest::default_instance());
    if (m == "CancelJob") p = generated(v1::CancelJobRequest::default_instance());
    if (m == "WatchJob") p = generated(v1::WatchJobRequest::default_instance());
    if (m == "CheckpointJob") p = generated(v1::CheckpointJobRequest::default_instance());
    if (m == "Register") p = generated(v1::RegisterRequest::default_instance());
    if (m == "Heartbeat") p = generated(v1::HeartbeatRequest::default_instance());
    if (m == "Deregister") p = generated(v1::DeregisterRequest::default_instance());
    if (m == "ListMembers") p = generated(v1::ListMembersRequest::default_instance());
    if (m == "WatchTasks") p = generated(v1::WatchTasksRequest::default_instance());
    if (m == "ReportProgress") p = generated(v1::ProgressReport::default_instance());
    if (m == "Check" || m == "Watch") p = dynamic("grpc.health.v1.HealthCheckRequest");
    if (m == "ServerReflectionInfo") {
      p = dynamic("grpc.reflection.v1alpha.ServerReflectionRequest");
    }
    if (p == nullptr) {
      std::fprintf(stderr, "hostile: no request type for %s\n", name.c_str());
      return false;
    }
    prototypes_[i] = p;
  }
  return true;
}

}  // namespace tessera::hostile
