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
#include "tests/bench/json_fields.h"
#include "tests/testing/child_process.h"
#include "tests/testing/server_config.h"

extern char** environ;

namespace indexer::bench {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;
using ::testing::HasSubstr;
using ::testing::Not;

using indexer::testing::ReadFile;

struct BenchRun {
  int code = -1;
  std::string out;
  std::string err;
};

// An indexer-bench process started with `args`, stdout and stderr in files of their own.
struct Running {
  pid_t pid = -1;
  std::string out_path, err_path;
};

Running StartBench(const std::vector<std::string>& args, const std::string& tag = "") {
  Running run;
  const char* binary = std::getenv("INDEXER_BENCH_BINARY");
  if (binary == nullptr) {
    ADD_FAILURE() << "INDEXER_BENCH_BINARY is not set (ctest sets it)";
    return run;
  }
  const std::string base =
      ::testing::TempDir() + "/bench-run-" + std::to_string(getpid()) + tag;
  run.out_path = base + ".out";
  run.err_path = base + ".err";
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> ptrs;
  for (std::string& a : argv) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, run.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&actions, 2, run.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  const int spawned = posix_spawn(&run.pid, binary, &actions, nullptr, ptrs.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    ADD_FAILURE() << "cannot start " << binary;
    run.pid = -1;
  }
  return run;
}

// Waits for the process (killing it past `timeout`) and collects its exit code and output.
BenchRun WaitBench(Running& run, absl::Duration timeout = absl::Seconds(60)) {
  BenchRun r;
  if (run.pid <= 0) return r;
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (waitpid(run.pid, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(run.pid, SIGKILL);
      waitpid(run.pid, &status, 0);
      ADD_FAILURE() << "indexer-bench ran past " << timeout;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  r.out = ReadFile(run.out_path);
  r.err = ReadFile(run.err_path);
  unlink(run.out_path.c_str());
  unlink(run.err_path.c_str());
  return r;
}

// Runs indexer-bench with `args`; stdout and stderr are kept apart.
BenchRun RunBench(const std::vector<std::string>& args,
                  absl::Duration timeout = absl::Seconds(60)) {
  Running run = StartBench(args);
  return WaitBench(run, timeout);
}

double N(const Struct& s, const std::string& key) { return Field(s, key).number_value(); }
const Struct& S(const Struct& s, const std::string& key) { return Field(s, key).struct_value(); }

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
    const auto& stages = Field(report, "stages").list_value();
    EXPECT_GT(stages.values_size(), index);
    if (stages.values_size() <= index) return Struct();
    const Struct& st = stages.values(index).struct_value();
    const Struct& requests = S(st, "requests");
    EXPECT_GT(N(requests, "ok"), 0);
    EXPECT_EQ(N(requests, "errors"), 0);
    const Struct& check = S(st, "correctness");
    EXPECT_GT(N(check, "responses"), 0);
    EXPECT_EQ(N(check, "mismatches"), 0) << Field(check, "first_mismatches").DebugString();
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
  EXPECT_THAT(r.out, HasSubstr("unix:/path/to/socket"));
  EXPECT_THAT(r.out, HasSubstr("2 a flag that could not be parsed"));
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
  EXPECT_EQ(Field(report, "servers").list_value().values_size(), 2);
  const Struct st = CheckedStage(report, 0);
  EXPECT_EQ(Field(st, "mode").string_value(), "closed");
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
  EXPECT_EQ(Field(st, "mode").string_value(), "open");
  EXPECT_EQ(Field(st, "arrivals").string_value(), "poisson");
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
  EXPECT_EQ(Field(report, "stages").list_value().values_size(), 2);
  CheckedStage(report, 0);
  const Struct second = CheckedStage(report, 1);
  EXPECT_EQ(N(second, "concurrency"), 2);
  EXPECT_EQ(Field(S(report, "sweep"), "kind").string_value(), "concurrency");
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
  ASSERT_TRUE(Field(server, "available").bool_value()) << Field(server, "note").string_value();
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
  EXPECT_FALSE(Field(S(CheckedStage(ParseJson(ReadFile(json)), 0), "server_stats"), "available")
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
  EXPECT_THAT(down.err, HasSubstr("not SERVING within 300ms")) << "the wait as given";
  // Usage errors exit 2 like every indexer program's: a stray argument, a missing value.
  EXPECT_EQ(RunBench({"run"}).code, 2);
  EXPECT_EQ(RunBench({"--servers"}).code, 2);
  EXPECT_EQ(RunBench({"help"}).code, 0);
}

// A server of its own (the tests that stop theirs, or listen elsewhere).
std::unique_ptr<server::IndexerServer> StartServer(const std::string& listen) {
  server::ServerOptions o;
  o.listen = listen;
  o.device = "cpu";
  o.handler_threads = 4;
  o.drain_seconds = 0;
  o.engine.head_dim = 64;
  o.engine.layers = 2;
  o.engine.capacity_pages = 1024;
  o.engine.cpu_threads = 1;
  o.engine.defaults = kernels::SelectParams{8, 1, 1};
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "w");
  EXPECT_NE(f, nullptr) << path;
  if (f != nullptr) {
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  return path;
}

// --json=- puts the report alone on stdout (the summary goes to stderr), for pipes into jq.
TEST_F(BenchBinaryTest, JsonAloneOnStdout) {
  BenchRun r = RunBench(Small({"--duration=500ms", "--warmup=100ms", "--json=-"}));
  ASSERT_EQ(r.code, 0) << r.err;
  const Struct report = ParseJson(r.out);
  CheckedStage(report, 0);
  EXPECT_EQ(r.out.find("decode requests"), std::string::npos);
  EXPECT_THAT(r.err, HasSubstr("decode requests"));  // the summary, on stderr
  r = RunBench(Small({"--duration=500ms", "--csv=-", "--summary=brief"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("stage,label,mode", 0), 0u) << r.out;
  EXPECT_THAT(r.err, HasSubstr("req/s"));
  r = RunBench(Small({"--json=-", "--csv=-"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("cannot both write to stdout"));
  ExpectAllReleased();
}

// Ctrl-C: the run stops, the reports hold what was measured and say so, and the exit status is
// 130 (128 + SIGINT), not success.
TEST_F(BenchBinaryTest, InterruptWritesTheReportsAndFails) {
  const std::string json = ::testing::TempDir() + "/interrupted.json";
  Running run = StartBench(
      Small({"--duration=60s", "--warmup=200ms", "--json=" + json, "--summary=brief"}), "-int");
  ASSERT_GT(run.pid, 0);  // never kill(-1, ...)
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_EQ(kill(run.pid, SIGINT), 0);
  const BenchRun r = WaitBench(run, absl::Seconds(30));
  EXPECT_EQ(r.code, 130) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("interrupted by SIGINT"));
  EXPECT_THAT(r.err, HasSubstr("interrupted"));
  const Struct report = ParseJson(ReadFile(json));
  EXPECT_THAT(Field(S(report, "sweep"), "stop_reason").string_value(), HasSubstr("interrupted"));
  CheckedStage(report, 0);
  ExpectAllReleased();
}

// A server that goes away mid-run: the workers back off instead of spinning (a down server fails
// every call at once), and after --unreachable_timeout the run ends, saying why, with exit 1.
TEST_F(BenchBinaryTest, UnreachableServerBacksOffAndEnds) {
  std::unique_ptr<server::IndexerServer> doomed = StartServer("127.0.0.1:0");
  ASSERT_NE(doomed, nullptr);
  const std::string json = ::testing::TempDir() + "/unreachable.json";
  Running run = StartBench({"--servers=127.0.0.1:" + std::to_string(doomed->port()),
                            "--prefill=200", "--decode_steps=fixed:5", "--heads=2",
                            "--topk=4", "--batch=2", "--concurrency=3", "--duration=60s",
                            "--warmup=200ms", "--unreachable_timeout=1500ms", "--progress=off",
                            "--wait=5s", "--json=" + json},
                           "-down");
  // Down once the load is under way: sequences live, and the warm-up well past.
  const absl::Time limit = absl::Now() + absl::Seconds(20);
  while (doomed->engine().Stats().live_sequences == 0 && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Milliseconds(1000));
  const absl::Time down_at = absl::Now();
  doomed->Shutdown(absl::ZeroDuration());
  const BenchRun r = WaitBench(run, absl::Seconds(40));
  const absl::Duration after = absl::Now() - down_at;
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("could not be reached"));
  EXPECT_LT(after, absl::Seconds(15));  // ended by the outage, not by --duration
  const Struct report = ParseJson(ReadFile(json));
  const Struct& stage = Field(report, "stages").list_value().values(0).struct_value();
  EXPECT_THAT(Field(stage, "stop_reason").string_value(), HasSubstr("could not be reached for"));
  EXPECT_THAT(Field(S(report, "sweep"), "stop_reason").string_value(),
              HasSubstr("could not be reached"));
  // Three workers backing off from 10 ms to 1 s over 1.5 s fail a few dozen calls, not tens of
  // thousands.
  EXPECT_LT(N(S(stage, "requests"), "errors"), 150);
  EXPECT_GT(N(S(stage, "requests"), "ok"), 0);
  // Among the first errors (calls the shutdown cancelled may come first): UNAVAILABLE.
  std::string errors;
  for (const Value& e : Field(stage, "first_errors").list_value().values()) {
    errors += e.string_value() + "\n";
    // "CODE: message", and the message says what went wrong.
    const size_t colon = e.string_value().find(": ");
    ASSERT_NE(colon, std::string::npos) << e.string_value();
    EXPECT_GT(e.string_value().size(), colon + 2) << "no message: " << e.string_value();
  }
  EXPECT_THAT(errors, HasSubstr("UNAVAILABLE"));
}

TEST_F(BenchBinaryTest, SweepSaysWhyItStopped) {
  const std::string json = ::testing::TempDir() + "/stopped.json";
  const BenchRun r =
      RunBench(Small({"--sweep=concurrency:1,2,4", "--sweep_max_latency=1us", "--duration=400ms",
                      "--warmup=100ms", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("sweep stopped: stage 1 (concurrency 1): p99 "));
  const Struct report = ParseJson(ReadFile(json));
  EXPECT_EQ(Field(report, "stages").list_value().values_size(), 1);
  EXPECT_THAT(Field(S(report, "sweep"), "stop_reason").string_value(), HasSubstr("> 0.001 ms"));
  ExpectAllReleased();
}

// A trace: sequences arrive at its times with its lengths, wait for a free slot, and the stage
// ends when the trace is done; every answer exact.
TEST_F(BenchBinaryTest, ReplaysATrace) {
  const std::string trace = WriteTemp("trace.txt",
                                      "# at prefill steps\n"
                                      "0 300 6\n0 100 3\n0.1 500 4\n0.2 256 8\n0.3 0 2\n"
                                      "0.45 700 5\n");
  const std::string json = ::testing::TempDir() + "/trace.json";
  const BenchRun r = RunBench(Small({"--trace=" + trace, "--batch=2", "--duration=0",
                                     "--warmup=0", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const Struct report = ParseJson(ReadFile(json));
  const Struct st = CheckedStage(report, 0);
  EXPECT_EQ(N(S(st, "sequences"), "started"), 6);
  const Struct& prefill = S(S(st, "operations"), "prefill");
  EXPECT_EQ(N(prefill, "tokens"), 300 + 100 + 500 + 256 + 0 + 700);
  // The four that arrived after the load began waited for a slot (or not at all).
  EXPECT_EQ(N(S(st, "admission_wait_ms"), "count"), 4);
  EXPECT_GE(N(st, "wall_s"), 0.45);
  // 28 steps in all, one request per step of each live batch: at least 28 / 2 requests.
  EXPECT_GE(N(S(st, "requests"), "ok"), 14);
  EXPECT_THAT(Field(S(report, "workload"), "trace").string_value(), HasSubstr("6 sequences"));
  EXPECT_EQ(RunBench(Small({"--trace=/no/such/trace"})).code, 2);
  ExpectAllReleased();
}

// Request intervals from a file (perf_analyzer's --request-intervals): open loop at their rate.
TEST_F(BenchBinaryTest, ReplaysRequestIntervals) {
  std::string gaps;
  for (int i = 0; i < 50; ++i) gaps += i % 2 == 0 ? "5000\n" : "15000\n";  // mean 10 ms: 100/s
  const std::string path = WriteTemp("intervals.txt", gaps);
  const std::string json = ::testing::TempDir() + "/intervals.json";
  const BenchRun r = RunBench(Small({"--arrivals=file:" + path, "--duration=1500ms",
                                     "--warmup=200ms", "--concurrency=3", "--style=unary",
                                     "--layers=1", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const Struct st = CheckedStage(ParseJson(ReadFile(json)), 0);
  EXPECT_EQ(Field(st, "mode").string_value(), "open");
  EXPECT_EQ(Field(st, "label").string_value(), "replayed intervals (100/s)");
  EXPECT_NEAR(N(st, "throughput_rps"), 100, 30);
  EXPECT_GT(N(S(st, "send_lag_ms"), "count"), 0);
  EXPECT_EQ(RunBench(Small({"--arrivals=file:" + path, "--rate=10"})).code, 2);
  ExpectAllReleased();
}

// Several requests in flight per stream, one micro-batch each, over two servers: every answer
// matched to its request and exact.
TEST_F(BenchBinaryTest, PipelinedStreamsAnswerInOrder) {
  const std::string json = ::testing::TempDir() + "/pipelined.json";
  BenchRun r = RunBench(Small({"--style=stream", "--stream_inflight=3", "--batch=6",
                               "--concurrency=2", "--duration=1s", "--warmup=200ms",
                               "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("3 requests in flight per stream"));
  const Struct st = CheckedStage(ParseJson(ReadFile(json)), 0);
  EXPECT_GT(N(S(st, "requests"), "ok"), 20);
  EXPECT_EQ(RunBench(Small({"--style=batch", "--stream_inflight=2"})).code, 2);
  EXPECT_EQ(RunBench(Small({"--style=stream", "--stream_inflight=4", "--batch=3"})).code, 2);
  ExpectAllReleased();
}

// Tensors by reference in system shared memory, over two servers and every call style (three
// requests in flight per stream): every answer, page tables included, read back from the
// worker's region and exact.
TEST_F(BenchBinaryTest, SharedMemoryAnswersAreExact) {
  for (const std::vector<std::string>& style :
       std::vector<std::vector<std::string>>{{"--style=stream", "--stream_inflight=3"},
                                             {"--style=batch"},
                                             {"--style=unary"}}) {
    SCOPED_TRACE(style[0]);
    const std::string json = ::testing::TempDir() + "/shared_memory.json";
    std::vector<std::string> args = {"--shared_memory=system", "--attention_pages",
                                     "--speculative=2", "--accept_rate=0.5", "--concurrency=2",
                                     "--duration=800ms", "--warmup=100ms", "--json=" + json};
    args.insert(args.end(), style.begin(), style.end());
    BenchRun r = RunBench(Small(args));
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_THAT(r.err, Not(HasSubstr("sends inline")));
    const Struct report = ParseJson(ReadFile(json));
    EXPECT_EQ(Field(S(report, "workload"), "tensors").string_value(),
              "by reference (system shared memory)");
    CheckedStage(report, 0);
  }
  BenchRun bad = RunBench(Small({"--shared_memory=gpu"}));
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--shared_memory"));
  ExpectAllReleased();
}

// The stability check: a threshold nothing meets extends the stage window by window up to
// --max_duration and then warns; identical sweep stages that differ are warned about.
TEST_F(BenchBinaryTest, StabilityCheckExtendsAndWarns) {
  const std::string json = ::testing::TempDir() + "/stability.json";
  BenchRun r = RunBench(Small({"--stability=0.0001", "--duration=600ms", "--max_duration=1200ms",
                               "--warmup=100ms", "--interval=100ms", "--json=" + json}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("warning: the stage (concurrency 1) did not settle"));
  const Struct st = CheckedStage(ParseJson(ReadFile(json)), 0);
  const Struct& v = S(st, "stability");
  EXPECT_TRUE(Field(v, "checked").bool_value());
  EXPECT_FALSE(Field(v, "stable").bool_value());
  EXPECT_EQ(N(v, "extensions"), 3);  // 600 ms + 3 windows of 200 ms = 1200 ms
  EXPECT_NEAR(N(st, "measured_s"), 1.2, 0.25);
  EXPECT_EQ(Field(v, "windows").list_value().values_size(), 3);

  r = RunBench(Small({"--sweep=concurrency:1,1", "--stability=0.0001", "--duration=400ms",
                      "--warmup=100ms"}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("stages 1, 2 (concurrency 1) ran the same load but differ"));
  EXPECT_EQ(RunBench(Small({"--stability_windows=1"})).code, 2);
  EXPECT_EQ(RunBench(Small({"--duration=2s", "--max_duration=1s"})).code, 2);
  ExpectAllReleased();
}

// A server on a Unix domain socket: --servers=unix:PATH, nothing parses host:port.
TEST_F(BenchBinaryTest, UnixSocketTarget) {
  const std::string socket = "/tmp/indexer-bench-test-" + std::to_string(getpid()) + ".sock";
  unlink(socket.c_str());
  std::unique_ptr<server::IndexerServer> local = StartServer("unix:" + socket);
  ASSERT_NE(local, nullptr);
  const std::string json = ::testing::TempDir() + "/unix.json";
  std::vector<std::string> args = Small({"--duration=600ms", "--warmup=100ms", "--style=stream",
                                         "--json=" + json});
  args[0] = "--servers=unix:" + socket;
  const BenchRun r = RunBench(args);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const Struct report = ParseJson(ReadFile(json));
  CheckedStage(report, 0);
  EXPECT_EQ(Field(Field(report, "servers").list_value().values(0).struct_value(), "target").string_value(),
            "unix:" + socket);
  local->Shutdown(absl::Seconds(1));
  unlink(socket.c_str());
}

}  // namespace
}  // namespace indexer::bench
