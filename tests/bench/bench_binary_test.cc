// The indexer-bench binary end to end, against two in-process CPU servers: --help documents every
// flag; closed loop, open loop, a sweep and count limits run with every answer checked against the
// CPU reference (integer values: exact) and write reports whose figures add up; usage errors exit
// 2 and unreachable servers 1. INDEXER_BENCH_BINARY and INDEXER_BENCH_SOURCE come from
// tests/bench/CMakeLists.txt.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/indexer_server.h"
#include "server/server_options.h"
#include "tests/testing/child_process.h"
#include "tests/testing/server_config.h"

extern char** environ;

namespace indexer::bench {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;
using ::testing::HasSubstr;

using indexer::testing::ReadFile;

struct BenchRun {
  int code = -1;
  std::string out;
  std::string err;
};

// Runs indexer-bench with `args`; stdout and stderr are kept apart.
BenchRun RunBench(const std::vector<std::string>& args,
                  absl::Duration timeout = absl::Seconds(60)) {
  const char* binary = std::getenv("INDEXER_BENCH_BINARY");
  BenchRun r;
  if (binary == nullptr) {
    ADD_FAILURE() << "INDEXER_BENCH_BINARY is not set (ctest sets it)";
    return r;
  }
  const std::string base = ::testing::TempDir() + "/bench-run-" + std::to_string(getpid());
  const std::string out = base + ".out", err = base + ".err";
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> ptrs;
  for (std::string& a : argv) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, binary, &actions, nullptr, ptrs.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    ADD_FAILURE() << "cannot start " << binary;
    return r;
  }
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "indexer-bench ran past " << timeout << ": " << absl::StrJoin(args, " ");
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  unlink(out.c_str());
  unlink(err.c_str());
  return r;
}

Struct ParseJson(const std::string& text) {
  Struct s;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &s);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return s;
}

const Value& F(const Struct& s, const std::string& key) {
  static const Value kMissing;
  const auto it = s.fields().find(key);
  EXPECT_TRUE(it != s.fields().end()) << "no field " << key;
  return it == s.fields().end() ? kMissing : it->second;
}
double N(const Struct& s, const std::string& key) { return F(s, key).number_value(); }
const Struct& S(const Struct& s, const std::string& key) { return F(s, key).struct_value(); }

class BenchBinaryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int i = 0; i < 2; ++i) {
      server::ServerOptions o = testing::LoopbackServerOptions();
      o.engine.capacity_pages = 1024;
      o.engine.cpu_threads = 1;
      o.engine.defaults = kernels::SelectParams{8, 1, 1};
      absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(o);
      ASSERT_TRUE(s.ok()) << s.status();
      servers_.push_back(std::move(*s));
    }
  }
  static void TearDownTestSuite() {
    for (auto& s : servers_) s->Shutdown(absl::Seconds(1));
    servers_.clear();
  }

  static std::string Servers(int n) {
    std::vector<std::string> t;
    for (int i = 0; i < n; ++i) t.push_back(absl::StrCat("127.0.0.1:", servers_[i]->port()));
    return absl::StrJoin(t, ",");
  }

  // Every server's pages are free again (the tester released what it created).
  static void ExpectAllReleased() {
    for (auto& s : servers_) {
      const auto stats = s->engine().Stats();
      EXPECT_EQ(stats.live_sequences, 0u);
      EXPECT_EQ(stats.free_pages, stats.total_pages);
    }
  }

  // A small, quick workload with exact checking.
  static std::vector<std::string> Small(std::vector<std::string> more) {
    std::vector<std::string> args = {"--servers=" + Servers(2),
                                     "--values=int",
                                     "--check",
                                     "--prefill=uniform:100-700",
                                     "--prefill_chunk=256",
                                     "--decode_steps=fixed:15",
                                     "--heads=2",
                                     "--topk=4",
                                     "--batch=3",
                                     "--progress=off",
                                     "--wait=5s"};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }

  // The one stage of a JSON report, checked for the invariants every run has.
  static Struct CheckedStage(const Struct& report, int index) {
    const auto& stages = F(report, "stages").list_value();
    EXPECT_GT(stages.values_size(), index);
    if (stages.values_size() <= index) return Struct();
    const Struct& st = stages.values(index).struct_value();
    const Struct& requests = S(st, "requests");
    EXPECT_GT(N(requests, "ok"), 0);
    EXPECT_EQ(N(requests, "errors"), 0);
    const Struct& check = S(st, "correctness");
    EXPECT_GT(N(check, "responses"), 0);
    EXPECT_EQ(N(check, "mismatches"), 0) << F(check, "first_mismatches").DebugString();
    EXPECT_EQ(N(S(st, "sequences"), "started"), N(S(st, "sequences"), "released"));
    EXPECT_GT(N(S(st, "latency_ms"), "p50"), 0);
    EXPECT_LE(N(S(st, "latency_ms"), "p50"), N(S(st, "latency_ms"), "p99"));
    EXPECT_LE(N(S(st, "latency_ms"), "p99"), N(S(st, "latency_ms"), "max"));
    return st;
  }

  static std::vector<std::unique_ptr<server::IndexerServer>> servers_;
};

