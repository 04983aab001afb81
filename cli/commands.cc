#include "cli/commands.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cli/coordinator_client.h"
#include "cli/criteo_datagen.h"
#include "cli/exporter.h"
#include "cli/job_format.h"
#include "cli/local_cluster.h"
#include "cli/safetensors.h"
#include "kernels/device.h"
#include "spec/dataset_spec.h"
#include "spec/device_spec.h"
#include "spec/job_spec.h"
#include "spec/job_spec_reader.h"
#include "spec/model_spec.h"

namespace tessera::cli {
namespace {

// Prints `status` to stderr (and as JSON to stdout) and returns its exit code.
int Fail(const GlobalOptions& global, const absl::Status& status, const std::string& context = "") {
  std::string message(status.message());
  if (status.code() == absl::StatusCode::kUnavailable ||
      status.code() == absl::StatusCode::kDeadlineExceeded) {
    message = absl::StrCat(
        message, " (", absl::StatusCodeToString(status.code()),
        "; is the daemon running there? set --coordinator or TESSERA_COORDINATOR",
        global.tls ? "; if the TLS handshake failed: check --tls_ca, --tls_cert/--tls_key and "
                     "--tls_server_name"
                   : "; if it serves TLS, give --tls_ca (TESSERA_TLS_CA)",
        ")");
  } else if (status.code() == absl::StatusCode::kUnauthenticated) {
    message = absl::StrCat(
        "UNAUTHENTICATED: ", message, " (",
        global.auth_token_file.empty()
            ? "no token was sent: give --auth_token_file FILE or set TESSERA_TOKEN_FILE"
            : absl::StrCat("the token in ", global.auth_token_file,
                           " (--auth_token_file / TESSERA_TOKEN_FILE) was refused"),
        ")");
  } else {
    message = absl::StrCat(absl::StatusCodeToString(status.code()), ": ", message);
  }
  if (!context.empty()) message = absl::StrCat(context, ": ", message);
  std::fprintf(stderr, "tessera: %s\n", message.c_str());
  if (global.json) {
    std::printf("{\"error\":{\"code\":\"%s\",\"message\":%s}}\n",
                absl::StatusCodeToString(status.code()).c_str(),
                JsonQuote(std::string(status.message())).c_str());
  }
  std::fflush(stdout);
  return ExitCodeFor(status);
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> Connect(const std::string& address,
                                                           const ClientCredentials& credentials) {
  CoordinatorClient::Options options;
  options.address = address;
  options.credentials = credentials;
  return CoordinatorClient::Create(options);
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> Connect(const GlobalOptions& global) {
  return Connect(global.coordinator, global.credentials);
}

int ExitForState(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitJobFailed;
}

// Progress goes to stdout for people, and to stderr when stdout carries JSON.
std::FILE* ProgressStream(const GlobalOptions& global) { return global.json ? stderr : stdout; }

// Follows `job_id` to its end with a progress display. Returns the last record.
absl::StatusOr<v1::Job> Follow(const GlobalOptions& global, CoordinatorClient* client,
                               const std::string& job_id) {
  std::FILE* out = ProgressStream(global);
  JobProgressPrinter printer(out, isatty(fileno(out)) == 1);
  v1::Job last;
  absl::Status status = client->WatchJob(job_id, [&](const v1::WatchJobResponse& update) {
    last = update.job();
    printer.Update(update);
    if (global.json && update.has_event()) {
      std::printf("%s\n", JobEventJson(update.event()).c_str());
      std::fflush(stdout);
    }
  });
  printer.Finish();
  if (!status.ok()) return status;
  return last;
}

int PrintFinal(const GlobalOptions& global, const v1::Job& job) {
  if (global.json) {
    std::printf("%s\n", JobRecordJson(job).c_str());
  } else {
    std::printf("%s\n", JobResultLine(job).c_str());
  }
  std::fflush(stdout);
  return ExitForState(job.state());
}

// Receives SIGINT and SIGTERM on its own thread (they are blocked everywhere else) and runs
// `on_signal` once, on that thread, for the first one; a second one ends the process at once
// (the children follow through PR_SET_PDEATHSIG).
class SignalThread {
 public:
  explicit SignalThread(std::function<void(int)> on_signal)
      : on_signal_(std::move(on_signal)), thread_([this] { Run(); }) {}
  ~SignalThread() {
    stop_.store(true);
    thread_.join();
  }
  int signal() const { return signal_.load(); }

 private:
  void Run() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    const timespec tick = {0, 100 * 1000 * 1000};
    while (!stop_.load()) {
      const int sig = sigtimedwait(&set, nullptr, &tick);
      if (sig <= 0) continue;
      if (signal_.load() != 0) {
        static const char kForced[] = "tessera: second signal, exiting now\n";
        (void)!write(STDERR_FILENO, kForced, sizeof(kForced) - 1);
        _exit(128 + sig);
      }
      signal_.store(sig);
      on_signal_(sig);
    }
  }

  std::function<void(int)> on_signal_;
  std::atomic<bool> stop_{false};
  std::atomic<int> signal_{0};
  std::thread thread_;
};

// The tail of the logs of the children the failure points at: the workers and shards named in
// the job's reason (by member id or rank), any child that has exited, else the coordinator.
void PrintFailingLogs(const v1::Job& job, CoordinatorClient* client, LocalCluster* cluster) {
  std::vector<const LocalCluster::Child*> chosen;
  auto choose = [&chosen](const LocalCluster::Child* c) {
    for (const LocalCluster::Child* x : chosen) {
      if (x == c) return;
    }
    chosen.push_back(c);
  };
  absl::StatusOr<std::vector<v1::Member>> members = client->ListMembers();
  if (members.ok()) {
    for (const v1::Member& m : *members) {
      bool named = !m.id().empty() && absl::StrContains(job.reason(), m.id());
      for (const v1::JobWorker& w : job.workers()) {
        if (w.member_id() == m.id() &&
            absl::StrContains(job.reason(), absl::StrCat("rank ", w.rank()))) {
          named = true;
        }
      }
      if (m.role() == v1::MEMBER_ROLE_SERVER && !m.address().empty() &&
          absl::StrContains(job.reason(), m.address())) {
        named = true;
      }
      if (!named) continue;
      for (const LocalCluster::Child& c : cluster->children()) {
        if (c.pid() > 0 && c.pid() == m.pid()) choose(&c);
      }
    }
  }
  cluster->CheckChildren().IgnoreError();
  for (const LocalCluster::Child& c : cluster->children()) {
    if (c.pid() <= 0) choose(&c);
  }
  if (chosen.empty()) choose(&cluster->children().front());
  for (const LocalCluster::Child* c : chosen) {
    std::fprintf(stderr, "--- the end of %s (%s):\n%s\n", c->log_path.c_str(), c->name.c_str(),
                 LocalCluster::LogTail(*c, 2500).c_str());
  }
}

}  // namespace

int ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    case absl::StatusCode::kInvalidArgument:
      return kExitUsage;
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return kExitNoPermission;
    default:
      return kExitJobFailed;
  }
}

