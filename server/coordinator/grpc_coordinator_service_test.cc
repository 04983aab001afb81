// The coordinator over gRPC on 127.0.0.1:0: spec validation through CreateJob, the task stream,
// WatchJob ordering. The shards are an in-process fake ParameterService.
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator_server.h"
#include "spec/job_spec_reader.h"
#include "spec/testing/example_jobs.h"
#include "tessera/v1/job.grpc.pb.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::coordinator {
namespace {

using ::tessera::spec::examples::FashionMlpJob;

class FakeParameterService final : public v1::ParameterService::Service {
 public:
  grpc::Status CreateJobState(grpc::ServerContext*, const v1::CreateJobStateRequest* request,
                              v1::CreateJobStateResponse*) override {
    absl::MutexLock lock(&mu);
    created.push_back(request->job_id());
    return grpc::Status::OK;
  }
  grpc::Status DropJob(grpc::ServerContext*, const v1::DropJobRequest* request,
                       v1::DropJobResponse*) override {
    absl::MutexLock lock(&mu);
    dropped.push_back(request->job_id());
    return grpc::Status::OK;
  }
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest* request,
                          v1::CheckpointResponse* response) override {
    absl::MutexLock lock(&mu);
    checkpoint_steps.push_back(request->step());
    response->set_path(
        absl::StrCat("/d/checkpoints/", request->job_id(), "/ckpt-", request->step(), "/shard-0"));
    response->set_bytes(4096);
    response->set_step(request->step());
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::vector<std::string> created;
  std::vector<std::string> dropped;
  std::vector<int64_t> checkpoint_steps;
};

// A shard whose Checkpoint calls are held (no thread waits on them: a callback service) until
// Release(), and answered at once after it.
class HeldCheckpointShard final : public v1::ParameterService::CallbackService {
 public:
  grpc::ServerUnaryReactor* CreateJobState(grpc::CallbackServerContext* context,
                                           const v1::CreateJobStateRequest*,
                                           v1::CreateJobStateResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* DropJob(grpc::CallbackServerContext* context, const v1::DropJobRequest*,
                                    v1::DropJobResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const v1::CheckpointRequest* request,
                                       v1::CheckpointResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    response->set_step(request->step());
    response->set_bytes(4096);
    absl::MutexLock lock(&mu_);
    ++arrived_;
    if (released_) {
      reactor->Finish(grpc::Status::OK);
    } else {
      held_.push_back(reactor);
    }
    return reactor;
  }
  void Release() {
    std::vector<grpc::ServerUnaryReactor*> held;
    {
      absl::MutexLock lock(&mu_);
      released_ = true;
      held.swap(held_);
    }
    for (grpc::ServerUnaryReactor* reactor : held) reactor->Finish(grpc::Status::OK);
  }
  int arrived() {
    absl::MutexLock lock(&mu_);
    return arrived_;
  }

 private:
  absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ServerUnaryReactor*> held_ ABSL_GUARDED_BY(mu_);
};

// The process's thread count (/proc/self/status); -1 when it cannot be read.
int ProcessThreads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "Threads:")) {
      std::istringstream fields(line.substr(8));
      int threads = -1;
      fields >> threads;
      return threads;
    }
  }
  return -1;
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  return context;
}

class CoordinatorGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/coordinator_grpc_XXXXXX";
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
    data_ = dir_ + "/data";
    ASSERT_EQ(::mkdir(data_.c_str(), 0755), 0);
    for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
      std::ofstream(data_ + "/" + name) << "x";
    }
    CoordinatorServerOptions options;
    options.listen = "127.0.0.1:0";
    options.data_dir = dir_ + "/db";
    options.coordinator.heartbeat_interval = absl::Milliseconds(200);
    options.coordinator.lease = absl::Seconds(5);
    auto server = CoordinatorServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_TRUE(server_->Start().ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    cluster_ = v1::ClusterService::NewStub(channel);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Stop(absl::Seconds(1));
  }

  std::string dir_;
  std::string data_;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
};

