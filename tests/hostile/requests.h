// The hostile test's requests: a valid template of each method, the invalid edits, the random
// edits through protobuf reflection, and Protect, which keeps control calls off the valid
// traffic's jobs and members (docs/reliability.md "Hostile input").
#ifndef TESSERA_TESTS_HOSTILE_REQUESTS_H_
#define TESSERA_TESTS_HOSTILE_REQUESTS_H_

#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "tessera/v1/job_spec.pb.h"
#include "tests/hostile/methods.h"

namespace tessera::hostile {

// Seeded randomness (thread i of the run draws from --seed + i).
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  uint64_t Next() { return gen_(); }
  // Uniform in [0, n). REQUIRES: n > 0.
  uint64_t Uniform(uint64_t n) { return gen_() % n; }
  bool OneIn(uint64_t n) { return Uniform(n) == 0; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Uniform(v.size())];
  }

 private:
  std::mt19937_64 gen_;
};

// What the requests aim at. Target jobs are declared by the test on both shards; the valid job
// is the valid traffic's. Filled before the threads start; read-only afterwards.
struct Targets {
  // Shards: hx-asp (ASP, 4 workers, SGD, REJECT non-finite; dense w/0 of 64, b/0 of 8, sparse
  // table emb of dim 4) and hx-bsp (BSP, 2 workers, Adam, SKIP non-finite; dense w/0 of 64).
  static constexpr int kAspWorkers = 4;
  static constexpr int kBspWorkers = 2;
  std::string valid_shard_job = "valid-job";
  // Coordinator.
  std::string valid_job_id;  // a PENDING job that never starts (num_workers 1024)
  std::string dataset_dir;   // readable files named as the spec's dataset
  std::set<std::string> protected_jobs;
  std::set<std::string> protected_members;
};

// A valid JobSpec of `workers` ranks named `name`: the demo MLP over the files in t.dataset_dir.
v1::JobSpec BaseSpec(const Targets& t, const std::string& name, int workers);

// The valid request of method `m` (an index of kMethods) that the edits start from.
std::unique_ptr<pb::Message> Template(int m, Rng& rng, const Targets& t,
                                      const Prototypes& prototypes);

// Applies one invalid edit to `msg` (a template of method `m`); returns what it did, or "" when
// the method has none (the caller then sends a random request instead).
std::string InvalidEdit(int m, Rng& rng, const Targets& t, pb::Message* msg);

// One random edit of `m` or of a message inside it (`depth` levels down).
void MutateMessage(pb::Message* m, Rng& rng, const Targets& t, int depth);

// Replaces the valid jobs and the real members in a control request's top-level job_id and
// member_id, and the valid job in a push or pull.
void Protect(int m, Rng& rng, const Targets& t, pb::Message* msg);

}  // namespace tessera::hostile

#endif  // TESSERA_TESTS_HOSTILE_REQUESTS_H_
