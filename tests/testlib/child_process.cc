#include "tests/testlib/child_process.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tessera {
namespace testlib {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string FileTail(const std::string& path, size_t max_bytes) {
  return ReadFileTail(path, max_bytes);
}

ScratchDirectory::ScratchDirectory(const std::string& prefix) {
  std::string tmpl = absl::StrCat("/tmp/", prefix, "-XXXXXX");
  if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
}

ScratchDirectory::~ScratchDirectory() {
  std::error_code ec;
  if (!path_.empty() && !keep_) std::filesystem::remove_all(path_, ec);
}

std::string ScratchDirectory::File(const std::string& name) const {
  return absl::StrCat(path_, "/", name);
}

ChildProcess SpawnChild(const std::vector<std::string>& args, const std::string& dir,
                        const std::string& tag, const SpawnOptions& options) {
  ChildProcess::Options child;
  child.name = tag;
  child.argv = args;
  child.log_path = absl::StrCat(dir, "/", tag, ".out");
  child.err_path = absl::StrCat(dir, "/", tag, ".err");
  if (options.scrub_environment) {
    child.drop_env = {"TESSERA_", "NOTIFY_SOCKET=", "WATCHDOG_", "JOURNAL_STREAM="};
  }
  child.set_env = options.env;
  absl::StatusOr<ChildProcess> p = ChildProcess::Spawn(std::move(child));
  if (p.ok()) return *std::move(p);
  std::ofstream(absl::StrCat(dir, "/", tag, ".err")) << p.status() << "\n";
  return ChildProcess();
}

int WaitChild(ChildProcess* p, absl::Duration timeout) {
  if (!p->running()) return -3;
  if (!p->Wait(timeout)) {
    p->Kill();
    return -1;
  }
  return p->exit_code();
}

int StopChild(ChildProcess* p, absl::Duration timeout) {
  if (!p->running()) return -1;
  p->Terminate(timeout);
  return p->exit_code();
}

CommandResult RunToEnd(const std::vector<std::string>& args, const std::string& dir,
                       const std::string& tag, const SpawnOptions& options,
                       absl::Duration timeout) {
  ChildProcess p = SpawnChild(args, dir, tag, options);
  CommandResult r;
  r.code = WaitChild(&p, timeout);
  r.out = ReadWholeFile(absl::StrCat(dir, "/", tag, ".out"));
  r.err = ReadWholeFile(absl::StrCat(dir, "/", tag, ".err"));
  return r;
}

int64_t ProcStatusField(pid_t pid, absl::string_view field) {
  const std::string status = ReadWholeFile(absl::StrCat("/proc/", pid, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, field) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, "kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib)) return kib;
  }
  return -1;
}

int64_t ResidentKib(pid_t pid) { return ProcStatusField(pid, "VmRSS"); }

}  // namespace testlib
}  // namespace tessera