int RunSubmit(const GlobalOptions& global, const SubmitOptions& options) {
  absl::StatusOr<v1::JobSpec> spec = spec::ReadJobSpecFile(options.spec_file);
  if (!spec.ok()) {
    return Fail(global, absl::InvalidArgumentError(spec.status().message()), "spec refused");
  }
  // The dataset files live on the workers' hosts, which the coordinator checks; everything
  // else is checked here before anything is sent.
  spec::ValidateOptions validate;
  validate.distributed = true;
  validate.check_files = false;
  absl::Status valid = spec::ValidateJobSpec(*spec, validate);
  if (!valid.ok()) return Fail(global, valid, absl::StrCat("spec refused: ", options.spec_file));

  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<v1::Job> job = (*client)->CreateJob(*spec);
  if (!job.ok()) {
    return Fail(global, job.status(),
                job.status().code() == absl::StatusCode::kInvalidArgument
                    ? absl::StrCat("spec refused by the coordinator: ", options.spec_file)
                    : "submit");
  }
  if (!options.watch) {
    if (global.json) {
      std::printf("%s\n", JobRecordJson(*job).c_str());
    } else {
      std::printf("%s\n", job->id().c_str());
    }
    std::fflush(stdout);
    return kExitOk;
  }
  std::fprintf(ProgressStream(global), "submitted job %s\n", job->id().c_str());
  absl::StatusOr<v1::Job> last = Follow(global, client->get(), job->id());
  if (!last.ok()) return Fail(global, last.status(), absl::StrCat("watching job ", job->id()));
  return PrintFinal(global, *last);
}

