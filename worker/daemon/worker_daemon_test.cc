#include "worker/daemon/worker_daemon.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/testing/prometheus_text.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "spec/testing/example_jobs.h"
#include "worker/client/local_shards.h"
#include "worker/client/parameter_client.h"
#include "worker/daemon/worker_metrics.h"

#ifndef TESSERA_SERVER_BINARY
#error "TESSERA_SERVER_BINARY must name the tessera-server binary"
#endif

namespace tessera::worker {
namespace {

using ::testing::HasSubstr;

// A coordinator's ClusterService, reduced to what one worker sees: it registers members, hands
// out the events the test queues on the task stream, and records every report.
class FakeCoordinator final : public v1::ClusterService::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override {
    absl::MutexLock lock(&mu_);
    registration_ = *request;
    response->set_member_id(absl::StrCat("w-", ++registrations_));
    response->set_lease_ms(5000);
    response->set_heartbeat_interval_ms(200);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu_);
    if (!forgotten_.empty() && request->member_id() == forgotten_) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "member_id: unknown member");
    }
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const v1::DeregisterRequest* request,
                          v1::DeregisterResponse*) override {
    absl::MutexLock lock(&mu_);
    deregistered_ = request->member_id();
    return grpc::Status::OK;
  }
  grpc::Status WatchTasks(grpc::ServerContext* context, const v1::WatchTasksRequest* request,
                          grpc::ServerWriter<v1::TaskEvent>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      watched_ = request->member_id();
    }
    // Bounded: the test's server shuts down (cancelling this call) within seconds.
    for (int i = 0; i < 3000 && !context->IsCancelled(); ++i) {
      std::optional<v1::TaskEvent> event;
      {
        absl::MutexLock lock(&mu_);
        if (!events_.empty()) {
          event = events_.front();
          events_.pop_front();
        }
      }
      if (event.has_value()) {
        if (!writer->Write(*event)) break;
      } else {
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    return grpc::Status::OK;
  }
  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ProgressReport* report,
                              v1::ProgressAck* ack) override {
    absl::MutexLock lock(&mu_);
    if (unavailable_) {
      ++rejected_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator down");
    }
    if (!forgotten_.empty() && report->member_id() == forgotten_) {
      ++rejected_;
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "member_id: unknown member");
    }
    reports_.push_back(*report);
    // One worker: its own TRAINING_DONE is everyone's.
    ack->set_all_workers_done(report->phase() == v1::TASK_PHASE_TRAINING_DONE);
    return grpc::Status::OK;
  }

  void Send(const v1::TaskEvent& event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(event);
  }
  // Waits (bounded) until a report passes `pred`; returns it.
  std::optional<v1::ProgressReport> WaitReport(
      const std::function<bool(const v1::ProgressReport&)>& pred, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&mu_);
        for (const v1::ProgressReport& r : reports_) {
          if (pred(r)) return r;
        }
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return std::nullopt;
  }
  // While set, every ReportProgress answers UNAVAILABLE (and is not recorded).
  void SetUnavailable(bool unavailable) {
    absl::MutexLock lock(&mu_);
    unavailable_ = unavailable;
  }
  // Heartbeats and reports of `member` answer NOT_FOUND from now on, as after a restart.
  void Forget(const std::string& member) {
    absl::MutexLock lock(&mu_);
    forgotten_ = member;
  }
  int rejected() {
    absl::MutexLock lock(&mu_);
    return rejected_;
  }
  std::vector<v1::ProgressReport> reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  std::string watched() {
    absl::MutexLock lock(&mu_);
    return watched_;
  }
  std::string deregistered() {
    absl::MutexLock lock(&mu_);
    return deregistered_;
  }
  v1::RegisterRequest registration() {
    absl::MutexLock lock(&mu_);
    return registration_;
  }

 private:
  absl::Mutex mu_;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  v1::RegisterRequest registration_ ABSL_GUARDED_BY(mu_);
  std::string watched_ ABSL_GUARDED_BY(mu_);
  std::string deregistered_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::TaskEvent> events_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ProgressReport> reports_ ABSL_GUARDED_BY(mu_);
  bool unavailable_ ABSL_GUARDED_BY(mu_) = false;
  std::string forgotten_ ABSL_GUARDED_BY(mu_);
  int rejected_ ABSL_GUARDED_BY(mu_) = 0;
};

class WorkerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    client::LocalShards::Options o;
    const char* override_path = std::getenv("TESSERA_SERVER_BINARY");
    o.server_path = override_path != nullptr ? override_path : TESSERA_SERVER_BINARY;
    auto shards = client::LocalShards::Start(o);
    ASSERT_TRUE(shards.ok()) << shards.status();
    shards_ = std::move(*shards);

    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&coordinator_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    coordinator_address_ = absl::StrCat("127.0.0.1:", port);

    char tmpl[] = "/tmp/tessera_daemon_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    spec::examples::WriteBlobsCsv(dir_ + "/train.csv", 300, 1);
    spec::examples::WriteBlobsCsv(dir_ + "/test.csv", 300, 2);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    std::system(absl::StrCat("rm -rf '", dir_, "'").c_str());
  }

  v1::TaskEvent Assign(const std::string& job_id, int epochs, const std::string& extra = "") {
    v1::TaskEvent event;
    v1::Task* task = event.mutable_assign();
    task->set_job_id(job_id);
    task->set_rank(0);
    task->set_world_size(1);
    task->set_incarnation(1);
    for (const std::string& a : shards_->addresses()) task->add_shard_addresses(a);
    const std::string text = absl::StrCat(spec::examples::BlobsJobText(dir_, 8), R"(
      optimizer { kind: OPTIMIZER_KIND_ADAM learning_rate: 0.01 }
      batch_size: 16 seed: 3 num_workers: 1 epochs: )",
                                          epochs, "\n", extra);
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, task->mutable_spec()));
    return event;
  }

  std::unique_ptr<WorkerDaemon> StartDaemon() {
    WorkerDaemon::Options o;
    o.coordinator = coordinator_address_;
    o.device = "cpu";
    o.device_name = "cpu";
    o.hostname = "test-host";
    o.num_threads = 1;
    o.progress_interval = absl::Milliseconds(50);
    o.data_plane_attempts = 3;  // a dead shard fails the task within seconds
    auto d = WorkerDaemon::Create(o);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return nullptr;
    (*d)->Start();
    return std::move(*d);
  }

  static bool Phase(const v1::ProgressReport& r, v1::TaskPhase phase) { return r.phase() == phase; }

  FakeCoordinator coordinator_;
  std::unique_ptr<grpc::Server> server_;
  std::string coordinator_address_;
  std::unique_ptr<client::LocalShards> shards_;
  std::string dir_;
};

TEST_F(WorkerDaemonTest, RegistersTrainsTheTaskAndReportsSuccess) {
  std::unique_ptr<WorkerDaemon> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (coordinator_.watched().empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(coordinator_.watched(), "w-1");
  EXPECT_EQ(coordinator_.registration().role(), v1::MEMBER_ROLE_WORKER);
  EXPECT_EQ(coordinator_.registration().hostname(), "test-host");
  EXPECT_EQ(coordinator_.registration().device(), "cpu");
  EXPECT_EQ(coordinator_.registration().pid(), getpid());

  coordinator_.Send(Assign("job-1", 3));
  std::optional<v1::ProgressReport> done = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_SUCCEEDED || r.phase() == v1::TASK_PHASE_FAILED;
      },
      absl::Seconds(20));
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->phase(), v1::TASK_PHASE_SUCCEEDED) << done->error();
  EXPECT_EQ(done->member_id(), "w-1");
  EXPECT_EQ(done->job_id(), "job-1");
  EXPECT_EQ(done->step(), 3 * 19);  // ceil(300 / 16) steps per epoch
  EXPECT_TRUE(done->evaluated());
  EXPECT_GT(done->test_accuracy(), 0.9);
  // An epoch-end progress report came before.
  EXPECT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.epochs() >= 1 && r.job_id() == "job-1";
      },
      absl::Seconds(1)));
  // Idle again: a second task runs too.
  const absl::Time idle = absl::Now() + absl::Seconds(10);
  while (!daemon->current_job().empty() && absl::Now() < idle)
    absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(daemon->current_job(), "");
  coordinator_.Send(Assign("job-2", 1));
  EXPECT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_SUCCEEDED && r.job_id() == "job-2";
      },
      absl::Seconds(20)));
  // The same assignment again (a task stream that replaced another) once it has ended here: not
  // run again. job-3, sent after it, shows the worker has handled it.
  auto count = [this](const std::string& job) {
    int n = 0;
    for (const v1::ProgressReport& r : coordinator_.reports()) n += r.job_id() == job ? 1 : 0;
    return n;
  };
  const int job2_reports = count("job-2");
  while (!daemon->current_job().empty() && absl::Now() < idle + absl::Seconds(20))
    absl::SleepFor(absl::Milliseconds(5));
  coordinator_.Send(Assign("job-2", 1));
  coordinator_.Send(Assign("job-3", 1));
  EXPECT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_SUCCEEDED && r.job_id() == "job-3";
      },
      absl::Seconds(20)));
  EXPECT_EQ(count("job-2"), job2_reports);
  daemon->Stop();
  EXPECT_EQ(coordinator_.deregistered(), "w-1");
}

