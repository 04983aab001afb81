// CoordinatorOptions: what a Coordinator is made with (Coordinator::Create validates them and
// names the option in its INVALID_ARGUMENT). A plain struct: copy it freely.
#ifndef TESSERA_SERVER_COORDINATOR_COORDINATOR_OPTIONS_H_
#define TESSERA_SERVER_COORDINATOR_COORDINATOR_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace tessera::coordinator {

struct CoordinatorOptions {
  // Shards every job uses; 0: the registered live shards (contiguous indices 0..S-1, S >= 1).
  int num_shards = 0;
  absl::Duration lease = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // Succeeded jobs whose weights stay on the shards (older ones are dropped); >= 0.
  int retain_models = 4;
  // Unix milliseconds; null: the wall clock.
  std::function<int64_t()> now_ms;
  // A watcher further behind than this is dropped with RESOURCE_EXHAUSTED.
  size_t max_watch_queue = 1000;
  // Check dataset files when validating specs (tests of the state machine turn it off).
  bool check_files = true;
  // The folders a spec's dataset files must lie in (spec::ValidateOptions::dataset_roots); empty:
  // anywhere. tessera-coordinator's --dataset_root (default /usr/share/datasets and --data_dir).
  std::vector<std::string> dataset_roots;
  // LOST and LEFT members kept (per role) for ListMembers; older ones are forgotten, so daemons
  // that come and go forever do not grow the member list and the database without bound.
  size_t max_departed_members = 256;
  // A recovering job whose lost shard has not come back (or whose restore keeps failing) for this
  // long fails. > 0.
  absl::Duration recovery_timeout = absl::Seconds(300);
  // Deadline of each Checkpoint call to a shard (it waits for the step and the write). > 0.
  absl::Duration checkpoint_timeout = absl::Seconds(120);
  // Recoveries per job; the next loss fails it. >= 0.
  int max_recoveries = 10;
  // Run the fault-tolerance actions on the thread that calls Tick() (tests, with a fake
  // ShardControl), instead of a thread per action.
  bool inline_actions = false;
};

}  // namespace tessera::coordinator

#endif  // TESSERA_SERVER_COORDINATOR_COORDINATOR_OPTIONS_H_
