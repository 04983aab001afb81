// A ShardClient decorator that injects transport faults: it delivers some requests twice and
// loses some responses (reported to the caller as UNAVAILABLE, so the caller retries with the
// same seq). Which requests are hit is a pure function of (seed, seq), so a run is reproducible.
#ifndef TESSERA_TESTS_E2E_FAULTY_SHARD_CLIENT_H_
#define TESSERA_TESTS_E2E_FAULTY_SHARD_CLIENT_H_

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/placement.h"
#include "tests/testlib/forwarding_shard_client.h"
#include "worker/client/shard_client.h"

namespace tessera {
namespace e2e {

class FaultyShardClient final : public testlib::ForwardingShardClient {
 public:
  // Percentages of requests (by seq) sent twice, and whose first response is lost.
  FaultyShardClient(std::unique_ptr<client::ShardClient> inner, uint64_t seed, int duplicate_pct,
                    int drop_pct)
      : ForwardingShardClient(std::move(inner)),
        seed_(seed),
        duplicate_pct_(duplicate_pct),
        drop_pct_(drop_pct) {}

  void PushPull(PushPullCall call, absl::Time deadline, PushPullCallback done) override {
    // The duplicate may still be in flight when the caller's callback has run: it must not point
    // into the caller's memory, nor write weights there.
    call = client::WithLentDataCopied(std::move(call));
    const PushPullCall duplicate_call{call.request};
    const uint64_t seq = call.request->seq();
    const uint64_t h = StableHash(absl::StrCat(seed_, "/", seq));
    bool first_attempt;
    {
      absl::MutexLock lock(&mu_);
      first_attempt = attempted_.insert(seq).second;
    }
    const bool duplicate = first_attempt && static_cast<int>(h % 100) < duplicate_pct_;
    const bool drop = first_attempt && static_cast<int>((h >> 20) % 100) < drop_pct_;
    if (drop) {
      dropped_.fetch_add(1);
      std::string address = inner()->address();
      inner()->PushPull(
          std::move(call), deadline,
          [done = std::move(done), address, seq](absl::StatusOr<v1::PushPullResponse>) {
            done(absl::UnavailableError(
                absl::StrCat(address, ": injected loss of the response to seq ", seq)));
          });
    } else {
      inner()->PushPull(std::move(call), deadline, std::move(done));
    }
    if (duplicate) {
      duplicated_.fetch_add(1);
      inner()->PushPull(duplicate_call, deadline, [](absl::StatusOr<v1::PushPullResponse>) {});
    }
  }

  int duplicated() const { return duplicated_.load(); }
  int dropped() const { return dropped_.load(); }

 private:
  const uint64_t seed_;
  const int duplicate_pct_;
  const int drop_pct_;
  std::atomic<int> duplicated_{0};
  std::atomic<int> dropped_{0};
  absl::Mutex mu_;
  std::set<uint64_t> attempted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace e2e
}  // namespace tessera

#endif  // TESSERA_TESTS_E2E_FAULTY_SHARD_CLIENT_H_
