#include "common/config.h"

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/security.h"
#include "spdlog/spdlog.h"

namespace tessera {
namespace {

constexpr char kConfigKey[] = "config";
constexpr char kCheckConfigKey[] = "check-config";

bool ValidKey(absl::string_view key) {
  if (key.empty()) return false;
  for (char c : key) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

// The key of an option: its first long name; empty for options the layers leave alone (help,
// positionals, --config, --check-config).
std::string KeyOf(const CLI::App& app, const CLI::Option* opt) {
  if (opt == app.get_help_ptr() || opt == app.get_help_all_ptr()) return "";
  if (opt->get_lnames().empty()) return "";
  const std::string& key = opt->get_lnames().front();
  if (key == kConfigKey || key == kCheckConfigKey) return "";
  return key;
}

// A flag takes no value on the command line (--insecure).
bool IsFlag(const CLI::Option* opt) { return opt->get_expected_max() == 0; }

// Normalises a flag's value from the environment or a file to "true"/"false".
absl::StatusOr<std::string> FlagValue(const std::string& value) {
  const std::string v = absl::AsciiStrToLower(value);
  if (v == "true" || v == "1" || v == "yes" || v == "on") return std::string("true");
  if (v == "false" || v == "0" || v == "no" || v == "off") return std::string("false");
  return absl::InvalidArgumentError(
      absl::StrCat("want true, false, 1, 0, yes, no, on or off, got '", value, "'"));
}

std::string LevelName(spdlog::level::level_enum level) {
  const auto& name = spdlog::level::to_string_view(level);
  return std::string(name.data(), name.size());
}

std::string ResultsOf(const CLI::Option* opt) { return absl::StrJoin(opt->results(), ","); }

}  // namespace

std::string ConfigSource::ToString() const {
  switch (kind) {
    case kFlag:
      return "flag";
    case kEnv:
      return absl::StrCat("env ", env_name);
    case kFile:
      return absl::StrCat("config ", file, ":", line);
    case kDefault:
      break;
  }
  return "default";
}

std::string ConfigEnvName(absl::string_view key) {
  std::string name = absl::StrCat("TESSERA_", absl::AsciiStrToUpper(key));
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

absl::StatusOr<std::map<std::string, ConfigFileEntry>> ReadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat("--config: cannot read ", path, ": ", std::strerror(errno)));
  }
  std::map<std::string, ConfigFileEntry> entries;
  std::string raw;
  int line_number = 0;
  while (std::getline(in, raw)) {
    ++line_number;
    const std::string where = absl::StrCat(path, ":", line_number);
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line.front() == '#') continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": want `key = value`, got '", line, "'"));
    }
    const std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
    if (!ValidKey(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": bad key '", key, "' (want a flag name without the dashes)"));
    }
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(eq + 1));
    std::string parsed;
    if (!value.empty() && value.front() == '"') {
      const size_t close = value.find('"', 1);
      if (close == absl::string_view::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", key, ": unterminated quoted value"));
      }
      parsed = std::string(value.substr(1, close - 1));
      absl::string_view rest = absl::StripAsciiWhitespace(value.substr(close + 1));
      if (!rest.empty() && rest.front() != '#') {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", key, ": unexpected text after the quoted value: '", rest, "'"));
      }
    } else {
      // A comment starts at a '#' that follows whitespace.
      for (size_t i = 1; i < value.size(); ++i) {
        if (value[i] == '#' && (value[i - 1] == ' ' || value[i - 1] == '\t')) {
          value = absl::StripAsciiWhitespace(value.substr(0, i));
          break;
        }
      }
      parsed = std::string(value);
    }
    auto [it, inserted] = entries.emplace(key, ConfigFileEntry{parsed, line_number});
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", key, ": given twice (also on line ", it->second.line, ")"));
    }
  }
  return entries;
}

LayeredConfig::LayeredConfig(std::string program) : program_(std::move(program)) {}

void LayeredConfig::AddFlags(CLI::App& app) {
  app.add_option("--config", config_file_,
                 "configuration file of `key = value` lines (a key is a flag name without the "
                 "dashes); default $TESSERA_CONFIG");
  app.add_flag("--check-config", check_config_,
               "print the effective configuration with the source of each value and exit 0, or "
               "the error and exit 78");
  std::string footer = app.get_footer();
  if (!footer.empty()) footer += "\n\n";
  footer +=
      "Configuration: every option takes its value from the command line, else the environment\n"
      "variable TESSERA_<NAME> (the flag name in upper case: --data_dir is TESSERA_DATA_DIR),\n"
      "else the --config file (`data_dir = /var/lib/tessera`, `insecure = true`, # comments),\n"
      "else its default. Unknown keys and bad values exit 78 naming the key and its source.\n"
      "--check-config prints `key = value  # source` for every option and runs the checks\n"
      "without binding anything.\n";
  app.footer(footer);
}

