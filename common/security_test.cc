// Security against an in-process gRPC server on 127.0.0.1 serving the health service, with a PKI
// made by `openssl` for the test: TLS, mutual TLS, the bearer token, Reload() and the refusals.
#include "common/security.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr char kOpensslConfig[] = R"([req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
authorityKeyIdentifier = keyid
)";

void WriteFile(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::trunc);
  out << content;
  ASSERT_TRUE(out.good()) << path;
  chmod(path.c_str(), 0600);
}

// Runs a shell command; fails the test with its output when it exits non-zero.
void Sh(const std::string& dir, const std::string& command) {
  const std::string full = absl::StrCat("cd ", dir, " && (", command, ") >> openssl.log 2>&1");
  const int rc = std::system(full.c_str());
  ASSERT_EQ(rc, 0) << command << " (log: " << dir << "/openssl.log)";
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/tessera-security-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = new std::string(tmpl);
    const std::string& d = *dir_;
    WriteFile(d + "/openssl.cnf", kOpensslConfig);
    // A CA and its leaf certificates (server: SAN IP:127.0.0.1, DNS:localhost; client), and a
    // second, unrelated CA with its own client certificate.
    for (const char* ca : {"ca", "wrongca"}) {
      Sh(d, absl::StrCat("openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256", " -out ",
                         ca, ".key && openssl req -x509 -new -config openssl.cnf -extensions ca",
                         " -key ", ca, ".key -subj /CN=", ca, " -days 2 -out ", ca, ".pem"));
    }
    int serial = 1;
    for (auto [leaf, ca] : std::vector<std::pair<const char*, const char*>>{
             {"server", "ca"}, {"client", "ca"}, {"wrongclient", "wrongca"}}) {
      Sh(d, absl::StrCat("openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256", " -out ",
                         leaf, ".key && openssl req -new -config openssl.cnf -key ", leaf,
                         ".key -subj /CN=", leaf, " -out ", leaf, ".csr && openssl x509 -req -in ",
                         leaf, ".csr -CA ", ca, ".pem -CAkey ", ca, ".key -set_serial ", serial++,
                         " -days 2 -extfile openssl.cnf -extensions leaf -out ", leaf, ".pem"));
    }
    WriteFile(d + "/token", "s3cret-token-1\n");
    WriteFile(d + "/badtoken", "not-the-token\n");
    // As long as the right one, differing only in its last character.
    WriteFile(d + "/neartoken", "s3cret-token-2\n");
  }

  static void TearDownTestSuite() {
    if (dir_ != nullptr) {
      std::system(absl::StrCat("rm -rf ", *dir_).c_str());
      delete dir_;
      dir_ = nullptr;
    }
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }

  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }

  // Starts the health service with `options`' server credentials on 127.0.0.1:0.
  void StartServer(const SecurityOptions& options) {
    auto security = Security::Create(options);
    ASSERT_TRUE(security.ok()) << security.status();
    server_security_ = *std::move(security);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", server_security_->ServerCredentials(), &port_);
    // A server needs one service of its own beside health; every method is UNIMPLEMENTED.
    builder.RegisterService(&unused_service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  // A serving process's options: TLS with the server certificate, the CA its own channels
  // verify with (a token needs it), mutual TLS, the token file (empty: none).
  static SecurityOptions TlsServer(bool mutual, const std::string& token = "token") {
    SecurityOptions o;
    o.tls_cert = Path("server.pem");
    o.tls_key = Path("server.key");
    o.tls_ca = Path("ca.pem");
    if (mutual) o.tls_client_ca = Path("ca.pem");
    if (!token.empty()) o.auth_token_file = Path(token);
    return o;
  }

  // A dialing-only process's options (serves no gRPC): TLS with the CA, the token file (empty:
  // none), a client certificate.
  static SecurityOptions TlsClient(const std::string& token, const std::string& cert = "") {
    SecurityOptions o;
    o.serves_grpc = false;
    o.tls_ca = Path("ca.pem");
    if (!token.empty()) o.auth_token_file = Path(token);
    if (!cert.empty()) {
      o.tls_cert = Path(cert + ".pem");
      o.tls_key = Path(cert + ".key");
    }
    return o;
  }

  std::string Target() const { return absl::StrCat("127.0.0.1:", port_); }

  // grpc.health.v1.Health/Check of the whole server, as raw bytes (no health proto needed).
  // OK only when it answered SERVING.
  static grpc::Status Check(const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Slice empty("", 0);
    grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                           grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(), method, &context, request, &response);
    if (!status.ok()) return status;
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(response.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    if (bytes != std::string("\x08\x01", 2)) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "health answered other than SERVING");
    }
    return status;
  }

  grpc::Status CheckWith(const SecurityOptions& client) {
    auto security = Security::Create(client);
    EXPECT_TRUE(security.ok()) << security.status();
    if (!security.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "no client security");
    return Check((*security)->Client().CreateChannel(Target()));
  }

  static std::string* dir_;
  v1::ClusterService::CallbackService unused_service_;
  std::unique_ptr<Security> server_security_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

