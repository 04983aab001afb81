// ForwardingShardClient: a client::ShardClient that passes every call to the one it wraps. Test
// decorators (injected faults, a ledger of what was sent) derive from it and override only
// PushPull; one that keeps or resends a request after its callback ran copies the lent push data
// into it first (client::WithLentDataCopied).
//
// Header-only: a test that includes it links tessera_client. Thread-safe as the wrapped client is.
#ifndef TESSERA_TESTS_TESTLIB_FORWARDING_SHARD_CLIENT_H_
#define TESSERA_TESTS_TESTLIB_FORWARDING_SHARD_CLIENT_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker/client/shard_client.h"

namespace tessera {
namespace testlib {

class ForwardingShardClient : public client::ShardClient {
 public:
  // Takes ownership of `inner`. REQUIRES: inner != nullptr.
  explicit ForwardingShardClient(std::unique_ptr<client::ShardClient> inner)
      : inner_(std::move(inner)) {}

  const std::string& address() const override { return inner_->address(); }
  void PushPull(PushPullCall call, absl::Time deadline, PushPullCallback done) override {
    inner_->PushPull(std::move(call), deadline, std::move(done));
  }
  absl::StatusOr<std::vector<v1::Slice>> Pull(const v1::PullRequest& request,
                                              absl::Time deadline) override {
    return inner_->Pull(request, deadline);
  }
  absl::StatusOr<v1::CreateJobStateResponse> CreateJobState(
      const v1::CreateJobStateRequest& request, absl::Time deadline) override {
    return inner_->CreateJobState(request, deadline);
  }
  absl::Status UpdateMembership(const v1::UpdateMembershipRequest& request,
                                absl::Time deadline) override {
    return inner_->UpdateMembership(request, deadline);
  }
  absl::Status DropJob(const v1::DropJobRequest& request, absl::Time deadline) override {
    return inner_->DropJob(request, deadline);
  }
  void CancelPending() override { inner_->CancelPending(); }

 protected:
  // The wrapped client; owned by this object.
  client::ShardClient* inner() const { return inner_.get(); }

 private:
  const std::unique_ptr<client::ShardClient> inner_;
};

}  // namespace testlib
}  // namespace tessera

#endif  // TESSERA_TESTS_TESTLIB_FORWARDING_SHARD_CLIENT_H_