const ConfigEntry* LayeredConfig::Find(absl::string_view key) const {
  for (const ConfigEntry& entry : entries_) {
    if (entry.key == key) return &entry;
  }
  return nullptr;
}

int LayeredConfig::Parse(CLI::App& app, int argc, char** argv,
                         const std::function<absl::Status()>& validate) {
  auto config_error = [this](const std::string& message) {
    std::fprintf(stderr, "%s: %s\n", program_.c_str(), message.c_str());
    return kExitConfig;
  };
  auto usage_error = [this, &app](const CLI::ParseError& e) {
    return usage_error_handler_ ? usage_error_handler_(app, e) : app.exit(e);
  };

  // Required options may be satisfied by a later layer: check them after all layers.
  std::vector<CLI::Option*> layered;
  std::vector<CLI::Option*> required;
  for (CLI::Option* opt : app.get_options()) {
    const std::string key = KeyOf(app, opt);
    if (key.empty()) continue;
    layered.push_back(opt);
    opt->capture_default_str();
    std::string def = opt->get_default_str();
    if (def.empty() && IsFlag(opt)) def = "false";
    defaults_[key] = def;
    if (opt->get_required()) {
      required.push_back(opt);
      opt->required(false);
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return usage_error(e);
  }

  std::map<std::string, ConfigSource> sources;
  for (CLI::Option* opt : layered) {
    if (opt->count() > 0) sources[KeyOf(app, opt)].kind = ConfigSource::kFlag;
  }

  if (config_file_.empty()) {
    const char* env = std::getenv("TESSERA_CONFIG");
    if (env != nullptr) config_file_ = env;
  }
  std::map<std::string, ConfigFileEntry> file;
  if (!config_file_.empty()) {
    absl::StatusOr<std::map<std::string, ConfigFileEntry>> read = ReadConfigFile(config_file_);
    if (!read.ok()) return config_error(std::string(read.status().message()));
    file = std::move(*read);
    for (const auto& [key, entry] : file) {
      if (defaults_.count(key) == 0) {
        return config_error(absl::StrCat(config_file_, ":", entry.line, ": unknown key '", key,
                                         "' (see --help for the options)"));
      }
    }
  }

  for (CLI::Option* opt : layered) {
    const std::string key = KeyOf(app, opt);
    if (opt->count() > 0) continue;
    ConfigSource source;
    std::string value;
    const std::string env_name = ConfigEnvName(key);
    const char* env = std::getenv(env_name.c_str());
    if (env != nullptr && *env != '\0') {
      source.kind = ConfigSource::kEnv;
      source.env_name = env_name;
      value = env;
    } else if (auto it = file.find(key); it != file.end()) {
      source.kind = ConfigSource::kFile;
      source.file = config_file_;
      source.line = it->second.line;
      value = it->second.value;
    } else {
      continue;
    }
    const std::string where =
        source.kind == ConfigSource::kEnv
            ? absl::StrCat("env ", env_name, "=", value)
            : absl::StrCat(source.file, ":", source.line, ": ", key, " = ", value);
    if (IsFlag(opt)) {
      absl::StatusOr<std::string> flag = FlagValue(value);
      if (!flag.ok()) {
        return config_error(absl::StrCat(where, ": --", key, ": ", flag.status().message()));
      }
      value = *flag;
    }
    try {
      opt->clear();
      opt->add_result(value);
      opt->run_callback();
    } catch (const CLI::Error& e) {
      return config_error(absl::StrCat(where, ": ", e.what()));
    }
    sources[key] = source;
  }

  for (CLI::Option* opt : required) {
    opt->required(true);
    if (opt->count() == 0) {
      return usage_error(
          CLI::RequiredError(absl::StrCat(opt->get_name(), " (or ", ConfigEnvName(KeyOf(app, opt)),
                                          ", or ", KeyOf(app, opt), " in --config)")));
    }
  }

  entries_.clear();
  for (CLI::Option* opt : layered) {
    ConfigEntry entry;
    entry.key = KeyOf(app, opt);
    entry.source = sources[entry.key];
    entry.value =
        entry.source.kind == ConfigSource::kDefault ? defaults_[entry.key] : ResultsOf(opt);
    if (IsFlag(opt) && entry.source.kind == ConfigSource::kFlag) {
      // The command line stores a bare flag as "true" or its count; show what it means.
      entry.value = entry.value.empty() ? "true" : entry.value;
    }
    entries_.push_back(std::move(entry));
  }

  absl::Status valid = validate ? validate() : absl::OkStatus();
  if (check_config_) {
    if (!config_file_.empty()) std::printf("# --config %s\n", config_file_.c_str());
    for (const ConfigEntry& entry : entries_) {
      std::printf("%s = %s  # %s\n", entry.key.c_str(), entry.value.c_str(),
                  entry.source.ToString().c_str());
    }
    std::fflush(stdout);
  }
  if (!valid.ok()) return config_error(std::string(valid.message()));
  return check_config_ ? 0 : -1;
}

absl::StatusOr<ConfigEntry> LayeredConfig::Reread(absl::string_view key) const {
  const ConfigEntry* current = Find(key);
  if (current == nullptr) {
    return absl::NotFoundError(absl::StrCat("no option '", key, "'"));
  }
  if (current->source.kind == ConfigSource::kFlag) return *current;
  ConfigEntry entry;
  entry.key = current->key;
  const std::string env_name = ConfigEnvName(key);
  const char* env = std::getenv(env_name.c_str());
  if (env != nullptr && *env != '\0') {
    entry.value = env;
    entry.source.kind = ConfigSource::kEnv;
    entry.source.env_name = env_name;
    return entry;
  }
  if (!config_file_.empty()) {
    absl::StatusOr<std::map<std::string, ConfigFileEntry>> file = ReadConfigFile(config_file_);
    if (!file.ok()) return file.status();
    if (auto it = file->find(entry.key); it != file->end()) {
      entry.value = it->second.value;
      entry.source.kind = ConfigSource::kFile;
      entry.source.file = config_file_;
      entry.source.line = it->second.line;
      return entry;
    }
  }
  auto def = defaults_.find(entry.key);
  entry.value = def == defaults_.end() ? "" : def->second;
  return entry;
}

absl::Status ValidateLogLevel(absl::string_view level) {
  const spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level: unknown level '", level,
                     "' (want trace, debug, info, warn, error, critical or off)"));
  }
  return absl::OkStatus();
}

