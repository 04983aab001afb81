#include "common/security.h"

#include <arpa/inet.h>
#include <openssl/crypto.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "spdlog/spdlog.h"

namespace tessera {
namespace {

constexpr char kAuthorizationKey[] = "authorization";
constexpr char kBearerPrefix[] = "Bearer ";

// The token in force, shared by the listeners' auth processor and the channels' token plugin,
// so that Reload() reaches both. Thread-safe.
class TokenStore {
 public:
  void Set(std::string token) {
    absl::MutexLock lock(&mu_);
    token_ = std::move(token);
  }
  std::string Get() const {
    absl::MutexLock lock(&mu_);
    return token_;
  }

 private:
  mutable absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

// Compares in time that depends only on the lengths (OpenSSL's CRYPTO_memcmp), not on where the
// strings differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::atomic<uint64_t> missing_token_failures{0};
std::atomic<uint64_t> bad_token_failures{0};

// Checks `authorization: Bearer <token>` on every call of a TLS listener. Runs inline on the
// transport thread (cheap, no I/O).
class BearerTokenProcessor : public grpc::AuthMetadataProcessor {
 public:
  explicit BearerTokenProcessor(std::shared_ptr<const TokenStore> token)
      : token_(std::move(token)) {}

  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* /*context*/,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* /*response_metadata*/) override {
    auto it = auth_metadata.find(kAuthorizationKey);
    if (it == auth_metadata.end()) {
      missing_token_failures.fetch_add(1, std::memory_order_relaxed);
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing bearer token (authorization: Bearer <token>)");
    }
    const absl::string_view value(it->second.data(), it->second.size());
    const std::string expected = token_->Get();
    if (!absl::StartsWith(value, kBearerPrefix) || expected.empty() ||
        !ConstantTimeEquals(value.substr(sizeof(kBearerPrefix) - 1), expected)) {
      bad_token_failures.fetch_add(1, std::memory_order_relaxed);
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad bearer token");
    }
    // The handlers never see the token.
    consumed_auth_metadata->emplace(kAuthorizationKey, std::string(value));
    return grpc::Status::OK;
  }

 private:
  const std::shared_ptr<const TokenStore> token_;
};

// Sends the current token on every call of a TLS channel.
class BearerTokenPlugin : public grpc::MetadataCredentialsPlugin {
 public:
  explicit BearerTokenPlugin(std::shared_ptr<const TokenStore> token) : token_(std::move(token)) {}

  bool IsBlocking() const override { return false; }
  const char* GetType() const override { return "tessera-bearer-token"; }

  grpc::Status GetMetadata(grpc::string_ref /*service_url*/, grpc::string_ref /*method_name*/,
                           const grpc::AuthContext& /*channel_auth_context*/,
                           std::multimap<std::string, std::string>* metadata) override {
    metadata->emplace(kAuthorizationKey, absl::StrCat(kBearerPrefix, token_->Get()));
    return grpc::Status::OK;
  }

  std::string DebugString() override { return "tessera bearer token"; }

 private:
  const std::shared_ptr<const TokenStore> token_;
};

absl::StatusOr<std::string> ReadWholeFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": cannot read: ", std::strerror(errno)));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": read error"));
  }
  std::string content = ss.str();
  if (absl::StripAsciiWhitespace(content).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": the file is empty"));
  }
  return content;
}

// A PEM file holding at least one block whose label ends with `label_suffix` ("CERTIFICATE",
// "PRIVATE KEY").
absl::StatusOr<std::string> ReadPem(absl::string_view flag, const std::string& path,
                                    absl::string_view label_suffix) {
  absl::StatusOr<std::string> content = ReadWholeFile(flag, path);
  if (!content.ok()) return content.status();
  const std::string end = absl::StrCat(label_suffix, "-----");
  const size_t begin = content->find("-----BEGIN ");
  if (begin == std::string::npos || content->find(end, begin) == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM file with a ",
                                                   label_suffix, " (no -----BEGIN ...",
                                                   label_suffix, "----- block)"));
  }
  return content;
}

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  constexpr char kFlag[] = "--auth_token_file";
  absl::StatusOr<std::string> content = ReadWholeFile(kFlag, path);
  if (!content.ok()) return content.status();
  absl::string_view first = *content;
  first = first.substr(0, first.find('\n'));
  first = absl::StripAsciiWhitespace(first);
  if (first.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFlag, " ", path, ": the first line is empty (the token goes there)"));
  }
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    spdlog::warn("{} {}: the token file is readable by group or others (mode {:o}); chmod 600 it",
                 kFlag, path, st.st_mode & 0777);
  }
  return std::string(first);
}

