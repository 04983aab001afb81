// Calls on a ParameterStore shared by the shard's tests (server/*_test.cc): pulls answered at
// once, job declarations, checkpoints waited for.
#ifndef TESSERA_SERVER_TESTING_STORE_CALLS_H_
#define TESSERA_SERVER_TESTING_STORE_CALLS_H_

#include <stdlib.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/testing/push_pull_requests.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"

namespace tessera::server::store_calls {

using push_pull_requests::Floats;
using push_pull_requests::PullKey;

inline absl::StatusOr<std::vector<v1::Slice>> PullNow(ParameterStore& store, const std::string& job,
                                                      const std::vector<v1::Slice>& keys,
                                                      v1::Encoding encoding = v1::ENCODING_FP32) {
  v1::PullRequest r;
  r.set_job_id(job);
  r.set_step(-1);
  r.set_encoding(encoding);
  for (const v1::Slice& k : keys) *r.add_keys() = k;
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> out;
  store.Pull(r, [&out](absl::StatusOr<std::vector<v1::Slice>> w) { out = std::move(w); });
  if (!out.has_value()) return absl::InternalError("an ungated pull parked");
  return *std::move(out);
}

// A dense partition's weights, pulled ungated (a failure is a test failure, and reads as none).
inline std::vector<float> PullDense(ParameterStore& store, const std::string& job,
                                    const std::string& tensor, uint32_t index) {
  auto w = PullNow(store, job, {PullKey(tensor, index)});
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return {};
  return Floats((*w)[0]);
}

inline v1::CreateJobStateRequest JobRequest(const std::string& id, const v1::JobConfig& config) {
  v1::CreateJobStateRequest r;
  r.set_job_id(id);
  *r.mutable_config() = config;
  return r;
}

inline v1::SparseTableDecl Table(const std::string& name, uint32_t dim, v1::Initializer::Kind kind,
                                 uint64_t seed) {
  v1::SparseTableDecl t;
  t.set_name(name);
  t.set_dim(dim);
  t.mutable_initializer()->set_kind(kind);
  t.mutable_initializer()->set_scale(0.5f);
  t.mutable_initializer()->set_value(0.25f);
  t.mutable_initializer()->set_seed(seed);
  return t;
}

inline std::vector<float> PullRows(ParameterStore& store, const std::string& job,
                                   const std::string& table, const std::vector<int64_t>& rows) {
  auto w = PullNow(store, job, {PullKey(table, 0, rows)});
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return {};
  EXPECT_EQ((*w)[0].row_ids_size(), static_cast<int>(rows.size()));
  return Floats((*w)[0]);
}

inline std::string MakeCheckpointDir() {
  std::string tmpl = ::testing::TempDir() + "/storeckptXXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

// Runs store.Checkpoint and waits (bounded) for its answer.
inline absl::StatusOr<v1::CheckpointResponse> CheckpointAndWait(ParameterStore& store,
                                                                const std::string& job,
                                                                int64_t step,
                                                                int64_t retain_from_step = 0) {
  v1::CheckpointRequest r;
  r.set_job_id(job);
  r.set_step(step);
  r.set_retain_from_step(retain_from_step);
  auto out = std::make_shared<std::optional<absl::StatusOr<v1::CheckpointResponse>>>();
  auto done = std::make_shared<absl::Notification>();
  store.Checkpoint(r, [out, done](absl::StatusOr<v1::CheckpointResponse> result) {
    *out = std::move(result);
    done->Notify();
  });
  if (!done->WaitForNotificationWithTimeout(absl::Seconds(30))) {
    return absl::DeadlineExceededError("checkpoint not answered in 30 s");
  }
  return **out;
}

inline ParameterStoreOptions CheckpointOptions(const std::string& dir, uint32_t shard = 0) {
  ParameterStoreOptions o;
  o.checkpoint_dir = dir;
  o.shard_index = shard;
  return o;
}

}  // namespace tessera::server::store_calls

#endif  // TESSERA_SERVER_TESTING_STORE_CALLS_H_
