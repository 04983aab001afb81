// Request builders of the shard's wire types, shared by the tests of the shard (server/), the
// PushPull codec (common/) and the fuzzers.
#ifndef TESSERA_COMMON_TESTING_PUSH_PULL_REQUESTS_H_
#define TESSERA_COMMON_TESTING_PUSH_PULL_REQUESTS_H_

#include <cstring>
#include <string>
#include <vector>

#include "common/encoding.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera::push_pull_requests {

inline std::string Fp32Bytes(const std::vector<float>& values) {
  std::string out(values.size() * 4, '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

inline std::vector<float> Floats(const v1::Slice& slice) {
  const size_t width = BytesPerValue(slice.encoding());
  std::vector<float> out(slice.data().size() / width);
  (void)DecodeValues(slice.encoding(), slice.data(), out.data(), out.size());
  return out;
}

inline v1::JobConfig Config(v1::Consistency consistency, uint32_t workers, float lr,
                            v1::OptimizerKind kind = v1::OPTIMIZER_KIND_SGD,
                            uint32_t staleness = 0) {
  v1::JobConfig c;
  c.set_consistency(consistency);
  c.set_num_workers(workers);
  c.set_staleness(staleness);
  c.mutable_optimizer()->set_kind(kind);
  c.mutable_optimizer()->set_learning_rate(lr);
  return c;
}

inline v1::PartitionKey Key(const std::string& tensor, uint32_t index) {
  v1::PartitionKey k;
  k.set_tensor(tensor);
  k.set_index(index);
  return k;
}

inline v1::DensePartitionDecl Dense(const std::string& tensor, uint32_t index, int64_t n,
                                    const std::vector<float>& initial = {}) {
  v1::DensePartitionDecl d;
  *d.mutable_key() = Key(tensor, index);
  d.set_num_elements(n);
  if (!initial.empty()) d.set_initial_values(Fp32Bytes(initial));
  return d;
}

inline v1::Slice GradSlice(const std::string& tensor, uint32_t index,
                           const std::vector<float>& values, bool want_weights = false,
                           v1::Encoding encoding = v1::ENCODING_FP32) {
  v1::Slice s;
  *s.mutable_key() = Key(tensor, index);
  s.set_encoding(encoding);
  EncodeValues(encoding, values.data(), values.size(), s.mutable_data());
  s.set_want_weights(want_weights);
  return s;
}

inline v1::Slice RowsSlice(const std::string& table, const std::vector<int64_t>& rows,
                           const std::vector<float>& values, bool want_weights = false) {
  v1::Slice s = GradSlice(table, 0, values, want_weights);
  for (int64_t r : rows) s.add_row_ids(r);
  return s;
}

inline v1::Slice PullKey(const std::string& tensor, uint32_t index,
                         const std::vector<int64_t>& rows = {}) {
  v1::Slice s;
  *s.mutable_key() = Key(tensor, index);
  for (int64_t r : rows) s.add_row_ids(r);
  return s;
}

inline v1::PushPullRequest Request(const std::string& job, uint32_t worker, uint64_t incarnation,
                                   int64_t step, uint64_t seq, const std::vector<v1::Slice>& push,
                                   const std::vector<v1::Slice>& pull = {}) {
  v1::PushPullRequest r;
  r.set_job_id(job);
  r.set_worker_id(worker);
  r.set_incarnation(incarnation);
  r.set_step(step);
  r.set_seq(seq);
  for (const v1::Slice& s : push) *r.add_push() = s;
  for (const v1::Slice& s : pull) *r.add_pull() = s;
  return r;
}

}  // namespace tessera::push_pull_requests

#endif  // TESSERA_COMMON_TESTING_PUSH_PULL_REQUESTS_H_