absl::Status CheckMetricsListenAddress(const std::string& listen, bool insecure) {
  // A Security without TLS applies the plaintext rule.
  SecurityOptions plaintext;
  plaintext.insecure = insecure;
  absl::StatusOr<std::unique_ptr<Security>> security = Security::Create(plaintext);
  if (!security.ok()) return security.status();
  absl::Status status = (*security)->CheckListenAddress("--metrics_listen", listen);
  if (status.code() == absl::StatusCode::kFailedPrecondition) {
    return absl::FailedPreconditionError(
        absl::StrCat("--metrics_listen ", listen,
                     " is not a loopback address and the metrics endpoint is plain HTTP: "
                     "give --metrics_insecure to serve it there, or listen on 127.0.0.1"));
  }
  return status;
}

void ReloadDaemonConfig(const LayeredConfig& config, Security* security,
                        absl::string_view program_name) {
  const std::string program(program_name);
  spdlog::info("{}: SIGHUP: reloading log_level and the security files", program);
  absl::StatusOr<ConfigEntry> level = config.Reread("log_level");
  if (!level.ok()) {
    spdlog::warn("{}: SIGHUP: keeping the log level: {}", program, level.status().ToString());
  } else if (absl::Status valid = ValidateLogLevel(level->value); !valid.ok()) {
    spdlog::warn("{}: SIGHUP: keeping the log level: {} ({})", program,
                 std::string(valid.message()), level->source.ToString());
  } else {
    const spdlog::level::level_enum want = spdlog::level::from_str(level->value);
    const spdlog::level::level_enum had = spdlog::default_logger()->level();
    if (want == had) {
      spdlog::info("{}: log level unchanged ({})", program, level->value);
    } else {
      // Said at the more verbose of the two levels, so that it shows either way.
      const std::string message = absl::StrCat(program, ": log level now ", level->value, " (was ",
                                               LevelName(had), "; ", level->source.ToString(), ")");
      if (want > had) spdlog::log(had, "{}", message);
      spdlog::default_logger()->set_level(want);
      if (want < had) spdlog::log(want, "{}", message);
      spdlog::debug("{}: debug logging is on", program);
    }
  }
  if (security != nullptr) {
    absl::Status reloaded = security->Reload();
    if (reloaded.ok()) {
      spdlog::info("{}: SIGHUP: token and certificate files re-read", program);
    } else {
      spdlog::warn("{}: SIGHUP: keeping the old token and certificates: {}", program,
                   reloaded.ToString());
    }
  }
}

}  // namespace tessera
