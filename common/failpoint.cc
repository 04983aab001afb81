#include "common/failpoint.h"

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace tessera::failpoint {
namespace {

// Failpoint name -> the value at which it hangs, parsed once from TESSERA_FAILPOINTS.
const std::map<std::string, int64_t>& Hangs() {
  static const std::map<std::string, int64_t>* hangs = [] {
    auto* parsed = new std::map<std::string, int64_t>;
    const char* env = std::getenv("TESSERA_FAILPOINTS");
    if (env == nullptr) return parsed;
    for (absl::string_view entry : absl::StrSplit(env, ',', absl::SkipWhitespace())) {
      std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('=', 1));
      int64_t from = 0;
      absl::string_view action = parts.size() == 2 ? parts[1] : absl::string_view();
      if (parts.size() != 2 || !absl::ConsumePrefix(&action, "hang@") ||
          !absl::SimpleAtoi(action, &from)) {
        spdlog::warn("TESSERA_FAILPOINTS: ignoring \"{}\" (want NAME=hang@N)", std::string(entry));
        continue;
      }
      spdlog::warn("TESSERA_FAILPOINTS: failpoint {} hangs at {}", std::string(parts[0]), from);
      (*parsed)[std::string(parts[0])] = from;
    }
    return parsed;
  }();
  return *hangs;
}

}  // namespace

void MaybeHang(absl::string_view name, int64_t value, const std::function<bool()>& cancelled) {
  const std::map<std::string, int64_t>& hangs = Hangs();
  if (hangs.empty()) return;
  auto it = hangs.find(std::string(name));
  if (it == hangs.end() || value != it->second) return;
  spdlog::warn("failpoint {}: hanging at {} (TESSERA_FAILPOINTS) until cancelled",
               std::string(name), value);
  while (!cancelled()) absl::SleepFor(absl::Milliseconds(50));
}

}  // namespace tessera::failpoint
