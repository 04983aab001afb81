// The CLI's commands over TLS with a bearer token, against an in-process JobService on 127.0.0.1
// serving with Security::ServerCredentials() (PKI made by `openssl`): the right credentials list
// the jobs; a refused token exits 77 (EX_NOPERM) and names the token file; a plaintext client of
// the TLS server exits 69.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "cli/coordinator_client.h"
#include "common/security.h"
#include "gmock/gmock.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera::cli {
namespace {

using ::testing::HasSubstr;

class OneJobService final : public v1::JobService::Service {
 public:
  grpc::Status ListJobs(grpc::ServerContext* /*context*/, const v1::ListJobsRequest* /*request*/,
                        v1::ListJobsResponse* response) override {
    v1::Job* job = response->add_jobs();
    job->set_id("tls-job-7");
    job->set_state(v1::JOB_STATE_SUCCEEDED);
    return grpc::Status::OK;
  }
};

void WriteFile(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::trunc);
  out << content;
  ASSERT_TRUE(out.good()) << path;
  chmod(path.c_str(), 0600);
}

class CliCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-cli-tls-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    WriteFile(dir_ + "/openssl.cnf",
              "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = unused\n"
              "[ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign\n"
              "[leaf]\nbasicConstraints = CA:FALSE\nextendedKeyUsage = serverAuth,clientAuth\n"
              "subjectAltName = IP:127.0.0.1,DNS:localhost\n");
    const std::string make_pki = absl::StrCat(
        "cd ", dir_, " && (",
        "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ca.key && ",
        "openssl req -x509 -new -config openssl.cnf -extensions ca -key ca.key -subj /CN=ca ",
        "-days 2 -out ca.pem && ",
        "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out server.key && ",
        "openssl req -new -config openssl.cnf -key server.key -subj /CN=server -out server.csr && ",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -set_serial 1 -days 2 ",
        "-extfile openssl.cnf -extensions leaf -out server.pem) > openssl.log 2>&1");
    ASSERT_EQ(std::system(make_pki.c_str()), 0) << "see " << dir_ << "/openssl.log";
    WriteFile(dir_ + "/token", "cli-token\n");
    WriteFile(dir_ + "/badtoken", "wrong\n");

    SecurityOptions server;
    server.tls_cert = dir_ + "/server.pem";
    server.tls_key = dir_ + "/server.key";
    server.tls_ca = dir_ + "/ca.pem";  // a token needs it, on a serving process too
    server.auth_token_file = dir_ + "/token";
    auto security = Security::Create(server);
    ASSERT_TRUE(security.ok()) << security.status();
    server_security_ = *std::move(security);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", server_security_->ServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  // GlobalOptions as cli/main.cc fills them from the flags.
  GlobalOptions Global(const std::string& token) {
    SecurityOptions o;
    o.serves_grpc = false;  // AddSecurityFlags(listener=false), as in cli/main.cc
    o.tls_ca = dir_ + "/ca.pem";
    if (!token.empty()) o.auth_token_file = dir_ + "/" + token;
    auto security = Security::Create(o);
    EXPECT_TRUE(security.ok()) << security.status();
    GlobalOptions global;
    global.coordinator = absl::StrCat("127.0.0.1:", port_);
    if (!security.ok()) return global;
    global.credentials = (*security)->Client();
    global.tls = true;
    if (!token.empty()) global.auth_token_file = o.auth_token_file;
    return global;
  }

  // Runs `tessera list` with `global`, capturing stderr. Returns the exit code.
  int List(const GlobalOptions& global, std::string* err) {
    const std::string err_path = dir_ + "/stderr";
    std::fflush(stderr);
    const int saved = dup(fileno(stderr));
    EXPECT_NE(std::freopen(err_path.c_str(), "w", stderr), nullptr);
    const int code = RunList(global);
    std::fflush(stderr);
    dup2(saved, fileno(stderr));
    close(saved);
    std::ifstream in(err_path);
    err->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return code;
  }

  std::string dir_;
  OneJobService service_;
  std::unique_ptr<Security> server_security_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(CliCredentialsTest, TheRightTokenListsTheJobs) {
  CoordinatorClient::Options options;
  options.address = absl::StrCat("127.0.0.1:", port_);
  options.credentials = Global("token").credentials;
  auto client = CoordinatorClient::Create(options);
  ASSERT_TRUE(client.ok());
  auto jobs = (*client)->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].id(), "tls-job-7");
  std::string err;
  EXPECT_EQ(List(Global("token"), &err), kExitOk) << err;
}

TEST_F(CliCredentialsTest, RefusedTokenExits77NamingTheTokenFile) {
  std::string err;
  EXPECT_EQ(List(Global("badtoken"), &err), kExitNoPermission);
  EXPECT_THAT(err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(err, HasSubstr("bad bearer token"));
  EXPECT_THAT(err, HasSubstr(dir_ + "/badtoken"));
  EXPECT_THAT(err, HasSubstr("--auth_token_file"));

  EXPECT_EQ(List(Global(""), &err), kExitNoPermission);
  EXPECT_THAT(err, HasSubstr("missing bearer token"));
  EXPECT_THAT(err, HasSubstr("TESSERA_TOKEN_FILE"));
}

TEST_F(CliCredentialsTest, PlaintextClientOfATlsCoordinatorExits69) {
  GlobalOptions global;
  global.coordinator = absl::StrCat("127.0.0.1:", port_);
  std::string err;
  EXPECT_EQ(List(global, &err), kExitUnavailable);
  EXPECT_THAT(err, HasSubstr("--tls_ca"));
}

TEST(ExitCodeForTest, MapsTheCodes) {
  EXPECT_EQ(ExitCodeFor(absl::UnauthenticatedError("x")), 77);
  EXPECT_EQ(ExitCodeFor(absl::PermissionDeniedError("x")), 77);
  EXPECT_EQ(ExitCodeFor(absl::UnavailableError("x")), 69);
  EXPECT_EQ(ExitCodeFor(absl::InvalidArgumentError("x")), 64);
  EXPECT_EQ(ExitCodeFor(absl::NotFoundError("x")), 1);
}

}  // namespace
}  // namespace tessera::cli
