// The real binaries: indexer-server's flag and environment checking, --help, its start-up
// errors and SIGTERM drain, a Unix-socket listener, and indexer-cli against a running server
// (over TCP and over a Unix socket). Paths come from INDEXER_SERVER_BINARY / INDEXER_CLI_BINARY,
// which tests/server/CMakeLists.txt sets.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <regex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cpp/indexer_client.h"
#include "tests/testing/child_process.h"

namespace indexer::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string BinaryPath(const char* variable) {
  const char* path = std::getenv(variable);
  return path == nullptr ? "" : path;
}

using ::indexer::testing::Child;
using ::indexer::testing::RunResult;
using ::indexer::testing::RunToEnd;
using ::indexer::testing::StartServerBinary;
using ::indexer::testing::WaitForServingPort;

class BinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = BinaryPath("INDEXER_SERVER_BINARY");
    cli_ = BinaryPath("INDEXER_CLI_BINARY");
    if (server_.empty()) GTEST_SKIP() << "INDEXER_SERVER_BINARY is not set (run through ctest)";
  }

  std::string server_, cli_;
};

TEST_F(BinaryTest, BadFlagValuesExitWithStatus2NamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"--capacity=bad", "capacity"},         {"--head_dim=100", "head_dim"},
      {"--device=tpu", "device"},             {"--key_dtype=int4", "key_dtype"},
      {"--drain_seconds=-1", "drain_seconds"}, {"--max_message_bytes=10", "max_message_bytes"},
      {"--topk=999", "topk"},                 {"--log_level=loud", "log_level"},
      {"--listen=garbage", "listen"},
  };
  for (const auto& [flag, name] : cases) {
    const RunResult r = RunToEnd({server_, "--listen=127.0.0.1:0", flag});
    EXPECT_EQ(r.code, 2) << flag << ":\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(name)) << flag;
  }
}

// What a start-up failure must not print: gRPC's own error dump before the clean message.
void ExpectNoGrpcDump(const std::string& output) {
  for (const char* dump : {"created\":", "created_time", "No address added", "Failed to add",
                           "server_builder.cc", "chttp2_server.cc", "tcp_server"}) {
    EXPECT_THAT(output, Not(HasSubstr(dump))) << output;
  }
}

TEST_F(BinaryTest, AnAddressInUseGivesOneCleanMessage) {
  int port = 0;
  std::unique_ptr<Child> first = StartServerBinary({"--capacity=64", "--metrics_listen=127.0.0.1:0"}, &port);
  ASSERT_NE(first, nullptr);
  const std::string taken = absl::StrCat("127.0.0.1:", port);
  RunResult r = RunToEnd({server_, "--device=cpu", "--capacity=64", "--listen=" + taken});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("--listen: cannot listen on ", taken,
                                               ": address in use (is another server running?)")));
  ExpectNoGrpcDump(r.output);
  r = RunToEnd({server_, "--device=cpu", "--capacity=64", "--listen=127.0.0.1:0",
                "--health_listen=" + taken});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--health_listen: cannot listen on"));
  ExpectNoGrpcDump(r.output);
  r = RunToEnd({server_, "--device=cpu", "--capacity=64", "--listen=127.0.0.1:0",
                "--metrics_listen=" + taken});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--metrics_listen: cannot listen on"));
  kill(first->pid(), SIGTERM);
  EXPECT_EQ(first->Wait(absl::Seconds(20)), std::optional<int>(0));
}

// MemTotal of /proc/meminfo in GiB, rounded up; 0 when unknown.
int64_t HostMemoryGib() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemTotal:") return (kib + (1 << 20) - 1) >> 20;
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

TEST_F(BinaryTest, ACpuPoolLargerThanTheHostsMemoryExitsWithStatus1NamingCapacity) {
  const int64_t host_gib = HostMemoryGib();
  if (host_gib == 0) GTEST_SKIP() << "no MemTotal in /proc/meminfo";
  const std::string capacity = absl::StrCat("--capacity=", 4 * host_gib, "GiB");
  const RunResult r =
      RunToEnd({server_, "--device=cpu", "--listen=127.0.0.1:0", capacity});
  EXPECT_EQ(r.code, 1) << capacity << ":\n" << r.output;
  EXPECT_THAT(r.output, HasSubstr("--capacity")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("available")) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("bad_alloc"))) << r.output;
}

