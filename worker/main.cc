// tessera-worker: the training worker (DESIGN.md §1).
//
//   tessera-worker [--coordinator ADDR] [--device auto|cpu|cuda] [--devices cpu:N] [--threads N]
//                  [--hostname NAME] [--log_level L] [--tls_ca FILE ...] [--metrics_listen A]
//                  [--config FILE] [--check-config]
//
// runs as a daemon: it registers with the coordinator, trains the tasks it is given and goes back
// to waiting; SIGTERM or SIGINT cancels a running task, deregisters and exits 0; SIGHUP re-reads
// log_level and the TLS and token files. Options also come from TESSERA_* variables and the
// --config file (common/config.h). Exit status 1 when it cannot start (e.g. --device cuda
// without a GPU), 64 for a usage error, 78 for a configuration error.
//
//   tessera-worker --standalone --job FILE [--device auto|cpu|cuda] [--output text|json]
//                  [--epochs N] [--threads N] [--target_accuracy X]
//
// trains a job spec in this process. Exit status: 0 on success, 64 for a usage error, 1 when the
// job fails (a bad spec, bad data, a device error); the reason goes to stderr, and with
// --output json also to stdout as {"error": {"code": ..., "message": ...}}.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/crash_reporter.h"
#include "common/daemon_metrics.h"
#include "common/daemon_runner.h"
#include "common/grpc_server.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "spdlog/spdlog.h"
#include "spec/dataset_spec.h"
#include "spec/device_spec.h"
#include "spec/job_spec_reader.h"
#include "worker/daemon/worker_daemon.h"
#include "worker/daemon/worker_metrics.h"
#include "worker/trainer/job_spec.h"
#include "worker/trainer/progress.h"
#include "worker/trainer/standalone_trainer.h"

namespace {

constexpr int kExitUsage = 64;  // sysexits.h EX_USAGE

struct WorkerFlags {
  bool standalone = false;
  std::string job;
  std::string device;
  std::string output = "text";
  int epochs = -1;
  int threads = 0;
  std::string devices;  // "cpu:N"; empty: the one device --device names
  double target_accuracy = 0;
  // Daemon mode.
  // From the layers: --coordinator, $TESSERA_COORDINATOR, the config file, else this default.
  std::string coordinator = "127.0.0.1:7070";
  std::string hostname;
  std::string log_level = "info";
  tessera::SecurityOptions security;
  tessera::MetricsFlags metrics;
  // The health and reflection listener; empty: none.
  std::string listen;
  std::string port_file;
  // The folders a task's dataset files may lie in; empty: /usr/share/datasets.
  std::vector<std::string> dataset_roots;
};

// The daemon's checks, run by --check-config and before every daemon start (exit 78 on failure);
// binds nothing. Standalone mode has none of its own.
absl::Status ValidateDaemon(const WorkerFlags& flags,
                            std::unique_ptr<tessera::Security>* security) {
  if (flags.standalone) return absl::OkStatus();
  TESSERA_RETURN_IF_ERROR(tessera::ValidateLogLevel(flags.log_level));
  TESSERA_RETURN_IF_ERROR(
      tessera::spec::ParseDevices(flags.devices, tessera::kernels::CudaDeviceCount()).status());
  // Before Security::Create, which may log warnings.
  TESSERA_RETURN_IF_ERROR(tessera::InitLogging(flags.log_level));
  // Only a worker with --listen serves gRPC: then a token also needs its own certificate.
  tessera::SecurityOptions security_options = flags.security;
  security_options.serves_grpc = !flags.listen.empty();
  TESSERA_ASSIGN_OR_RETURN(*security, tessera::Security::Create(security_options));
  if (!flags.listen.empty()) {
    TESSERA_RETURN_IF_ERROR((*security)->CheckListenAddress("--listen", flags.listen));
  } else if (!flags.port_file.empty()) {
    return absl::InvalidArgumentError("--port_file: needs --listen");
  }
  return tessera::ValidateMetricsFlags(flags.metrics, flags.security.insecure);
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) >= 0x20) {
      out += c;
    }
  }
  return out;
}

