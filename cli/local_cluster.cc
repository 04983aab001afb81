#include "cli/local_cluster.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/coordinator_client.h"

namespace tessera::cli {

absl::StatusOr<std::string> SelfBinaryDir() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("readlink /proc/self/exe: ", ec.message()));
  }
  return self.parent_path().string();
}

std::string LocalCluster::LogTail(const Child& child, size_t max_bytes) {
  return ReadFileTail(child.log_path, max_bytes);
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const Options& options) {
  if (options.num_shards < 1 || options.num_shards > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards: must be in [1, 64], got ", options.num_shards));
  }
  if (options.num_workers < 1 || options.num_workers > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("workers: must be in [1, 64], got ", options.num_workers));
  }
  if (options.worker_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads: must be >= 0, got ", options.worker_threads));
  }
  for (const char* binary : {"tessera-coordinator", "tessera-server", "tessera-worker"}) {
    const std::string path = absl::StrCat(options.bin_dir, "/", binary);
    if (access(path.c_str(), X_OK) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          binary, " not found next to tessera: ", path,
          " is not an executable file (build it: ", "cmake --build build --target ", binary, ")"));
    }
  }

  std::unique_ptr<LocalCluster> cluster(new LocalCluster(options));
  const char* tmpdir = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat((tmpdir != nullptr && *tmpdir != '\0') ? tmpdir : "/tmp",
                                  "/tessera-local-XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
  }
  cluster->work_dir_ = tmpl;
  cluster->owns_work_dir_ = true;
  const std::string& dir = cluster->work_dir_;
  const std::string bin = options.bin_dir;

  // Coordinator.
  Child coordinator;
  coordinator.name = "coordinator";
  coordinator.log_path = absl::StrCat(dir, "/coordinator.log");
  coordinator.port_file = absl::StrCat(dir, "/coordinator.port");
  coordinator.argv = {bin + "/tessera-coordinator",
                      "--listen",
                      "127.0.0.1:0",
                      "--port_file",
                      coordinator.port_file,
                      "--data_dir",
                      absl::StrCat(dir, "/coordinator"),
                      "--num_shards",
                      absl::StrCat(options.num_shards),
                      "--log_level",
                      options.log_level};
  coordinator.argv.insert(coordinator.argv.end(), options.coordinator_args.begin(),
                          options.coordinator_args.end());
  cluster->children_.push_back(std::move(coordinator));
  {
    Child& c = cluster->children_.back();
    absl::Status spawned = cluster->Spawn(&c);
    if (!spawned.ok()) return spawned;
    absl::StatusOr<std::string> address = cluster->WaitServing(&c);
    if (!address.ok()) return address.status();
    cluster->coordinator_address_ = *address;
    // Restarts reuse the port, so shards and workers find the coordinator again.
    c.argv[2] = *address;
  }

  // Shards: start them all, then wait for each.
  for (int i = 0; i < options.num_shards; ++i) {
    Child shard;
    shard.name = absl::StrCat("shard-", i);
    shard.log_path = absl::StrCat(dir, "/", shard.name, ".log");
    shard.port_file = absl::StrCat(dir, "/", shard.name, ".port");
    const bool fixed_listen =
        i < static_cast<int>(options.shard_listen.size()) && !options.shard_listen[i].empty();
    shard.argv = {bin + "/tessera-server",
                  "--listen",
                  fixed_listen ? options.shard_listen[i] : "127.0.0.1:0",
                  "--port_file",
                  shard.port_file,
                  "--shard_index",
                  absl::StrCat(i),
                  "--coordinator",
                  cluster->coordinator_address_,
                  "--data_dir",
                  absl::StrCat(dir, "/", shard.name),
                  "--log_level",
                  options.log_level};
    shard.argv.insert(shard.argv.end(), options.server_args.begin(), options.server_args.end());
    if (i < static_cast<int>(options.shard_args.size())) {
      shard.argv.insert(shard.argv.end(), options.shard_args[i].begin(),
                        options.shard_args[i].end());
    }
    cluster->children_.push_back(std::move(shard));
    absl::Status spawned = cluster->Spawn(&cluster->children_.back());
    if (!spawned.ok()) return spawned;
  }
  for (Child& c : cluster->children_) {
    if (!absl::StartsWith(c.name, "shard-")) continue;
    absl::StatusOr<std::string> address = cluster->WaitServing(&c);
    if (!address.ok()) return address.status();
    cluster->shard_addresses_.push_back(*address);
    // Restarts reuse the port (as a systemd restart with a fixed --listen would).
    c.argv[2] = *address;
  }

  // Workers.
  int threads = options.worker_threads;
  if (threads == 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    threads = std::max(1, static_cast<int>(cores) / options.num_workers);
  }
  for (int i = 0; i < options.num_workers; ++i) {
    Child worker;
    worker.name = absl::StrCat("worker-", i);
    worker.log_path = absl::StrCat(dir, "/", worker.name, ".log");
    worker.argv = {bin + "/tessera-worker",
                   "--coordinator",
                   cluster->coordinator_address_,
                   "--threads",
                   absl::StrCat(threads),
                   "--log_level",
                   options.log_level};
    worker.argv.insert(worker.argv.end(), options.worker_args.begin(), options.worker_args.end());
    if (i < static_cast<int>(options.worker_env.size())) worker.env = options.worker_env[i];
    cluster->children_.push_back(std::move(worker));
    absl::Status spawned = cluster->Spawn(&cluster->children_.back());
    if (!spawned.ok()) return spawned;
  }
  absl::Status ready = cluster->WaitMembersReady();
  if (!ready.ok()) return ready;
  return cluster;
}

