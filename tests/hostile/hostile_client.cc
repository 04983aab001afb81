// tessera_hostile: malformed and hostile input against every method of every service of every
// daemon, while valid traffic runs (issue #6, test 7; docs/reliability.md "Hostile input").
//
// It starts a real tessera-coordinator, two tessera-server shards and a tessera-worker (child
// processes on ports picked at run time), declares two "target" jobs on the shards (the data-plane
// requests aim at them, so that the validation of a declared job runs), starts valid traffic (a
// ParameterClient pushing and pulling job "valid-job" on both shards; GetJob of a PENDING job and
// ListMembers on the coordinator), and then sends --requests requests from --threads threads
// (or as many as --time_limit_s allows: then at least --min_requests must have gone), each
// through grpc's raw byte path so that anything can be sent:
//   garbage   bytes that protobuf cannot parse as the method's request type;
//   invalid   a valid request with one edit that makes it invalid (an unknown job, key or member,
//             a wrong size, NaN under the REJECT policy, an unknown enum value, ...);
//   random    a valid request with 1-4 random edits through protobuf reflection (shapes, sizes,
//             NaN/Inf, huge and negative numbers, odd strings, duplicate and giant repeated
//             fields); it may be valid, so OK is allowed;
//   oversize  a request over the daemon's receive limit.
// Every answer is checked against the method's allowed codes (kMethods below: THE table).
// Failures: a code outside the set (OK to a garbage/invalid request included), a daemon that
// exits, a health check that is not SERVING, a valid request that fails, or a daemon's VmRSS
// growing by more than --max_rss_growth between 10% of the requests and the end (read 2 s after
// the last hostile request, once the daemons have trimmed their heaps).
//
// Control calls that a valid token authorizes (DropJob, Restore, CreateJobState, UpdateMembership,
// Checkpoint, CancelJob, CheckpointJob, Deregister, Heartbeat, WatchTasks, ReportProgress) never
// name the valid traffic's jobs or the real members: the bearer token (issue #5) is what keeps
// strangers from those. Accepted mutants are undone at once and counted: a created job is
// cancelled, a created job state dropped, a registered member deregistered.
//
// Seeded: thread i draws from --seed + i; the seed is printed; `--seed S` replays the same
// requests (their interleaving differs). Exit status 0 when every check passed, 1 otherwise,
// 2 for a usage error.
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/child_process.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "tessera/v1/job.grpc.pb.h"
#include "tessera/v1/parameter.grpc.pb.h"
#include "tests/hostile/methods.h"
#include "tests/hostile/requests.h"
#include "tests/testlib/child_process.h"
#include "worker/client/parameter_client.h"

namespace tessera::hostile {
namespace {

// --- Options -------------------------------------------------------------------------------------

struct Options {
  uint64_t seed = 0;  // 0: from the clock (printed)
  int64_t requests = 100000;
  // Reaching --time_limit_s first ends the run; it passes if at least this many were sent.
  // 0: all of --requests.
  int64_t min_requests = 0;
  int threads = 8;
  double time_limit_s = 240;
  double max_rss_growth = 0.05;
  int64_t shard_max_message_bytes = 8 << 20;
  std::string bin_dir;
  bool keep_dir = false;
  // Diagnosis: send only this kind (garbage, invalid, random, oversize) or this method.
  std::string only_kind;
  std::string only_method;
};

constexpr char kUsage[] =
    "usage: tessera_hostile --bin_dir DIR [--seed S] [--requests N] [--min_requests M]\n"
    "                       [--threads T] [--time_limit_s S] [--max_rss_growth F] [--keep_dir]\n"
    "                       [--only_kind garbage|invalid|random|oversize] [--only_method NAME]\n";

bool ParseFlags(int argc, char** argv, Options* options) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--keep_dir") {
      options->keep_dir = true;
      continue;
    }
    if (i + 1 >= argc) return false;
    const std::string value = argv[++i];
    bool ok = true;
    if (flag == "--seed") {
      ok = absl::SimpleAtoi(value, &options->seed);
    } else if (flag == "--requests") {
      ok = absl::SimpleAtoi(value, &options->requests) && options->requests > 0;
    } else if (flag == "--min_requests") {
      ok = absl::SimpleAtoi(value, &options->min_requests) && options->min_requests > 0;
    } else if (flag == "--threads") {
      ok = absl::SimpleAtoi(value, &options->threads) && options->threads > 0 &&
           options->threads <= 64;
    } else if (flag == "--time_limit_s") {
      ok = absl::SimpleAtod(value, &options->time_limit_s) && options->time_limit_s > 0;
    } else if (flag == "--max_rss_growth") {
      ok = absl::SimpleAtod(value, &options->max_rss_growth) && options->max_rss_growth >= 0;
    } else if (flag == "--only_kind") {
      options->only_kind = value;
    } else if (flag == "--only_method") {
      options->only_method = value;
    } else if (flag == "--bin_dir") {
      options->bin_dir = value;
    } else {
      ok = false;
    }
    if (!ok) return false;
  }
  return !options->bin_dir.empty();
}

// --- Raw calls -----------------------------------------------------------------------------------

struct CallResult {
  grpc::Status status;
  std::vector<std::string> responses;
};