std::vector<std::unique_ptr<server::IndexerServer>> BenchBinaryTest::servers_;

TEST_F(BenchBinaryTest, HelpDocumentsEveryFlag) {
  const BenchRun r = RunBench({"--help"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Usage: indexer-bench"));
  const char* source = std::getenv("INDEXER_BENCH_SOURCE");
  ASSERT_NE(source, nullptr);
  const std::string main_cc = ReadFile(std::string(source) + "/client/bench/main.cc");
  const std::regex flag_re(R"(ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,)");
  int flags = 0;
  for (auto it = std::sregex_iterator(main_cc.begin(), main_cc.end(), flag_re);
       it != std::sregex_iterator(); ++it) {
    ++flags;
    const std::string name = (*it)[1];
    EXPECT_THAT(r.out, HasSubstr("--" + name + " (default: ")) << "--help does not list --" << name;
  }
  EXPECT_GT(flags, 30);
  EXPECT_EQ(RunBench({"--version"}).code, 0);
}

TEST_F(BenchBinaryTest, ClosedLoopBatchTwoServersChecked) {
  const std::string json = ::testing::TempDir() + "/closed.json";
  const BenchRun r =
      RunBench(Small({"--duration=1500ms", "--warmup=300ms", "--concurrency=2", "--speculative=3",
                      "--accept_rate=0.5", "--attention_pages", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("0 mismatches"));
  EXPECT_THAT(r.out, HasSubstr("p99.9"));
  const Struct report = ParseJson(ReadFile(json));
  EXPECT_EQ(F(report, "servers").list_value().values_size(), 2);
  const Struct st = CheckedStage(report, 0);
  EXPECT_EQ(F(st, "mode").string_value(), "closed");
  EXPECT_GT(N(S(S(st, "operations"), "truncate"), "ok"), 0);  // speculative tokens rolled back
  EXPECT_GT(N(S(S(st, "operations"), "prefill"), "tokens"), 0);
  EXPECT_GT(N(S(st, "requests"), "warmup_excluded"), 0);
  EXPECT_NEAR(N(st, "measured_s"), 1.5, 0.5);
  // Items: 2 layers x up to 3 sequences per request.
  EXPECT_GT(N(st, "items"), N(S(st, "requests"), "ok"));
  ExpectAllReleased();
}

TEST_F(BenchBinaryTest, OpenLoopUnaryKeepsTheRate) {
  const std::string json = ::testing::TempDir() + "/open.json";
  const BenchRun r =
      RunBench(Small({"--style=unary", "--rate=150", "--arrivals=poisson", "--duration=2s",
                      "--warmup=250ms", "--concurrency=4", "--layers=1", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const Struct report = ParseJson(ReadFile(json));
  const Struct st = CheckedStage(report, 0);
  EXPECT_EQ(F(st, "mode").string_value(), "open");
  EXPECT_EQ(F(st, "arrivals").string_value(), "poisson");
  // Poisson over 2 s at 150/s: about 300 +- 17 requests; allow for slow machines.
  EXPECT_NEAR(N(st, "throughput_rps"), 150, 40);
  EXPECT_GT(N(S(st, "send_lag_ms"), "count"), 0);
  EXPECT_EQ(N(S(st, "requests"), "not_sent"), 0);
  ExpectAllReleased();
}

TEST_F(BenchBinaryTest, SweepWritesEveryReport) {
  const std::string dir = ::testing::TempDir();
  const BenchRun r = RunBench(
      Small({"--style=stream", "--connections=2", "--sweep=concurrency:1,2", "--duration=700ms",
             "--warmup=200ms", "--sweep_max_latency=10s", "--json=" + dir + "/sweep.json",
             "--csv=" + dir + "/sweep.csv", "--html=" + dir + "/sweep.html"}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const Struct report = ParseJson(ReadFile(dir + "/sweep.json"));
  EXPECT_EQ(F(report, "stages").list_value().values_size(), 2);
  CheckedStage(report, 0);
  const Struct second = CheckedStage(report, 1);
  EXPECT_EQ(N(second, "concurrency"), 2);
  EXPECT_EQ(F(S(report, "sweep"), "kind").string_value(), "concurrency");
  const std::vector<std::string> csv =
      absl::StrSplit(ReadFile(dir + "/sweep.csv"), '\n', absl::SkipEmpty());
  EXPECT_EQ(csv.size(), 3u);
  const std::string html = ReadFile(dir + "/sweep.html");
  EXPECT_THAT(html, HasSubstr("Throughput against latency across the sweep"));
  EXPECT_THAT(r.out, HasSubstr("(latencies in ms)"));  // the sweep table
  ExpectAllReleased();
}

TEST_F(BenchBinaryTest, CountLimits) {
  const std::string json = ::testing::TempDir() + "/count.json";
  BenchRun r = RunBench(Small({"--duration=0", "--warmup=0", "--requests=40", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  Struct st = CheckedStage(ParseJson(ReadFile(json)), 0);
  EXPECT_EQ(N(S(st, "requests"), "ok"), 40);

  r = RunBench(Small({"--duration=0", "--warmup=0", "--sequences=5", "--concurrency=2",
                      "--decode_steps=uniform:3-6", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  st = CheckedStage(ParseJson(ReadFile(json)), 0);
  EXPECT_EQ(N(S(st, "sequences"), "started"), 5);
  EXPECT_EQ(N(S(st, "sequences"), "released"), 5);
  ExpectAllReleased();
}

// One sequence per worker, decoded far past what a sequence may hold: --rewind truncates each
// back to its prefill every 5 steps (every answer still exact), no sequence is replaced, and the
// servers' own figures over the measured window come back (two servers, summed).
TEST_F(BenchBinaryTest, RewindKeepsTheLengthAndServerStatsCoverTheWindow) {
  const std::string json = ::testing::TempDir() + "/rewind.json";
  const std::vector<std::string> args = {
      "--style=unary", "--layers=1",       "--batch=1",        "--concurrency=3",
      "--prefill=300", "--rewind=5",       "--duration=1200ms", "--warmup=300ms",
      "--decode_steps=fixed:2000000",      "--json=" + json};
  BenchRun r = RunBench(Small(args));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("back to the prefill every 5"));
  EXPECT_THAT(r.out, HasSubstr("backend selections, mean"));
  const Struct st = CheckedStage(ParseJson(ReadFile(json)), 0);
  EXPECT_EQ(N(S(st, "sequences"), "started"), 3);  // nobody finished: no new prefill
  const double ok = N(S(st, "requests"), "ok");
  const double all = ok + N(S(st, "requests"), "warmup_excluded");
  const double truncates = N(S(S(st, "operations"), "truncate"), "ok");
  EXPECT_GE(truncates, all / 5 - 3);
  EXPECT_LE(truncates, all / 5 + 3);

  const Struct& server = S(st, "server_stats");
  ASSERT_TRUE(F(server, "available").bool_value()) << F(server, "note").string_value();
  EXPECT_GT(N(server, "backend_selections"), 0);
  EXPECT_GT(N(server, "backend_select_mean_us"), 0);
  EXPECT_GT(N(server, "backend_select_us_per_request"), 0);
  EXPECT_GE(N(server, "spans_per_selection"), 1);
  // The window starts when the warm-up ends: the servers answered about the measured requests
  // (a few in flight at either edge, and those answered while the first GetStats was read).
  const double selects = N(S(S(server, "requests"), "SelectBlocks"), "count");
  EXPECT_GE(selects, 0.9 * ok - 5);
  EXPECT_LE(selects, ok + 5);
  EXPECT_EQ(S(server, "requests").fields().count("GetStats"), 0u);
  ExpectAllReleased();

  // Without --rewind that many steps would outgrow a sequence: refused before any call.
  std::vector<std::string> no_rewind = args;
  no_rewind[5] = "--rewind=0";
  r = RunBench(Small(no_rewind));
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--rewind"));
  EXPECT_EQ(RunBench(Small({"--rewind=-2"})).code, 2);

  r = RunBench(Small({"--duration=500ms", "--warmup=100ms", "--noserver_stats", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_FALSE(F(S(CheckedStage(ParseJson(ReadFile(json)), 0), "server_stats"), "available")
                   .bool_value());
}

TEST_F(BenchBinaryTest, UsageAndConnectionErrors) {
  EXPECT_EQ(RunBench({"--no_such_flag=1"}).code, 2);
  EXPECT_EQ(RunBench({"--servers=" + Servers(1), "--style=bogus"}).code, 2);
  EXPECT_EQ(RunBench({"--servers=" + Servers(1), "--sweep=latency:1,2"}).code, 2);
  EXPECT_EQ(RunBench({"--servers=" + Servers(1), "--prefill=uniform:9-1"}).code, 2);
  const BenchRun r = RunBench({"--servers=" + Servers(1), "--heads=999", "--wait=5s"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--heads"));
  // Nothing listens on port 1.
  const BenchRun down = RunBench({"--servers=127.0.0.1:1", "--wait=300ms", "--duration=1s"});
  EXPECT_EQ(down.code, 1);
  EXPECT_THAT(down.err, HasSubstr("not serving"));
}

}  // namespace
}  // namespace indexer::bench
