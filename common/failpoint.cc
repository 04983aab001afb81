#include "common/failpoint.h"

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace tessera::failpoint {
namespace {

enum class Action { kHang, kAt };

// Failpoint name -> its action and the value at which it acts, parsed once from
// TESSERA_FAILPOINTS.
const std::map<std::string, std::pair<Action, int64_t>>& Failpoints() {
  static const std::map<std::string, std::pair<Action, int64_t>>* failpoints = [] {
    auto* parsed = new std::map<std::string, std::pair<Action, int64_t>>;
    const char* env = std::getenv("TESSERA_FAILPOINTS");
    if (env == nullptr) return parsed;
    for (absl::string_view entry : absl::StrSplit(env, ',', absl::SkipWhitespace())) {
      std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('=', 1));
      int64_t from = 0;
      absl::string_view action = parts.size() == 2 ? parts[1] : absl::string_view();
      Action kind = Action::kHang;
      if (absl::ConsumePrefix(&action, "at@")) kind = Action::kAt;
      if (parts.size() != 2 || (kind == Action::kHang && !absl::ConsumePrefix(&action, "hang@")) ||
          !absl::SimpleAtoi(action, &from)) {
        spdlog::warn("TESSERA_FAILPOINTS: ignoring \"{}\" (want NAME=hang@N or NAME=at@N)",
                     std::string(entry));
        continue;
      }
      spdlog::warn("TESSERA_FAILPOINTS: failpoint {} {} {}", std::string(parts[0]),
                   kind == Action::kHang ? "hangs at" : "acts at", from);
      (*parsed)[std::string(parts[0])] = {kind, from};
    }
    return parsed;
  }();
  return *failpoints;
}

bool Matches(absl::string_view name, Action kind, int64_t value) {
  const std::map<std::string, std::pair<Action, int64_t>>& failpoints = Failpoints();
  if (failpoints.empty()) return false;
  auto it = failpoints.find(std::string(name));
  return it != failpoints.end() && it->second.first == kind && it->second.second == value;
}

}  // namespace

void MaybeHang(absl::string_view name, int64_t value, const std::function<bool()>& cancelled) {
  if (!Matches(name, Action::kHang, value)) return;
  spdlog::warn("failpoint {}: hanging at {} (TESSERA_FAILPOINTS) until cancelled",
               std::string(name), value);
  while (!cancelled()) absl::SleepFor(absl::Milliseconds(50));
}

bool Hit(absl::string_view name, int64_t value) {
  if (!Matches(name, Action::kAt, value)) return false;
  spdlog::warn("failpoint {}: acting at {} (TESSERA_FAILPOINTS)", std::string(name), value);
  return true;
}

}  // namespace tessera::failpoint