TEST_F(CoordinatorGrpcTest, BadSpecsAreRefusedNamingTheFieldAndNothingIsQueued) {
  struct Case {
    std::string what;
    v1::JobSpec spec;
    std::string field;  // the message starts with it
  };
  std::vector<Case> cases;
  cases.push_back({"unknown consistency", FashionMlpJob("mlp", 2, data_), "consistency:"});
  cases.back().spec.set_consistency("paxos");
  cases.push_back({"num_workers 0", FashionMlpJob("mlp", 0, data_), "num_workers:"});
  cases.push_back(
      {"missing dataset file", FashionMlpJob("mlp", 2, data_), "dataset.train_labels:"});
  cases.back().spec.mutable_dataset()->set_train_labels(data_ + "/missing.gz");
  cases.push_back({"impossible shapes", FashionMlpJob("mlp", 2, data_), "model.layers[0]"});
  cases.back().spec.mutable_model()->mutable_layers(0)->mutable_conv2d()->set_filters(4);
  cases.back().spec.mutable_model()->mutable_layers(0)->mutable_conv2d()->set_kernel_h(3);
  cases.back().spec.mutable_model()->mutable_layers(0)->mutable_conv2d()->set_kernel_w(3);
  cases.push_back({"a layer of no known kind", FashionMlpJob("mlp", 2, data_), "model.layers[1]"});
  cases.back().spec.mutable_model()->mutable_layers(1)->clear_kind();
  for (const Case& c : cases) {
    v1::CreateJobRequest request;
    *request.mutable_spec() = c.spec;
    v1::Job job;
    const grpc::Status status = jobs_->CreateJob(Context().get(), request, &job);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what;
    EXPECT_TRUE(absl::StartsWith(status.error_message(), c.field))
        << c.what << ": " << status.error_message();
  }
  // An unknown layer in a JSON spec is refused when the file is parsed, naming the field.
  auto parsed = spec::ParseJobSpec(R"({"name": "mlp", "model": {"layers": [{"transformer": {}}]}})",
                                   "job.json");
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(parsed.status().message(), "transformer")) << parsed.status();

  // Nothing was queued, and the coordinator still serves.
  v1::ListJobsResponse list;
  ASSERT_TRUE(jobs_->ListJobs(Context().get(), v1::ListJobsRequest(), &list).ok());
  EXPECT_EQ(list.jobs_size(), 0);
  v1::CreateJobRequest good;
  *good.mutable_spec() = FashionMlpJob("mlp", 2, data_);
  v1::Job job;
  const grpc::Status created = jobs_->CreateJob(Context().get(), good, &job);
  ASSERT_TRUE(created.ok()) << created.error_message();
  EXPECT_EQ(job.id(), "mlp-1");  // the refused specs used no number
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  v1::GetJobRequest get;
  get.set_job_id("nope-3");
  EXPECT_EQ(jobs_->GetJob(Context().get(), get, &job).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::RegisterRequest bad_member;
  bad_member.set_role(v1::MEMBER_ROLE_SERVER);
  bad_member.set_shard_index(-2);
  bad_member.set_address("127.0.0.1:1");
  v1::RegisterResponse registered;
  const grpc::Status refused = cluster_->Register(Context().get(), bad_member, &registered);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(refused.error_message(), "shard_index:"));
}

