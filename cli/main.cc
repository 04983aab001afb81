// tessera: the command-line client of a Tessera cluster (DESIGN.md §1, §6), and `tessera local`,
// which runs a whole cluster on this machine for one job. See cli/commands.h for the exit status.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "cli/commands.h"
#include "common/process.h"
#include "common/security.h"

extern char** environ;

namespace {

constexpr char kDescription[] =
    "tessera: submit, follow and export training jobs on a Tessera cluster.\n"
    "\n"
    "Examples:\n"
    "  tessera local --job examples/fashion_mlp_2epochs.textproto --shards 2 --workers 2\n"
    "  tessera local --job examples/fashion_mlp_2epochs.textproto --out model.safetensors\n"
    "  tessera submit examples/fashion_mlp.textproto --watch\n"
    "  tessera list\n"
    "  tessera get fashion-mlp-1 --output json\n"
    "  tessera watch fashion-mlp-1\n"
    "  tessera cancel fashion-mlp-1\n"
    "  tessera checkpoint fashion-mlp-1\n"
    "  tessera cluster\n"
    "  tessera export fashion-mlp-1 --out model.safetensors\n"
    "  tessera datagen criteo --rows 1000000 --out /var/tmp/criteo\n"
    "  TESSERA_COORDINATOR=10.0.0.5:7070 tessera list\n"
    "  tessera list --coordinator 10.0.0.5:7070 --tls_ca ca.pem --auth_token_file "
    "~/.tessera-token\n"
    "\n"
    "Security: a cluster that serves TLS needs --tls_ca (the CA that signed the daemons'\n"
    "certificates); one that requires client certificates (mutual TLS) also needs --tls_cert and\n"
    "--tls_key; one that checks a bearer token needs --auth_token_file FILE (first line = the\n"
    "token; chmod 600; sent only over TLS). --tls_server_name NAME checks NAME in the\n"
    "certificates when they were made for a DNS name but you dial an IP. Environment defaults:\n"
    "TESSERA_TLS_CA, TESSERA_TLS_CERT, TESSERA_TLS_KEY, TESSERA_TLS_SERVER_NAME,\n"
    "TESSERA_TOKEN_FILE. `tessera export` dials the shards with the same credentials.\n"
    "`tessera local` ignores them: its cluster is plaintext on loopback, and its daemons start\n"
    "without the shell's TESSERA_* variables.\n";

constexpr char kFooter[] =
    "Exit status: 0 success (the job SUCCEEDED for submit --watch, watch and local); 1 the job\n"
    "failed or was cancelled, or the request was refused; 64 usage (bad flags, a refused spec);\n"
    "69 the coordinator is unreachable or the TLS handshake failed (the message names the\n"
    "address); 77 the bearer token was refused (UNAUTHENTICATED); 130/143 `tessera local`\n"
    "interrupted by SIGINT/SIGTERM after cancelling the job.";

// Removes every TESSERA_* variable from this process's environment. The daemons read their flags
// from TESSERA_<FLAG> (TESSERA_TLS_CA, TESSERA_CONFIG, ...); `tessera local` starts them with
// this environment, and its cluster must stay plaintext on loopback whatever the shell exports.
// REQUIRES: no other thread exists (setenv/unsetenv are not thread-safe).
void ClearTesseraEnvironment() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.rfind("TESSERA_", 0) == 0) names.push_back(entry.substr(0, entry.find('=')));
  }
  for (const std::string& name : names) unsetenv(name.c_str());
}