TEST_F(WorkerDaemonTest, CancelTaskStopsTheTaskAndStopReportsWorkerStopped) {
  std::unique_ptr<WorkerDaemon> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  coordinator_.Send(Assign("long-1", 100000));
  ASSERT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.step() > 0;
      },
      absl::Seconds(20)));
  v1::TaskEvent cancel;
  cancel.mutable_cancel()->set_job_id("long-1");
  cancel.mutable_cancel()->set_reason("test");
  coordinator_.Send(cancel);
  std::optional<v1::ProgressReport> failed = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) { return r.phase() == v1::TASK_PHASE_FAILED; },
      absl::Seconds(5));
  ASSERT_TRUE(failed.has_value());
  EXPECT_EQ(failed->error(), "cancelled");
  EXPECT_EQ(failed->job_id(), "long-1");

  const absl::Time idle = absl::Now() + absl::Seconds(10);
  while (!daemon->current_job().empty() && absl::Now() < idle)
    absl::SleepFor(absl::Milliseconds(5));
  coordinator_.Send(Assign("long-2", 100000));
  ASSERT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.step() > 0 && r.job_id() == "long-2";
      },
      absl::Seconds(20)));
  const auto t0 = std::chrono::steady_clock::now();
  daemon->Stop();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  std::optional<v1::ProgressReport> stopped = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_FAILED && r.job_id() == "long-2";
      },
      absl::Seconds(1));
  ASSERT_TRUE(stopped.has_value());
  EXPECT_EQ(stopped->error(), "worker stopped");
  EXPECT_EQ(coordinator_.deregistered(), "w-1");
}

// ceil(300 / 16) steps per epoch for Assign()'s task.
constexpr int64_t kStepsPerEpoch = 19;

// The coordinator sends the assignment again on a task stream that replaced another: the worker
// running it goes on, without starting over.
TEST_F(WorkerDaemonTest, TheSameAssignmentAgainIsIgnored) {
  std::unique_ptr<WorkerDaemon> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const std::string asp = R"(consistency: "asp")";
  coordinator_.Send(Assign("dup", 100000, asp));
  std::optional<v1::ProgressReport> first = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.step() > 0;
      },
      absl::Seconds(20));
  ASSERT_TRUE(first.has_value());
  const size_t before = coordinator_.reports().size();
  coordinator_.Send(Assign("dup", 100000, asp));
  // Events are handled in order: once another job sent after it is refused (busy), the
  // duplicate has been handled. Then a report from after it.
  coordinator_.Send(Assign("marker", 1));
  ASSERT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.job_id() == "marker" && r.phase() == v1::TASK_PHASE_FAILED;
      },
      absl::Seconds(20)));
  int64_t seen = 0;
  for (const v1::ProgressReport& r : coordinator_.reports()) seen = std::max(seen, r.step());
  std::optional<v1::ProgressReport> later = coordinator_.WaitReport(
      [seen](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.step() > seen;
      },
      absl::Seconds(20));
  ASSERT_TRUE(later.has_value());
  EXPECT_EQ(daemon->current_job(), "dup");
  // The metrics: one task from step 0, so the steps counted are its step.
  const WorkerDaemon::Stats stats = daemon->stats();
  EXPECT_TRUE(stats.busy);
  EXPECT_EQ(stats.job_id, "dup");
  EXPECT_GE(stats.step, later->step());
  EXPECT_EQ(stats.steps_total, stats.step);
  auto metrics = Metrics::Create("worker", "");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  (*metrics)->AddCollectable(NewWorkerCollectable(daemon.get()));
  const std::string text = (*metrics)->Serialize();
  EXPECT_NE(text.find("tessera_worker_busy 1"), std::string::npos) << text;
  EXPECT_NE(text.find("tessera_worker_task_step{job=\"dup\",rank=\"0\"}"), std::string::npos)
      << text;
  const double steps_total = prometheus_text::Sample(text, "tessera_worker_steps_total");
  ASSERT_NE(steps_total, -1) << text;
  EXPECT_GE(steps_total, stats.steps_total);
  metrics->reset();
  daemon->Stop();
  EXPECT_FALSE(daemon->stats().busy);
  EXPECT_GE(daemon->stats().steps_total, stats.steps_total);
  // One run of incarnation 1 throughout: its reports' steps never go back (a run started over
  // would). Two may carry the same step: an interval's report that falls on an epoch's last step
  // is followed at once by that epoch's own report (worker/trainer/distributed_trainer.cc).
  const std::vector<v1::ProgressReport> reports = coordinator_.reports();
  ASSERT_GT(reports.size(), before);
  int64_t last = -1;
  for (size_t i = 0; i < reports.size(); ++i) {
    if (reports[i].job_id() != "dup") continue;  // the marker's refusal
    EXPECT_EQ(reports[i].incarnation(), first->incarnation());
    if (reports[i].phase() != v1::TASK_PHASE_TRAINING) continue;
    EXPECT_GE(reports[i].step(), last) << "report " << i << " started over";
    last = reports[i].step();
  }
}