// One call of `path` with `requests` as raw messages over a bidirectional stream: a unary or
// server-streaming method sees exactly what its own client would send (the wire does not say
// which kind a call is). Reads every response, then Finish. Blocks until the deadline at most.
CallResult RawCall(grpc::Channel* channel, const std::string& path,
                   const std::vector<std::string>& requests, absl::Duration deadline) {
  CallResult result;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  const grpc::internal::RpcMethod method(path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel, method, &context));
  for (const std::string& request : requests) {
    grpc::Slice slice(request);
    grpc::ByteBuffer buffer(&slice, 1);
    if (!stream->Write(buffer)) break;
  }
  stream->WritesDone();
  grpc::ByteBuffer response;
  while (stream->Read(&response)) {
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (response.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    result.responses.push_back(std::move(bytes));
  }
  result.status = stream->Finish();
  return result;
}

// Health/Check of the whole server: true when it answers SERVING.
bool HealthServing(grpc::Channel* channel) {
  const CallResult r =
      RawCall(channel, "/grpc.health.v1.Health/Check", {std::string()}, absl::Seconds(5));
  // HealthCheckResponse{status: SERVING (1)} is the two bytes 08 01.
  return r.status.ok() && r.responses.size() == 1 && r.responses[0] == std::string("\x08\x01", 2);
}

// Longest error message a daemon may send (a quarter of gRPC's default 8 KiB metadata limit).
constexpr size_t kMaxErrorMessageBytes = 2048;

// --- Tallies -------------------------------------------------------------------------------------

std::string Hex(const std::string& bytes, size_t max = 96) {
  std::string out;
  for (size_t i = 0; i < bytes.size() && i < max; ++i) {
    absl::StrAppendFormat(&out, "%02x", static_cast<unsigned char>(bytes[i]));
  }
  if (bytes.size() > max) absl::StrAppend(&out, "...");
  return out;
}

std::string CodeName(int code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : absl::StrCat("code ", code);
}

// Counts of one daemon. Thread-safe.
class Tally {
 public:
  void Add(int method, Kind kind, int code, int64_t n = 1) {
    absl::MutexLock lock(&mu_);
    requests_ += n;
    codes_[code] += n;
    methods_.insert(method);
    by_kind_[{method, static_cast<int>(kind)}] += n;
  }
  int64_t requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  // "<N> requests (<k> methods): <a> INVALID_ARGUMENT, ..." (codes by count, descending).
  std::string Summary() const {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<int64_t, int>> codes;
    for (const auto& [code, n] : codes_) codes.emplace_back(n, code);
    std::sort(codes.rbegin(), codes.rend());
    std::vector<std::string> parts;
    for (const auto& [n, code] : codes) parts.push_back(absl::StrCat(n, " ", CodeName(code)));
    return absl::StrCat(requests_, " requests (", methods_.size(),
                        " methods): ", absl::StrJoin(parts, ", "));
  }
  // Methods that got no request of `kind` (coverage check).
  std::vector<std::string> MissingKinds() const {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> missing;
    for (int m = 0; m < kNumMethods; ++m) {
      if (by_kind_.count({m, static_cast<int>(Kind::kGarbage)}) == 0 &&
          by_kind_.count({m, static_cast<int>(Kind::kRandom)}) == 0) {
        missing.push_back(kMethods[m].name);
      }
    }
    return missing;
  }

 private:
  mutable absl::Mutex mu_;
  int64_t requests_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int64_t> codes_ ABSL_GUARDED_BY(mu_);
  std::set<int> methods_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<int, int>, int64_t> by_kind_ ABSL_GUARDED_BY(mu_);
};