std::string* SecurityTest::dir_ = nullptr;

TEST_F(SecurityTest, DefaultsArePlaintext) {
  StartServer(SecurityOptions{});
  EXPECT_FALSE(server_security_->server_tls());
  EXPECT_FALSE(server_security_->client_tls());
  EXPECT_FALSE(server_security_->has_token());
  grpc::Status status = Check(ClientCredentials{}.CreateChannel(Target()));
  EXPECT_TRUE(status.ok()) << status.error_message();
  status = CheckWith(SecurityOptions{});
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(SecurityTest, TlsWithTheRightTokenIsServed) {
  StartServer(TlsServer(/*mutual=*/false));
  EXPECT_TRUE(server_security_->server_tls());
  EXPECT_TRUE(server_security_->has_token());
  const grpc::Status status = CheckWith(TlsClient("token"));
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
}

TEST_F(SecurityTest, MissingOrBadTokenIsUnauthenticated) {
  StartServer(TlsServer(/*mutual=*/false));
  const AuthFailureCounts before = AuthFailures();
  grpc::Status status = CheckWith(TlsClient(""));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(status.error_message(), HasSubstr("missing bearer token"));
  status = CheckWith(TlsClient("badtoken"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(status.error_message(), HasSubstr("bad bearer token"));
  status = CheckWith(TlsClient("neartoken"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(status.error_message(), HasSubstr("bad bearer token"));
  // Counted for tessera_auth_failures_total; a call with the right token is not.
  EXPECT_TRUE(CheckWith(TlsClient("token")).ok());
  const AuthFailureCounts after = AuthFailures();
  EXPECT_EQ(after.missing_token - before.missing_token, 1u);
  EXPECT_EQ(after.bad_token - before.bad_token, 2u);
}

TEST_F(SecurityTest, PlaintextClientOfATlsServerIsUnavailable) {
  StartServer(TlsServer(/*mutual=*/false));
  const grpc::Status status = Check(ClientCredentials{}.CreateChannel(Target()));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(SecurityTest, TlsClientOfAPlaintextServerIsUnavailable) {
  StartServer(SecurityOptions{});
  const grpc::Status status = CheckWith(TlsClient(""));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateFromTheRightCa) {
  StartServer(TlsServer(/*mutual=*/true));
  grpc::Status status = CheckWith(TlsClient("token"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  status = CheckWith(TlsClient("token", "wrongclient"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  status = CheckWith(TlsClient("badtoken", "client"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
  status = CheckWith(TlsClient("token", "client"));
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
}

TEST_F(SecurityTest, ServerNameOverrideIsChecked) {
  StartServer(TlsServer(/*mutual=*/false));
  SecurityOptions client = TlsClient("token");
  client.tls_server_name = "localhost";  // in the certificate's SAN
  grpc::Status status = CheckWith(client);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  client.tls_server_name = "shard.example.org";  // not in it
  status = CheckWith(client);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(SecurityTest, ReloadReplacesTheTokenOnBothSides) {
  WriteFile(Path("rtoken"), "first-token\n");
  WriteFile(Path("rtoken-client"), "first-token\n");
  StartServer(TlsServer(/*mutual=*/false, "rtoken"));
  auto client = Security::Create(TlsClient("rtoken-client"));
  ASSERT_TRUE(client.ok()) << client.status();
  std::shared_ptr<grpc::Channel> channel = (*client)->Client().CreateChannel(Target());
  ASSERT_TRUE(Check(channel).ok());

  WriteFile(Path("rtoken"), "  second-token  \nignored second line\n");
  ASSERT_TRUE(server_security_->Reload().ok());
  // The open channel still sends the old token: refused.
  grpc::Status status = Check(channel);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
  // The client reloads: the same channel now sends the new one.
  WriteFile(Path("rtoken-client"), "second-token\n");
  ASSERT_TRUE((*client)->Reload().ok());
  status = Check(channel);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();

  // A failed reload keeps the token in force.
  WriteFile(Path("rtoken"), "\n");
  const absl::Status reload = server_security_->Reload();
  EXPECT_EQ(reload.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reload.message()), HasSubstr("--auth_token_file"));
  status = Check(channel);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
}

TEST_F(SecurityTest, ReloadReReadsTheCaForNewChannels) {
  StartServer(TlsServer(/*mutual=*/false));
  Sh(*dir_, "cp ca.pem rca.pem && cp token rtoken2");
  SecurityOptions options = TlsClient("rtoken2");
  options.tls_ca = Path("rca.pem");
  options.certificate_refresh_seconds = 3600;  // here only Create() and Reload() read the files
  auto client = Security::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Check((*client)->Client().CreateChannel(Target())).ok());

  // Not PEM: refused, the old CA stays in force for new channels.
  WriteFile(Path("rca.pem"), "garbage\n");
  const absl::Status bad = (*client)->Reload();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("--tls_ca"));
  grpc::Status status = Check((*client)->Client().CreateChannel(Target()));
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();

  // Another CA, which did not sign the server's certificate: new channels fail the handshake.
  Sh(*dir_, "cp wrongca.pem rca.pem");
  ASSERT_TRUE((*client)->Reload().ok());
  status = Check((*client)->Client().CreateChannel(Target()));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

// Without any Reload(), an existing channel uses a rotated CA and a rotated client certificate
// on its next handshake: the channels' file watcher re-reads them (every second here).
TEST_F(SecurityTest, ExistingChannelsUseRotatedCaAndClientCertificate) {
  StartServer(TlsServer(/*mutual=*/true));
  grpc::ChannelArguments args;  // reconnect quickly after a failed handshake
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  // Checks on `channel` until OK, at most 15 s (or 150 tries).
  auto serving_within_15s = [](const std::shared_ptr<grpc::Channel>& channel) {
    const absl::Time deadline = absl::Now() + absl::Seconds(15);
    grpc::Status status;
    for (int i = 0; i < 150 && absl::Now() < deadline; ++i) {
      status = Check(channel);
      if (status.ok()) return status;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return status;
  };

  // The CA: a channel that trusts the wrong one, then the file is replaced by the right one.
  Sh(*dir_, "cp wrongca.pem rotca.pem && cp client.pem rotc1.pem && cp client.key rotc1.key");
  SecurityOptions ca_options = TlsClient("token");
  ca_options.tls_ca = Path("rotca.pem");
  ca_options.tls_cert = Path("rotc1.pem");
  ca_options.tls_key = Path("rotc1.key");
  ca_options.certificate_refresh_seconds = 1;
  auto ca_client = Security::Create(ca_options);
  ASSERT_TRUE(ca_client.ok()) << ca_client.status();
  std::shared_ptr<grpc::Channel> ca_channel = (*ca_client)->Client().CreateChannel(Target(), args);
  grpc::Status status = Check(ca_channel);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  Sh(*dir_, "cp ca.pem rotca.tmp && mv rotca.tmp rotca.pem");
  status = serving_within_15s(ca_channel);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();

  // The client certificate: one the server's CA did not sign, then the right one.
  Sh(*dir_, "cp ca.pem rotca2.pem && cp wrongclient.pem rotc2.pem && cp wrongclient.key rotc2.key");
  SecurityOptions cert_options = TlsClient("token");
  cert_options.tls_ca = Path("rotca2.pem");
  cert_options.tls_cert = Path("rotc2.pem");
  cert_options.tls_key = Path("rotc2.key");
  cert_options.certificate_refresh_seconds = 1;
  auto cert_client = Security::Create(cert_options);
  ASSERT_TRUE(cert_client.ok()) << cert_client.status();
  std::shared_ptr<grpc::Channel> cert_channel =
      (*cert_client)->Client().CreateChannel(Target(), args);
  status = Check(cert_channel);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  Sh(*dir_,
     "cp client.key rotc2.key.tmp && cp client.pem rotc2.pem.tmp && mv rotc2.key.tmp rotc2.key && "
     "mv rotc2.pem.tmp rotc2.pem");
  status = serving_within_15s(cert_channel);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
}

TEST_F(SecurityTest, CreateRefusesBadCombinationsNamingTheFlag) {
  struct Case {
    const char* name;
    SecurityOptions options;
    const char* flag;
  };
  std::vector<Case> cases;
  SecurityOptions o;
  o.tls_key = Path("server.key");
  cases.push_back({"key without cert", o, "--tls_key"});
  o = {};
  o.tls_cert = Path("server.pem");
  cases.push_back({"cert without key", o, "--tls_cert"});
  o = {};
  o.tls_client_ca = Path("ca.pem");
  cases.push_back({"client CA without cert", o, "--tls_client_ca"});
  o = {};
  o.auth_token_file = Path("token");
  cases.push_back({"token in plaintext", o, "--auth_token_file"});
  o = {};
  o.tls_ca = Path("does-not-exist.pem");
  cases.push_back({"missing CA file", o, "--tls_ca"});
  o = TlsServer(false, "");
  o.tls_cert = Path("token");
  cases.push_back({"cert not PEM", o, "--tls_cert"});
  o = TlsServer(false, "");
  o.tls_key = Path("server.pem");
  cases.push_back({"key file holds a certificate", o, "--tls_key"});
  WriteFile(Path("empty"), "  \n");
  o = TlsServer(false, "empty");
  cases.push_back({"empty token file", o, "--auth_token_file"});
  for (const Case& c : cases) {
    auto security = Security::Create(c.options);
    ASSERT_FALSE(security.ok()) << c.name;
    EXPECT_EQ(security.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(security.status().message()), HasSubstr(c.flag)) << c.name;
  }
}

// A token travels only over TLS: without --tls_ca (the channels would be plaintext) it is
// refused in every process; a process that serves gRPC also needs --tls_cert/--tls_key (its
// listener could not check the token); one that only dials does not.
TEST_F(SecurityTest, TokenNeedsTlsCaAndOnAServingProcessACertificate) {
  struct Refused {
    const char* name;
    SecurityOptions options;
    const char* needed;  // the flag the message says is missing
  };
  std::vector<Refused> refused;
  SecurityOptions o = TlsClient("token");
  o.tls_ca.clear();
  refused.push_back({"dialing only, no --tls_ca", o, "--tls_ca"});
  o = TlsServer(/*mutual=*/false);
  o.tls_ca.clear();
  refused.push_back({"serving TLS, no --tls_ca", o, "--tls_ca"});
  o = TlsClient("token");
  o.serves_grpc = true;
  refused.push_back({"serving with --tls_ca, no --tls_cert", o, "--tls_cert"});
  for (const Refused& r : refused) {
    auto security = Security::Create(r.options);
    ASSERT_FALSE(security.ok()) << r.name;
    EXPECT_EQ(security.status().code(), absl::StatusCode::kInvalidArgument) << r.name;
    const std::string message(security.status().message());
    EXPECT_THAT(message, HasSubstr("--auth_token_file")) << r.name;
    EXPECT_THAT(message, HasSubstr(r.needed)) << r.name;
  }

  // The same as the last, on a process that serves no gRPC: accepted, and its channels are TLS
  // with the token.
  auto dialer = Security::Create(TlsClient("token"));
  ASSERT_TRUE(dialer.ok()) << dialer.status();
  EXPECT_TRUE((*dialer)->client_tls());
  EXPECT_TRUE((*dialer)->has_token());
  EXPECT_FALSE((*dialer)->server_tls());
}

TEST_F(SecurityTest, CheckListenAddress) {
  auto plain = Security::Create(SecurityOptions{});
  ASSERT_TRUE(plain.ok());
  SecurityOptions insecure_options;
  insecure_options.insecure = true;
  auto insecure = Security::Create(insecure_options);
  ASSERT_TRUE(insecure.ok());
  auto tls = Security::Create(TlsServer(false, ""));
  ASSERT_TRUE(tls.ok());

  struct Case {
    const Security* security;
    const char* address;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {plain->get(), "127.0.0.5:1", absl::StatusCode::kOk},
      {plain->get(), "127.0.0.1:0", absl::StatusCode::kOk},
      {plain->get(), "localhost:7070", absl::StatusCode::kOk},
      {plain->get(), "[::1]:7070", absl::StatusCode::kOk},
      {plain->get(), "0.0.0.0:1", absl::StatusCode::kFailedPrecondition},
      {plain->get(), "[::]:1", absl::StatusCode::kFailedPrecondition},
      {plain->get(), "10.1.2.3:1", absl::StatusCode::kFailedPrecondition},
      {plain->get(), "128.0.0.1:1", absl::StatusCode::kFailedPrecondition},
      {plain->get(), "shard.example.org:1", absl::StatusCode::kFailedPrecondition},
      {plain->get(), ":7070", absl::StatusCode::kFailedPrecondition},
      {insecure->get(), "10.1.2.3:1", absl::StatusCode::kOk},
      {insecure->get(), "0.0.0.0:1", absl::StatusCode::kOk},
      {tls->get(), "10.1.2.3:1", absl::StatusCode::kOk},
      {tls->get(), "[::]:1", absl::StatusCode::kOk},
      {plain->get(), "127.0.0.1", absl::StatusCode::kInvalidArgument},
      {plain->get(), "127.0.0.1:70000", absl::StatusCode::kInvalidArgument},
      {plain->get(), "127.0.0.1:x", absl::StatusCode::kInvalidArgument},
      {plain->get(), "::1:7070", absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    const absl::Status status = c.security->CheckListenAddress("--listen", c.address);
    EXPECT_EQ(status.code(), c.code) << c.address << ": " << status;
    if (!status.ok()) {
      EXPECT_THAT(std::string(status.message()), HasSubstr("--listen")) << c.address;
    }
    if (status.code() == absl::StatusCode::kFailedPrecondition) {
      EXPECT_THAT(std::string(status.message()), HasSubstr("--tls_cert and --tls_key"));
      EXPECT_THAT(std::string(status.message()), HasSubstr("--insecure"));
    }
  }
}

// TLS on a non-loopback address with neither a token nor --tls_client_ca is allowed but warned
// about (anyone who reaches the port may call every RPC), naming both flags; with either, or on
// loopback, nothing is logged.
TEST_F(SecurityTest, CheckListenAddressWarnsAboutTlsWithoutCallerAuthentication) {
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  std::shared_ptr<spdlog::logger> saved = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("security-test", sink));
  // Returns what CheckListenAddress logged for `options` and `address`, and its status.
  auto logged = [&log](const SecurityOptions& options, const std::string& address) {
    log.str("");
    auto security = Security::Create(options);
    EXPECT_TRUE(security.ok()) << security.status();
    if (!security.ok()) return std::string("<no security>");
    const absl::Status status = (*security)->CheckListenAddress("--listen", address);
    EXPECT_TRUE(status.ok()) << address << ": " << status;
    return log.str();
  };

  const std::string open = logged(TlsServer(/*mutual=*/false, ""), "0.0.0.0:7070");
  EXPECT_THAT(open, HasSubstr("--listen 0.0.0.0:7070"));
  EXPECT_THAT(open, HasSubstr("--auth_token_file"));
  EXPECT_THAT(open, HasSubstr("--tls_client_ca"));
  EXPECT_THAT(open, HasSubstr("warn"));
  EXPECT_THAT(logged(TlsServer(/*mutual=*/false, ""), "[::]:7070"), HasSubstr("--tls_client_ca"));
  EXPECT_EQ(logged(TlsServer(/*mutual=*/false, "token"), "0.0.0.0:7070"), "");
  EXPECT_EQ(logged(TlsServer(/*mutual=*/true, ""), "0.0.0.0:7070"), "");
  EXPECT_EQ(logged(TlsServer(/*mutual=*/false, ""), "127.0.0.1:7070"), "");
  SecurityOptions insecure;
  insecure.insecure = true;
  EXPECT_EQ(logged(insecure, "127.0.0.1:7070"), "");
  spdlog::set_default_logger(saved);
}

}  // namespace
}  // namespace tessera