absl::Status LocalCluster::Spawn(Child* child) {
  if (!child->port_file.empty()) unlink(child->port_file.c_str());
  ChildProcess::Options options;
  options.name = child->name;
  options.argv = child->argv;
  options.log_path = child->log_path;
  options.append_log = true;
  options.set_env = child->env;
  // Die with the parent, and leave the terminal's process group (see the header).
  options.die_with_parent = true;
  options.own_process_group = true;
  absl::StatusOr<ChildProcess> process = ChildProcess::Spawn(std::move(options));
  if (!process.ok()) return process.status();
  child->process = *std::move(process);
  return absl::OkStatus();
}

absl::StatusOr<std::string> LocalCluster::WaitServing(Child* child) {
  absl::StatusOr<int> port = WaitUntilServing(child->process, child->port_file,
                                              options_.start_timeout, options_.interrupted);
  if (absl::IsCancelled(port.status())) {
    return absl::CancelledError("interrupted while starting the cluster");
  }
  if (!port.ok()) return port.status();
  return absl::StrCat("127.0.0.1:", *port);
}

absl::Status LocalCluster::WaitMembersReady() {
  CoordinatorClient::Options client_options;
  client_options.address = coordinator_address_;
  client_options.rpc_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client =
      CoordinatorClient::Create(client_options);
  if (!client.ok()) return client.status();
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  std::string last = "no answer yet";
  for (;;) {
    absl::Status alive = CheckChildren();
    if (!alive.ok()) return alive;
    if (options_.interrupted && options_.interrupted()) {
      return absl::CancelledError("interrupted while starting the cluster");
    }
    absl::StatusOr<std::vector<v1::Member>> members = (*client)->ListMembers();
    if (members.ok()) {
      int shards = 0, workers = 0;
      for (const v1::Member& m : *members) {
        if (m.state() != v1::MEMBER_STATE_READY) continue;
        if (m.role() == v1::MEMBER_ROLE_SERVER) ++shards;
        if (m.role() == v1::MEMBER_ROLE_WORKER) ++workers;
      }
      if (shards >= options_.num_shards && workers >= options_.num_workers) {
        return absl::OkStatus();
      }
      last = absl::StrCat(shards, " of ", options_.num_shards, " shards and ", workers, " of ",
                          options_.num_workers, " workers READY");
    } else {
      last = std::string(members.status().message());
    }
    if (absl::Now() > deadline) {
      std::string tails;
      for (const Child& c : children_) {
        if (absl::StartsWith(c.name, "worker-")) {
          absl::StrAppend(&tails, "\n--- ", c.log_path, ":\n", LogTail(c, 800));
        }
      }
      return absl::DeadlineExceededError(absl::StrCat("the cluster is not ready after ",
                                                      absl::FormatDuration(options_.start_timeout),
                                                      ": ", last, tails));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

std::vector<pid_t> LocalCluster::live_pids() const {
  std::vector<pid_t> pids;
  for (const Child& c : children_) {
    if (c.pid() > 0) pids.push_back(c.pid());
  }
  return pids;
}

absl::Status LocalCluster::CheckChildren() {
  for (Child& c : children_) {
    if (c.process.running() && c.process.HasExited()) return c.process.ExitedError();
  }
  return absl::OkStatus();
}

void LocalCluster::StopGroup(const std::string& prefix, absl::Duration grace) {
  std::vector<Child*> group;
  for (Child& c : children_) {
    if (absl::StartsWith(c.name, prefix) && c.process.running()) group.push_back(&c);
  }
  for (Child* c : group) c->process.Signal(SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  for (Child* c : group) {
    if (!c->process.Wait(deadline - absl::Now())) c->process.Kill();
  }
}

absl::Status LocalCluster::Stop(absl::Duration grace) {
  // Reap what already exited first, so that its status is reported.
  std::vector<std::string> exited_before;
  for (Child& c : children_) {
    if (c.process.running() && c.process.HasExited()) exited_before.push_back(c.name);
  }
  StopGroup("worker-", grace);
  StopGroup("shard-", grace);
  StopGroup("coordinator", grace);
  for (const Child& c : children_) {
    if (!c.process.ended() || c.process.exit_code() == 0) continue;
    const bool before =
        std::find(exited_before.begin(), exited_before.end(), c.name) != exited_before.end();
    return absl::InternalError(absl::StrCat(c.name, " ", c.process.DescribeExit(),
                                            before ? " before shutdown" : " after SIGTERM",
                                            "; the end of ", c.log_path, ":\n", LogTail(c)));
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::KillCoordinator() { return Kill("coordinator"); }

absl::Status LocalCluster::RestartCoordinator() { return Restart("coordinator"); }

LocalCluster::Child* LocalCluster::FindChild(const std::string& name) {
  for (Child& c : children_) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

absl::Status LocalCluster::Kill(const std::string& name) {
  Child* c = FindChild(name);
  if (c == nullptr) return absl::NotFoundError(absl::StrCat("no child named ", name));
  if (!c->process.running()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " is not running"));
  }
  c->process.Kill();
  return absl::OkStatus();
}

absl::Status LocalCluster::Restart(const std::string& name) {
  Child* c = FindChild(name);
  if (c == nullptr) return absl::NotFoundError(absl::StrCat("no child named ", name));
  if (c->process.running()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " is still running"));
  }
  absl::Status spawned = Spawn(c);
  if (!spawned.ok()) return spawned;
  if (c->port_file.empty()) return absl::OkStatus();  // a worker: nothing to wait for
  absl::StatusOr<std::string> address = WaitServing(c);
  if (!address.ok()) return address.status();
  if (c->argv[2] == "127.0.0.1:0") {
    // RestartOnNewPort: later restarts keep the port it got.
    std::replace(shard_addresses_.begin(), shard_addresses_.end(), c->previous_address, *address);
    c->argv[2] = *address;
  } else if (*address != c->argv[2]) {
    return absl::InternalError(
        absl::StrCat(name, " came back on ", *address, " instead of ", c->argv[2]));
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::RestartOnNewPort(const std::string& name) {
  Child* c = FindChild(name);
  if (c == nullptr || !absl::StartsWith(name, "shard-")) {
    return absl::NotFoundError(absl::StrCat("no shard named ", name));
  }
  if (c->process.running()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " is still running"));
  }
  c->previous_address = c->argv[2];
  c->argv[2] = "127.0.0.1:0";
  absl::Status restarted = Restart(name);
  if (c->argv[2] == "127.0.0.1:0") c->argv[2] = c->previous_address;  // it did not come up
  return restarted;
}

LocalCluster::~LocalCluster() {
  Stop(absl::Seconds(10)).IgnoreError();
  if (owns_work_dir_ && !options_.keep_work_dir) {
    std::error_code ec;
    std::filesystem::remove_all(work_dir_, ec);
  }
}

}  // namespace tessera::cli
