// The fixture of the end-to-end fault tests (tests/recovery/): a whole cluster of real daemons on
// loopback (cli/local_cluster.h), a coordinator client, and bounded waits on a job's record and
// history. The jobs are the demo's Fashion-MNIST MLP in BSP with a fixed seed.
#ifndef TESSERA_TESTS_RECOVERY_CLUSTER_FIXTURE_H_
#define TESSERA_TESTS_RECOVERY_CLUSTER_FIXTURE_H_

#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/coordinator_client.h"
#include "cli/exporter.h"
#include "cli/local_cluster.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "spec/job_spec_reader.h"
#include "spec/testing/example_jobs.h"

#ifndef TESSERA_BIN_DIR
#error "TESSERA_BIN_DIR must name the folder of the daemons"
#endif
#ifndef TESSERA_SOURCE_DIR
#error "TESSERA_SOURCE_DIR must name the source tree"
#endif

namespace tessera::testing {

using cli::CoordinatorClient;
using cli::LocalCluster;

// Short leases, so that a lost member is noticed within seconds (StartCluster's default).
inline constexpr char kLeaseSeconds[] = "2";
inline constexpr char kHeartbeatSeconds[] = "0.5";

inline int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// A job's weights as the exporter reads them: each dense tensor as row 0, each sparse table's
// rows by id (two jobs' files hold the rows in different orders).
using WeightsByRow = std::map<std::string, std::map<int64_t, std::vector<float>>>;
inline WeightsByRow PullWeightsByRow(const v1::Job& job) {
  absl::StatusOr<std::vector<cli::NamedTensor>> w = cli::PullJobWeights(job);
  EXPECT_TRUE(w.ok()) << w.status();
  WeightsByRow out;
  if (!w.ok()) return out;
  const std::vector<int64_t>* ids = nullptr;
  for (const cli::NamedTensor& t : *w) {
    if (t.int64) {
      ids = &t.ids;
      continue;
    }
    std::map<int64_t, std::vector<float>>& rows = out[t.name];
    if (t.shape.size() == 2 && ids != nullptr && static_cast<int64_t>(ids->size()) == t.shape[0]) {
      const size_t dim = static_cast<size_t>(t.shape[1]);
      for (size_t i = 0; i < ids->size(); ++i) {
        rows[(*ids)[i]].assign(t.values.begin() + i * dim, t.values.begin() + (i + 1) * dim);
      }
      ids = nullptr;
    } else {
      rows[0] = t.values;
    }
  }
  return out;
}

// The names of the tensors of `got` that differ from `want` (a missing one counts).
inline std::vector<std::string> Differing(const WeightsByRow& want, const WeightsByRow& got) {
  std::vector<std::string> names;
  for (const auto& [name, rows] : want) {
    auto it = got.find(name);
    if (it == got.end() || it->second != rows) names.push_back(name);
  }
  for (const auto& [name, rows] : got) {
    if (want.count(name) == 0) names.push_back(name);
  }
  return names;
}

// The MLP of the demo, BSP, seed 1, 2 workers, `epochs` epochs (the cosine schedule spans them).
inline v1::JobSpec Spec(const std::string& name, int64_t checkpoint_every, int epochs = 2) {
  absl::StatusOr<v1::JobSpec> spec = spec::ReadJobSpecFile(
      absl::StrCat(TESSERA_SOURCE_DIR, "/examples/fashion_mlp_2epochs.textproto"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  v1::JobSpec s = spec.ok() ? *spec : v1::JobSpec();
  s.set_name(name);
  s.set_num_workers(2);
  s.set_checkpoint_every_steps(checkpoint_every);
  s.set_epochs(epochs);
  s.mutable_schedule()->set_total_steps(s.schedule().total_steps() * epochs / 2);
  return s;
}

class ClusterE2eTest : public ::testing::Test {
 protected:
  // 2 shards and 3 workers (one more than the jobs need: the idle one takes over a lost rank),
  // with the short leases above.
  static LocalCluster::Options ClusterOptions() {
    LocalCluster::Options o;
    o.bin_dir = TESSERA_BIN_DIR;
    o.num_shards = 2;
    o.num_workers = 3;
    o.worker_threads = 1;
    o.log_level = "info";
    o.coordinator_args = {"--lease_seconds", kLeaseSeconds, "--heartbeat_seconds",
                          kHeartbeatSeconds};
    return o;
  }

  // A sparse BSP job (the hashed embedding model, Adagrad, batch 16, 2 workers, seed 3) on
  // generated LIBSVM data written to a new folder under /tmp (40,000 training and 2,000 test
  // examples), and a cluster whose coordinator and workers may read it. The folder goes in
  // TearDown.
  v1::JobSpec StartSparseCluster(int epochs, int64_t checkpoint_every) {
    char tmpl[] = "/tmp/tessera_sparse_e2e.XXXXXX";
    sparse_dir_ = mkdtemp(tmpl);
    LocalCluster::Options o = ClusterOptions();
    for (auto* args : {&o.coordinator_args, &o.worker_args}) {
      args->insert(args->end(), {"--dataset_root", sparse_dir_});
    }
    StartCluster(o);
    spec::examples::WriteHashedLibsvm(sparse_dir_ + "/train.svm", 40000, 5);
    spec::examples::WriteHashedLibsvm(sparse_dir_ + "/test.svm", 2000, 6);
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
        absl::StrCat(spec::examples::HashedJobText(sparse_dir_), R"(
          optimizer { kind: OPTIMIZER_KIND_ADAGRAD learning_rate: 0.2 }
          batch_size: 16
          seed: 3
          num_workers: 2
          consistency: "bsp"
        )"),
        &spec));
    spec.set_epochs(epochs);
    spec.set_checkpoint_every_steps(checkpoint_every);
    return spec;
  }

  void StartCluster(const LocalCluster::Options& o = ClusterOptions()) {
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(o);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    CoordinatorClient::Options c;
    c.address = cluster_->coordinator_address();
    c.rpc_timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = CoordinatorClient::Create(c);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  void TearDown() override {
    if (cluster_ == nullptr) return;
    if (HasFailure()) {
      for (const LocalCluster::Child& child : cluster_->children()) {
        std::fprintf(stderr, "--- %s ---\n%s\n", child.name.c_str(),
                     LocalCluster::LogTail(child, 4000).c_str());
      }
    }
    cluster_->Stop(absl::Seconds(15)).IgnoreError();
    if (!sparse_dir_.empty()) std::system(absl::StrCat("rm -rf '", sparse_dir_, "'").c_str());
  }

  // Polls GetJob every 50 ms until `done(job)` or the timeout; `each` sees every record.
  template <typename Pred>
  v1::Job WaitForJob(const std::string& id, absl::Duration timeout, Pred done,
                     const std::function<void(const v1::Job&)>& each = nullptr) {
    const absl::Time deadline = absl::Now() + timeout;
    v1::Job job;
    while (absl::Now() < deadline) {
      absl::StatusOr<v1::Job> got = client_->GetJob(id);
      if (got.ok()) {
        job = *got;
        if (each) each(job);
        if (done(job)) break;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return job;
  }

  static bool Ended(const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
           j.state() == v1::JOB_STATE_CANCELLED;
  }

  // Runs `spec` to its end; returns the final record.
  v1::Job RunToEnd(const v1::JobSpec& spec) {
    absl::StatusOr<v1::Job> created = client_->CreateJob(spec);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return v1::Job();
    return WaitForJob(created->id(), absl::Seconds(240), Ended);
  }

  // Every event of the job, in order (the whole history, replayed from the coordinator).
  std::vector<v1::JobEvent> Events(const std::string& id) {
    std::vector<v1::JobEvent> events;
    absl::Status watched = client_->WatchJob(id, [&](const v1::WatchJobResponse& r) {
      if (r.has_event()) events.push_back(r.event());
    });
    EXPECT_TRUE(watched.ok()) << watched;
    return events;
  }

  // The first event at or after `since_ms` whose message contains `text`.
  static std::optional<v1::JobEvent> FindEvent(const std::vector<v1::JobEvent>& events,
                                               const std::string& text, int64_t since_ms = 0) {
    for (const v1::JobEvent& e : events) {
      if (e.time_ms() >= since_ms && absl::StrContains(e.message(), text)) return e;
    }
    return std::nullopt;
  }

  // The child process running the job's rank `rank` (from ListMembers' pid).
  std::string ChildOfRank(const std::string& job_id, int rank) {
    absl::StatusOr<std::vector<v1::Member>> members = client_->ListMembers();
    if (!members.ok()) return "";
    for (const v1::Member& m : *members) {
      if (m.role() != v1::MEMBER_ROLE_WORKER || m.job_id() != job_id || m.rank() != rank) continue;
      for (const LocalCluster::Child& child : cluster_->children()) {
        if (child.pid() == m.pid()) return child.name;
      }
    }
    return "";
  }

  // The fault-free run every faulty run is compared with (same spec and seed).
  double Baseline(int epochs = 2) {
    v1::Job job = RunToEnd(Spec("baseline", 50, epochs));
    EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
    return job.test_accuracy();
  }

  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<CoordinatorClient> client_;
  std::string sparse_dir_;  // StartSparseCluster's data, removed in TearDown
};

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_RECOVERY_CLUSTER_FIXTURE_H_