// Failures, of which the first kMaxShown are kept with their request. Thread-safe.
class Failures {
 public:
  static constexpr int kMaxShown = 25;
  void Add(std::string what) {
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(shown_.size()) < kMaxShown) shown_.push_back(std::move(what));
    ++count_;
  }
  // A failure that explains the others (a daemon that died): shown first.
  void AddFirst(std::string what) {
    absl::MutexLock lock(&mu_);
    shown_.insert(shown_.begin(), std::move(what));
    if (static_cast<int>(shown_.size()) > kMaxShown) shown_.pop_back();
    ++count_;
  }
  int64_t count() const {
    absl::MutexLock lock(&mu_);
    return count_;
  }
  void Print() const {
    absl::MutexLock lock(&mu_);
    for (const std::string& s : shown_) std::fprintf(stderr, "hostile: FAILURE: %s\n", s.c_str());
    if (count_ > static_cast<int64_t>(shown_.size())) {
      std::fprintf(stderr, "hostile: ... and %lld more failures\n",
                   static_cast<long long>(count_ - static_cast<int64_t>(shown_.size())));
    }
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> shown_ ABSL_GUARDED_BY(mu_);
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// --- The run -------------------------------------------------------------------------------------

struct Daemon {
  ChildProcess process;
  std::string address;
  size_t max_receive = 4 << 20;
  Tally tally;
  int64_t rss_base_kib = -1;
  int64_t rss_end_kib = -1;
  std::vector<int64_t> rss_curve;  // KiB at every tenth of the requests
  int64_t threads_base = -1;       // its threads then, and at the end
  int64_t threads_end = -1;
};

class HostileRun {
 public:
  HostileRun(const Options& options, const std::string& dir) : options_(options), dir_(dir) {}

  int Run();

 private:
  bool StartDaemons();
  bool DeclareTargets();
  bool StartValidTraffic();
  void StopValidTraffic();
  void HostileThread(int index, int64_t count);
  void SendOne(int thread, Rng& rng, const std::vector<std::shared_ptr<grpc::Channel>>& channels,
               const std::vector<std::unique_ptr<v1::JobService::Stub>>& jobs,
               const std::vector<std::unique_ptr<v1::ClusterService::Stub>>& cluster,
               const std::vector<std::unique_ptr<v1::ParameterService::Stub>>& shards);
  void Judge(int daemon, int m, Kind kind, const std::string& edit, const CodeSet allowed,
             const std::vector<std::string>& requests, const CallResult& result);
  void CountRequest();
  void CheckHealthAndLife(const char* when);

  const Options options_;
  const std::string dir_;
  Prototypes prototypes_;
  Targets targets_;
  std::array<Daemon, kNumDaemons> daemons_;
  Failures failures_;

  std::atomic<int64_t> sent_{0};
  std::atomic<bool> stop_valid_{false};
  std::atomic<bool> out_of_time_{false};
  absl::Time deadline_;
  std::vector<std::thread> valid_threads_;
  std::atomic<int64_t> valid_ops_{0};
  std::atomic<int64_t> valid_pushes_{0};  // applied, and found in the final weights
  std::atomic<int64_t> accepted_jobs_{0};
  std::atomic<int64_t> accepted_job_states_{0};
  std::atomic<int64_t> accepted_members_{0};
  std::atomic<int64_t> edits_{0};
  absl::Mutex rss_mu_;
  // Error messages over kMaxErrorMessageBytes, by daemon and method (one failure each).
  std::array<std::array<std::atomic<int64_t>, kNumMethods>, kNumDaemons> long_messages_{};
};

// A channel on a connection of its own (`connection` keeps gRPC from sharing one between the
// hostile threads and the valid traffic, as separate clients would not share one). `hostile`:
// headers up to 1 MiB, so that an over-long error message is measured (see Judge) instead of
// closing the connection.
std::shared_ptr<grpc::Channel> Channel(const std::string& address, int connection = 0,
                                       bool hostile = false) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(-1);
  args.SetInt("tessera.hostile.connection", connection);
  if (hostile) args.SetInt(GRPC_ARG_MAX_METADATA_SIZE, 1 << 20);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

bool HostileRun::StartDaemons() {
  const std::string& d = dir_;
  auto bin = [&](const char* name) { return absl::StrCat(options_.bin_dir, "/", name); };
  Daemon& coordinator = daemons_[kCoordinator];
  coordinator.process = testlib::SpawnChild(
      {bin("tessera-coordinator"), "--listen", "127.0.0.1:0", "--port_file",
       d + "/coordinator.port", "--data_dir", d + "/coordinator", "--num_shards", "2",
       "--lease_seconds", "10", "--heartbeat_seconds", "1", "--dataset_root", d + "/dataset"},
      d, "coordinator");
  const int coordinator_port =
      coordinator.process.WaitForPortFile(d + "/coordinator.port", absl::Seconds(30));
  if (coordinator_port <= 0) {
    failures_.Add(absl::StrCat("coordinator did not start: ",
                               testlib::FileTail(coordinator.process.stderr_path())));
    return false;
  }
  coordinator.address = absl::StrCat("127.0.0.1:", coordinator_port);
  for (int i = 0; i < 2; ++i) {
    Daemon& shard = daemons_[kShard0 + i];
    shard.max_receive = static_cast<size_t>(options_.shard_max_message_bytes);
    shard.process =
        testlib::SpawnChild({bin("tessera-server"), "--listen", "127.0.0.1:0", "--port_file",
                             absl::StrCat(d, "/shard-", i, ".port"), "--coordinator",
                             coordinator.address, "--shard_index", absl::StrCat(i), "--threads",
                             "2", "--data_dir", absl::StrCat(d, "/shard-", i),
                             "--max_message_bytes", absl::StrCat(options_.shard_max_message_bytes)},
                            d, absl::StrCat("shard-", i));
  }
  Daemon& worker = daemons_[kWorker];
  worker.process =
      testlib::SpawnChild({bin("tessera-worker"), "--coordinator", coordinator.address, "--listen",
                           "127.0.0.1:0", "--port_file", d + "/worker.port", "--device", "cpu",
                           "--threads", "1", "--dataset_root", d + "/dataset"},
                          d, "worker");
  for (int i = 0; i < 2; ++i) {
    Daemon& shard = daemons_[kShard0 + i];
    const int port =
        shard.process.WaitForPortFile(absl::StrCat(d, "/shard-", i, ".port"), absl::Seconds(30));
    if (port <= 0) {
      failures_.Add(absl::StrCat(
          "shard ", i, " did not start: ", testlib::FileTail(shard.process.stderr_path())));
      return false;
    }
    shard.address = absl::StrCat("127.0.0.1:", port);
  }
  const int worker_port = worker.process.WaitForPortFile(d + "/worker.port", absl::Seconds(30));
  if (worker_port <= 0) {
    failures_.Add(
        absl::StrCat("worker did not start: ", testlib::FileTail(worker.process.stderr_path())));
    return false;
  }
  worker.address = absl::StrCat("127.0.0.1:", worker_port);
  for (int i = 0; i < kNumDaemons; ++i) {
    bool serving = false;
    for (int attempt = 0; attempt < 100 && !serving; ++attempt) {
      serving = HealthServing(Channel(daemons_[i].address).get());
      if (!serving) absl::SleepFor(absl::Milliseconds(100));
    }
    if (!serving) {
      failures_.Add(absl::StrCat(kDaemonNames[i], " is not SERVING after start"));
      return false;
    }
  }
  // The coordinator must see the three members before they are protected.
  auto stub = v1::ClusterService::NewStub(Channel(coordinator.address));
  for (int attempt = 0; attempt < 200; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListMembersResponse members;
    if (stub->ListMembers(&context, v1::ListMembersRequest(), &members).ok() &&
        members.members_size() == 3) {
      for (const v1::Member& member : members.members()) {
        targets_.protected_members.insert(member.id());
      }
      return true;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  failures_.Add("the coordinator did not list the two shards and the worker within 20 s");
  return false;
}

bool HostileRun::DeclareTargets() {
  // Dataset files only need to exist and be readable for a spec to validate; no job here trains.
  targets_.dataset_dir = dir_ + "/dataset";
  mkdir(targets_.dataset_dir.c_str(), 0755);
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    std::ofstream(targets_.dataset_dir + "/" + f) << "not a dataset";
  }
  for (int i = 0; i < 2; ++i) {
    auto stub = v1::ParameterService::NewStub(Channel(daemons_[kShard0 + i].address));
    for (const bool asp : {true, false}) {
      v1::CreateJobStateRequest request;
      request.set_job_id(asp ? "hx-asp" : "hx-bsp");
      v1::JobConfig* c = request.mutable_config();
      c->set_consistency(asp ? v1::CONSISTENCY_ASP : v1::CONSISTENCY_BSP);
      c->set_num_workers(asp ? Targets::kAspWorkers : Targets::kBspWorkers);
      c->mutable_optimizer()->set_kind(asp ? v1::OPTIMIZER_KIND_SGD : v1::OPTIMIZER_KIND_ADAM);
      c->mutable_optimizer()->set_learning_rate(0.01f);
      c->set_non_finite_policy(asp ? v1::NON_FINITE_POLICY_REJECT : v1::NON_FINITE_POLICY_SKIP);
      auto* w = request.add_partitions();
      w->mutable_key()->set_tensor("w");
      w->set_num_elements(64);
      if (asp) {
        auto* b = request.add_partitions();
        b->mutable_key()->set_tensor("b");
        b->set_num_elements(8);
        v1::SparseTableDecl* t = request.add_tables();
        t->set_name("emb");
        t->set_dim(4);
      }
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::CreateJobStateResponse response;
      const grpc::Status status = stub->CreateJobState(&context, request, &response);
      if (!status.ok()) {
        failures_.Add(absl::StrCat("declaring ", request.job_id(), " on shard ", i, ": ",
                                   status.error_message()));
        return false;
      }
    }
  }
  targets_.protected_jobs = {targets_.valid_shard_job, "hx-asp", "hx-bsp"};
  // The coordinator's valid job: PENDING for good (1024 workers never register).
  auto jobs = v1::JobService::NewStub(Channel(daemons_[kCoordinator].address));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::CreateJobRequest request;
  *request.mutable_spec() = BaseSpec(targets_, "valid", 1024);
  v1::Job job;
  const grpc::Status status = jobs->CreateJob(&context, request, &job);
  if (!status.ok()) {
    failures_.Add(absl::StrCat("creating the valid job: ", status.error_message()));
    return false;
  }
  targets_.valid_job_id = job.id();
  targets_.protected_jobs.insert(job.id());
  return true;
}

bool HostileRun::StartValidTraffic() {
  client::ParameterClient::Options options;
  options.shard_addresses = {daemons_[kShard0].address, daemons_[kShard1].address};
  options.job_id = targets_.valid_shard_job;
  options.worker_id = 0;
  options.incarnation = 1;
  options.partition_bytes = 1024;  // 256 floats: the tensor's 4 partitions land on both shards
  options.call_timeout = absl::Seconds(10);
  options.retry.max_attempts = 1;  // a valid request must succeed the first time
  absl::StatusOr<std::unique_ptr<client::ParameterClient>> created =
      client::ParameterClient::Create(options);
  if (!created.ok()) {
    failures_.Add(absl::StrCat("valid client: ", created.status().ToString()));
    return false;
  }
  std::shared_ptr<client::ParameterClient> client = std::move(*created);
  v1::JobConfig config;
  config.set_consistency(v1::CONSISTENCY_ASP);
  config.set_num_workers(1);
  config.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
  config.mutable_optimizer()->set_learning_rate(0.0625f);  // kLr below
  const absl::Status declared = client->DeclareJob(config, {{"v", {1024}, {}}}, {});
  if (!declared.ok()) {
    failures_.Add(absl::StrCat("valid job: ", declared.ToString()));
    return false;
  }
  valid_threads_.emplace_back([this, client] {
    // ASP and SGD: every applied push of g moves each weight by -lr * g, so after n pushes the
    // weights are -n * lr * g, whatever the hostile traffic did (none of it may touch this job).
    // lr * g = 2^-14, so the sum is exact in float32 and one push too many or too few shows.
    constexpr float kLr = 0.0625f;
    constexpr float kGrad = 0.0009765625f;
    std::vector<float> gradient(1024, kGrad);
    std::vector<float> weights(1024);
    int64_t failures = 0;
    int64_t applied = 0;
    for (int64_t step = 0; !stop_valid_.load() && failures < 5; ++step) {
      absl::StatusOr<client::PushPullResult> r =
          client->PushPull("v", step, gradient, absl::MakeSpan(weights)).get();
      absl::Status s = r.status();
      if (s.ok()) ++applied;
      if (s.ok() && step % 8 == 0) s = client->Pull("v", -1, absl::MakeSpan(weights));
      if (!s.ok()) {
        ++failures;
        failures_.Add(absl::StrCat("valid traffic: push/pull of valid-job at step ", step, ": ",
                                   s.ToString()));
      }
      valid_ops_.fetch_add(1);
      absl::SleepFor(absl::Milliseconds(2));
    }
    const absl::Status pulled = client->Pull("v", -1, absl::MakeSpan(weights));
    const double expected = -static_cast<double>(applied) * kLr * kGrad;
    double worst = 0;
    for (float w : weights) worst = std::max(worst, std::abs(static_cast<double>(w) - expected));
    if (!pulled.ok() || worst != 0) {
      failures_.Add(
          absl::StrFormat("valid traffic: after %d pushes valid-job's weights are off "
                          "by up to %g from %g (%s)",
                          applied, worst, expected, pulled.ToString()));
    }
    valid_pushes_.store(applied);
  });
  valid_threads_.emplace_back([this] {
    auto jobs = v1::JobService::NewStub(Channel(daemons_[kCoordinator].address, 1));
    auto cluster = v1::ClusterService::NewStub(Channel(daemons_[kCoordinator].address, 2));
    int64_t failures = 0;
    while (!stop_valid_.load() && failures < 5) {
      grpc::ClientContext c1;
      c1.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::GetJobRequest get;
      get.set_job_id(targets_.valid_job_id);
      v1::Job job;
      const grpc::Status s1 = jobs->GetJob(&c1, get, &job);
      if (!s1.ok() || job.state() != v1::JOB_STATE_PENDING) {
        ++failures;
        failures_.Add(absl::StrCat("valid traffic: GetJob ", targets_.valid_job_id, ": ",
                                   CodeName(s1.error_code()), " ", s1.error_message(), " state ",
                                   job.state()));
      }
      grpc::ClientContext c2;
      c2.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::ListMembersResponse members;
      const grpc::Status s2 = cluster->ListMembers(&c2, v1::ListMembersRequest(), &members);
      int live = 0;
      for (const v1::Member& m : members.members()) {
        if (targets_.protected_members.count(m.id()) > 0 && m.state() == v1::MEMBER_STATE_READY) {
          ++live;
        }
      }
      if (!s2.ok() || live != 3) {
        ++failures;
        failures_.Add(absl::StrCat("valid traffic: ListMembers: ", CodeName(s2.error_code()), " ",
                                   s2.error_message(), "; ", live, " of the 3 real members READY"));
      }
      valid_ops_.fetch_add(2);
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  return true;
}

void HostileRun::StopValidTraffic() {
  stop_valid_.store(true);
  for (std::thread& t : valid_threads_) t.join();
  valid_threads_.clear();
}

void HostileRun::CheckHealthAndLife(const char* when) {
  for (int i = 0; i < kNumDaemons; ++i) {
    Daemon& d = daemons_[i];
    if (d.process.HasExited()) {
      failures_.AddFirst(absl::StrCat(kDaemonNames[i], " ", d.process.DescribeExit(), " ", when,
                                      "; stderr tail:\n",
                                      testlib::FileTail(d.process.stderr_path())));
      continue;
    }
    if (!HealthServing(Channel(d.address).get())) {
      failures_.Add(absl::StrCat(kDaemonNames[i], ": health is not SERVING ", when));
    }
  }
}

void HostileRun::CountRequest() {
  const int64_t sent = sent_.fetch_add(1) + 1;
  // VmRSS at every tenth of the requests; the first is the baseline (after warm-up).
  const int64_t tenth = std::max<int64_t>(1, options_.requests / 10);
  if (sent % tenth != 0 || sent / tenth > 10) return;
  absl::MutexLock lock(&rss_mu_);
  for (Daemon& d : daemons_) {
    if (d.process.pid() <= 0) continue;
    const int64_t kib = testlib::ResidentKib(d.process.pid());
    if (d.rss_base_kib < 0) {
      d.rss_base_kib = kib;
      d.threads_base = testlib::ProcStatusField(d.process.pid(), "Threads");
    }
    d.rss_curve.push_back(kib);
  }
}

void HostileRun::Judge(int daemon, int m, Kind kind, const std::string& edit, const CodeSet allowed,
                       const std::vector<std::string>& requests, const CallResult& result) {
  const MethodSpec& spec = kMethods[m];
  std::vector<int> codes;
  if (spec.multi_message && (spec.served_by & (1u << daemon)) != 0 && kind != Kind::kOversize) {
    // Each answered request has its own status; the unanswered ones get the call's.
    for (const std::string& bytes : result.responses) {
      v1::PushPullResponse response;
      codes.push_back(response.ParseFromString(bytes) ? response.status().code() : -1);
    }
    while (codes.size() < requests.size()) codes.push_back(result.status.error_code());
    codes.resize(requests.size());
  } else {
    codes.assign(requests.size(), result.status.error_code());
  }
  // The status message travels in a header: one that echoes a request's long field can pass a
  // client's metadata limit (8 KiB by default), and that client then loses its connection.
  if (result.status.error_message().size() > kMaxErrorMessageBytes &&
      long_messages_[daemon][m].fetch_add(1) == 0) {
    failures_.Add(absl::StrCat(kDaemonNames[daemon], " /", spec.service, "/", spec.name, " ",
                               kKindNames[static_cast<int>(kind)], ": an error message of ",
                               result.status.error_message().size(), " bytes (over ",
                               kMaxErrorMessageBytes, "): \"",
                               result.status.error_message().substr(0, 120), "...\""));
  }
  for (size_t i = 0; i < codes.size(); ++i) {
    const int code = codes[i];
    daemons_[daemon].tally.Add(m, kind, code);
    if (code >= 0 && code <= 16 && (allowed & C(static_cast<grpc::StatusCode>(code))) != 0) {
      continue;
    }
    failures_.Add(absl::StrCat(
        kDaemonNames[daemon], " /", spec.service, "/", spec.name, " ",
        kKindNames[static_cast<int>(kind)], edit.empty() ? "" : absl::StrCat(" (", edit, ")"),
        ": got ", CodeName(code), " \"", result.status.error_message(), "\"; request ", i, " of ",
        requests.size(), ", ", requests[i].size(), " bytes: ", Hex(requests[i])));
  }
}

void HostileRun::SendOne(int thread, Rng& rng,
                         const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                         const std::vector<std::unique_ptr<v1::JobService::Stub>>& jobs,
                         const std::vector<std::unique_ptr<v1::ClusterService::Stub>>& cluster,
                         const std::vector<std::unique_ptr<v1::ParameterService::Stub>>& shards) {
  // Daemon: the shards and the coordinator take most; the worker serves health and reflection.
  const uint64_t d_pick = rng.Uniform(20);
  const int daemon = d_pick < 6    ? kCoordinator
                     : d_pick < 12 ? kShard0
                     : d_pick < 18 ? kShard1
                                   : kWorker;
  const Daemon& target = daemons_[daemon];
  // Method: served ones four times as often as the others (which answer UNIMPLEMENTED).
  int m = 0;
  for (;;) {
    m = static_cast<int>(rng.Uniform(kNumMethods));
    if (!options_.only_method.empty()) {
      if (options_.only_method == kMethods[m].name) break;
      continue;
    }
    if ((kMethods[m].served_by & (1u << daemon)) != 0 || rng.OneIn(4)) break;
  }
  const MethodSpec& spec = kMethods[m];
  const bool served = (spec.served_by & (1u << daemon)) != 0;
  const uint64_t k_pick = rng.Uniform(1000);
  Kind kind = k_pick < 2     ? Kind::kOversize
              : k_pick < 200 ? Kind::kGarbage
              : k_pick < 600 ? Kind::kInvalid
                             : Kind::kRandom;
  if (!options_.only_kind.empty()) {
    for (int k = 0; k < 4; ++k) {
      if (options_.only_kind == kKindNames[k]) kind = static_cast<Kind>(k);
    }
  }
  const int messages = spec.multi_message ? 1 + static_cast<int>(rng.Uniform(3)) : 1;
  std::vector<std::string> requests;
  std::string edit;
  const pb::Message* prototype = prototypes_.Get(m);
  const Kind drawn = kind;
  Kind requests_kind = kind;
  for (int i = 0; i < messages; ++i) {
    // One kind per call: a later message whose kind turned out otherwise is not sent.
    Kind kind = drawn;
    std::string bytes;
    if (kind == Kind::kGarbage) {
      // Random bytes; most do not parse. Those that happen to are judged as random requests.
      bytes.resize(rng.Uniform(200));
      for (char& c : bytes) c = static_cast<char>(rng.Uniform(256));
      if (rng.OneIn(3)) {
        // A valid request cut short: a length-delimited field that runs past the end.
        std::unique_ptr<pb::Message> msg = Template(m, rng, targets_, prototypes_);
        bytes = msg->SerializeAsString();
        bytes += '\x0a';
        bytes += '\x40';
        bytes += "short";
      }
      std::unique_ptr<pb::Message> check(prototype->New());
      if (check->ParseFromString(bytes)) kind = Kind::kRandom;
    } else {
      std::unique_ptr<pb::Message> msg = Template(m, rng, targets_, prototypes_);
      if (kind == Kind::kInvalid) {
        Protect(m, rng, targets_, msg.get());
        edit = InvalidEdit(m, rng, targets_, msg.get());
        if (edit.empty()) kind = Kind::kRandom;
      }
      if (kind == Kind::kRandom) {
        const int n = 1 + static_cast<int>(rng.Uniform(4));
        for (int e = 0; e < n; ++e) MutateMessage(msg.get(), rng, targets_, 0);
        Protect(m, rng, targets_, msg.get());
        edits_.fetch_add(n);
        if (msg->ByteSizeLong() > (2u << 20)) {
          msg = Template(m, rng, targets_, prototypes_);  // keep random requests under 4 MiB
        }
      }
      bytes = msg->SerializeAsString();
      if (kind == Kind::kOversize) {
        // A parseable request (an unknown field holds the bulk) over the receive limit.
        const size_t bulk = target.max_receive + (256 << 10);
        bytes += '\xc2';  // field 1000, length-delimited: tag varint c2 3e
        bytes += '\x3e';
        size_t n = bulk;
        while (n >= 0x80) {
          bytes += static_cast<char>((n & 0x7f) | 0x80);
          n >>= 7;
        }
        bytes += static_cast<char>(n);
        bytes.append(bulk, 'O');
      } else if (kind != Kind::kGarbage) {
        // Strings with invalid UTF-8 do not parse: judged as garbage then.
        std::unique_ptr<pb::Message> check(prototype->New());
        if (!check->ParseFromString(bytes)) kind = Kind::kGarbage;
      }
    }
    if (i > 0 && kind != requests_kind) break;
    requests_kind = kind;
    requests.push_back(std::move(bytes));
  }
  kind = requests_kind;
  CodeSet allowed;
  if (!served) {
    allowed = kUn | (kind == Kind::kOversize ? kRe : 0);
  } else if (kind == Kind::kGarbage) {
    allowed = spec.garbage;
  } else if (kind == Kind::kInvalid) {
    allowed = spec.invalid;
  } else if (kind == Kind::kRandom) {
    allowed = spec.random;
  } else {
    allowed = kRe;
  }
  // Only random requests may rightly wait (a gated pull, an open stream): short deadlines for
  // them, so waiting calls do not set the pace; every other answer must come well within 10 s.
  const std::string method_name = spec.name;
  const bool may_wait = spec.long_lived || method_name == "Pull" || method_name == "PushPull" ||
                        method_name == "Checkpoint";
  const absl::Duration deadline = kind == Kind::kRandom && may_wait
                                      ? absl::Milliseconds(spec.long_lived ? 100 : 250)
                                      : absl::Seconds(10);
  const std::string path = absl::StrCat("/", spec.service, "/", spec.name);
  const CallResult result = RawCall(channels[daemon].get(), path, requests, deadline);
  Judge(daemon, m, kind, edit, allowed, requests, result);
  for (size_t i = 0; i < requests.size(); ++i) CountRequest();

  // Undo accepted mutants (never the valid jobs or members: Protect kept them out).
  if (!served || !result.status.ok() || result.responses.empty()) return;
  const std::string name = spec.name;
  if (name == "CreateJob") {
    v1::Job job;
    if (!job.ParseFromString(result.responses[0])) return;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::CancelJobRequest cancel;
    cancel.set_job_id(job.id());
    v1::Job cancelled;
    const grpc::Status s = jobs[daemon]->CancelJob(&context, cancel, &cancelled);
    if (!s.ok())
      failures_.Add(absl::StrCat("cancelling accepted job ", job.id(), ": ", s.error_message()));
    accepted_jobs_.fetch_add(1);
  } else if (name == "CreateJobState") {
    v1::CreateJobStateRequest request;
    if (!request.ParseFromString(requests[0])) return;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::DropJobRequest drop;
    drop.set_job_id(request.job_id());
    v1::DropJobResponse dropped;
    const grpc::Status s = shards[daemon]->DropJob(&context, drop, &dropped);
    if (!s.ok())
      failures_.Add(absl::StrCat("dropping accepted job state '", request.job_id(),
                                 "': ", s.error_message()));
    accepted_job_states_.fetch_add(1);
  } else if (name == "Register") {
    v1::RegisterResponse registered;
    if (!registered.ParseFromString(result.responses[0])) return;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::DeregisterRequest deregister;
    deregister.set_member_id(registered.member_id());
    v1::DeregisterResponse response;
    const grpc::Status s = cluster[daemon]->Deregister(&context, deregister, &response);
    if (!s.ok())
      failures_.Add(absl::StrCat("deregistering accepted member ", registered.member_id(), ": ",
                                 s.error_message()));
    accepted_members_.fetch_add(1);
  }
}

void HostileRun::HostileThread(int index, int64_t count) {
  Rng rng(options_.seed + static_cast<uint64_t>(index));
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::JobService::Stub>> jobs;
  std::vector<std::unique_ptr<v1::ClusterService::Stub>> cluster;
  std::vector<std::unique_ptr<v1::ParameterService::Stub>> shards;
  for (const Daemon& d : daemons_) {
    channels.push_back(Channel(d.address, 100 + index, /*hostile=*/true));
    jobs.push_back(v1::JobService::NewStub(channels.back()));
    cluster.push_back(v1::ClusterService::NewStub(channels.back()));
    shards.push_back(v1::ParameterService::NewStub(channels.back()));
  }
  for (int64_t i = 0; i < count; ++i) {
    if (absl::Now() > deadline_ || failures_.count() >= 200) {
      if (absl::Now() > deadline_) out_of_time_.store(true);
      return;
    }
    SendOne(index, rng, channels, jobs, cluster, shards);
  }
}

int HostileRun::Run() {
  google::protobuf::SetLogHandler(nullptr);  // our own parse checks of garbage are expected
  if (!prototypes_.Init()) return 1;
  std::printf("hostile: seed %llu (replay with --seed %llu), %lld requests, %d threads\n",
              static_cast<unsigned long long>(options_.seed),
              static_cast<unsigned long long>(options_.seed),
              static_cast<long long>(options_.requests), options_.threads);
  std::fflush(stdout);
  const absl::Time start = absl::Now();
  deadline_ = start + absl::Seconds(options_.time_limit_s);
  bool ok = StartDaemons() && DeclareTargets() && StartValidTraffic();
  if (ok) {
    std::atomic<bool> checker_stop{false};
    std::thread checker([&] {
      while (!checker_stop.load()) {
        CheckHealthAndLife("during the run");
        for (int i = 0; i < 10 && !checker_stop.load(); ++i) {
          absl::SleepFor(absl::Milliseconds(100));
        }
      }
    });
    std::vector<std::thread> threads;
    const int64_t per_thread = options_.requests / options_.threads;
    for (int i = 0; i < options_.threads; ++i) {
      // PushPull calls carry 1-3 requests, so the counts run a little over; the rest goes to 0.
      const int64_t count =
          per_thread + (i == 0 ? options_.requests - per_thread * options_.threads : 0);
      threads.emplace_back([this, i, count] { HostileThread(i, count); });
    }
    for (std::thread& t : threads) t.join();
    // The daemons give freed memory back to the kernel once a second (common/process.h
    // ReleaseFreeMemory): the end figure is read after that, so that it counts what they keep,
    // not the hostile requests still being freed. The valid traffic goes on meanwhile.
    absl::SleepFor(absl::Seconds(2));
    for (Daemon& d : daemons_) {
      if (d.process.pid() <= 0) continue;
      d.rss_end_kib = testlib::ResidentKib(d.process.pid());
      d.threads_end = testlib::ProcStatusField(d.process.pid(), "Threads");
    }
    checker_stop.store(true);
    checker.join();
    StopValidTraffic();
    CheckHealthAndLife("after the run");
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t min_requests = options_.min_requests > 0
                                   ? std::min(options_.min_requests, options_.requests)
                                   : options_.requests;
  if (out_of_time_.load()) {
    if (sent_.load() < min_requests) {
      failures_.Add(absl::StrCat("out of time: ", sent_.load(), " of ", options_.requests,
                                 " requests in --time_limit_s ", options_.time_limit_s,
                                 " (at least ", min_requests, " must be sent)"));
    } else {
      std::printf(
          "hostile: --time_limit_s %g reached after %lld of %lld requests (at least %lld)\n",
          options_.time_limit_s, static_cast<long long>(sent_.load()),
          static_cast<long long>(options_.requests), static_cast<long long>(min_requests));
    }
  }
  if (ok && !out_of_time_.load() && sent_.load() < options_.requests && failures_.count() == 0) {
    failures_.Add(absl::StrCat("only ", sent_.load(), " of ", options_.requests, " requests sent"));
  }

  // One figure line per daemon.
  for (int i = 0; i < kNumDaemons && ok; ++i) {
    Daemon& d = daemons_[i];
    const double growth = d.rss_base_kib > 0 && d.rss_end_kib > 0
                              ? static_cast<double>(d.rss_end_kib - d.rss_base_kib) /
                                    static_cast<double>(d.rss_base_kib)
                              : std::nan("");
    const bool alive = d.process.pid() > 0;
    const bool serving = alive && HealthServing(Channel(d.address).get());
    std::printf(
        "hostile: %s %s ; %d crashes; health %s; RSS %+.1f%% (%lld -> %lld KiB; by "
        "tenths: %s; threads %lld -> %lld)\n",
        kDaemonNames[i], d.tally.Summary().c_str(), alive ? 0 : 1,
        serving ? "SERVING" : "NOT SERVING", growth * 100, static_cast<long long>(d.rss_base_kib),
        static_cast<long long>(d.rss_end_kib), absl::StrJoin(d.rss_curve, " ").c_str(),
        static_cast<long long>(d.threads_base), static_cast<long long>(d.threads_end));
    if (!(growth <= options_.max_rss_growth)) {
      failures_.Add(
          absl::StrFormat("%s: RSS grew by %.1f%% after warm-up (%lld -> %lld KiB), "
                          "over %.1f%%",
                          kDaemonNames[i], growth * 100, static_cast<long long>(d.rss_base_kib),
                          static_cast<long long>(d.rss_end_kib), options_.max_rss_growth * 100));
    }
    const std::vector<std::string> missing = d.tally.MissingKinds();
    if (!missing.empty() && !out_of_time_.load()) {
      failures_.Add(absl::StrCat(kDaemonNames[i], ": no garbage or random request reached ",
                                 absl::StrJoin(missing, ", ")));
    }
  }
  std::printf(
      "hostile: valid traffic %lld operations (%lld pushes of valid-job, all in its "
      "final weights); accepted mutants undone: %lld jobs "
      "cancelled, %lld job states dropped, %lld members deregistered; %lld random "
      "edits; %.1f s\n",
      static_cast<long long>(valid_ops_.load()), static_cast<long long>(valid_pushes_.load()),
      static_cast<long long>(accepted_jobs_.load()),
      static_cast<long long>(accepted_job_states_.load()),
      static_cast<long long>(accepted_members_.load()), static_cast<long long>(edits_.load()),
      seconds);
  // Every daemon ends cleanly on SIGTERM.
  for (int i = kNumDaemons - 1; i >= 0; --i) {
    Daemon& d = daemons_[i];
    if (d.process.pid() <= 0) continue;
    const int code = testlib::StopChild(&d.process, absl::Seconds(20));
    if (code != 0) {
      failures_.Add(absl::StrCat(kDaemonNames[i], " exited with ", code,
                                 " on SIGTERM; stderr tail:\n",
                                 testlib::FileTail(d.process.stderr_path())));
    }
  }
  std::fflush(stdout);
  failures_.Print();
  if (failures_.count() > 0) {
    std::fprintf(stderr, "hostile: FAILED (%lld failures); replay with --seed %llu\n",
                 static_cast<long long>(failures_.count()),
                 static_cast<unsigned long long>(options_.seed));
    return 1;
  }
  std::printf("hostile: PASSED\n");
  return 0;
}

}  // namespace
}  // namespace tessera::hostile

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  tessera::hostile::Options options;
  if (!tessera::hostile::ParseFlags(argc, argv, &options)) {
    std::fputs(tessera::hostile::kUsage, stderr);
    return 2;
  }
  if (options.seed == 0) {
    options.seed = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) | 1;
  }
  tessera::testlib::ScratchDirectory dir("tessera-hostile");
  if (dir.path().empty()) {
    std::fprintf(stderr, "hostile: cannot make a scratch directory under /tmp\n");
    return 1;
  }
  tessera::hostile::HostileRun run(options, dir.path());
  const int code = run.Run();
  if (code != 0 || options.keep_dir) {
    dir.keep();
    std::fprintf(stderr, "hostile: daemons' logs kept in %s\n", dir.path().c_str());
  }
  return code;
}
