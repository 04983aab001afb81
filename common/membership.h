// MemberAgent: keeps a daemon (a shard or a worker) registered with the coordinator
// (proto/tessera/v1/job.proto, ClusterService).
//
// A background thread registers (retrying with capped exponential backoff, and logging why each
// attempt failed: "coordinator 127.0.0.1:7070 unavailable: ...; retrying in 1.6 s"), then sends a
// heartbeat every heartbeat_interval_ms the coordinator asked for. A heartbeat answered NOT_FOUND
// (the coordinator restarted without the member, or the lease expired) registers again, with a
// new member id. Transient heartbeat failures are retried and logged at most once per outage.
//
// Thread-safety: all methods may be called from any thread.
#ifndef TESSERA_COMMON_MEMBERSHIP_H_
#define TESSERA_COMMON_MEMBERSHIP_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "grpcpp/channel.h"
#include "tessera/v1/job.grpc.pb.h"

namespace tessera {

class MemberAgent {
 public:
  struct Options {
    std::string coordinator;           // host:port
    v1::RegisterRequest registration;  // role, address, shard_index, hostname, pid, device
    absl::Duration initial_backoff = absl::Milliseconds(200);
    absl::Duration max_backoff = absl::Seconds(5);
    absl::Duration rpc_timeout = absl::Seconds(5);
    // How the channel to the coordinator is made (default: plaintext, no token).
    ClientCredentials credentials;
    // Runs on the agent's thread after every successful registration, with the new member id
    // (the first one and every re-registration). May be empty.
    std::function<void(const std::string& member_id)> on_registered;
    // Runs on the agent's thread before every heartbeat, to add what the member reports with it
    // (a shard's stalls); must not block. May be empty.
    std::function<void(v1::HeartbeatRequest* request)> fill_heartbeat;
  };

  explicit MemberAgent(Options options);
  // Stop(/*deregister=*/false).
  ~MemberAgent();

  MemberAgent(const MemberAgent&) = delete;
  MemberAgent& operator=(const MemberAgent&) = delete;

  // Starts the thread. Call once.
  void Start();
  // Stops the thread; with `deregister`, tells the coordinator (one attempt, rpc_timeout) so the
  // member shows as LEFT rather than LOST. Idempotent.
  void Stop(bool deregister);

  // The current member id; empty until registered.
  std::string member_id() const;
  // Blocks until registered. DEADLINE_EXCEEDED (with the last registration error) after `timeout`.
  absl::Status WaitRegistered(absl::Duration timeout) const;

  // The channel to the coordinator, shared with the caller for its other ClusterService calls.
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  void Run();

  const Options options_;
  const std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::string member_id_ ABSL_GUARDED_BY(mu_);
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_MEMBERSHIP_H_
