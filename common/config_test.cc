#include "common/config.h"

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// A temporary config file, removed at the end.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    char tmpl[] = "/tmp/tessera-config-test-XXXXXX";
    const int fd = mkstemp(tmpl);
    EXPECT_GE(fd, 0);
    close(fd);
    path_ = tmpl;
    Write(text);
  }
  ~TempFile() { std::remove(path_.c_str()); }
  void Write(const std::string& text) const { std::ofstream(path_, std::ios::trunc) << text; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Sets an environment variable for the scope of one test.
class ScopedEnv {
 public:
  ScopedEnv(const std::string& name, const std::string& value) : name_(name) {
    setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() { unsetenv(name_.c_str()); }

 private:
  std::string name_;
};

struct Values {
  std::string listen = "127.0.0.1:0";
  int threads = 0;
  bool insecure = false;
  std::string data_dir;
};

// A daemon-like app; returns Parse()'s code.
int ParseApp(std::vector<std::string> args, Values* values, LayeredConfig* config,
             bool require_data_dir = false) {
  CLI::App app{"test daemon", "testd"};
  app.add_option("--listen", values->listen, "address")->capture_default_str();
  app.add_option("--threads", values->threads, "threads")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app.add_flag("--insecure", values->insecure, "plaintext on any address");
  CLI::Option* data_dir = app.add_option("--data_dir", values->data_dir, "data");
  if (require_data_dir) data_dir->required();
  config->AddFlags(app);
  args.insert(args.begin(), "testd");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return config->Parse(app, static_cast<int>(argv.size()), argv.data());
}

TEST(ConfigEnvNameTest, UpperCaseWithUnderscores) {
  EXPECT_EQ(ConfigEnvName("data_dir"), "TESSERA_DATA_DIR");
  EXPECT_EQ(ConfigEnvName("auth_token_file"), "TESSERA_AUTH_TOKEN_FILE");
  EXPECT_EQ(ConfigEnvName("check-config"), "TESSERA_CHECK_CONFIG");
}

// Every pair of layers, for a string option: the higher layer wins, and the source says which.
TEST(LayeredConfigTest, PrecedenceOfEveryPair) {
  struct Case {
    const char* name;
    bool flag, env, file;
    const char* want;
    ConfigSource::Kind source;
  };
  const Case cases[] = {
      {"flag over env", true, true, false, "10.0.0.1:1", ConfigSource::kFlag},
      {"flag over file", true, false, true, "10.0.0.1:1", ConfigSource::kFlag},
      {"flag over default", true, false, false, "10.0.0.1:1", ConfigSource::kFlag},
      {"env over file", false, true, true, "10.0.0.2:2", ConfigSource::kEnv},
      {"env over default", false, true, false, "10.0.0.2:2", ConfigSource::kEnv},
      {"file over default", false, false, true, "10.0.0.3:3", ConfigSource::kFile},
      {"all three", true, true, true, "10.0.0.1:1", ConfigSource::kFlag},
      {"default", false, false, false, "127.0.0.1:0", ConfigSource::kDefault},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempFile file("# comment\n\nlisten = 10.0.0.3:3\n");
    std::vector<std::string> args;
    if (c.flag) args = {"--listen", "10.0.0.1:1"};
    if (c.file) {
      args.push_back("--config");
      args.push_back(file.path());
    }
    std::unique_ptr<ScopedEnv> env;
    if (c.env) env = std::make_unique<ScopedEnv>("TESSERA_LISTEN", "10.0.0.2:2");
    Values values;
    LayeredConfig config("testd");
    ASSERT_EQ(ParseApp(args, &values, &config), -1);
    EXPECT_EQ(values.listen, c.want);
    const ConfigEntry* entry = config.Find("listen");
    ASSERT_NE(entry, nullptr);
    EXPECT_EQ(entry->value, c.want);
    EXPECT_EQ(entry->source.kind, c.source);
    if (c.source == ConfigSource::kFile) {
      EXPECT_EQ(entry->source.ToString(), "config " + file.path() + ":3");
    }
    if (c.source == ConfigSource::kEnv) {
      EXPECT_EQ(entry->source.ToString(), "env TESSERA_LISTEN");
    }
  }
}

TEST(LayeredConfigTest, TypedValuesAndFlagsFromEveryLayer) {
  TempFile file("threads = 7   # trailing comment\ninsecure = true\n");
  {
    Values values;
    LayeredConfig config("testd");
    ASSERT_EQ(ParseApp({"--config", file.path()}, &values, &config), -1);
    EXPECT_EQ(values.threads, 7);
    EXPECT_TRUE(values.insecure);
    EXPECT_EQ(config.Find("insecure")->value, "true");
  }
  {
    // The environment turns off what the file turns on.
    ScopedEnv env("TESSERA_INSECURE", "0");
    ScopedEnv threads("TESSERA_THREADS", "3");
    Values values;
    LayeredConfig config("testd");
    ASSERT_EQ(ParseApp({"--config", file.path()}, &values, &config), -1);
    EXPECT_EQ(values.threads, 3);
    EXPECT_FALSE(values.insecure);
    EXPECT_EQ(config.Find("insecure")->source.kind, ConfigSource::kEnv);
  }
  {
    // The command line beats both.
    ScopedEnv threads("TESSERA_THREADS", "3");
    Values values;
    LayeredConfig config("testd");
    ASSERT_EQ(ParseApp({"--config", file.path(), "--threads", "1"}, &values, &config), -1);
    EXPECT_EQ(values.threads, 1);
    EXPECT_EQ(config.Find("threads")->source.kind, ConfigSource::kFlag);
    EXPECT_EQ(config.Find("insecure")->source.kind, ConfigSource::kFile);
  }
  {
    Values values;
    LayeredConfig config("testd");
    ASSERT_EQ(ParseApp({}, &values, &config), -1);
    EXPECT_EQ(config.Find("insecure")->value, "false");
    EXPECT_EQ(config.Find("threads")->value, "0");
    EXPECT_EQ(config.Find("threads")->source.ToString(), "default");
  }
}

TEST(LayeredConfigTest, ConfigFileFromEnvironment) {
  TempFile file("data_dir = \"/tmp/with # hash\"\n");
  ScopedEnv env("TESSERA_CONFIG", file.path());
  Values values;
  LayeredConfig config("testd");
  ASSERT_EQ(ParseApp({}, &values, &config, /*require_data_dir=*/true), -1);
  EXPECT_EQ(values.data_dir, "/tmp/with # hash");
  EXPECT_EQ(config.config_file(), file.path());
}

TEST(LayeredConfigTest, RequiredOptionFromAnyLayer) {
  {
    ScopedEnv env("TESSERA_DATA_DIR", "/tmp/d");
    Values values;
    LayeredConfig config("testd");
    ASSERT_EQ(ParseApp({}, &values, &config, /*require_data_dir=*/true), -1);
    EXPECT_EQ(values.data_dir, "/tmp/d");
  }
  {
    // Missing everywhere: CLI11's RequiredError code, a usage error as before.
    Values values;
    LayeredConfig config("testd");
    EXPECT_EQ(ParseApp({}, &values, &config, /*require_data_dir=*/true),
              static_cast<int>(CLI::ExitCodes::RequiredError));
  }
}

TEST(LayeredConfigTest, ConfigErrorsExit78) {
  const std::vector<std::string> bad_files = {
      "listen = 127.0.0.1:0\nlisen = typo\n",  // unknown key
      "threads\n",                             // no '='
      "threads = 5000\n",                      // out of range for the option
      "threads = many\n",                      // not a number
      "insecure = maybe\n",                    // not a boolean
      "threads = 1\nthreads = 2\n",            // twice
      "config = /etc/other.conf\n",            // not a settable key
      "data_dir = \"unterminated\n",
  };
  for (const std::string& text : bad_files) {
    SCOPED_TRACE(text);
    TempFile file(text);
    Values values;
    LayeredConfig config("testd");
    EXPECT_EQ(ParseApp({"--config", file.path()}, &values, &config), kExitConfig);
  }
  {
    ScopedEnv env("TESSERA_THREADS", "-4");
    Values values;
    LayeredConfig config("testd");
    EXPECT_EQ(ParseApp({}, &values, &config), kExitConfig);
  }
  {
    Values values;
    LayeredConfig config("testd");
    EXPECT_EQ(ParseApp({"--config", "/nonexistent/tessera.conf"}, &values, &config), kExitConfig);
  }
  {
    // A bad value on the real command line stays a usage error.
    Values values;
    LayeredConfig config("testd");
    const int code = ParseApp({"--threads", "5000"}, &values, &config);
    EXPECT_NE(code, kExitConfig);
    EXPECT_NE(code, -1);
    EXPECT_NE(code, 0);
  }
}

TEST(LayeredConfigTest, ValidationErrorExits78AndCheckConfigExits0) {
  auto run = [](std::vector<std::string> args, absl::Status verdict) {
    Values values;
    LayeredConfig config("testd");
    CLI::App app{"test daemon", "testd"};
    app.add_option("--listen", values.listen, "address")->capture_default_str();
    config.AddFlags(app);
    args.insert(args.begin(), "testd");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return config.Parse(app, static_cast<int>(argv.size()), argv.data(), [&] { return verdict; });
  };
  EXPECT_EQ(run({}, absl::OkStatus()), -1);
  EXPECT_EQ(run({"--check-config"}, absl::OkStatus()), 0);
  EXPECT_EQ(run({}, absl::FailedPreconditionError("--listen: no")), kExitConfig);
  EXPECT_EQ(run({"--check-config"}, absl::FailedPreconditionError("--listen: no")), kExitConfig);
}

TEST(LayeredConfigTest, RereadSeesTheChangedFileAndEnvironment) {
  TempFile file("listen = 10.0.0.3:3\n");
  Values values;
  LayeredConfig config("testd");
  ASSERT_EQ(ParseApp({"--config", file.path(), "--threads", "2"}, &values, &config), -1);
  file.Write("# moved\nlisten = 10.0.0.4:4\n");
  absl::StatusOr<ConfigEntry> entry = config.Reread("listen");
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(entry->value, "10.0.0.4:4");
  EXPECT_EQ(entry->source.line, 2);
  {
    ScopedEnv env("TESSERA_LISTEN", "10.0.0.5:5");
    entry = config.Reread("listen");
    ASSERT_TRUE(entry.ok());
    EXPECT_EQ(entry->value, "10.0.0.5:5");
  }
  file.Write("");
  entry = config.Reread("listen");
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ(entry->value, "127.0.0.1:0");
  EXPECT_EQ(entry->source.kind, ConfigSource::kDefault);
  // A command-line value stays.
  file.Write("threads = 9\n");
  entry = config.Reread("threads");
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ(entry->value, "2");
  file.Write("threads\n");
  EXPECT_FALSE(config.Reread("listen").ok());
  EXPECT_EQ(config.Reread("nope").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tessera