int Fail(const absl::Status& status, bool json) {
  std::fprintf(stderr, "tessera-worker: %s\n", status.ToString().c_str());
  if (json) {
    std::printf("{\"error\":{\"code\":\"%s\",\"message\":\"%s\"}}\n",
                absl::StatusCodeToString(status.code()).c_str(),
                JsonEscape(std::string(status.message())).c_str());
  }
  return 1;
}

int RunStandalone(const WorkerFlags& flags) {
  const bool json = flags.output == "json";
  if (!flags.devices.empty()) {
    return Fail(
        absl::InvalidArgumentError(
            "--devices: several devices are for the daemon's distributed tasks; --standalone "
            "trains on the one device --device names"),
        json);
  }
  absl::StatusOr<tessera::v1::JobSpec> spec = tessera::spec::ReadJobSpecFile(flags.job);
  if (!spec.ok()) return Fail(spec.status(), json);

  tessera::trainer::TrainerOptions options;
  options.spec = *spec;
  options.device = flags.device;
  options.num_threads = flags.threads;
  options.epochs = flags.epochs;
  options.target_accuracy = flags.target_accuracy;
  // With --output json, stdout carries only the result line; progress goes to stderr.
  std::FILE* progress_out = json ? stderr : stdout;
  tessera::trainer::ProgressPrinter printer(progress_out, isatty(fileno(progress_out)) == 1);
  options.on_progress = [&printer](const tessera::trainer::Progress& p) { printer.Report(p); };
  options.on_note = [&printer](const std::string& note) { printer.Note(note); };

  absl::StatusOr<std::unique_ptr<tessera::trainer::StandaloneTrainer>> trainer =
      tessera::trainer::StandaloneTrainer::Create(std::move(options));
  if (!trainer.ok()) return Fail(trainer.status(), json);
  std::fprintf(progress_out, "job %s on %s: %lld training examples, %lld trainable values\n",
               spec->name().c_str(), (*trainer)->backend().Description().c_str(),
               static_cast<long long>((*trainer)->train_data().size()),
               static_cast<long long>((*trainer)->model().num_trainable_values()));
  absl::StatusOr<tessera::trainer::TrainResult> result = (*trainer)->Run();
  printer.Finish();
  if (!result.ok()) return Fail(result.status(), json);
  if (json) {
    std::printf("%s\n", tessera::trainer::TrainResultJson(*result, *spec).c_str());
  } else {
    std::printf("done: %d epochs, %lld steps, %.1f samples/s on %s", result->epochs,
                static_cast<long long>(result->steps), result->samples_per_second,
                result->device.c_str());
    if (result->evaluated) {
      std::printf(", test loss %.4f, test accuracy %.4f", result->test_loss, result->test_accuracy);
      if (result->test_auc.has_value()) std::printf(", test AUC %.4f", *result->test_auc);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
  return 0;
}

// The worker daemon in RunDaemon's steps (common/daemon_runner.h): it registers, runs the tasks
// it is given, and on SIGTERM/SIGINT stops cleanly.
class WorkerDaemonRun final : public tessera::Daemon {
 public:
  // `backend`: the device found at start-up, released once the daemon knows its name.
  WorkerDaemonRun(const WorkerFlags& flags, tessera::Security* security,
                  std::unique_ptr<tessera::kernels::Backend> backend,
                  tessera::spec::DeviceList devices)
      : flags_(flags),
        security_(security),
        backend_(std::move(backend)),
        devices_(std::move(devices)) {}

  absl::Status Create(tessera::Metrics* metrics) override {
    metrics_ = metrics;
    tessera::worker::WorkerDaemon::Options options;
    options.coordinator = flags_.coordinator;
    options.credentials = security_->Client();
    options.device = flags_.device;
    options.device_name = backend_->Name();
    options.cpu_devices = devices_.cpu;
    options.cuda_devices = devices_.cuda;
    // Named GPUs train every task, as --device cuda would: a spec's device "cpu" does not
    // override them.
    if (!devices_.cuda.empty() && options.device.empty()) options.device = "cuda";
    if (devices_.count() > 1) options.device_name = devices_.Name();
    options.hostname = flags_.hostname;
    options.num_threads = flags_.threads;
    options.dataset_roots = flags_.dataset_roots;
    if (options.dataset_roots.empty()) {
      options.dataset_roots = {tessera::spec::kDebianDatasetsFolder};
    }
    backend_.reset();
    TESSERA_ASSIGN_OR_RETURN(daemon_, tessera::worker::WorkerDaemon::Create(options));
    metrics->AddCollectable(tessera::worker::NewWorkerCollectable(daemon_.get()));
    return absl::OkStatus();
  }
  absl::Status Start() override {
    daemon_->Start();
    // grpc.health.v1 and reflection only: the worker's work comes over the channels it dials.
    if (flags_.listen.empty()) return absl::OkStatus();
    tessera::GrpcServerOptions server_options;
    server_options.listen = flags_.listen;
    server_options.credentials = security_->ServerCredentials();
    server_options.configure = tessera::RpcMetricsHook(metrics_);
    absl::StatusOr<tessera::StartedGrpcServer> health = tessera::StartGrpcServer(server_options);
    if (!health.ok()) {
      daemon_->Stop();
      return health.status();
    }
    health_ = *std::move(health);
    return absl::OkStatus();
  }
  int port() const override { return health_.port; }
  void Announce() override {
    if (health_.server != nullptr) {
      spdlog::info("tessera-worker: health and reflection on port {}", health_.port);
    }
  }
  // Registration goes on in the background (with retries): the worker is up once started.
  std::string ReadyStatus() const override {
    return absl::StrCat("worker for ", flags_.coordinator);
  }
  absl::Status CheckLive() override { return daemon_->CheckLive(); }
  void StopServing() override {
    if (health_.server != nullptr) tessera::SetGrpcServing(health_.server.get(), false);
  }
  // The daemon deregisters in Stop(), once its task is cancelled.
  void Stop(absl::Duration grace) override {
    daemon_->Stop();
    if (health_.server != nullptr) {
      health_.server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
      health_.server->Wait();
    }
  }

 private:
  const WorkerFlags& flags_;
  tessera::Security* const security_;
  std::unique_ptr<tessera::kernels::Backend> backend_;
  const tessera::spec::DeviceList devices_;
  tessera::Metrics* metrics_ = nullptr;
  // Read by the metrics at scrape time: RunDaemon stops them before it returns.
  std::unique_ptr<tessera::worker::WorkerDaemon> daemon_;
  tessera::StartedGrpcServer health_;
};

// The daemon: the device found once, so the worker registers with its name and a forced --device
// cuda on a host without a GPU fails now (exit 1) rather than in every task; then RunDaemon.
// REQUIRES: BlockDaemonSignals() before any thread was started.
int RunWorkerDaemon(const WorkerFlags& flags, const tessera::LayeredConfig& config,
                    tessera::Security* security) {
  tessera::kernels::BackendOptions backend_options;
  absl::StatusOr<tessera::kernels::DeviceChoice> choice =
      tessera::trainer::ParseDeviceChoice(flags.device.empty() ? "auto" : flags.device);
  if (!choice.ok()) return Fail(choice.status(), false);
  absl::StatusOr<tessera::spec::DeviceList> devices =
      tessera::spec::ParseDevices(flags.devices, tessera::kernels::CudaDeviceCount());
  if (!devices.ok()) return Fail(devices.status(), false);
  if (devices->cpu > 1) {
    if (*choice == tessera::kernels::DeviceChoice::kCuda) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat(
              "devices: ", flags.devices, " trains on the CPU, but --device is ", flags.device)),
          false);
    }
    *choice = tessera::kernels::DeviceChoice::kCpu;
  }
  if (!devices->cuda.empty()) {
    if (*choice == tessera::kernels::DeviceChoice::kCpu) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
                      "devices: ", flags.devices, " names GPUs, but --device is ", flags.device)),
                  false);
    }
    *choice = tessera::kernels::DeviceChoice::kCuda;
    backend_options.cuda_device = devices->cuda[0];
  }
  backend_options.device = *choice;
  backend_options.num_threads = flags.threads;
  absl::StatusOr<std::unique_ptr<tessera::kernels::Backend>> backend =
      tessera::kernels::CreateBackend(backend_options);
  if (!backend.ok()) return Fail(backend.status(), false);
  WorkerDaemonRun daemon(flags, security, *std::move(backend), *std::move(devices));

  tessera::DaemonRunOptions run;
  run.program = "tessera-worker";
  run.metrics_daemon = "worker";
  run.metrics = flags.metrics;
  run.port_file = flags.port_file;
  // How long the health listener's running calls may take to finish.
  run.shutdown_grace = absl::Seconds(1);
  run.drain_log = "stopping";
  run.stopping_status = "stopping";
  run.create_failure_exit_code = 1;
  run.report_failure = [](const absl::Status& status) { Fail(status, false); };
  run.config = &config;
  run.security = security;
  return tessera::RunDaemon(run, daemon);
}

}  // namespace