// Sets `*field` from the environment variable `name` when it is set and not empty.
void FromEnv(const char* name, std::string* field) {
  if (const char* env = std::getenv(name); env != nullptr && *env != '\0') *field = env;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::cli::GlobalOptions global;
  std::string output = "text";
  if (const char* env = std::getenv("TESSERA_COORDINATOR"); env != nullptr && *env != '\0') {
    global.coordinator = env;
  }

  CLI::App app{kDescription, "tessera"};
  app.footer(kFooter);
  app.require_subcommand(1);
  app.fallthrough();
  app.add_option("--coordinator", global.coordinator,
                 "Coordinator address host:port (default 127.0.0.1:7070, or TESSERA_COORDINATOR)");
  app.add_option("--output", output, "text, or json for one JSON line on stdout")
      ->check(CLI::IsMember({"text", "json"}));

  tessera::SecurityOptions security_options;
  FromEnv("TESSERA_TLS_CA", &security_options.tls_ca);
  FromEnv("TESSERA_TLS_CERT", &security_options.tls_cert);
  FromEnv("TESSERA_TLS_KEY", &security_options.tls_key);
  FromEnv("TESSERA_TLS_SERVER_NAME", &security_options.tls_server_name);
  FromEnv("TESSERA_AUTH_TOKEN_FILE", &security_options.auth_token_file);
  FromEnv("TESSERA_TOKEN_FILE", &security_options.auth_token_file);
  tessera::AddSecurityFlags(*app.add_option_group("Security", "TLS and the bearer token"),
                            &security_options, /*listener=*/false);

  tessera::cli::SubmitOptions submit;
  CLI::App* submit_cmd = app.add_subcommand(
      "submit", "Validate a job spec, submit it and print the job id (--watch: follow it)");
  submit_cmd->add_option("FILE", submit.spec_file, "Job spec: textproto, or JSON")->required();
  submit_cmd->add_flag("--watch", submit.watch, "Follow the job; exit 0 only if it succeeds");

  CLI::App* list_cmd = app.add_subcommand("list", "List every job with its state");

  std::string job_id;
  CLI::App* get_cmd = app.add_subcommand("get", "Show one job (why it waits, progress, result)");
  get_cmd->add_option("ID", job_id, "Job id")->required();
  CLI::App* watch_cmd =
      app.add_subcommand("watch", "Follow a job to its end; exit 0 only if it succeeds");
  watch_cmd->add_option("ID", job_id, "Job id")->required();
  CLI::App* cancel_cmd = app.add_subcommand("cancel", "Cancel a pending or running job");
  cancel_cmd->add_option("ID", job_id, "Job id")->required();
  CLI::App* checkpoint_cmd = app.add_subcommand(
      "checkpoint",
      "Checkpoint a running job now and wait until it is committed.\n"
      "The coordinator picks a step a little ahead of the job (about 2 s of steps, at least 10),\n"
      "every shard snapshots the job at that step boundary and writes its file, and the\n"
      "checkpoint is committed once all have. It counts towards the spec's keep_checkpoints and\n"
      "is what a shard crash rewinds the job to. Prints \"checkpoint <step> of <job> committed\n"
      "(<n> shards, <size>)\". Exit 1 if the job is not RUNNING or is recovering.");
  checkpoint_cmd->add_option("ID", job_id, "Job id")->required();
  CLI::App* cluster_cmd =
      app.add_subcommand("cluster", "List the shards and workers with their state and last seen");

  tessera::cli::ExportOptionsFlags export_flags;
  CLI::App* export_cmd =
      app.add_subcommand("export", "Write a job's final weights to a safetensors file");
  export_cmd->add_option("ID", export_flags.job_id, "Job id")->required();
  export_cmd->add_option("--out", export_flags.out, "Output file (model.safetensors)")->required();

  tessera::cli::LocalOptions local;
  CLI::App* local_cmd = app.add_subcommand(
      "local",
      "Start a coordinator, shards and workers on this machine, run one job, shut them down");
  local_cmd->add_option("--job", local.spec_file, "Job spec: textproto, or JSON")->required();
  local_cmd->add_option("--shards", local.shards, "Parameter shards (default 2)")
      ->check(CLI::Range(1, 64));
  local_cmd
      ->add_option("--workers", local.workers,
                   "Workers; sets the spec's num_workers (default: the spec's, else 2)")
      ->check(CLI::Range(1, 64));
  local_cmd->add_option("--out", local.out, "Export the model to this safetensors file");
  local_cmd
      ->add_option("--threads", local.threads,
                   "CPU threads per worker (default: cores / workers, at least 1)")
      ->check(CLI::Range(0, 4096));
  local_cmd->add_option("--devices", local.devices,
                        "Each worker's --devices: cpu:N trains on N CPU devices, as replicas that "
                        "split each batch, or one stage each for a model with a pipeline of N "
                        "stages (dense models; sparse tables train on replicas); cuda:0,cuda:1 "
                        "or cuda (every visible GPU) the same on GPUs");
  local_cmd->add_flag("--keep_dir", local.keep_dir,
                      "Keep the temporary directory (logs, the coordinator's database)");

  tessera::cli::CriteoDatagenFlags datagen;
  CLI::App* datagen_cmd =
      app.add_subcommand("datagen", "Generate data sets with known best results");
  datagen_cmd->require_subcommand(1);
  CLI::App* criteo_cmd = datagen_cmd->add_subcommand(
      "criteo",
      "Write Criteo-format click logs (train.tsv, test.tsv) drawn from a planted model, and\n"
      "planted.json with the best test log loss and AUC any model can reach on them. Field Ck\n"
      "has a vocabulary from 10 (C1) to 10^7 (C26), Zipf-distributed; labels come from a\n"
      "logistic model over the fields, or a factorisation machine (--model fm).");
  criteo_cmd->add_option("--rows", datagen.rows, "Training rows")
      ->required()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  criteo_cmd->add_option("--out", datagen.out, "Output folder (created when absent)")->required();
  criteo_cmd
      ->add_option("--test_rows", datagen.test_rows,
                   "Test rows (default: rows / 10, at least 1000, at most rows)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  criteo_cmd->add_option("--seed", datagen.seed, "Seed of the planted model and the draws (1)");
  criteo_cmd->add_option("--model", datagen.model, "logistic (default) or fm")
      ->check(CLI::IsMember({"logistic", "fm"}));
  criteo_cmd->add_option(
      "--zipf", datagen.zipf,
      "Zipf exponent of every field's values, in (0, 4], not 1 (1.05); smaller "
      "spreads the ids over more of each vocabulary (more distinct ids per row)");

  for (CLI::App* sub : {submit_cmd, list_cmd, get_cmd, watch_cmd, cancel_cmd, checkpoint_cmd,
                        cluster_cmd, export_cmd, local_cmd, datagen_cmd, criteo_cmd}) {
    sub->fallthrough();
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "tessera: %s\nRun `tessera --help` for usage and examples.\n", e.what());
    return tessera::cli::kExitUsage;
  }
  global.json = output == "json";

  // `tessera local` runs its own plaintext loopback cluster and dials nothing else; datagen
  // dials nothing.
  std::unique_ptr<tessera::Security> security;
  if (!*local_cmd && !*datagen_cmd) {
    // This process only dials: a certificate or a token without a CA to verify the server
    // would go unused, or (the token) travel in plaintext.
    if (security_options.tls_ca.empty() &&
        (!security_options.tls_cert.empty() || !security_options.auth_token_file.empty())) {
      std::fprintf(stderr,
                   "tessera: %s needs --tls_ca (or TESSERA_TLS_CA): the CA that verifies the "
                   "coordinator; a token is only sent over TLS\n",
                   security_options.auth_token_file.empty() ? "--tls_cert" : "--auth_token_file");
      return tessera::cli::kExitUsage;
    }
    absl::StatusOr<std::unique_ptr<tessera::Security>> created =
        tessera::Security::Create(security_options);
    if (!created.ok()) {
      std::fprintf(stderr, "tessera: %s\n", std::string(created.status().message()).c_str());
      return tessera::cli::kExitUsage;
    }
    security = *std::move(created);
    global.credentials = security->Client();
    global.tls = security->client_tls();
    if (security->has_token()) global.auth_token_file = security_options.auth_token_file;
  }

  if (*local_cmd) {
    // Before any thread exists: SIGINT and SIGTERM go to the command's signal thread only.
    tessera::BlockShutdownSignals();
    ClearTesseraEnvironment();
    return tessera::cli::RunLocal(global, local);
  }
  if (*submit_cmd) return tessera::cli::RunSubmit(global, submit);
  if (*list_cmd) return tessera::cli::RunList(global);
  if (*get_cmd) return tessera::cli::RunGet(global, job_id);
  if (*watch_cmd) return tessera::cli::RunWatch(global, job_id);
  if (*cancel_cmd) return tessera::cli::RunCancel(global, job_id);
  if (*checkpoint_cmd) return tessera::cli::RunCheckpoint(global, job_id);
  if (*cluster_cmd) return tessera::cli::RunCluster(global);
  if (*export_cmd) return tessera::cli::RunExport(global, export_flags);
  if (*criteo_cmd) return tessera::cli::RunDatagenCriteo(global, datagen);
  std::fprintf(stderr, "tessera: no command given; run `tessera --help`\n");
  return tessera::cli::kExitUsage;
}
