// Issue #6, test 3: SIGKILL a shard while it writes checkpoints, 20 times at random moments. Every
// restart must find a complete checkpoint, old or new, never a torn one; corrupt files are refused
// with DATA_LOSS and leave the job as it was. Prints the figure line (docs/reliability.md).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/testing/push_pull_requests.h"
#include "gtest/gtest.h"
#include "server/checkpoint_file.h"
#include "server/parameter_store.h"

namespace tessera::server {
namespace {

using namespace ::tessera::push_pull_requests;  // NOLINT: request builders

constexpr char kJob[] = "kill-job";
constexpr int kKills = 20;
constexpr int kPartitions = 4;
constexpr int64_t kElements = 128 * 1024;  // Adam: 3 x 512 KiB per partition, 6 MiB a file

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir() + "/ckptkillXXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

v1::CreateJobStateRequest JobRequest() {
  v1::JobConfig config = Config(v1::CONSISTENCY_BSP, 1, 0.01f, v1::OPTIMIZER_KIND_ADAM);
  config.set_checkpoint_every_steps(1);
  v1::CreateJobStateRequest r;
  r.set_job_id(kJob);
  *r.mutable_config() = config;
  for (int i = 0; i < kPartitions; ++i) {
    *r.add_partitions() = Dense("w", static_cast<uint32_t>(i), kElements);
  }
  return r;
}

std::string JobDir(const std::string& root) { return absl::StrCat(root, "/", kJob); }

int64_t NewestStep(const std::string& root) {
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpointSteps(JobDir(root), 0);
  if (!steps.ok() || steps->empty()) return -1;
  return steps->back();
}

// The child: a shard that restarts from the newest checkpoint (when there is one) and then writes
// a checkpoint at every step, until it is killed. Never returns.
[[noreturn]] void RunWriter(const std::string& root) {
  ParameterStoreOptions options;
  options.checkpoint_dir = root;
  ParameterStore store(options);
  const int64_t newest = NewestStep(root);
  int64_t step = 0;
  if (newest > 0) {
    v1::RestoreRequest restore;
    restore.set_job_id(kJob);
    restore.set_step(newest);
    restore.set_min_incarnation(static_cast<uint64_t>(newest) + 1);
    absl::StatusOr<v1::RestoreResponse> r = store.Restore(restore);
    if (!r.ok()) {
      std::fprintf(stderr, "child: restore of %lld failed: %s\n", static_cast<long long>(newest),
                   r.status().ToString().c_str());
      ::_exit(3);
    }
    step = newest;
  } else if (!store.CreateJobState(JobRequest()).ok()) {
    ::_exit(4);
  }
  const uint64_t incarnation = static_cast<uint64_t>(step) + 1;
  std::vector<float> grad(kElements);
  for (uint64_t seq = 1; seq < 100000; ++seq, ++step) {
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>((i + step) % 13) - 6;
    std::vector<v1::Slice> push;
    for (int p = 0; p < kPartitions; ++p) {
      push.push_back(GradSlice("w", static_cast<uint32_t>(p), grad));
    }
    if (!store.Push(Request(kJob, 0, incarnation, step, seq, push)).ok()) ::_exit(5);
    // Step + 1 is captured by itself (checkpoint_every_steps 1); wait until it is written.
    v1::CheckpointRequest ask;
    ask.set_job_id(kJob);
    ask.set_step(step + 1);
    ask.set_retain_from_step(std::max<int64_t>(0, step - 2));
    absl::Notification done;
    bool ok = false;
    store.Checkpoint(ask, [&](absl::StatusOr<v1::CheckpointResponse> r) {
      ok = r.ok();
      done.Notify();
    });
    if (!done.WaitForNotificationWithTimeout(absl::Seconds(30)) || !ok) ::_exit(6);
  }
  ::_exit(0);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteAllTo(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<float> Weights(ParameterStore& store) {
  v1::PullRequest r;
  r.set_job_id(kJob);
  r.set_step(-1);
  for (int p = 0; p < kPartitions; ++p) *r.add_keys() = PullKey("w", static_cast<uint32_t>(p));
  std::optional<absl::StatusOr<std::vector<v1::Slice>>> out;
  store.Pull(r, [&](absl::StatusOr<std::vector<v1::Slice>> s) { out = std::move(s); });
  std::vector<float> all;
  if (!out.has_value() || !out->ok()) {
    ADD_FAILURE() << "pull failed";
    return all;
  }
  for (const v1::Slice& s : **out) {
    std::vector<float> f = Floats(s);
    all.insert(all.end(), f.begin(), f.end());
  }
  return all;
}

TEST(CheckpointKillTest, EveryRestartFindsACompleteCheckpointAndCorruptFilesAreRefused) {
  uint32_t seed = static_cast<uint32_t>(
      std::chrono::steady_clock::now().time_since_epoch().count() & 0xffffffff);
  if (const char* env = std::getenv("TESSERA_KILL_SEED"))
    seed = static_cast<uint32_t>(std::atoll(env));
  std::printf("checkpoint-kill: seed %u (rerun with TESSERA_KILL_SEED=%u)\n", seed, seed);
  std::mt19937 rng(seed);
  const std::string root = MakeTempDir();

  int loaded_new = 0;
  int loaded_old = 0;
  int torn = 0;
  int temps_seen = 0;
  int64_t previous = -1;
  for (int kill = 0; kill < kKills; ++kill) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0) << std::strerror(errno);
    if (child == 0) RunWriter(root);
    // Long enough for the child to restore and write a few files (each 6 MiB, fsynced).
    const int delay_ms = std::uniform_int_distribution<int>(30, 400)(rng);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status))
        << "the writer exited by itself with status " << WEXITSTATUS(status) << " before the kill";