// What the files held when last read.
struct Material {
  std::string cert;       // --tls_cert
  std::string key;        // --tls_key
  std::string ca;         // --tls_ca
  std::string client_ca;  // --tls_client_ca
  std::string token;      // --auth_token_file, first line
};

absl::StatusOr<Material> ReadMaterial(const SecurityOptions& o) {
  Material m;
  if (!o.tls_cert.empty()) {
    absl::StatusOr<std::string> cert = ReadPem("--tls_cert", o.tls_cert, "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    m.cert = *std::move(cert);
    absl::StatusOr<std::string> key = ReadPem("--tls_key", o.tls_key, "PRIVATE KEY");
    if (!key.ok()) return key.status();
    m.key = *std::move(key);
  }
  if (!o.tls_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls_ca", o.tls_ca, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    m.ca = *std::move(ca);
  }
  if (!o.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls_client_ca", o.tls_client_ca, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    m.client_ca = *std::move(ca);
  }
  if (!o.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadToken(o.auth_token_file);
    if (!token.ok()) return token.status();
    m.token = *std::move(token);
  }
  return m;
}

bool IsLoopbackHost(absl::string_view host) {
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&v6)) return v6.s6_addr[12] == 127;
  }
  return false;
}

}  // namespace

void AddSecurityFlags(CLI::App& app, SecurityOptions* options, bool listener) {
  options->serves_grpc = listener;
  app.add_option("--tls_cert", options->tls_cert,
                 listener ? "Certificate chain (PEM) this process serves TLS with, and presents "
                            "as its client certificate on the channels it dials"
                          : "Client certificate chain (PEM) for mutual TLS; needs --tls_key");
  app.add_option("--tls_key", options->tls_key, "Private key (PEM) of --tls_cert");
  app.add_option("--tls_ca", options->tls_ca,
                 "CA bundle (PEM) that verifies the servers this process dials; given, every "
                 "channel is TLS");
  if (listener) {
    app.add_option("--tls_client_ca", options->tls_client_ca,
                   "Require client certificates signed by this CA (PEM; mutual TLS); needs "
                   "--tls_cert and --tls_key");
  }
  app.add_option("--tls_server_name", options->tls_server_name,
                 "Name to check in the servers' certificates instead of the dialed host");
  app.add_option("--auth_token_file", options->auth_token_file,
                 listener ? "File whose first line is the bearer token (sent on every call, and "
                            "required on every call served); needs TLS"
                          : "File whose first line is the bearer token sent on every call; needs "
                            "--tls_ca (a token travels only over TLS)");
  if (listener) {
    app.add_flag("--insecure", options->insecure,
                 "Allow a plaintext listener on a non-loopback address");
  }
}

std::shared_ptr<grpc::Channel> ClientCredentials::CreateChannel(const std::string& target,
                                                                grpc::ChannelArguments args) const {
  if (!server_name_override.empty()) args.SetSslTargetNameOverride(server_name_override);
  // Reconnect with capped exponential backoff: gRPC's default grows to 120 s, so a daemon that
  // comes back (a restarted shard, coordinator, or the end of a partition) would sit unused for
  // up to two minutes. 2 s keeps reconnection prompt without spinning.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  return grpc::CreateCustomChannel(
      target, channel != nullptr ? channel : grpc::InsecureChannelCredentials(), args);
}

