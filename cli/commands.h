// The `tessera` subcommands (cli/main.cc parses the flags into these structs and calls them).
//
// Exit status, for every command:
//   0   success (and, for submit --watch, watch and local: the job SUCCEEDED)
//   1   the job FAILED or was CANCELLED, or the coordinator refused the request (unknown job, a
//       state that does not allow it), or an export failed
//   64  usage: bad flags, or a spec refused (locally or by the coordinator, INVALID_ARGUMENT)
//   69  unavailable: the coordinator (or, for local, a daemon) could not be reached or started;
//       the message says which address (a failed TLS handshake is UNAVAILABLE too)
//   77  not permitted (sysexits.h EX_NOPERM): the coordinator or a shard refused the bearer token
//       (UNAUTHENTICATED) or the call (PERMISSION_DENIED); the message names the token file
//   130, 143  `tessera local` stopped by SIGINT or SIGTERM (the job is cancelled first)
// Errors go to stderr as "tessera: ..."; with --output json, stdout also gets
// {"error":{"code":"...","message":"..."}}.
#ifndef TESSERA_CLI_COMMANDS_H_
#define TESSERA_CLI_COMMANDS_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "cli/local_cluster.h"
#include "common/security.h"

namespace tessera::cli {

constexpr int kExitOk = 0;
constexpr int kExitJobFailed = 1;
constexpr int kExitUsage = 64;         // sysexits.h EX_USAGE
constexpr int kExitUnavailable = 69;   // sysexits.h EX_UNAVAILABLE
constexpr int kExitNoPermission = 77;  // sysexits.h EX_NOPERM

struct GlobalOptions {
  std::string coordinator = "127.0.0.1:7070";
  bool json = false;
  // Channels to the coordinator and (for export) the shards: TLS and the bearer token from
  // --tls_ca, --tls_cert/--tls_key, --tls_server_name, --auth_token_file (default plaintext).
  // `tessera local` ignores them: its cluster is plaintext on loopback.
  ClientCredentials credentials;
  bool tls = false;             // credentials dial TLS (--tls_ca given)
  std::string auth_token_file;  // for messages; empty: no token is sent
};

struct SubmitOptions {
  std::string spec_file;
  bool watch = false;
};

struct ExportOptionsFlags {
  std::string job_id;
  std::string out;
};

struct LocalOptions {
  std::string spec_file;
  int shards = 2;
  int workers = 0;      // 0: the spec's num_workers, or 2 when it has none
  std::string out;      // empty: no export
  int threads = 0;      // per worker (per replica with devices); 0: cores / (workers x replicas)
  std::string devices;  // each worker's --devices ("cpu:N"); empty: one device
  bool keep_dir = false;
  // Called with the cluster's options before it starts (not from the command line): a benchmark
  // puts an emulated link in front of each shard (bench/slow_link_bench.cc). An error is the
  // command's (exit 64 for INVALID_ARGUMENT, else 69).
  std::function<absl::Status(LocalCluster::Options*)> adjust_cluster;
};

struct CriteoDatagenFlags {
  int64_t rows = 0;
  std::string out;
  int64_t test_rows = -1;  // -1: the default (criteo_datagen.h)
  uint64_t seed = 1;
  std::string model = "logistic";
  double zipf = 1.05;
};

// The exit status for a failed request: 69 for UNAVAILABLE and DEADLINE_EXCEEDED, 64 for
// INVALID_ARGUMENT, 77 for UNAUTHENTICATED and PERMISSION_DENIED, 1 otherwise.
int ExitCodeFor(const absl::Status& status);

int RunSubmit(const GlobalOptions& global, const SubmitOptions& options);
int RunList(const GlobalOptions& global);
int RunGet(const GlobalOptions& global, const std::string& job_id);
int RunWatch(const GlobalOptions& global, const std::string& job_id);
int RunCancel(const GlobalOptions& global, const std::string& job_id);
// Prints "checkpoint <step> of <job> committed (<n> shards, <size>)" once the coordinator has
// committed it.
int RunCheckpoint(const GlobalOptions& global, const std::string& job_id);
int RunCluster(const GlobalOptions& global);
int RunExport(const GlobalOptions& global, const ExportOptionsFlags& options);
// `tessera datagen criteo`: writes the files, progress on stderr, and prints the planted model's
// best test log loss and AUC (the planted.json line with --output json).
int RunDatagenCriteo(const GlobalOptions& global, const CriteoDatagenFlags& options);
// REQUIRES: SIGINT and SIGTERM blocked in every thread (BlockShutdownSignals() first thing in
// main), so that this command's own signal thread receives them.
int RunLocal(const GlobalOptions& global, const LocalOptions& options);

}  // namespace tessera::cli

#endif  // TESSERA_CLI_COMMANDS_H_
