#include "worker/client/local_shards.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

extern char** environ;

namespace tessera {
namespace client {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string LogTail(const std::string& path) {
  std::string log = ReadFile(path);
  if (log.size() > 2000) log = log.substr(log.size() - 2000);
  return log;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  return absl::StrCat("ended with wait status ", status);
}

}  // namespace

bool IsServing(const std::string& address, absl::Duration timeout,
               const ClientCredentials& credentials) {
  auto channel = credentials.CreateChannel(address);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // HealthCheckRequest{service: ""} serialises to no bytes; HealthCheckResponse{status: SERVING}
  // to the two bytes 08 01. Raw bytes keep the health proto out of our build.
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                         grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), method, &context, request, &response);
  if (!status.ok()) return false;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes == std::string("\x08\x01", 2);
}

absl::StatusOr<std::unique_ptr<LocalShards>> LocalShards::Start(const Options& options) {
  if (options.num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards must be >= 1, got ", options.num_shards));
  }
  if (access(options.server_path.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("server_path '", options.server_path, "' is not an executable file"));
  }
  char tmpl[] = "/tmp/tessera-shards-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  std::unique_ptr<LocalShards> shards(new LocalShards());
  shards->work_dir_ = tmpl;
  const std::string& dir = shards->work_dir_;
  for (int i = 0; i < options.num_shards; ++i) {
    const std::string log = absl::StrCat(dir, "/shard-", i, ".log");
    std::vector<std::string> args = {options.server_path,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--port_file",
                                     absl::StrCat(dir, "/shard-", i, ".port"),
                                     "--shard_index",
                                     absl::StrCat(i),
                                     "--data_dir",
                                     absl::StrCat(dir, "/shard-", i, "-data"),
                                     "--max_message_bytes",
                                     absl::StrCat(options.max_message_bytes)};
    args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
    TESSERA_ASSIGN_OR_RETURN(pid_t pid,
                             SpawnWithLog(options.server_path, std::move(args), log, false));
    shards->pids_.push_back(pid);
  }

  const absl::Time deadline = absl::Now() + options.start_timeout;
  for (int i = 0; i < options.num_shards; ++i) {
    const std::string port_file = absl::StrCat(dir, "/shard-", i, ".port");
    const std::string log = absl::StrCat(dir, "/shard-", i, ".log");
    int port = 0;
    bool serving = false;
    while (!serving) {
      int status = 0;
      if (waitpid(shards->pids_[i], &status, WNOHANG) == shards->pids_[i]) {
        shards->pids_[i] = -1;
        return absl::InternalError(absl::StrCat("shard ", i, " ", DescribeExit(status),
                                                " before serving; log:\n", LogTail(log)));
      }
      if (port == 0) {
        std::string text = ReadFile(port_file);
        int parsed = 0;
        if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &parsed) && parsed > 0) {
          port = parsed;
        }
      }
      if (port != 0) {
        serving = IsServing(absl::StrCat("127.0.0.1:", port), absl::Milliseconds(500));
      }
      if (!serving) {
        if (absl::Now() > deadline) {
          return absl::DeadlineExceededError(
              absl::StrCat("shard ", i, " not serving after ",
                           absl::FormatDuration(options.start_timeout), "; log:\n", LogTail(log)));
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    shards->addresses_.push_back(absl::StrCat("127.0.0.1:", port));
  }
  return shards;
}

absl::Status LocalShards::Stop(absl::Duration timeout) {
  for (pid_t pid : pids_) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status result;
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (pids_[i] <= 0) continue;
    int status = 0;
    for (;;) {
      const pid_t r = waitpid(pids_[i], &status, WNOHANG);
      if (r == pids_[i]) break;
      if (absl::Now() > deadline) {
        kill(pids_[i], SIGKILL);
        waitpid(pids_[i], &status, 0);
        if (result.ok()) {
          result = absl::InternalError(absl::StrCat("shard ", i, " did not exit within ",
                                                    absl::FormatDuration(timeout),
                                                    " of SIGTERM; killed"));
        }
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    pids_[i] = -1;
    if (result.ok() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      result = absl::InternalError(
          absl::StrCat("shard ", i, " ", DescribeExit(status), " after SIGTERM; log:\n",
                       LogTail(absl::StrCat(work_dir_, "/shard-", i, ".log"))));
    }
  }
  return result;
}

LocalShards::~LocalShards() {
  for (pid_t& pid : pids_) {
    if (pid <= 0) continue;
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
  }
  if (!work_dir_.empty() && std::getenv("TESSERA_KEEP_SHARD_LOGS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(work_dir_, ec);
  }
}

absl::StatusOr<pid_t> SpawnWithLog(const std::string& binary, std::vector<std::string> args,
                                   const std::string& log, bool append) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(),
                                   O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, binary.c_str(), &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (err != 0)
    return absl::InternalError(absl::StrCat("posix_spawn ", binary, ": ", std::strerror(err)));
  return pid;
}

}  // namespace client
}  // namespace tessera