class Security::Impl {
 public:
  Impl(SecurityOptions options, Material material)
      : options_(std::move(options)), token_(std::make_shared<TokenStore>()) {
    token_->Set(material.token);
    material_ = std::move(material);
    if (server_tls()) {
      provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          options_.tls_key, options_.tls_cert, options_.tls_client_ca,
          options_.certificate_refresh_seconds);
    }
    if (has_token()) processor_ = std::make_shared<BearerTokenProcessor>(token_);
    if (client_tls()) client_provider_ = NewClientProvider();
  }

  bool server_tls() const { return !options_.tls_cert.empty(); }
  bool client_tls() const { return !options_.tls_ca.empty(); }
  bool has_token() const { return !options_.auth_token_file.empty(); }

  absl::Status CheckListenAddress(absl::string_view flag, const std::string& host_port) const {
    if (absl::StartsWith(host_port, "unix:") || absl::StartsWith(host_port, "unix-abstract:")) {
      return absl::OkStatus();  // never leaves the host
    }
    const size_t colon = host_port.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", host_port, ": not host:port (e.g. 127.0.0.1:7070, [::1]:7070)"));
    }
    absl::string_view host = absl::string_view(host_port).substr(0, colon);
    const absl::string_view port_text = absl::string_view(host_port).substr(colon + 1);
    int port = -1;
    if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", host_port, ": the port '", port_text, "' is not in [0, 65535]"));
    }
    if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
      host = host.substr(1, host.size() - 2);
    } else if (absl::StrContains(host, ':')) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", host_port, ": write an IPv6 address in brackets ([::1]:7070)"));
    }
    const bool loopback = IsLoopbackHost(host);
    if (server_tls() && !loopback && !has_token() && options_.tls_client_ca.empty()) {
      // Allowed (TLS keeps the traffic private), but nothing checks who the callers are.
      spdlog::warn(
          "{} {}: TLS on a non-loopback address with neither --auth_token_file nor "
          "--tls_client_ca: ANYONE WHO CAN REACH THIS PORT CAN CALL EVERY RPC (submit and cancel "
          "jobs, read and overwrite parameters). Give --auth_token_file (a bearer token checked "
          "on every call) and/or --tls_client_ca (mutual TLS)",
          std::string(flag), host_port);
    }
    if (server_tls() || options_.insecure || loopback) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        flag, " ", host_port,
        " is not a loopback address and no TLS is configured: give --tls_cert and --tls_key, "
        "or --insecure to serve plaintext"));
  }

  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const {
    if (!server_tls()) return grpc::InsecureServerCredentials();
    grpc::experimental::TlsServerCredentialsOptions tls(provider_);
    tls.watch_identity_key_cert_pairs();
    if (!options_.tls_client_ca.empty()) {
      tls.watch_root_certs();
      tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    std::shared_ptr<grpc::ServerCredentials> credentials =
        grpc::experimental::TlsServerCredentials(tls);
    if (processor_ != nullptr) credentials->SetAuthMetadataProcessor(processor_);
    return credentials;
  }

  ClientCredentials Client() const {
    ClientCredentials out;
    out.server_name_override = options_.tls_server_name;
    if (!client_tls()) {
      out.channel = grpc::InsecureChannelCredentials();
      return out;
    }
    std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
    {
      absl::MutexLock lock(&mu_);
      provider = client_provider_;
    }
    // TLS credentials backed by a file watcher, not SslCredentials: a channel re-reads --tls_ca,
    // --tls_cert and --tls_key on every handshake from the watcher, so a reconnect after a
    // rotation presents the new client certificate and trusts the new CA. No certificate
    // verifier is set: gRPC then checks the server's certificate against the dialed host (or
    // GRPC_SSL_TARGET_NAME_OVERRIDE_ARG) as SslCredentials do.
    grpc::experimental::TlsChannelCredentialsOptions tls;
    tls.set_certificate_provider(provider);
    tls.watch_root_certs();
    if (!options_.tls_cert.empty()) tls.watch_identity_key_cert_pairs();
    out.channel = grpc::experimental::TlsCredentials(tls);
    if (out.channel == nullptr) {
      // gRPC refused the options (it logs why; not expected with these): fixed credentials from
      // the files read last, which do not follow a rotation but never leave the channel null.
      spdlog::error(
          "gRPC refused file-watching TLS credentials for --tls_ca {}; client "
          "certificate and CA rotations need a restart",
          options_.tls_ca);
      grpc::SslCredentialsOptions ssl;
      absl::MutexLock lock(&mu_);
      ssl.pem_root_certs = material_.ca;
      ssl.pem_cert_chain = material_.cert;
      ssl.pem_private_key = material_.key;
      out.channel = grpc::SslCredentials(ssl);
    }
    if (has_token()) {
      out.channel = grpc::CompositeChannelCredentials(
          out.channel,
          grpc::MetadataCredentialsFromPlugin(std::make_unique<BearerTokenPlugin>(token_)));
    }
    return out;
  }

  absl::Status Reload() {
    // File I/O without the lock; then swap in the whole set or nothing.
    absl::StatusOr<Material> material = ReadMaterial(options_);
    if (!material.ok()) return material.status();
    // A new watcher reads the files now, so channels created from here on use them at once;
    // the old one keeps serving the channels made before, re-reading the same files by itself.
    std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
    if (client_tls()) provider = NewClientProvider();
    token_->Set(material->token);
    absl::MutexLock lock(&mu_);
    material_ = *std::move(material);
    if (provider != nullptr) client_provider_ = std::move(provider);
    return absl::OkStatus();
  }

 private:
  const SecurityOptions options_;
  const std::shared_ptr<TokenStore> token_;
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider_;
  std::shared_ptr<BearerTokenProcessor> processor_;
  mutable absl::Mutex mu_;
  Material material_ ABSL_GUARDED_BY(mu_);
  // What Client() hands to new channels: watches --tls_ca (and --tls_cert/--tls_key when given).
  // Null without --tls_ca.
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> client_provider_
      ABSL_GUARDED_BY(mu_);

  // A watcher of the channels' files; reads them before it returns (blocks on that I/O).
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> NewClientProvider() const {
    if (options_.tls_cert.empty()) {
      return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          options_.tls_ca, options_.certificate_refresh_seconds);
    }
    return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        options_.tls_key, options_.tls_cert, options_.tls_ca, options_.certificate_refresh_seconds);
  }
};

