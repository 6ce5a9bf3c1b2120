// ServerOptions from flags and INDEXER_* variables: the batching flags' defaults, validation
// messages, environment variables (set, refused, unknown), the handler-thread rule, the startup
// summary and --help.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/server_options.h"

ABSL_DECLARE_FLAG(bool, batching);
ABSL_DECLARE_FLAG(int32_t, batch_max_tasks);
ABSL_DECLARE_FLAG(int64_t, batch_max_delay_us);
ABSL_DECLARE_FLAG(int64_t, batch_queue_bound);
ABSL_DECLARE_FLAG(int32_t, batch_max_inflight);
ABSL_DECLARE_FLAG(std::string, devices);
ABSL_DECLARE_FLAG(int32_t, cpu_devices);
ABSL_DECLARE_FLAG(int32_t, handler_spin_us);
ABSL_DECLARE_FLAG(int32_t, head_dim);
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(std::string, health_listen);
ABSL_DECLARE_FLAG(std::string, metrics_listen);

namespace indexer::server {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

// NAME=value strings as a null-terminated array, like environ.
class Environment {
 public:
  Environment(std::initializer_list<const char*> entries) : strings_(entries.begin(), entries.end()) {
    for (std::string& s : strings_) pointers_.push_back(s.data());
    pointers_.push_back(nullptr);
  }
  char** get() { return pointers_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> pointers_;
};

class OptionsTest : public ::testing::Test {
 protected:
  absl::FlagSaver saver_;  // every test starts from the defaults
};

TEST_F(OptionsTest, BatchingDefaults) {
  absl::StatusOr<ServerOptions> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  const engine::BatcherConfig& b = o->engine.batching;
  EXPECT_TRUE(b.enabled);
  EXPECT_EQ(b.max_tasks, 256);
  EXPECT_EQ(b.max_delay_us, 0);
  EXPECT_EQ(b.queue_bound, 8192);
  EXPECT_EQ(b.max_inflight, 2);
  EXPECT_THAT(Summary(*o), HasSubstr("batching=on batch_max_tasks=256 batch_max_delay_us=0 "
                                     "batch_queue_bound=8192 batch_max_inflight=2"));
}

TEST_F(OptionsTest, BatchingFlagsAreRead) {
  absl::SetFlag(&FLAGS_batching, false);
  absl::SetFlag(&FLAGS_batch_max_tasks, 32);
  absl::SetFlag(&FLAGS_batch_max_delay_us, 250);
  absl::SetFlag(&FLAGS_batch_queue_bound, 100);
  absl::SetFlag(&FLAGS_batch_max_inflight, 1);
  absl::StatusOr<ServerOptions> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  const engine::BatcherConfig& b = o->engine.batching;
  EXPECT_FALSE(b.enabled);
  EXPECT_EQ(b.max_tasks, 32);
  EXPECT_EQ(b.max_delay_us, 250);
  EXPECT_EQ(b.queue_bound, 100);
  EXPECT_EQ(b.max_inflight, 1);
  EXPECT_THAT(Summary(*o), HasSubstr("batching=off"));
}

TEST_F(OptionsTest, BatchingValuesOutOfRangeNameTheFlag) {
  struct Case {
    std::function<void()> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[] { absl::SetFlag(&FLAGS_batch_max_tasks, 0); }, "--batch_max_tasks is 0; it must be in [1, 1048576]"},
      {[] { absl::SetFlag(&FLAGS_batch_max_delay_us, -1); }, "--batch_max_delay_us is -1; it must be in [0, 1000000]"},
      {[] { absl::SetFlag(&FLAGS_batch_queue_bound, 0); }, "--batch_queue_bound is 0; it must be in [1, 16777216]"},
      {[] { absl::SetFlag(&FLAGS_batch_max_inflight, 17); }, "--batch_max_inflight is 17; it must be in [1, 16]"},
  };
  for (const Case& c : cases) {
    absl::FlagSaver restore;
    c.set();
    absl::StatusOr<ServerOptions> o = OptionsFromFlags();
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(o.status().message()), HasSubstr(c.message));
  }
}