TEST_F(BinaryTest, HelpPrintsTheProgramsOwnSections) {
  for (const char* flag : {"--help", "--helpfull", "-h"}) {
    const RunResult r = RunToEnd({server_, flag});
    EXPECT_EQ(r.code, 0) << flag;
    EXPECT_THAT(r.output, HasSubstr("Usage: indexer-server [flags]")) << flag;
    EXPECT_THAT(r.output, HasSubstr("\nListening:\n  --listen (default: 0.0.0.0:50051)")) << flag;
    EXPECT_THAT(r.output, HasSubstr("INDEXER_CUDA_LANES")) << flag;
    EXPECT_THAT(r.output, HasSubstr("INDEXER_CUDA_GRAPHS")) << flag;
    EXPECT_THAT(r.output, Not(HasSubstr("Flags from"))) << flag;
    EXPECT_THAT(r.output, Not(HasSubstr("/server/"))) << "a build path in:\n" << r.output;
  }
  const RunResult version = RunToEnd({server_, "--version"});
  EXPECT_EQ(version.code, 0);
  EXPECT_THAT(version.output, HasSubstr("indexer-server "));
}

TEST_F(BinaryTest, EnvironmentVariablesAreCheckedAndNamed) {
  // A value that does not parse: like the same value on the command line (exit 2), named.
  RunResult r = RunToEnd({server_, "--device=cpu"}, {"INDEXER_HEAD_DIM=abc"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("INDEXER_HEAD_DIM='abc' (the variable of --head_dim)"));
  // A value out of range (exit 2), named by its variable.
  r = RunToEnd({server_, "--device=cpu"}, {"INDEXER_HEAD_DIM=100"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--head_dim is 100; it must be 64, 128 or 256 (set by INDEXER_HEAD_DIM)"));
  r = RunToEnd({server_, "--device=cpu"}, {"INDEXER_CUDA_LANES=9"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("INDEXER_CUDA_LANES is '9'; it must be an integer in [1, 8]"));
  // A misspelt variable: a warning at start, and the server runs.
  int port = 0;
  std::vector<std::string> argv = {server_, "--listen=127.0.0.1:0", "--device=cpu"};
  Child child(argv, {"INDEXER_CAPACTIY=64", "INDEXER_CAPACITY=64"});
  ASSERT_TRUE(WaitForServingPort(child, absl::Seconds(20)).has_value()) << child.Log();
  EXPECT_THAT(child.Log(), HasSubstr("INDEXER_CAPACTIY is not a setting of indexer-server and is "
                                     "ignored (did you mean INDEXER_CAPACITY?)"));
  EXPECT_THAT(child.Log(), HasSubstr("capacity=64 pages"));
  (void)port;
  kill(child.pid(), SIGTERM);
  EXPECT_EQ(child.Wait(absl::Seconds(20)), std::optional<int>(0));
}

TEST_F(BinaryTest, ServesOnAUnixSocketAndTheCliReachesIt) {
  char templ[] = "/tmp/indexer-sock-XXXXXX";
  const std::string dir = mkdtemp(templ);
  const std::string socket = dir + "/indexer.sock";
  Child server({server_, "--listen=unix:" + socket, "--device=cpu", "--capacity=64",
                "--head_dim=64"});
  const std::regex serving("serving on (\\S+):");
  std::smatch m;
  std::string log;
  for (int i = 0; i < 2000 && !std::regex_search(log, m, serving); ++i) {
    ASSERT_FALSE(server.Wait(absl::ZeroDuration()).has_value()) << server.Log();
    absl::SleepFor(absl::Milliseconds(10));
    log = server.Log();
  }
  ASSERT_TRUE(std::regex_search(log, m, serving)) << log;
  EXPECT_EQ(m[1], "unix:" + socket) << "the start-up line names the socket, not 'port 1'";
  EXPECT_THAT(log, Not(HasSubstr("port 1:")));
  if (!cli_.empty()) {
    const RunResult health = RunToEnd({cli_, "--server=unix:" + socket, "health"});
    EXPECT_EQ(health.code, 0) << health.output;
    EXPECT_THAT(health.output, HasSubstr("SERVING"));
    const RunResult info = RunToEnd({cli_, "info"}, {"INDEXER_SERVER=unix://" + socket});
    EXPECT_EQ(info.code, 0) << info.output;
    EXPECT_THAT(info.output, HasSubstr("head_dim              64"));
    const RunResult demo = RunToEnd({cli_, "--server=unix:" + socket, "demo", "--sequences=2",
                                     "--tokens=300", "--steps=2", "--chunk=128"});
    EXPECT_EQ(demo.code, 0) << demo.output;
  }
  kill(server.pid(), SIGTERM);
  EXPECT_EQ(server.Wait(absl::Seconds(20)), std::optional<int>(0)) << server.Log();
  EXPECT_NE(access(socket.c_str(), F_OK), 0) << "the socket file is removed at exit";
  rmdir(dir.c_str());
}

// The other usage errors exit 2 too (README and --help: 2 = a usage error, 1 = could not
// start), naming what was wrong: a flag that does not exist, a value absl's parser refuses, a
// missing value, a stray argument.
TEST_F(BinaryTest, UnparsableFlagsAndArgumentsExitWithStatus2) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--head_dim=abc"}, "--head_dim"},
      {{"--no_such_flag=1"}, "unknown flag --no_such_flag"},
      {{"--devices=abc"}, "--devices"},
      {{"--capacity"}, "--capacity needs a value"},
      {{"serve"}, "unexpected argument 'serve'"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {server_, "--device=cpu"};
    argv.insert(argv.end(), args.begin(), args.end());
    const RunResult r = RunToEnd(argv);
    EXPECT_EQ(r.code, 2) << args[0] << " exited with " << r.code << ":\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(message)) << args[0];
    EXPECT_THAT(r.output, HasSubstr("Run 'indexer-server --help' for usage.")) << args[0];
  }
}

TEST_F(BinaryTest, SigtermDrainsInFlightCallsAndExitsZero) {
  int port = 0;
  std::unique_ptr<Child> server =
      StartServerBinary({"--capacity=512", "--drain_seconds=20", "--cpu_threads=1", "--handler_threads=4"}, &port);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<IndexerClient>> client =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(client.ok());
  IndexerClient& c = **client;
  ASSERT_TRUE(c.WaitUntilServing(absl::Seconds(10)).ok());
  absl::StatusOr<v1::ServerInfoResponse> info = c.ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const int d = static_cast<int>(info->head_dim());

  // A long sequence, then size the slow calls from a measured one: ~1.5 s each.
  constexpr int kTokens = 16384;
  std::vector<float> keys(static_cast<size_t>(kTokens) * d);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<float>(static_cast<int>(i * 7919 % 17) - 8);
  ASSERT_TRUE(c.AppendKeys(MakeAppend("s", 0, keys)).ok());
  const auto select = [&](int tokens, int64_t start) {
    std::vector<float> q(static_cast<size_t>(tokens) * 4 * d);
    for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(static_cast<int>(i * 31 % 9) - 4);
    v1::SelectBlocksRequest req = MakeSelect("s", 0, 4, q);
    req.set_start_position(start);
    return c.Select(req, CallOptions::Timeout(absl::Seconds(60)));
  };
  absl::Time t0 = absl::Now();
  ASSERT_TRUE(select(32, kTokens - 32).ok());
  const double per_token_s = absl::ToDoubleSeconds(absl::Now() - t0) / 32;
  const int tokens = std::clamp(static_cast<int>(1.5 / per_token_s), 32, 8192);

  constexpr int kCalls = 3;
  std::vector<absl::StatusOr<Selection>> results(kCalls, absl::UnknownError("not run"));
  std::vector<absl::Time> finished(kCalls);
  std::vector<std::thread> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.emplace_back([&, i] {
      results[i] = select(tokens, kTokens - tokens - i);
      finished[i] = absl::Now();
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time sigterm = absl::Now();
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  // Health turns NOT_SERVING first (for --not_serving_seconds, default 1 s), so that probes stop
  // sending work before the listener closes.
  bool not_serving = false;
  for (int i = 0; i < 100 && !not_serving; ++i) {
    absl::StatusOr<HealthStatus> h = c.Health("", CallOptions::Timeout(absl::Milliseconds(500)));
    not_serving = h.ok() && *h == HealthStatus::kNotServing;
    if (!not_serving) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(not_serving) << "health never answered NOT_SERVING after SIGTERM";
  for (auto& t : calls) t.join();

  int drained = 0;
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(results[i].ok()) << "in-flight call " << i << " was not drained: " << results[i].status();
    EXPECT_EQ(results[i]->num_tokens, tokens);
    EXPECT_EQ(results[i]->start_position, kTokens - tokens - i);
    drained += finished[i] > sigterm ? 1 : 0;
  }
  EXPECT_GT(drained, 0) << "every call finished before SIGTERM (" << tokens
                        << " query tokens each): nothing was drained";
  const std::optional<int> code = server->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << "indexer-server did not exit within its 20 s drain";
  EXPECT_EQ(*code, 0) << server->Log();
  const std::string log = server->Log();
  EXPECT_THAT(log, HasSubstr("received SIGTERM, draining in-flight calls"));
  EXPECT_THAT(log, HasSubstr("stopped;"));
  // Gone: calls now fail fast.
  EXPECT_EQ(c.ServerInfo(CallOptions::Timeout(absl::Seconds(2))).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(BinaryTest, CliTalksToTheServer) {
  if (cli_.empty()) GTEST_SKIP() << "INDEXER_CLI_BINARY is not set";
  int port = 0;
  std::unique_ptr<Child> server = StartServerBinary({"--capacity=256", "--head_dim=64"}, &port);
  ASSERT_NE(server, nullptr);
  const std::string env = absl::StrCat("INDEXER_SERVER=127.0.0.1:", port);
  struct Case {
    std::vector<std::string> args;
    int code;
    std::string output;
  };
  const Case cases[] = {
      {{"health"}, 0, "SERVING"},
      {{"info"}, 0, "head_dim              64"},
      {{"append", "--sequence=c1", "--tokens=300", "--attention_pages=auto"}, 0, "created"},
      {{"append", "--sequence", "c1", "--tokens", "10", "--dtype=fp32"}, 0, "lengths [310]"},
      {{"select", "--sequence=c1", "--heads=2", "--tokens=2", "--topk=4"}, 0, "page table"},
      {{"select", "--sequence=c1", "--start_position=0", "--init_blocks=1", "--local_blocks=0"}, 0,
       "position 0"},
      {{"get", "--sequence=c1"}, 0, "attention pages [0 1 2]"},
      {{"fork", "--sequence=c1", "--target=c2", "--length=200"}, 0, "2 shared"},
      {{"fork", "--sequence=c1", "--target=c2"}, 1, "ALREADY_EXISTS"},
      {{"truncate", "--sequence=c2", "--length=100"}, 0, "lengths [100]"},
      {{"release", "--sequence=c2"}, 0, "released"},
      {{"release", "--sequence=c2"}, 1, "NOT_FOUND"},
      {{"select", "--sequence=c1", "--heads=99"}, 1, "INVALID_ARGUMENT"},
      {{"demo", "--sequences=2", "--tokens=600", "--steps=4", "--chunk=256"}, 0, "check: 32"},
      {{"bogus"}, 2, "unknown command"},
      {{"select"}, 2, "--sequence is required"},
      {{"--topk=x", "info"}, 2, "--topk"},
      {{"--no_such_flag", "info"}, 2, "unknown flag"},
      {{"truncate", "--sequence=c1"}, 2, "--length"},
      {{}, 2, "no command"},
      {{"--help"}, 0, "demo"},
      {{"--help"}, 0, "unix:/path/to/socket"},
      {{"--help"}, 0, "Exit status: 0 ok"},
      {{"--version"}, 0, "indexer-cli "},
      {{"--timeout"}, 2, "--timeout needs a value"},
      {{"--server=127.0.0.1:1", "info"}, 1, "UNAVAILABLE"},
      {{"--server=unix:/nonexistent/indexer.sock", "info"}, 1, "UNAVAILABLE"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {cli_};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const RunResult r = RunToEnd(argv, {env});
    const std::string what = absl::StrCat("indexer-cli ", absl::StrJoin(c.args, " "));
    EXPECT_EQ(r.code, c.code) << what << ":\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.output)) << what;
  }
  // The demo cleaned up after itself; only c1 is left.
  absl::StatusOr<std::unique_ptr<IndexerClient>> client =
      IndexerClient::Connect(absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(client.ok());
  absl::StatusOr<v1::ServerInfoResponse> info = (*client)->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->live_sequences(), 1u);
  kill(server->pid(), SIGTERM);
  EXPECT_EQ(server->Wait(absl::Seconds(20)), std::optional<int>(0));
}

}  // namespace
}  // namespace indexer::client