int RunList(const GlobalOptions& global) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<std::vector<v1::Job>> jobs = (*client)->ListJobs();
  if (!jobs.ok()) return Fail(global, jobs.status(), "list");
  if (global.json) {
    std::printf("%s\n", JobListJson(*jobs).c_str());
  } else {
    std::printf("%s", JobTable(*jobs, absl::Now()).c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

int RunGet(const GlobalOptions& global, const std::string& job_id) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<v1::Job> job = (*client)->GetJob(job_id);
  if (!job.ok()) return Fail(global, job.status(), absl::StrCat("get ", job_id));
  if (global.json) {
    std::printf("%s\n", JobRecordJson(*job).c_str());
  } else {
    std::printf("%s", JobDetails(*job, absl::Now()).c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

int RunWatch(const GlobalOptions& global, const std::string& job_id) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<v1::Job> last = Follow(global, client->get(), job_id);
  if (!last.ok()) return Fail(global, last.status(), absl::StrCat("watch ", job_id));
  return PrintFinal(global, *last);
}

int RunCancel(const GlobalOptions& global, const std::string& job_id) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<v1::Job> job = (*client)->CancelJob(job_id);
  if (!job.ok()) return Fail(global, job.status(), absl::StrCat("cancel ", job_id));
  if (global.json) {
    std::printf("%s\n", JobRecordJson(*job).c_str());
  } else {
    std::printf("job %s: %s\n", job->id().c_str(), StateName(job->state()).c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

int RunCheckpoint(const GlobalOptions& global, const std::string& job_id) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<v1::CheckpointRecord> record = (*client)->CheckpointJob(job_id);
  if (!record.ok()) return Fail(global, record.status(), absl::StrCat("checkpoint ", job_id));
  if (global.json) {
    std::printf("%s\n", CheckpointJson(*record).c_str());
  } else {
    std::printf("%s\n", CheckpointLine(*record).c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

int RunCluster(const GlobalOptions& global) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<std::vector<v1::Member>> members = (*client)->ListMembers();
  if (!members.ok()) return Fail(global, members.status(), "cluster");
  if (global.json) {
    std::printf("%s\n", MemberListJson(*members).c_str());
  } else {
    std::printf("%s", MemberTable(*members, absl::Now()).c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

namespace {

// The shards are dialed with `credentials` (the global ones; plaintext for `tessera local`).
int ExportAndReport(const GlobalOptions& global, const v1::Job& job, const std::string& out,
                    const ClientCredentials& credentials) {
  ExportOptions export_options;
  export_options.credentials = credentials;
  absl::StatusOr<int64_t> values = ExportJob(job, out, export_options);
  if (!values.ok()) return Fail(global, values.status(), absl::StrCat("export ", job.id()));
  const std::string line = absl::StrFormat("wrote %s: job %s, %d values (%s)", out, job.id(),
                                           *values, StateName(job.state()));
  if (global.json) {
    std::fprintf(stderr, "%s\n", line.c_str());
  } else {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  return kExitOk;
}

}  // namespace

int RunExport(const GlobalOptions& global, const ExportOptionsFlags& options) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = Connect(global);
  if (!client.ok()) return Fail(global, client.status());
  absl::StatusOr<v1::Job> job = (*client)->GetJob(options.job_id);
  if (!job.ok()) return Fail(global, job.status(), absl::StrCat("export ", options.job_id));
  if (job->state() != v1::JOB_STATE_SUCCEEDED) {
    std::fprintf(stderr, "tessera: warning: job %s is %s; exporting its current weights\n",
                 job->id().c_str(), StateName(job->state()).c_str());
  }
  const int code = ExportAndReport(global, *job, options.out, global.credentials);
  if (code == kExitOk && global.json) {
    std::printf("{\"out\":%s,\"job_id\":%s}\n", JsonQuote(options.out).c_str(),
                JsonQuote(job->id()).c_str());
    std::fflush(stdout);
  }
  return code;
}

int RunDatagenCriteo(const GlobalOptions& global, const CriteoDatagenFlags& options) {
  CriteoDatagenOptions o;
  o.out_dir = options.out;
  o.train_rows = options.rows;
  o.test_rows = options.test_rows;
  o.seed = options.seed;
  o.factorization_machine = options.model == "fm";
  o.zipf_exponent = options.zipf;
  const bool tty = isatty(fileno(stderr)) == 1;
  o.progress = [tty](int64_t written, int64_t total) {
    std::fprintf(stderr, "%swrote %lld of %lld rows (%.0f%%)%s", tty ? "\r" : "",
                 static_cast<long long>(written), static_cast<long long>(total),
                 100.0 * static_cast<double>(written) / static_cast<double>(total),
                 tty ? "" : "\n");
    std::fflush(stderr);
  };
  absl::StatusOr<CriteoDatagenResult> r = GenerateCriteo(o);
  if (tty) std::fprintf(stderr, "\n");
  if (!r.ok()) return Fail(global, r.status(), "datagen criteo");
  if (global.json) {
    std::printf("%s", PlantedJson(*r, o).c_str());
  } else {
    std::printf(
        "wrote %lld training rows to %s and %lld test rows to %s\n"
        "planted %s model: best test log loss %.4f, best test AUC %.4f, positive rate %.3f (%s)\n",
        static_cast<long long>(r->train_rows), r->train_path.c_str(),
        static_cast<long long>(r->test_rows), r->test_path.c_str(), options.model.c_str(),
        r->best_test_log_loss, r->best_test_auc, r->positive_rate, r->planted_path.c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

int RunLocal(const GlobalOptions& global, const LocalOptions& options) {
  std::FILE* progress = ProgressStream(global);
  absl::StatusOr<v1::JobSpec> spec = spec::ReadJobSpecFile(options.spec_file);
  if (!spec.ok()) {
    return Fail(global, absl::InvalidArgumentError(spec.status().message()), "spec refused");
  }
  if (options.workers > 0) {
    spec->set_num_workers(options.workers);
  } else if (spec->num_workers() == 0) {
    spec->set_num_workers(2);
  }
  spec::ValidateOptions validate;
  validate.distributed = true;
  absl::Status valid = spec::ValidateJobSpec(*spec, validate);
  if (!valid.ok()) return Fail(global, valid, absl::StrCat("spec refused: ", options.spec_file));
  if (options.shards < 1 || options.shards > 64) {
    return Fail(global, absl::InvalidArgumentError(
                            absl::StrCat("--shards: must be in [1, 64], got ", options.shards)));
  }
  if (spec->num_workers() > 64) {
    return Fail(global, absl::InvalidArgumentError(absl::StrCat(
                            "--workers: at most 64 local workers, got ", spec->num_workers())));
  }
  absl::StatusOr<spec::DeviceList> devices =
      spec::ParseDevices(options.devices, kernels::CudaDeviceCount());
  if (!devices.ok()) {
    return Fail(global, absl::InvalidArgumentError(absl::StrCat("--", devices.status().message())));
  }
  absl::Status fits = spec::CheckDevicesFitModel(devices->count(), spec->model());
  if (!fits.ok()) {
    return Fail(global, absl::InvalidArgumentError(
                            absl::StrCat("--", fits.message(), " [", options.spec_file, "]")));
  }
  absl::StatusOr<std::string> bin_dir = SelfBinaryDir();
  if (!bin_dir.ok()) return Fail(global, bin_dir.status());

  // Cancels whatever is in progress when SIGINT or SIGTERM arrives; the main thread then
  // cancels the job and stops the cluster.
  std::atomic<bool> interrupted{false};
  absl::Mutex client_mu;
  CoordinatorClient* active_client = nullptr;  // guarded by client_mu
  SignalThread signals([&](int sig) {
    std::fprintf(stderr, "\ntessera local: %s: cancelling the job and stopping the cluster\n",
                 sig == SIGINT ? "interrupted" : "terminated");
    interrupted.store(true);
    absl::MutexLock lock(&client_mu);
    if (active_client != nullptr) active_client->CancelWatches();
  });
  auto exit_for_signal = [&]() { return 128 + signals.signal(); };

  LocalCluster::Options cluster_options;
  cluster_options.bin_dir = *bin_dir;
  cluster_options.num_shards = options.shards;
  cluster_options.num_workers = spec->num_workers();
  cluster_options.worker_threads = options.threads;
  if (devices->count() > 1 || !devices->cuda.empty()) {
    cluster_options.worker_args.insert(cluster_options.worker_args.end(),
                                       {"--devices", options.devices});
    if (options.threads == 0) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      cluster_options.worker_threads =
          std::max(1, cores / (spec->num_workers() * devices->count()));
    }
  }
  cluster_options.keep_work_dir = options.keep_dir;
  cluster_options.interrupted = [&interrupted] { return interrupted.load(); };
  // The daemons read datasets only in their --dataset_root folders: these are the spec's.
  for (const std::string& folder : spec::DatasetFolders(spec->dataset())) {
    for (std::vector<std::string>* args :
         {&cluster_options.coordinator_args, &cluster_options.worker_args}) {
      args->insert(args->end(), {"--dataset_root", folder});
    }
  }
  if (options.adjust_cluster) {
    absl::Status adjusted = options.adjust_cluster(&cluster_options);
    if (!adjusted.ok()) {
      Fail(global, adjusted, "tessera local: the cluster's options");
      return adjusted.code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitUnavailable;
    }
  }
  std::fprintf(progress, "tessera local: starting a coordinator, %d shards and %d workers\n",
               options.shards, spec->num_workers());
  std::fflush(progress);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(cluster_options);
  if (!cluster.ok()) {
    if (interrupted.load()) return exit_for_signal();
    Fail(global, cluster.status(), "tessera local: the cluster did not start");
    return cluster.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage
                                                                         : kExitUnavailable;
  }
  std::fprintf(progress, "tessera local: coordinator %s, shards",
               (*cluster)->coordinator_address().c_str());
  for (const std::string& a : (*cluster)->shard_addresses())
    std::fprintf(progress, " %s", a.c_str());
  std::fprintf(progress, "; logs in %s\n", (*cluster)->work_dir().c_str());
  std::fflush(progress);

  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client =
      Connect((*cluster)->coordinator_address(), ClientCredentials{});
  if (!client.ok()) return Fail(global, client.status());
  {
    absl::MutexLock lock(&client_mu);
    active_client = client->get();
    if (interrupted.load()) active_client->CancelWatches();
  }
  auto stop_cluster = [&]() {
    {
      absl::MutexLock lock(&client_mu);
      active_client = nullptr;
    }
    absl::Status stopped = (*cluster)->Stop(absl::Seconds(10));
    if (!stopped.ok()) {
      std::fprintf(stderr, "tessera local: warning: unclean shutdown: %s\n",
                   std::string(stopped.message()).c_str());
    }
    return stopped;
  };

  absl::StatusOr<v1::Job> job = (*client)->CreateJob(*spec);
  if (!job.ok()) {
    const int code = Fail(global, job.status(), "tessera local: submit");
    stop_cluster().IgnoreError();
    return interrupted.load() ? exit_for_signal() : code;
  }
  const std::string job_id = job->id();
  std::fprintf(progress,
               "tessera local: job %s submitted (watch it from another terminal: "
               "tessera watch %s --coordinator %s)\n",
               job_id.c_str(), job_id.c_str(), (*cluster)->coordinator_address().c_str());
  std::fflush(progress);

  absl::StatusOr<v1::Job> last = Follow(global, client->get(), job_id);
  if (interrupted.load()) {
    absl::StatusOr<v1::Job> cancelled = (*client)->CancelJob(job_id);
    if (cancelled.ok()) {
      std::fprintf(stderr, "tessera local: job %s %s\n", job_id.c_str(),
                   StateName(cancelled->state()).c_str());
      if (global.json) std::printf("%s\n", JobRecordJson(*cancelled).c_str());
    } else {
      std::fprintf(stderr, "tessera local: cancelling job %s: %s\n", job_id.c_str(),
                   cancelled.status().ToString().c_str());
    }
    std::fflush(stdout);
    stop_cluster().IgnoreError();
    return exit_for_signal();
  }
  if (!last.ok()) {
    const int code =
        Fail(global, last.status(), absl::StrCat("tessera local: watching job ", job_id));
    PrintFailingLogs(v1::Job(), client->get(), cluster->get());
    stop_cluster().IgnoreError();
    return code;
  }

  int code = ExitForState(last->state());
  if (last->state() == v1::JOB_STATE_SUCCEEDED && !options.out.empty()) {
    const int exported = ExportAndReport(global, *last, options.out, ClientCredentials{});
    if (exported != kExitOk) code = exported;
  }
  if (last->state() == v1::JOB_STATE_FAILED) {
    PrintFailingLogs(*last, client->get(), cluster->get());
  }
  stop_cluster().IgnoreError();
  if (interrupted.load()) return exit_for_signal();
  PrintFinal(global, *last);
  return code;
}

}  // namespace tessera::cli