TEST_F(CoordinatorGrpcTest, TaskStreamAndWatchJobInOrder) {
  FakeParameterService shard;
  int shard_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &shard_port);
  builder.RegisterService(&shard);
  std::unique_ptr<grpc::Server> shard_server = builder.BuildAndStart();
  ASSERT_NE(shard_server, nullptr);

  v1::RegisterRequest request;
  request.set_role(v1::MEMBER_ROLE_SERVER);
  request.set_address(absl::StrCat("127.0.0.1:", shard_port));
  v1::RegisterResponse response;
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &response).ok());
  EXPECT_EQ(response.member_id(), "s-1");
  EXPECT_EQ(response.lease_ms(), 5000);
  EXPECT_EQ(response.heartbeat_interval_ms(), 200);
  request.Clear();
  request.set_role(v1::MEMBER_ROLE_WORKER);
  request.set_hostname("host-a");
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &response).ok());
  const std::string worker = response.member_id();
  ASSERT_EQ(worker, "w-1");

  v1::WatchTasksRequest watch_tasks;
  watch_tasks.set_member_id(worker);
  auto tasks_context = Context();
  auto tasks = cluster_->WatchTasks(tasks_context.get(), watch_tasks);

  v1::CreateJobRequest create;
  *create.mutable_spec() = FashionMlpJob("mlp", 1, data_);
  v1::Job job;
  ASSERT_TRUE(jobs_->CreateJob(Context().get(), create, &job).ok());
  v1::WatchJobRequest watch;
  watch.set_job_id(job.id());
  auto watch_context = Context();
  auto watcher = jobs_->WatchJob(watch_context.get(), watch);

  v1::TaskEvent event;
  ASSERT_TRUE(tasks->Read(&event));  // the scheduler wakes on the new stream and job
  ASSERT_TRUE(event.has_assign());
  EXPECT_EQ(event.assign().job_id(), "mlp-1");
  EXPECT_EQ(event.assign().world_size(), 1);
  EXPECT_EQ(event.assign().shard_addresses(0), absl::StrCat("127.0.0.1:", shard_port));
  {
    absl::MutexLock lock(&shard.mu);
    EXPECT_EQ(shard.created, (std::vector<std::string>{"mlp-1"}));
  }

  v1::ProgressReport report;
  report.set_member_id(worker);
  report.set_job_id("mlp-1");
  report.set_phase(v1::TASK_PHASE_TRAINING_DONE);
  report.set_step(10);
  v1::ProgressAck ack;
  ASSERT_TRUE(cluster_->ReportProgress(Context().get(), report, &ack).ok());
  EXPECT_TRUE(ack.all_workers_done());
  report.set_phase(v1::TASK_PHASE_SUCCEEDED);
  report.set_test_accuracy(0.875);
  ASSERT_TRUE(cluster_->ReportProgress(Context().get(), report, &ack).ok());
  EXPECT_FALSE(ack.cancel());

  v1::WatchJobResponse update;
  ASSERT_TRUE(watcher->Read(&update));
  EXPECT_FALSE(update.has_event());
  EXPECT_EQ(update.job().id(), "mlp-1");
  std::vector<int64_t> seqs;
  std::vector<std::string> messages;
  while (watcher->Read(&update)) {
    seqs.push_back(update.event().seq());
    messages.push_back(update.event().message());
  }
  const grpc::Status ended = watcher->Finish();
  EXPECT_TRUE(ended.ok()) << ended.error_message();
  ASSERT_GE(seqs.size(), 3u);
  for (size_t i = 0; i < seqs.size(); ++i) EXPECT_EQ(seqs[i], static_cast<int64_t>(i + 1));
  EXPECT_EQ(messages.front(), "queued");
  EXPECT_EQ(messages[1], "started on 1 workers and 1 shards");
  EXPECT_EQ(messages.back(), "succeeded: test accuracy 0.8750, test loss 0.0000");
  EXPECT_EQ(update.job().state(), v1::JOB_STATE_SUCCEEDED);

  // A second WatchTasks replaces the first, which ends ABORTED.
  auto second_context = Context();
  auto second = cluster_->WatchTasks(second_context.get(), watch_tasks);
  EXPECT_FALSE(tasks->Read(&event));
  EXPECT_EQ(tasks->Finish().error_code(), grpc::StatusCode::ABORTED);
  v1::ListMembersResponse members;
  ASSERT_TRUE(cluster_->ListMembers(Context().get(), v1::ListMembersRequest(), &members).ok());
  ASSERT_EQ(members.members_size(), 2);
  EXPECT_EQ(members.members(0).id(), "s-1");
  EXPECT_EQ(members.members(1).id(), "w-1");
  EXPECT_EQ(members.members(1).state(), v1::MEMBER_STATE_READY);
  second_context->TryCancel();
  second->Finish().ok();
  shard_server->Shutdown();
}

TEST_F(CoordinatorGrpcTest, CheckpointJobWaitsForTheShardsAndCommits) {
  FakeParameterService shard;
  int shard_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &shard_port);
  builder.RegisterService(&shard);
  std::unique_ptr<grpc::Server> shard_server = builder.BuildAndStart();
  ASSERT_NE(shard_server, nullptr);
  v1::RegisterRequest request;
  request.set_role(v1::MEMBER_ROLE_SERVER);
  request.set_address(absl::StrCat("127.0.0.1:", shard_port));
  v1::RegisterResponse response;
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &response).ok());
  request.Clear();
  request.set_role(v1::MEMBER_ROLE_WORKER);
  request.set_hostname("host-a");
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &response).ok());
  const std::string worker = response.member_id();
  v1::WatchTasksRequest watch_tasks;
  watch_tasks.set_member_id(worker);
  auto tasks_context = Context();
  auto tasks = cluster_->WatchTasks(tasks_context.get(), watch_tasks);
  v1::CreateJobRequest create;
  *create.mutable_spec() = FashionMlpJob("mlp", 1, data_);
  v1::Job job;
  ASSERT_TRUE(jobs_->CreateJob(Context().get(), create, &job).ok());
  v1::TaskEvent event;
  ASSERT_TRUE(tasks->Read(&event));
  ASSERT_TRUE(event.has_assign());

  v1::ProgressReport report;
  report.set_member_id(worker);
  report.set_job_id(job.id());
  report.set_phase(v1::TASK_PHASE_TRAINING);
  report.set_step(20);
  report.set_total_steps(500);
  report.set_incarnation(event.assign().incarnation());
  v1::ProgressAck ack;
  ASSERT_TRUE(cluster_->ReportProgress(Context().get(), report, &ack).ok());
  v1::CheckpointJobRequest checkpoint;
  checkpoint.set_job_id(job.id());
  v1::CheckpointRecord record;
  const grpc::Status status = jobs_->CheckpointJob(Context().get(), checkpoint, &record);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(record.step(), 30);  // 20 + the smallest margin
  EXPECT_TRUE(record.manual());
  ASSERT_EQ(record.shards_size(), 1);
  EXPECT_EQ(record.shards(0).bytes(), 4096u);
  EXPECT_EQ(record.shards(0).path(), "/d/checkpoints/mlp-1/ckpt-30/shard-0");
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  ASSERT_TRUE(jobs_->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.last_checkpoint_step(), 30);
  checkpoint.set_job_id("nope-7");
  EXPECT_EQ(jobs_->CheckpointJob(Context().get(), checkpoint, &record).error_code(),
            grpc::StatusCode::NOT_FOUND);
  tasks_context->TryCancel();
  tasks->Finish().ok();
  shard_server->Shutdown();
}