TEST_F(OptionsTest, HandlerSpinDefaultRangeAndEnvironment) {
  absl::StatusOr<ServerOptions> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->handler_spin_us, 0);
  EXPECT_THAT(Summary(*o), HasSubstr("handler_spin_us=0"));
  absl::SetFlag(&FLAGS_handler_spin_us, 300);
  o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->handler_spin_us, 300);
  EXPECT_THAT(Summary(*o), HasSubstr("handler_spin_us=300"));
  for (int bad : {-1, 10001}) {
    absl::SetFlag(&FLAGS_handler_spin_us, bad);
    o = OptionsFromFlags();
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(o.status().message()),
                HasSubstr(absl::StrCat("--handler_spin_us is ", bad, "; it must be in [0, 10000]")));
  }
  Environment env({"INDEXER_HANDLER_SPIN_US=50"});
  absl::StatusOr<EnvironmentFlags> applied = ApplyEnvironment(env.get());
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_THAT(applied->flags, Contains("handler_spin_us"));
  EXPECT_EQ(absl::GetFlag(FLAGS_handler_spin_us), 50);
}

TEST_F(OptionsTest, EnvironmentVariablesNameTheBatchingFlags) {
  Environment env({"INDEXER_BATCH_MAX_TASKS=64", "INDEXER_BATCHING=false", "PATH=/usr/bin"});
  absl::StatusOr<EnvironmentFlags> applied = ApplyEnvironment(env.get());
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_batch_max_tasks), 64);
  EXPECT_FALSE(absl::GetFlag(FLAGS_batching));
  EXPECT_TRUE(applied->warnings.empty());
}

TEST_F(OptionsTest, AnEnvironmentValueThatDoesNotParseNamesTheVariable) {
  Environment env({"INDEXER_HEAD_DIM=abc"});
  absl::StatusOr<EnvironmentFlags> applied = ApplyEnvironment(env.get());
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(applied.status().message()),
              HasSubstr("INDEXER_HEAD_DIM='abc' (the variable of --head_dim)"));
}

TEST_F(OptionsTest, UnknownVariablesAreWarnedAboutWithTheNearestName) {
  Environment env({"INDEXER_CAPACTIY=4GiB", "INDEXER_NO_SUCH_THING=1", "INDEXER_SERVER=x:1",
                   "INDEXER_TOKEN=t", "INDEXER_CUDA_LANES=4", "INDEXER_CUDA_GRAPH=0"});
  absl::StatusOr<EnvironmentFlags> applied = ApplyEnvironment(env.get());
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_TRUE(applied->flags.empty());
  ASSERT_EQ(applied->warnings.size(), 3u) << "the client tools' and the CUDA backend's are known";
  EXPECT_THAT(applied->warnings[0],
              HasSubstr("INDEXER_CAPACTIY is not a setting of indexer-server and is ignored (did "
                        "you mean INDEXER_CAPACITY?)"));
  EXPECT_THAT(applied->warnings[1], HasSubstr("INDEXER_NO_SUCH_THING is not a setting"));
  EXPECT_THAT(applied->warnings[1], Not(HasSubstr("did you mean")));
  EXPECT_THAT(applied->warnings[2], HasSubstr("did you mean INDEXER_CUDA_GRAPHS?"));
}

TEST_F(OptionsTest, EnvironmentSettingsOutOfRangeAreRefused) {
  EXPECT_TRUE(CheckEnvironmentSettings(Environment({"INDEXER_CUDA_LANES=8"}).get()).ok());
  for (const char* bad : {"INDEXER_CUDA_LANES=9", "INDEXER_CUDA_LANES=two", "INDEXER_CUDA_GRAPHS=2"}) {
    const absl::Status s = CheckEnvironmentSettings(Environment({bad}).get());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), HasSubstr(std::string(bad).substr(0, std::string(bad).find('='))));
  }
}

TEST_F(OptionsTest, RefusedValuesNameTheVariableThatSetThem) {
  EnvironmentFlags env;
  env.flags = {"head_dim"};
  const std::string message = "--head_dim is 100; it must be 64, 128 or 256";
  EXPECT_EQ(NameTheVariable(message, env, {}), message + " (set by INDEXER_HEAD_DIM)");
  EXPECT_EQ(NameTheVariable(message, env, {"capacity"}), message + " (set by INDEXER_HEAD_DIM)");
  EXPECT_EQ(NameTheVariable(message, env, {"head_dim"}), message);
  EXPECT_EQ(NameTheVariable("--capacity is 0", env, {}), "--capacity is 0");
}

TEST_F(OptionsTest, ListenAddressesAreCheckedByTheirFlag) {
  absl::SetFlag(&FLAGS_listen, "localhost");
  EXPECT_THAT(std::string(OptionsFromFlags().status().message()), HasSubstr("--listen is 'localhost'"));
  absl::SetFlag(&FLAGS_listen, "unix:/run/indexer/indexer.sock");
  absl::StatusOr<ServerOptions> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->listen, "unix:/run/indexer/indexer.sock");
  absl::SetFlag(&FLAGS_health_listen, "unix:/run/indexer/indexer.sock");
  EXPECT_THAT(std::string(OptionsFromFlags().status().message()), HasSubstr("--health_listen must differ"));
  absl::SetFlag(&FLAGS_health_listen, "0.0.0.0:50052");
  o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_THAT(Summary(*o), HasSubstr("listen=unix:/run/indexer/indexer.sock health_listen=0.0.0.0:50052"));
  absl::SetFlag(&FLAGS_metrics_listen, "unix:/tmp/m.sock");
  EXPECT_THAT(std::string(OptionsFromFlags().status().message()), HasSubstr("--metrics_listen"));
}