int main(int argc, char** argv) {
  tessera::ExecWithPassiveOpenMpWait(argv);
  tessera::ConfigureReleaseMutexes();
  WorkerFlags flags;
  CLI::App app{
      "tessera-worker: the training worker.\n"
      "\n"
      "Examples:\n"
      "  tessera-worker --coordinator 127.0.0.1:7070\n"
      "      run as a daemon: register, wait for tasks, train them (on a GPU where one exists)\n"
      "  TESSERA_COORDINATOR=10.0.0.5:7070 tessera-worker --device cpu --threads 2\n"
      "  tessera-worker --standalone --job examples/fashion_mlp.textproto --output json\n"
      "      train one job spec in this process, without a cluster\n"};
  app.footer(
      "Daemon: the coordinator address comes from --coordinator, else $TESSERA_COORDINATOR, else\n"
      "the config file, else 127.0.0.1:7070. While it is unreachable the worker retries with\n"
      "backoff and logs why. SIGTERM or SIGINT cancels a running task (reported FAILED \"worker\n"
      "stopped\"), deregisters and exits 0; SIGHUP re-reads log_level and the TLS and token\n"
      "files; exit 1 when the daemon cannot start (e.g. --device cuda on a host without a GPU),\n"
      "78 for a configuration error. Under systemd (Type=notify) it sends READY=1, STOPPING=1\n"
      "and WATCHDOG=1 like the other daemons.\n"
      "Standalone exit status: 0 on success; 1 when the job fails (the reason on stderr, and with\n"
      "--output json also on stdout as {\"error\":{\"code\":...,\"message\":...}}).\n"
      "64 for a usage error in either mode.");
  app.add_option("--coordinator", flags.coordinator,
                 "Daemon: the coordinator's host:port (default $TESSERA_COORDINATOR, else "
                 "127.0.0.1:7070)")
      ->capture_default_str();
  app.add_option("--dataset_root", flags.dataset_roots,
                 "Daemon: a folder a task's dataset files may lie in (repeat it, or separate "
                 "folders with commas, for several); a task naming a file elsewhere fails before "
                 "reading it. Default: /usr/share/datasets")
      ->delimiter(',');
  app.add_option("--hostname", flags.hostname,
                 "Daemon: the host name to register with (default: this host's name)");
  app.add_option("--log_level", flags.log_level,
                 "Daemon: trace, debug, info, warn, error, critical or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  app.add_flag("--standalone", flags.standalone, "Train one job spec in this process");
  app.add_option("--job", flags.job,
                 "Standalone: job spec file, textproto or JSON when it starts with '{' (see "
                 "examples/)");
  app.add_option("--device", flags.device,
                 "Device, overriding the job spec's: auto (CUDA where a GPU exists), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--output", flags.output,
                 "Standalone: text, or json for one JSON line on stdout (progress on stderr)")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_option("--epochs", flags.epochs,
                 "Standalone: epochs, overriding the spec (N > 0 also drops the spec's max_steps)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--threads", flags.threads,
                 "CPU threads (0: the first training steps measure every core against 1 thread "
                 "and keep the faster, saying so in the log); with --devices cpu:N, per device "
                 "(0: 1)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--devices", flags.devices,
                 "Daemon: cpu:N trains each task on N devices on this host's CPU: N model "
                 "replicas that split every batch and sum their gradients here before the one "
                 "push, or, for a model with a pipeline of N stages (model.pipeline), one stage "
                 "per device, micro-batches flowing through them at once (dense models; sparse "
                 "tables train on replicas). cuda:0,cuda:1 does the same on those GPUs, NCCL "
                 "summing the gradients; cuda: every visible GPU. "
                 "Empty: the one device --device names (a pipelined model trains unsplit)");
  app.add_option("--target_accuracy", flags.target_accuracy,
                 "Standalone: stop after the first evaluation with at least this test accuracy")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--listen", flags.listen,
                 "Daemon: host:port serving grpc.health.v1 and reflection (SERVING while the "
                 "daemon runs); port 0 picks one (see --port_file); empty: none")
      ->capture_default_str();
  app.add_option("--port_file", flags.port_file,
                 "Daemon: write the bound --listen port here (atomically); empty: don't")
      ->capture_default_str();
  // The channels' TLS and token; the listener flags apply to --listen and --metrics_listen.
  tessera::AddSecurityFlags(app, &flags.security);
  tessera::AddMetricsFlags(app, &flags.metrics, "Daemon: ");
  tessera::LayeredConfig config("tessera-worker");
  config.AddFlags(app);
  config.set_usage_error_handler([](CLI::App& app, const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::CallForHelp*>(&e) != nullptr) return app.exit(e);
    std::fprintf(stderr, "tessera-worker: %s\nRun with --help for usage.\n", e.what());
    return kExitUsage;
  });
  std::unique_ptr<tessera::Security> security;
  const int code = config.Parse(app, argc, argv, [&] {
    // A daemon blocks its signals before Security::Create, which may start gRPC's threads; a
    // standalone run keeps the default handling (SIGINT ends it).
    if (!flags.standalone) {
      tessera::ConfigureDaemonAllocator();
      tessera::BlockDaemonSignals();
      tessera::InstallCrashReporter(argv[0]);
    }
    return ValidateDaemon(flags, &security);
  });
  if (code >= 0) return code;
  if (!flags.standalone) {
    if (!flags.job.empty() || flags.output != "text" || flags.epochs >= 0 ||
        flags.target_accuracy > 0) {
      std::fprintf(stderr,
                   "tessera-worker: --job, --output, --epochs and --target_accuracy need "
                   "--standalone; a daemon gets its jobs from the coordinator\n");
      return kExitUsage;
    }
    return RunWorkerDaemon(flags, config, security.get());
  }
  // Only a --coordinator on the command line conflicts: $TESSERA_COORDINATOR or a config file
  // meant for the daemon does not.
  if (config.Find("coordinator")->source.kind == tessera::ConfigSource::kFlag) {
    std::fprintf(stderr,
                 "tessera-worker: --standalone runs without a coordinator; drop "
                 "--coordinator\n");
    return kExitUsage;
  }
  if (flags.job.empty()) {
    std::fprintf(stderr, "tessera-worker: --standalone needs --job FILE\n");
    return kExitUsage;
  }
  try {
    return RunStandalone(flags);
  } catch (const std::bad_alloc&) {
    // The spec and the data are checked against the memory they need before anything large is
    // allocated; this is the backstop for what no check foresaw (a host short of free memory).
    return Fail(absl::ResourceExhaustedError("out of host memory"), flags.output == "json");
  }
}