// A flood of CheckpointJob calls waits on the bounded checkpoint pool: it starts no thread per
// call, reaches the shard only as many at a time as the pool has threads, and leaves gRPC's
// threads and the store pool free, so GetJob, ListMembers and CreateJob still answer.
TEST_F(CoordinatorGrpcTest, ACheckpointJobFloodWaitsOnABoundedPoolAndOtherCallsStillAnswer) {
  HeldCheckpointShard shard;
  int shard_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &shard_port);
  builder.RegisterService(&shard);
  std::unique_ptr<grpc::Server> shard_server = builder.BuildAndStart();
  ASSERT_NE(shard_server, nullptr);
  v1::RegisterRequest request;
  request.set_role(v1::MEMBER_ROLE_SERVER);
  request.set_address(absl::StrCat("127.0.0.1:", shard_port));
  v1::RegisterResponse response;
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &response).ok());
  request.Clear();
  request.set_role(v1::MEMBER_ROLE_WORKER);
  request.set_hostname("host-a");
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &response).ok());
  const std::string worker = response.member_id();
  v1::WatchTasksRequest watch_tasks;
  watch_tasks.set_member_id(worker);
  auto tasks_context = Context();
  auto tasks = cluster_->WatchTasks(tasks_context.get(), watch_tasks);
  v1::CreateJobRequest create;
  *create.mutable_spec() = FashionMlpJob("mlp", 1, data_);
  v1::Job job;
  ASSERT_TRUE(jobs_->CreateJob(Context().get(), create, &job).ok());
  v1::TaskEvent event;
  ASSERT_TRUE(tasks->Read(&event));
  ASSERT_TRUE(event.has_assign());
  v1::ProgressReport report;
  report.set_member_id(worker);
  report.set_job_id(job.id());
  report.set_phase(v1::TASK_PHASE_TRAINING);
  report.set_step(20);
  report.set_total_steps(500);
  report.set_incarnation(event.assign().incarnation());
  v1::ProgressAck ack;
  ASSERT_TRUE(cluster_->ReportProgress(Context().get(), report, &ack).ok());

  const int pool_threads = CoordinatorServerOptions().checkpoint_threads;
  constexpr int kCalls = 48;
  const int threads_before = ProcessThreads();
  ASSERT_GT(threads_before, 0);
  struct Call {
    grpc::ClientContext context;
    v1::CheckpointJobRequest request;
    v1::CheckpointRecord record;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Call>> calls;
  absl::Mutex mu;
  int answered = 0;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<Call>());
    Call& call = *calls.back();
    call.context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    call.request.set_job_id(job.id());
    jobs_->async()->CheckpointJob(&call.context, &call.request, &call.record,
                                  [&mu, &answered, &call](grpc::Status status) {
                                    absl::MutexLock lock(&mu);
                                    call.status = std::move(status);
                                    ++answered;
                                  });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (shard.arrived() < pool_threads && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  absl::SleepFor(absl::Milliseconds(500));  // time for more to arrive, were they not queued
  EXPECT_EQ(shard.arrived(), pool_threads);
  const int threads_during = ProcessThreads();
  EXPECT_LT(threads_during - threads_before, kCalls / 2)
      << threads_before << " threads before, " << threads_during << " during";

  // Neither gRPC's threads nor the store pool wait on the checkpoints.
  auto quick = [] {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
    return context;
  };
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  v1::Job got;
  const grpc::Status got_status = jobs_->GetJob(quick().get(), get, &got);
  ASSERT_TRUE(got_status.ok()) << got_status.error_message();
  EXPECT_EQ(got.state(), v1::JOB_STATE_RUNNING);
  v1::ListMembersResponse members;
  ASSERT_TRUE(cluster_->ListMembers(quick().get(), v1::ListMembersRequest(), &members).ok());
  EXPECT_EQ(members.members_size(), 2);
  v1::Job second;
  const grpc::Status created = jobs_->CreateJob(quick().get(), create, &second);
  ASSERT_TRUE(created.ok()) << created.error_message();
  EXPECT_EQ(second.id(), "mlp-2");
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(answered, 0);
  }

  shard.Release();
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                        +[](int* n) { return *n == kCalls; }, &answered),
                                    absl::Seconds(60)));
  }
  EXPECT_EQ(shard.arrived(), kCalls);
  for (const std::unique_ptr<Call>& call : calls) {
    EXPECT_TRUE(call->status.ok()) << call->status.error_message();
    EXPECT_EQ(call->record.step(), 30);  // 20 + the smallest margin, every time
    EXPECT_TRUE(call->record.manual());
  }
  ASSERT_TRUE(jobs_->GetJob(Context().get(), get, &got).ok());
  EXPECT_EQ(got.last_checkpoint_step(), 30);
  tasks_context->TryCancel();
  tasks->Finish().ok();
  shard_server->Shutdown();
}