TEST(Help, EveryFlagIsInExactlyOneSection) {
  std::map<std::string, int> seen;
  for (const FlagSection& section : FlagSections()) {
    for (const char* flag : section.flags) ++seen[flag];
  }
  int ours = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::StrContains(flag->Filename(), "server/server_options.cc")) continue;
    ++ours;
    EXPECT_EQ(seen[std::string(name)], 1) << "--" << name;
  }
  EXPECT_EQ(ours, static_cast<int>(seen.size())) << "a section names a flag that does not exist";
}

TEST(Help, PrintsTheProgramsSectionsNotBuildPaths) {
  const std::string help = HelpText();
  EXPECT_THAT(help, Not(HasSubstr("Flags from")));
  EXPECT_THAT(help, Not(HasSubstr(".cc")));
  for (const FlagSection& section : FlagSections()) {
    EXPECT_THAT(help, HasSubstr(absl::StrCat("\n", section.title, ":\n")));
    for (const char* flag : section.flags) EXPECT_THAT(help, HasSubstr(absl::StrCat("  --", flag, " (default: ")));
  }
  EXPECT_THAT(help, HasSubstr("INDEXER_CUDA_LANES (default: 2; 1 to 8)"));
  EXPECT_THAT(help, HasSubstr("INDEXER_CUDA_GRAPHS (default: 1; 0 to 1)"));
  EXPECT_THAT(help, HasSubstr("unix:/path/to/socket"));
  EXPECT_THAT(help, HasSubstr("Exit status: 0 after a graceful shutdown; 1 the server could not start"));
  for (absl::string_view line : absl::StrSplit(help, '\n')) EXPECT_LE(line.size(), 100u) << line;
}

// Handler threads serve only the calls that may wait (appends and selections hold none), so the
// default does not grow with the batch size.
TEST_F(OptionsTest, HandlerThreadsDefaultToTheHardwareThreads) {
  ServerOptions o;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.handler_threads = 7;
  EXPECT_EQ(HandlerThreads(o), 7);
  o.handler_threads = 0;
  EXPECT_EQ(HandlerThreads(o), std::max(4, hw));
  o.engine.batching.max_tasks = 1000;
  EXPECT_EQ(HandlerThreads(o), std::max(4, hw));
  o.engine.batching.enabled = false;
  EXPECT_EQ(HandlerThreads(o), std::max(4, hw));
}

TEST_F(OptionsTest, DevicesFlags) {
  absl::StatusOr<ServerOptions> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->devices.empty()) << "all by default";
  EXPECT_EQ(o->cpu_devices, 1);
  EXPECT_THAT(Summary(*o), HasSubstr("devices=all cpu_devices=1"));

  absl::SetFlag(&FLAGS_devices, "2, 0");
  absl::SetFlag(&FLAGS_cpu_devices, 3);
  o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->devices, (std::vector<int>{2, 0}));
  EXPECT_EQ(o->cpu_devices, 3);
  EXPECT_THAT(Summary(*o), HasSubstr("devices=2,0 cpu_devices=3"));

  for (const char* bad : {"0,0", "x", "-1", "0,,1", ""}) {
    absl::SetFlag(&FLAGS_devices, bad);
    o = OptionsFromFlags();
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(o.status().message()), HasSubstr("--devices")) << bad;
  }
  absl::SetFlag(&FLAGS_devices, "all");
  absl::SetFlag(&FLAGS_cpu_devices, 0);
  o = OptionsFromFlags();
  EXPECT_THAT(std::string(o.status().message()), HasSubstr("--cpu_devices is 0; it must be in [1, 64]"));
}

TEST(ParseDevices, AllAndLists) {
  EXPECT_TRUE(ParseDevices("all")->empty());
  EXPECT_TRUE(ParseDevices(" ALL ")->empty());
  EXPECT_EQ(*ParseDevices("3"), std::vector<int>{3});
  EXPECT_EQ(*ParseDevices("0,1,2,3"), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_THAT(std::string(ParseDevices("1,1").status().message()), HasSubstr("named twice"));
}

}  // namespace
}  // namespace indexer::server