absl::StatusOr<std::unique_ptr<Security>> Security::Create(const SecurityOptions& options) {
  if (options.certificate_refresh_seconds == 0) {
    return absl::InvalidArgumentError("certificate_refresh_seconds must be positive");
  }
  if (!options.tls_key.empty() && options.tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls_key " + options.tls_key +
                                      " is given without --tls_cert: give both or neither");
  }
  if (!options.tls_cert.empty() && options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert " + options.tls_cert +
                                      " is given without --tls_key: give both or neither");
  }
  if (!options.tls_client_ca.empty() && options.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is on top of TLS)");
  }
  if (!options.auth_token_file.empty() && options.tls_ca.empty()) {
    return absl::InvalidArgumentError(
        "--auth_token_file needs --tls_ca: a token never travels in plaintext, and the channels "
        "this process dials are TLS only with --tls_ca");
  }
  if (!options.auth_token_file.empty() && options.serves_grpc && options.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "--auth_token_file needs --tls_cert and --tls_key: the token is checked only on a TLS "
        "listener, and a plaintext one would let every call through");
  }
  absl::StatusOr<Material> material = ReadMaterial(options);
  if (!material.ok()) return material.status();
  return std::unique_ptr<Security>(
      new Security(std::make_unique<Impl>(options, *std::move(material))));
}

Security::Security(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Security::~Security() = default;

absl::Status Security::CheckListenAddress(absl::string_view flag,
                                          const std::string& host_port) const {
  return impl_->CheckListenAddress(flag, host_port);
}

std::shared_ptr<grpc::ServerCredentials> Security::ServerCredentials() const {
  return impl_->ServerCredentials();
}

ClientCredentials Security::Client() const { return impl_->Client(); }

absl::Status Security::Reload() { return impl_->Reload(); }

bool Security::server_tls() const { return impl_->server_tls(); }
bool Security::client_tls() const { return impl_->client_tls(); }
bool Security::has_token() const { return impl_->has_token(); }

AuthFailureCounts AuthFailures() {
  AuthFailureCounts counts;
  counts.missing_token = missing_token_failures.load(std::memory_order_relaxed);
  counts.bad_token = bad_token_failures.load(std::memory_order_relaxed);
  return counts;
}

}  // namespace tessera
