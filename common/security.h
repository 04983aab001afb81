// Transport security for every Tessera process (DESIGN.md §8; issue #5): TLS on listeners and
// channels, mutual TLS, and a bearer token checked on every RPC.
//
// One Security per process, made from the flags below:
//   --tls_cert FILE, --tls_key FILE  this process's certificate chain and private key (PEM). A
//                                    listener serves TLS with them; with --tls_ca, the channels
//                                    this process dials present them as its client certificate.
//   --tls_ca FILE                    CA bundle (PEM) that verifies the servers this process dials;
//                                    given, every channel it opens is TLS.
//   --tls_client_ca FILE             listeners require a client certificate signed by this CA
//                                    (mutual TLS). Needs --tls_cert/--tls_key.
//   --tls_server_name NAME           name checked in the servers' certificates instead of the host
//                                    part of the address dialed (certificates made for DNS names,
//                                    dialed by IP).
//   --auth_token_file FILE           bearer token (first line, surrounding whitespace dropped;
//                                    never a flag value). Listeners accept only calls that carry
//                                    `authorization: Bearer <token>` (UNAUTHENTICATED otherwise),
//                                    checked by one grpc::AuthMetadataProcessor; channels send it.
//                                    A token travels only over TLS: on a listener it needs
//                                    --tls_cert/--tls_key, on a channel --tls_ca.
//   --insecure                       allow a plaintext listener on a non-loopback address.
// A plaintext listener may bind only loopback (127.0.0.0/8, ::1, localhost) unless --insecure.
//
// Reload (SIGHUP): Reload() re-reads the token file and the certificate files; channels created
// afterwards, and the token checks and token sends of calls that start afterwards (on old
// channels too), use the new values. Certificates need no SIGHUP: listeners and channels use
// gRPC's FileWatcherCertificateProvider (grpc::experimental::TlsServerCredentials /
// TlsCredentials), which re-reads --tls_cert, --tls_key, --tls_client_ca and --tls_ca every 10 s
// by itself: a rotated server certificate is served, and a rotated client certificate and CA are
// used on the next handshake (reconnect) of existing channels, without a restart. The watchers do
// not check the files: replace them atomically (write elsewhere, then rename), certificate
// before key is not enough.
#ifndef TESSERA_COMMON_SECURITY_H_
#define TESSERA_COMMON_SECURITY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace CLI {
class App;
}  // namespace CLI

namespace tessera {

struct SecurityOptions {
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  std::string tls_client_ca;
  std::string tls_server_name;
  std::string auth_token_file;
  bool insecure = false;
  // Whether this process serves gRPC (the coordinator, a shard). False in processes that only dial
  // (the worker daemon, the CLI): a token then needs only --tls_ca.
  bool serves_grpc = true;
  // How often the certificate file watchers re-read the files (not a flag; tests shorten it).
  // Must be positive.
  unsigned int certificate_refresh_seconds = 10;
};

// Adds the flags above to `app`, writing into `options` (which must outlive the parse). With
// `listener` false (a process that serves no gRPC: the CLI), --tls_client_ca and --insecure are
// left out.
void AddSecurityFlags(CLI::App& app, SecurityOptions* options, bool listener = true);

// What a process dials with: channel credentials (plaintext, or TLS with the CA, the client
// certificate and the token) and the server-name override. Copyable and cheap; the default is
// plaintext without a token, which is what tests on loopback use.
struct ClientCredentials {
  // Never null after Security::Client(); null in a default-constructed value means plaintext.
  std::shared_ptr<grpc::ChannelCredentials> channel;
  // Non-empty: GRPC_SSL_TARGET_NAME_OVERRIDE_ARG.
  std::string server_name_override;

  // Reconnect backoff of every channel CreateChannel makes: from 200 ms, capped at 2 s.
  static constexpr int kInitialReconnectBackoffMs = 200;
  static constexpr int kMaxReconnectBackoffMs = 2000;

  // Creates a channel to `target` ("host:port") with these credentials and `args` (the override
  // and the reconnect backoff added). Makes no RPC.
  std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target,
                                               grpc::ChannelArguments args = {}) const;
};

class Security {
 public:
  // Validates the combination and reads every file once: INVALID_ARGUMENT naming the flag for a
  // key without a certificate (or the reverse), --tls_client_ca without --tls_cert, a token file
  // without --tls_ca (the channels would carry it in plaintext, or not at all), a token file
  // without --tls_cert/--tls_key in a process that serves gRPC (its listener could not check the
  // token: gRPC attaches the check only to TLS credentials, so every call would get through), an
  // unreadable or empty file, a file that is not PEM. Warns when the token file is readable by
  // group or others. Thread-safe afterwards.
  static absl::StatusOr<std::unique_ptr<Security>> Create(const SecurityOptions& options);
  ~Security();

  // OK when `host_port` may be served with these options: TLS is on, or the host is loopback, or
  // --insecure was given. Otherwise FAILED_PRECONDITION whose message names `flag` and says what
  // to do ("--listen 10.0.0.5:7070 is not a loopback address and no TLS is configured: give
  // --tls_cert and --tls_key, or --insecure to serve plaintext"). INVALID_ARGUMENT naming `flag`
  // for an address that is not host:port. Logs a warning (spdlog::warn, once per call) naming
  // --auth_token_file and --tls_client_ca when TLS serves a non-loopback address with neither:
  // allowed, but anyone who reaches the port may call every RPC.
  absl::Status CheckListenAddress(absl::string_view flag, const std::string& host_port) const;

  // Credentials for a grpc::ServerBuilder listening port: TLS (requiring and verifying client
  // certificates with --tls_client_ca) or plaintext, with the token check attached when a token
  // file was given (calls without it: UNAUTHENTICATED "missing bearer token" / "bad bearer
  // token"). A new object each call, sharing the token and the file watcher. Create() refuses a
  // token without TLS on a process that serves, so a plaintext listener never has a token.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;

  // Credentials for the channels this process dials: TLS with --tls_ca (presenting --tls_cert
  // when given; the server's certificate checked against the dialed host or --tls_server_name)
  // and the token when a token file was given; plaintext without --tls_ca (the token is then
  // never sent). The token sent follows Reload(). The CA and certificate come from a file
  // watcher shared by the channels made between two Reload()s: read when the watcher was made
  // (Create(), each successful Reload()) and every certificate_refresh_seconds after, each
  // handshake using what it read last.
  ClientCredentials Client() const;

  // SIGHUP: re-reads the token and certificate files (blocks on that file I/O); on success the
  // channels created afterwards get a new watcher, which has read the files already. On an error
  // (file gone, empty, not PEM: INVALID_ARGUMENT naming the flag) the old token and watcher stay
  // in force and the error is returned for the log (the watchers still re-read the files on
  // their own: a file gone is ignored by them, a non-PEM one is not).
  absl::Status Reload();

  // Whether listeners serve TLS / channels dial TLS / a token is in force.
  bool server_tls() const;
  bool client_tls() const;
  bool has_token() const;

  class Impl;

 private:
  explicit Security(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Calls this process's listeners refused for their bearer token since it started (every
// Security of the process together), for tessera_auth_failures_total. Thread-safe.
struct AuthFailureCounts {
  uint64_t missing_token = 0;  // no `authorization` header
  uint64_t bad_token = 0;      // a header that is not `Bearer <the token>`
};
AuthFailureCounts AuthFailures();

}  // namespace tessera

#endif  // TESSERA_COMMON_SECURITY_H_
