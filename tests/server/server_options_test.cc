// ServerOptions from flags and INDEXER_* variables: the batching flags' defaults, validation
// messages, environment names, the handler-thread rule and the startup summary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "server/server_options.h"

ABSL_DECLARE_FLAG(bool, batching);
ABSL_DECLARE_FLAG(int32_t, batch_max_tasks);
ABSL_DECLARE_FLAG(int64_t, batch_max_delay_us);
ABSL_DECLARE_FLAG(int64_t, batch_queue_bound);
ABSL_DECLARE_FLAG(int32_t, batch_max_inflight);
ABSL_DECLARE_FLAG(std::string, devices);
ABSL_DECLARE_FLAG(int32_t, cpu_devices);
ABSL_DECLARE_FLAG(int32_t, handler_spin_us);

namespace indexer::server {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

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
  setenv("INDEXER_HANDLER_SPIN_US", "50", 1);
  char arg0[] = "indexer-server";
  char* argv[] = {arg0};
  const std::vector<std::string> args = ArgsWithEnvironment(1, argv);
  unsetenv("INDEXER_HANDLER_SPIN_US");
  EXPECT_THAT(args, Contains("--handler_spin_us=50"));
}

TEST_F(OptionsTest, EnvironmentVariablesNameTheBatchingFlags) {
  setenv("INDEXER_BATCH_MAX_TASKS", "64", 1);
  setenv("INDEXER_BATCHING", "false", 1);
  char arg0[] = "indexer-server";
  char* argv[] = {arg0};
  const std::vector<std::string> args = ArgsWithEnvironment(1, argv);
  unsetenv("INDEXER_BATCH_MAX_TASKS");
  unsetenv("INDEXER_BATCHING");
  EXPECT_THAT(args, Contains("--batch_max_tasks=64"));
  EXPECT_THAT(args, Contains("--batching=false"));
}

TEST_F(OptionsTest, HandlerThreadsLeaveRoomForAFullBatch) {
  ServerOptions o;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.handler_threads = 7;
  EXPECT_EQ(HandlerThreads(o), 7);
  o.handler_threads = 0;
  EXPECT_EQ(HandlerThreads(o), std::max({64, 4 * hw, 256}));
  o.engine.batching.max_tasks = 1000;
  EXPECT_EQ(HandlerThreads(o), std::max(1000, 4 * hw));
  o.engine.batching.max_tasks = 1 << 20;
  EXPECT_EQ(HandlerThreads(o), 4096);
  o.engine.batching.enabled = false;
  EXPECT_EQ(HandlerThreads(o), std::max(4, 2 * hw));
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