// The real tessera-server registers itself, takes CreateJobState, and deregisters on SIGTERM.
TEST_F(CoordinatorGrpcTest, RealShardRegistersServesTheJobAndLeaves) {
  const std::string log = dir_ + "/shard.log";
  const std::string coordinator = absl::StrCat("127.0.0.1:", server_->port());
  const pid_t shard = ::fork();
  ASSERT_GE(shard, 0);
  if (shard == 0) {
    if (std::freopen(log.c_str(), "w", stderr) == nullptr) ::_exit(126);
    ::dup2(::fileno(stderr), STDOUT_FILENO);
    ::execl(TESSERA_SERVER_PATH, TESSERA_SERVER_PATH, "--listen", "127.0.0.1:0", "--shard_index",
            "0", "--threads", "1", "--coordinator", coordinator.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  auto members = [&] {
    v1::ListMembersResponse response;
    EXPECT_TRUE(cluster_->ListMembers(Context().get(), v1::ListMembersRequest(), &response).ok());
    return response;
  };
  absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (members().members_size() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  v1::ListMembersResponse listed = members();
  ASSERT_EQ(listed.members_size(), 1) << "see " << log;
  EXPECT_EQ(listed.members(0).role(), v1::MEMBER_ROLE_SERVER);
  EXPECT_EQ(listed.members(0).pid(), shard);
  EXPECT_TRUE(absl::StartsWith(listed.members(0).address(), "127.0.0.1:"));
  EXPECT_NE(listed.members(0).address(), "127.0.0.1:0");

  v1::RegisterRequest request;
  request.set_role(v1::MEMBER_ROLE_WORKER);
  request.set_hostname("host-a");
  v1::RegisterResponse registered;
  ASSERT_TRUE(cluster_->Register(Context().get(), request, &registered).ok());
  v1::WatchTasksRequest watch_tasks;
  watch_tasks.set_member_id(registered.member_id());
  auto tasks_context = Context();
  auto tasks = cluster_->WatchTasks(tasks_context.get(), watch_tasks);
  v1::CreateJobRequest create;
  *create.mutable_spec() = FashionMlpJob("mlp", 1, data_);
  create.mutable_spec()->set_consistency("ssp");
  create.mutable_spec()->set_staleness(2);
  v1::Job job;
  ASSERT_TRUE(jobs_->CreateJob(Context().get(), create, &job).ok());
  v1::TaskEvent event;
  ASSERT_TRUE(tasks->Read(&event));
  EXPECT_EQ(event.assign().shard_addresses(0), listed.members(0).address());
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  ASSERT_TRUE(jobs_->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.id());
  ASSERT_TRUE(jobs_->CancelJob(Context().get(), cancel, &job).ok());
  ASSERT_TRUE(tasks->Read(&event));
  EXPECT_EQ(event.cancel().job_id(), job.id());

  ASSERT_EQ(::kill(shard, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(shard, &status, 0), shard);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "see " << log;
  listed = members();
  EXPECT_EQ(listed.members(0).state(), v1::MEMBER_STATE_LEFT);
  tasks_context->TryCancel();
  tasks->Finish().ok();
}

}  // namespace
}  // namespace tessera::coordinator
