#include "common/reflection_guard.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_server.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

namespace pb = google::protobuf;

TEST(ReflectionNamesTest, HoldsTheLinkedFilesAndTheirSymbolsOnly) {
  const ReflectionNames& names = ReflectionNames::Get();
  EXPECT_TRUE(names.HasFile("google/protobuf/descriptor.proto"));
  EXPECT_TRUE(names.HasSymbol("google"));
  EXPECT_TRUE(names.HasSymbol("google.protobuf"));
  EXPECT_TRUE(names.HasSymbol("google.protobuf.FileDescriptorProto"));
  EXPECT_TRUE(names.HasSymbol("google.protobuf.FileDescriptorProto.message_type"));
  EXPECT_TRUE(names.HasSymbol("google.protobuf.FieldDescriptorProto.Type"));
  EXPECT_TRUE(names.HasSymbol("google.protobuf.FieldDescriptorProto.TYPE_INT32"));
  EXPECT_TRUE(names.HasSymbol("google.protobuf.FieldOptions.CType.STRING"));
  EXPECT_FALSE(names.HasFile("no/such/file.proto"));
  EXPECT_FALSE(names.HasFile(""));
  EXPECT_FALSE(names.HasSymbol("google.protobuf.FileDescriptorProto.no_such_field"));
  EXPECT_FALSE(names.HasSymbol(std::string(70000, 'A')));
  EXPECT_FALSE(names.HasSymbol(""));
  EXPECT_GT(names.num_files(), 0u);
  EXPECT_GT(names.num_symbols(), names.num_files());
}

// ServerReflectionRequest{file_containing_symbol: symbol} (field 4) or {file_by_filename: file}
// (field 3), encoded by hand.
std::string Request(int field, const std::string& name) {
  std::string out;
  pb::io::StringOutputStream stream(&out);
  pb::io::CodedOutputStream coded(&stream);
  coded.WriteTag(static_cast<uint32_t>(field << 3 | 2));
  coded.WriteVarint32(static_cast<uint32_t>(name.size()));
  coded.WriteString(name);
  return out;
}

struct Answer {
  std::string echoed;   // original_request's name (same field as sent)
  int error_code = -1;  // error_response.error_code, -1 without one
  bool file_found = false;
};

Answer Parse(const std::string& bytes, int field) {
  Answer answer;
  pb::UnknownFieldSet response;
  EXPECT_TRUE(response.ParseFromString(bytes));
  for (int i = 0; i < response.field_count(); ++i) {
    const pb::UnknownField& f = response.field(i);
    if (f.type() != pb::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    pb::UnknownFieldSet sub;
    if (f.number() == 2 && sub.ParseFromString(f.length_delimited())) {
      for (int j = 0; j < sub.field_count(); ++j) {
        if (sub.field(j).number() == field) answer.echoed = sub.field(j).length_delimited();
      }
    } else if (f.number() == 4) {
      answer.file_found = true;
    } else if (f.number() == 7 && sub.ParseFromString(f.length_delimited())) {
      for (int j = 0; j < sub.field_count(); ++j) {
        if (sub.field(j).number() == 1) answer.error_code = static_cast<int>(sub.field(j).varint());
      }
    }
  }
  return answer;
}

// Sends each request on one ServerReflectionInfo stream and parses the answers.
std::vector<Answer> Ask(int port, int field, const std::vector<std::string>& names) {
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), method, &context));
  std::vector<Answer> answers;
  for (const std::string& name : names) {
    grpc::Slice slice(Request(field, name));
    grpc::ByteBuffer request(&slice, 1);
    EXPECT_TRUE(stream->Write(request));
    grpc::ByteBuffer response;
    EXPECT_TRUE(stream->Read(&response));
    std::vector<grpc::Slice> slices;
    std::string bytes;
    EXPECT_TRUE(response.Dump(&slices).ok());
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    answers.push_back(Parse(bytes, field));
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  return answers;
}

TEST(ReflectionGuardTest, UnknownNamesReachTheServiceAsTheEmptyName) {
  GrpcServerOptions options;
  options.listen = "127.0.0.1:0";
  absl::StatusOr<StartedGrpcServer> started = StartGrpcServer(options);
  ASSERT_TRUE(started.ok()) << started.status();

  constexpr int kSymbol = 4;
  constexpr int kFile = 3;
  const std::string long_name(70000, 'A');
  std::vector<Answer> symbols =
      Ask(started->port, kSymbol,
          {"google.protobuf.FileDescriptorProto", "tessera.no.Such", long_name,
           "google.protobuf.FileDescriptorProto.no_such_field"});
  ASSERT_EQ(symbols.size(), 4u);
  EXPECT_TRUE(symbols[0].file_found);
  EXPECT_EQ(symbols[0].echoed, "google.protobuf.FileDescriptorProto");
  for (int i = 1; i < 4; ++i) {
    EXPECT_FALSE(symbols[i].file_found) << i;
    EXPECT_EQ(symbols[i].error_code, static_cast<int>(grpc::StatusCode::NOT_FOUND)) << i;
    EXPECT_EQ(symbols[i].echoed, "") << i;  // rewritten before the pool saw it
  }

  std::vector<Answer> files =
      Ask(started->port, kFile, {"google/protobuf/descriptor.proto", "../../etc/passwd"});
  ASSERT_EQ(files.size(), 2u);
  EXPECT_TRUE(files[0].file_found);
  EXPECT_EQ(files[0].echoed, "google/protobuf/descriptor.proto");
  EXPECT_FALSE(files[1].file_found);
  EXPECT_EQ(files[1].error_code, static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_EQ(files[1].echoed, "");

  started->server->Shutdown();
}

}  // namespace
}  // namespace tessera
