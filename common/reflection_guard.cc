#include "common/reflection_guard.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/descriptor_database.h"
#include "google/protobuf/message.h"

namespace tessera {
namespace {

namespace pb = google::protobuf;

constexpr char kReflectionMethod[] =
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
constexpr char kReflectionRequest[] = "grpc.reflection.v1alpha.ServerReflectionRequest";

std::string Qualify(const std::string& scope, const std::string& name) {
  return scope.empty() ? name : absl::StrCat(scope, ".", name);
}

void AddEnum(const pb::EnumDescriptorProto& e, const std::string& scope,
             absl::flat_hash_set<std::string>* out) {
  const std::string full = Qualify(scope, e.name());
  out->insert(full);
  for (const pb::EnumValueDescriptorProto& v : e.value()) {
    out->insert(Qualify(scope, v.name()));  // C++ scoping: values are the enum's siblings
    out->insert(Qualify(full, v.name()));
  }
}

void AddMessage(const pb::DescriptorProto& m, const std::string& scope,
                absl::flat_hash_set<std::string>* out) {
  const std::string full = Qualify(scope, m.name());
  out->insert(full);
  for (const pb::FieldDescriptorProto& f : m.field()) out->insert(Qualify(full, f.name()));
  for (const pb::FieldDescriptorProto& f : m.extension()) out->insert(Qualify(full, f.name()));
  for (const pb::OneofDescriptorProto& o : m.oneof_decl()) out->insert(Qualify(full, o.name()));
  for (const pb::DescriptorProto& nested : m.nested_type()) AddMessage(nested, full, out);
  for (const pb::EnumDescriptorProto& e : m.enum_type()) AddEnum(e, full, out);
}

// Rewrites `field` (a string field of `message`) to "" unless `known` holds its value.
template <typename Known>
void Guard(pb::Message* message, const pb::FieldDescriptor* field, const Known& known) {
  if (field == nullptr) return;
  const pb::Reflection* r = message->GetReflection();
  if (!r->HasField(*message, field)) return;
  std::string scratch;
  const std::string& value = r->GetStringReference(*message, field, &scratch);
  if (!known(value)) r->SetString(message, field, std::string());
}

class ReflectionGuard final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_MESSAGE)) {
      // The sync reflection service hands its ServerReflectionRequest (a generated message,
      // single inheritance from Message) to the interceptors as void*.
      if (void* received = methods->GetRecvMessage()) Rewrite(static_cast<pb::Message*>(received));
    }
    methods->Proceed();
  }

 private:
  static void Rewrite(pb::Message* request) {
    const pb::Descriptor* d = request->GetDescriptor();
    if (d->full_name() != kReflectionRequest) return;
    const ReflectionNames& names = ReflectionNames::Get();
    auto file = [&names](const std::string& n) { return names.HasFile(n); };
    auto symbol = [&names](const std::string& n) { return names.HasSymbol(n); };
    Guard(request, d->FindFieldByName("file_by_filename"), file);
    Guard(request, d->FindFieldByName("file_containing_symbol"), symbol);
    Guard(request, d->FindFieldByName("all_extension_numbers_of_type"), symbol);
    const pb::FieldDescriptor* extension = d->FindFieldByName("file_containing_extension");
    if (extension != nullptr && request->GetReflection()->HasField(*request, extension)) {
      pb::Message* sub = request->GetReflection()->MutableMessage(request, extension);
      Guard(sub, sub->GetDescriptor()->FindFieldByName("containing_type"), symbol);
    }
  }
};

class ReflectionGuardFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (info->method() == nullptr || std::string(info->method()) != kReflectionMethod) {
      return nullptr;
    }
    return new ReflectionGuard();
  }
};

}  // namespace

const ReflectionNames& ReflectionNames::Get() {
  static const ReflectionNames* const names = new ReflectionNames();
  return *names;
}

ReflectionNames::ReflectionNames() {
  pb::DescriptorDatabase* db = pb::DescriptorPool::internal_generated_database();
  std::vector<std::string> files;
  if (db == nullptr || !db->FindAllFileNames(&files)) return;
  for (const std::string& name : files) {
    pb::FileDescriptorProto file;
    if (!db->FindFileByName(name, &file)) continue;
    files_.insert(name);
    const std::string& package = file.package();
    for (size_t dot = package.find('.'); dot != std::string::npos;
         dot = package.find('.', dot + 1)) {
      symbols_.insert(package.substr(0, dot));
    }
    if (!package.empty()) symbols_.insert(package);
    for (const pb::DescriptorProto& m : file.message_type()) AddMessage(m, package, &symbols_);
    for (const pb::EnumDescriptorProto& e : file.enum_type()) AddEnum(e, package, &symbols_);
    for (const pb::FieldDescriptorProto& f : file.extension()) {
      symbols_.insert(Qualify(package, f.name()));
    }
    for (const pb::ServiceDescriptorProto& s : file.service()) {
      const std::string service = Qualify(package, s.name());
      symbols_.insert(service);
      for (const pb::MethodDescriptorProto& m : s.method()) {
        symbols_.insert(Qualify(service, m.name()));
      }
    }
  }
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewReflectionGuardFactory() {
  return std::make_unique<ReflectionGuardFactory>();
}

}  // namespace tessera