    // As a restarted shard: clean up unfinished writes, then load the newest file.
    absl::StatusOr<int> removed = RemoveTemporaryCheckpointFiles(root, -1);
    ASSERT_TRUE(removed.ok()) << removed.status();
    temps_seen += *removed;
    const int64_t newest = NewestStep(root);
    if (newest < 0) {
      // Killed before its first file: nothing to load yet (counts as the old state, none).
      ++loaded_old;
      continue;
    }
    absl::StatusOr<CheckpointContents> contents =
        ReadCheckpointFile(CheckpointPath(root, kJob, newest, 0));
    if (!contents.ok()) {
      ++torn;
      ADD_FAILURE() << "kill " << kill << ": the newest checkpoint " << newest
                    << " does not load: " << contents.status();
      continue;
    }
    EXPECT_EQ(contents->header.step(), newest);
    EXPECT_EQ(contents->header.partitions_size(), kPartitions);
    for (const v1::PartitionCheckpoint& p : contents->header.partitions()) {
      EXPECT_EQ(p.version(), newest) << "kill " << kill;
    }
    if (newest > previous) {
      ++loaded_new;
    } else {
      ++loaded_old;
    }
    previous = newest;
    std::printf("checkpoint-kill: kill %d after %d ms: newest step %lld loads (%d temp removed)\n",
                kill, delay_ms, static_cast<long long>(newest), *removed);
  }
  EXPECT_EQ(torn, 0);
  EXPECT_GT(loaded_new, 0) << "the writer never got a checkpoint written: the test proves nothing";
  std::printf(
      "checkpoint-kill: %d kills, %d loaded new, %d loaded old, %d torn (%d unfinished "
      "temp files removed)\n",
      kKills, loaded_new, loaded_old, torn, temps_seen);

  // Corrupt files: DATA_LOSS, and the job keeps the state it had ("never half-loaded").
  const int64_t newest = NewestStep(root);
  ASSERT_GT(newest, 0);
  ParameterStoreOptions options;
  options.checkpoint_dir = root;
  ParameterStore store(options);
  v1::RestoreRequest restore;
  restore.set_job_id(kJob);
  restore.set_step(newest);
  ASSERT_TRUE(store.Restore(restore).ok());
  // Move the job away from the checkpoint so that a half-load would show.
  std::vector<v1::Slice> push;
  for (int p = 0; p < kPartitions; ++p) {
    push.push_back(GradSlice("w", static_cast<uint32_t>(p), std::vector<float>(kElements, 1.0f)));
  }
  ASSERT_TRUE(store.Push(Request(kJob, 0, 1ull << 40, newest, 1, push)).ok());
  const std::vector<float> before = Weights(store);
  const std::string path = CheckpointPath(root, kJob, newest, 0);
  const std::string good = ReadAll(path);
  std::vector<std::pair<std::string, std::string>> corrupt;
  for (int i = 0; i < 5; ++i) {
    std::string flipped = good;
    const size_t at = std::uniform_int_distribution<size_t>(0, good.size() - 1)(rng);
    flipped[at] = static_cast<char>(flipped[at] ^ (1 << (i % 8)));
    corrupt.emplace_back(absl::StrCat("byte ", at, " flipped"), flipped);
    const size_t cut = std::uniform_int_distribution<size_t>(0, good.size() - 1)(rng);
    corrupt.emplace_back(absl::StrCat("truncated at ", cut), good.substr(0, cut));
    corrupt.emplace_back(absl::StrCat("garbage appended"),
                         good + std::string(1 + i * 100, static_cast<char>('a' + i)));
  }
  // A file whose CRC verifies but whose header does not match its data.
  absl::StatusOr<CheckpointContents> parsed = ParseCheckpoint(good);
  ASSERT_TRUE(parsed.ok());
  v1::CheckpointHeader bad_range = parsed->header;
  bad_range.mutable_partitions(kPartitions - 1)->mutable_weights()->set_offset(good.size() * 2);
  const absl::string_view data[] = {parsed->data};
  ASSERT_TRUE(WriteCheckpointFile(path, bad_range, data).ok());
  corrupt.emplace_back("range outside the data", ReadAll(path));
  for (const auto& [what, bytes] : corrupt) {
    WriteAllTo(path, bytes);
    absl::StatusOr<v1::RestoreResponse> r = store.Restore(restore);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << what << ": " << r.status();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << what;
    const std::vector<float> after = Weights(store);
    EXPECT_TRUE(after.size() == before.size() &&
                std::memcmp(after.data(), before.data(), after.size() * 4) == 0)
        << what << ": the job changed";
  }
  WriteAllTo(path, good);
  ASSERT_TRUE(store.Restore(restore).ok());
}

}  // namespace
}  // namespace tessera::server
