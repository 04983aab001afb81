// Layered configuration for the Tessera daemons (issue #5), over CLI11.
//
// Every option of a daemon's CLI::App takes its value from the first of these layers that has
// one:
//   1. the command line (--listen 127.0.0.1:0);
//   2. the environment variable TESSERA_<KEY> where KEY is the flag name without the dashes, in
//      upper case, '-' as '_' (TESSERA_LISTEN, TESSERA_DATA_DIR, TESSERA_AUTH_TOKEN_FILE); a
//      variable set to the empty string counts as unset;
//   3. the file named by --config (or TESSERA_CONFIG): lines `key = value`, blank lines and `#`
//      comments (a whole line, or after whitespace at the end of a line); a value may be
//      double-quoted; flags without a value take true/false/1/0/yes/no/on/off
//      (`insecure = true`);
//   4. the option's default.
// Unknown keys, malformed lines and values the option rejects are configuration errors: the
// daemon prints one naming the key and where it came from (FILE:LINE, the variable) and exits 78
// (EX_CONFIG). --check-config prints the effective configuration, one `key = value  # source`
// line per option (after a `# --config FILE` line when there is one), after running the daemon's
// own validation, and exits 0 (or 78).
//
// Usage errors on the real command line keep CLI11's behaviour (or the daemon's own handler).
#ifndef TESSERA_COMMON_CONFIG_H_
#define TESSERA_COMMON_CONFIG_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace CLI {
class App;
class ParseError;
}  // namespace CLI

namespace tessera {

// sysexits.h EX_CONFIG: a configuration error.
inline constexpr int kExitConfig = 78;

// Where an option's effective value came from.
struct ConfigSource {
  enum Kind { kDefault, kFlag, kEnv, kFile };
  Kind kind = kDefault;
  std::string env_name;  // kEnv: TESSERA_X
  std::string file;      // kFile
  int line = 0;          // kFile
  // "flag", "env TESSERA_X", "config FILE:LINE" or "default".
  std::string ToString() const;
};

// One option's effective value, as --check-config prints it.
struct ConfigEntry {
  std::string key;  // the flag name without dashes
  std::string value;
  ConfigSource source;
};

// One `key = value` line of a config file.
struct ConfigFileEntry {
  std::string value;
  int line = 0;
};

// Reads a config file (format above). INVALID_ARGUMENT naming FILE:LINE for a malformed line or a
// key given twice; NOT_FOUND / FAILED_PRECONDITION naming --config when it cannot be read.
absl::StatusOr<std::map<std::string, ConfigFileEntry>> ReadConfigFile(const std::string& path);

// The environment variable that sets `key`: TESSERA_ + upper case, '-' as '_'.
std::string ConfigEnvName(absl::string_view key);

// Applies the layers to one CLI::App. Usage:
//   CLI::App app{...};  app.add_option(...) ...;
//   tessera::LayeredConfig config("tessera-server");
//   config.AddFlags(app);                       // --config, --check-config, the footer
//   const int rc = config.Parse(app, argc, argv, [&] { return Validate(flags); });
//   if (rc >= 0) return rc;
// Not thread-safe; Reread() may be called from the one thread that handles SIGHUP.
class LayeredConfig {
 public:
  explicit LayeredConfig(std::string program);

  // Adds --config FILE and --check-config to `app`, and a footer explaining the layers.
  void AddFlags(CLI::App& app);

  // Called for a usage error on the real command line (and --help); returns the exit code.
  // Default: app.exit(e), CLI11's message and code.
  void set_usage_error_handler(std::function<int(CLI::App&, const CLI::ParseError&)> handler) {
    usage_error_handler_ = std::move(handler);
  }

  // Parses the command line, then fills every option not given on it from the environment and
  // then the config file, and runs `validate` (the daemon's own checks: listen address and TLS
  // rule, readable files, ranges; it must not bind anything). Returns -1 when the daemon should
  // run; otherwise the exit code: 0 after --help or a successful --check-config, 78 for a
  // configuration error (printed to stderr naming the key and its source, or `validate`'s
  // message), the usage handler's code for a usage error. Call once.
  int Parse(CLI::App& app, int argc, char** argv,
            const std::function<absl::Status()>& validate = nullptr);

  // The effective configuration after Parse(), in the app's option order.
  const std::vector<ConfigEntry>& entries() const { return entries_; }
  // The entry for `key`, or null.
  const ConfigEntry* Find(absl::string_view key) const;
  // --config as given (flag or TESSERA_CONFIG); empty when none.
  const std::string& config_file() const { return config_file_; }

  // SIGHUP: the value `key` would get now, re-reading the environment and the config file (a
  // command-line value still wins; without any layer, the default). Errors: the config file's
  // (the caller keeps the old value); NOT_FOUND for an unknown key.
  absl::StatusOr<ConfigEntry> Reread(absl::string_view key) const;

 private:
  std::string program_;
  std::string config_file_;
  bool check_config_ = false;
  std::function<int(CLI::App&, const CLI::ParseError&)> usage_error_handler_;
  std::vector<ConfigEntry> entries_;
  std::map<std::string, std::string> defaults_;
};

// --- Checks and SIGHUP handling the three daemons share -----------------------------------------

class Security;

// OK for trace, debug, info, warn, error, critical and off; INVALID_ARGUMENT naming --log_level.
absl::Status ValidateLogLevel(absl::string_view level);

// The metrics endpoint is plain HTTP: it may bind a non-loopback address only with --insecure.
// FAILED_PRECONDITION naming --metrics_listen otherwise; INVALID_ARGUMENT when not host:port.
absl::Status CheckMetricsListenAddress(const std::string& listen, bool insecure);

// SIGHUP: re-reads log_level (Reread: the environment and the config file; a command-line value
// stays) and applies it to the default logger, logging "<program>: log level now <level>" when it
// changed; then calls security->Reload() (when not null) and logs the outcome. Errors are logged
// and leave the old values in force. Call from the signal-waiting thread.
void ReloadDaemonConfig(const LayeredConfig& config, Security* security, absl::string_view program);

}  // namespace tessera

#endif  // TESSERA_COMMON_CONFIG_H_