TEST_F(WorkerDaemonTest, AHigherIncarnationPreemptsTheTaskAndALowerOneIsIgnored) {
  std::unique_ptr<WorkerDaemon> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  // ASP: the new incarnation may push steps the shards are already past (no rewind here).
  const std::string asp = R"(consistency: "asp")";
  coordinator_.Send(Assign("pre", 100000, asp));
  std::optional<v1::ProgressReport> first = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.step() > 0 && r.incarnation() == 1;
      },
      absl::Seconds(20));
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->steps_per_epoch(), kStepsPerEpoch);

  const int64_t start = first->step();
  v1::TaskEvent newer = Assign("pre", 100000, asp);
  newer.mutable_assign()->set_incarnation(5);
  newer.mutable_assign()->set_start_step(start);
  *newer.mutable_assign()->mutable_data_position() =
      trainer::DataPositionAt(start, kStepsPerEpoch, kStepsPerEpoch, 3);
  coordinator_.Send(newer);
  std::optional<v1::ProgressReport> resumed = coordinator_.WaitReport(
      [start](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_TRAINING && r.incarnation() == 5 && r.step() > start;
      },
      absl::Seconds(20));
  ASSERT_TRUE(resumed.has_value());
  EXPECT_EQ(daemon->current_job(), "pre");

  // An older incarnation of the job in hand changes nothing.
  v1::TaskEvent older = Assign("pre", 100000, asp);
  older.mutable_assign()->set_incarnation(3);
  coordinator_.Send(older);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(daemon->current_job(), "pre");
  daemon->Stop();

  // Incarnation 1 ended without a terminal report, and reported nothing once 5 had begun;
  // incarnation 3 never ran; incarnation 5 ended FAILED "worker stopped".
  const std::vector<v1::ProgressReport> reports = coordinator_.reports();
  bool five_began = false;
  int64_t five_first = -1;
  int terminal_of_five = 0;
  for (const v1::ProgressReport& r : reports) {
    ASSERT_NE(r.incarnation(), 3u);
    if (r.incarnation() == 5) {
      if (!five_began) five_first = r.step();
      five_began = true;
      if (r.phase() != v1::TASK_PHASE_TRAINING) {
        ++terminal_of_five;
        EXPECT_EQ(r.phase(), v1::TASK_PHASE_FAILED);
        EXPECT_EQ(r.error(), "worker stopped");
        EXPECT_FALSE(r.shard_error());
      }
      continue;
    }
    EXPECT_EQ(r.incarnation(), 1u);
    EXPECT_EQ(r.phase(), v1::TASK_PHASE_TRAINING) << "incarnation 1 sent a terminal report";
    EXPECT_FALSE(five_began) << "incarnation 1 reported after incarnation 5 began";
  }
  EXPECT_GT(five_first, start) << "incarnation 5 reports the real step numbers";
  EXPECT_EQ(terminal_of_five, 1);
}

TEST_F(WorkerDaemonTest, ReportsBufferedDuringAnOutageGoOutInOrderUnderTheNewMemberId) {
  std::unique_ptr<WorkerDaemon> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  const absl::Time registered = absl::Now() + absl::Seconds(10);
  while (coordinator_.watched().empty() && absl::Now() < registered) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(coordinator_.watched(), "w-1");
  // The coordinator goes down; the task trains on (3 epochs, an evaluation after the first two).
  coordinator_.SetUnavailable(true);
  coordinator_.Send(Assign("buffered", 3));
  const absl::Time outage_end = absl::Now() + absl::Seconds(2);
  while ((absl::Now() < outage_end || coordinator_.rejected() < 3) &&
         absl::Now() < outage_end + absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GE(coordinator_.rejected(), 3);
  EXPECT_TRUE(coordinator_.reports().empty());
  // It comes back without this member (a restart): the agent registers again as w-2.
  coordinator_.Forget("w-1");
  coordinator_.SetUnavailable(false);
  ASSERT_TRUE(coordinator_.WaitReport(
      [](const v1::ProgressReport& r) { return r.phase() == v1::TASK_PHASE_SUCCEEDED; },
      absl::Seconds(30)));
  daemon->Stop();

  const std::vector<v1::ProgressReport> reports = coordinator_.reports();
  ASSERT_FALSE(reports.empty());
  int64_t last_step = 0;
  int last_phase = v1::TASK_PHASE_TRAINING;
  std::vector<int64_t> evaluated, epoch_ends;
  for (const v1::ProgressReport& r : reports) {
    EXPECT_EQ(r.member_id(), "w-2");
    EXPECT_EQ(r.job_id(), "buffered");
    EXPECT_EQ(r.incarnation(), 1u);
    EXPECT_EQ(r.steps_per_epoch(), kStepsPerEpoch);
    EXPECT_GE(r.step(), last_step) << "out of order";
    EXPECT_GE(static_cast<int>(r.phase()), last_phase) << "out of order";
    last_step = r.step();
    last_phase = r.phase();
    if (r.phase() != v1::TASK_PHASE_TRAINING) continue;
    if (r.evaluated()) evaluated.push_back(r.step());
    // An epoch end is the report that counts the epoch as completed; a plain report may land on
    // the same step just before it (the interval elapsed at the last step of the epoch).
    if (r.epochs() > 0 && r.step() == r.epochs() * kStepsPerEpoch) epoch_ends.push_back(r.step());
  }
  EXPECT_EQ(reports.back().phase(), v1::TASK_PHASE_SUCCEEDED);
  EXPECT_EQ(reports.back().step(), 3 * kStepsPerEpoch);
  EXPECT_EQ(evaluated, (std::vector<int64_t>{kStepsPerEpoch, 2 * kStepsPerEpoch}));
  EXPECT_EQ(epoch_ends,
            (std::vector<int64_t>{kStepsPerEpoch, 2 * kStepsPerEpoch, 3 * kStepsPerEpoch}));
}

TEST_F(WorkerDaemonTest, DataPlaneFailuresReportShardError) {
  std::unique_ptr<WorkerDaemon> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  // A port nothing listens on: bind port 0, read it, close it.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string dead = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  close(fd);

  v1::TaskEvent unreachable = Assign("dead-shard", 1);
  unreachable.mutable_assign()->set_incarnation(7);
  unreachable.mutable_assign()->add_shard_addresses(dead);
  coordinator_.Send(unreachable);
  std::optional<v1::ProgressReport> failed = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) { return r.phase() == v1::TASK_PHASE_FAILED; },
      absl::Seconds(30));
  ASSERT_TRUE(failed.has_value());
  EXPECT_EQ(failed->job_id(), "dead-shard");
  EXPECT_TRUE(failed->shard_error()) << failed->error();
  EXPECT_THAT(failed->error(), HasSubstr(dead));
  EXPECT_EQ(failed->incarnation(), 7u);
  EXPECT_EQ(failed->steps_per_epoch(), kStepsPerEpoch);

  // A bad task is not a data-plane failure.
  const absl::Time idle = absl::Now() + absl::Seconds(10);
  while (!daemon->current_job().empty() && absl::Now() < idle)
    absl::SleepFor(absl::Milliseconds(5));
  v1::TaskEvent bad = Assign("bad-task", 1);
  bad.mutable_assign()->set_world_size(2);
  coordinator_.Send(bad);
  std::optional<v1::ProgressReport> refused = coordinator_.WaitReport(
      [](const v1::ProgressReport& r) {
        return r.phase() == v1::TASK_PHASE_FAILED && r.job_id() == "bad-task";
      },
      absl::Seconds(10));
  ASSERT_TRUE(refused.has_value());
  EXPECT_FALSE(refused->shard_error());
  EXPECT_THAT(refused->error(), HasSubstr("task.world_size"));
  EXPECT_EQ(refused->incarnation(), 1u);
  daemon->Stop();
}

}  // namespace
}  // namespace tessera::worker
