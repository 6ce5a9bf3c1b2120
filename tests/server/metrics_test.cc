// Metrics (the Prometheus endpoint and GetStats, which read the same sources) and the
// idle-sequence TTL, against an in-process server; the exposition checked by promtool (Debian's
// prometheus package, installed by scripts/setup.sh).
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/backend_factory.h"
#include "flags/command_line.h"
#include "server/gpu_metrics.h"
#include "server/metrics.h"
#include "server/metrics_endpoint.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Runs `promtool check metrics` on `exposition`: its exit code and output (nullopt, and a test
// failure, when promtool is missing).
struct Promtool {
  int code = -1;
  std::string output;
};
std::optional<Promtool> CheckWithPromtool(const std::string& exposition) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    ADD_FAILURE() << "promtool is missing: run scripts/setup.sh (Debian package prometheus)";
    return std::nullopt;
  }
  char path[] = "/tmp/indexer-metrics-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return std::nullopt;
  close(fd);
  std::ofstream(path) << exposition;
  FILE* p = popen(absl::StrCat("promtool check metrics < ", path, " 2>&1").c_str(), "r");
  Promtool r;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) r.output.append(buf, n);
  const int status = pclose(p);
  unlink(path);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class MetricsTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.metrics_listen = "127.0.0.1:0";
    ServerTest::SetUp();
  }
};

TEST_F(MetricsTest, GetStatsAndTheEndpointCountEveryCall) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  std::vector<float> q;
  ASSERT_TRUE(client_->SelectBlocks(RandomSelect("a", 0, 2, 1, &q)).ok());
  ASSERT_TRUE(client_->SelectBlocks(RandomSelect("a", 0, 2, 1, &q)).ok());
  EXPECT_EQ(client_->GetSequence("missing").status().code(), absl::StatusCode::kNotFound);
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 0, 100));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("c", 0, 100));
  v1::BatchRequest batch;  // three sequences: one wave, one backend launch
  for (const char* id : {"a", "b", "c"}) *batch.add_items() = RandomSelect(id, 0, 1, 1, &q);
  ASSERT_TRUE(client_->Batch(batch).ok());

  absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(StatValue(*stats, "indexer_requests_total", {{"rpc", "SelectBlocks"}, {"code", "OK"}}), 2);
  EXPECT_EQ(StatValue(*stats, "indexer_requests_total", {{"rpc", "AppendKeys"}, {"code", "OK"}}), 3);
  EXPECT_EQ(StatValue(*stats, "indexer_requests_total", {{"rpc", "GetSequence"}, {"code", "NOT_FOUND"}}), 1);
  EXPECT_EQ(StatValue(*stats, "indexer_requests_total", {{"rpc", "Batch"}, {"code", "OK"}}), 1);
  EXPECT_EQ(StatValue(*stats, "indexer_request_seconds", {{"rpc", "SelectBlocks"}}), 2);
  EXPECT_EQ(StatValue(*stats, "indexer_batch_items", {}), 1);
  // Two unary selections and one batch: three backend launches.
  EXPECT_EQ(StatValue(*stats, "indexer_backend_select_seconds", {}), 3);
  EXPECT_EQ(StatValue(*stats, "indexer_select_spans", {}), 3);
  // The select batcher (on by default): one call's group per launch here, each queued once.
  EXPECT_EQ(StatValue(*stats, "indexer_batch_calls", {}), 3);
  EXPECT_EQ(StatValue(*stats, "indexer_batch_queue_seconds", {}), 3);
  EXPECT_EQ(StatValue(*stats, "indexer_batch_dropped_total", {{"reason", "queue_full"}}), 0);
  EXPECT_EQ(StatValue(*stats, "indexer_batch_dropped_total", {{"reason", "deadline"}}), 0);
  const int64_t used = options_.engine.capacity_pages - FreePages();
  EXPECT_EQ(used, 5);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_used", {{"device", "cpu"}}), used);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_capacity", {{"device", "cpu"}}), options_.engine.capacity_pages);
  EXPECT_EQ(StatValue(*stats, "indexer_live_sequences", {}), 3);
  // Every step call (three appends, two selections, one batch) is timed in every phase.
  for (const char* phase : {"parse", "validate", "wave", "lock", "apply", "queue", "stage",
                            "launch", "device", "scatter", "complete", "respond"}) {
    EXPECT_EQ(StatValue(*stats, "indexer_step_phase_seconds", {{"phase", phase}}), 6) << phase;
  }

  // The Prometheus endpoint serves the same registry.
  ASSERT_GT(server_->metrics_port(), 0);
  const std::string text = ScrapeMetrics(server_->metrics_port());
  EXPECT_THAT(text, HasSubstr("indexer_requests_total{code=\"OK\",rpc=\"SelectBlocks\"} 2"));
  EXPECT_THAT(text, HasSubstr("indexer_requests_total{code=\"NOT_FOUND\",rpc=\"GetSequence\"} 1"));
  EXPECT_THAT(text, HasSubstr("indexer_live_sequences 3"));
  EXPECT_THAT(text, HasSubstr("indexer_pages_used{device=\"cpu\"} 5"));
  EXPECT_THAT(text, HasSubstr("# TYPE indexer_backend_select_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("# TYPE indexer_batch_queue_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("indexer_batch_dropped_total{reason=\"cancelled\"} 0"));
}

// Concurrent unary calls share backend launches, and the figures say so.
class BatchingMetricsTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.handler_threads = 32;
    // A launch waits up to 100 ms for company (or 16 selections): the callers below arrive
    // within a few milliseconds of each other, so they share a handful of launches at most.
    options_.engine.batching.max_delay_us = 100000;
    options_.engine.batching.max_tasks = 16;
    options_.engine.capacity_pages = 128;
    ServerTest::SetUp();
  }
};

TEST_F(BatchingMetricsTest, ConcurrentSelectBlocksShareLaunches) {
  constexpr int kClients = 16;
  std::vector<v1::SelectBlocksRequest> requests;
  std::vector<std::vector<float>> queries(kClients);
  for (int i = 0; i < kClients; ++i) {
    const std::string id = absl::StrCat("s", i);
    ASSERT_NO_FATAL_FAILURE(AppendRandom(id, 0, 200 + 50 * i));
    requests.push_back(RandomSelect(id, 0, 2, 1, &queries[i]));
  }
  absl::StatusOr<v1::GetStatsResponse> before = client_->GetStats();
  ASSERT_TRUE(before.ok());
  const double launches_before = StatValue(*before, "indexer_backend_select_seconds", {});
  std::vector<absl::StatusOr<v1::SelectBlocksResponse>> got(kClients, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] { got[i] = client_->SelectBlocks(requests[i]); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    absl::StatusOr<Selection> parsed = client::ParseSelection(*got[i]);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const std::string id = absl::StrCat("s", i);
    ExpectSameSelection(*parsed,
                        Host(id).Select(0, queries[i], 2, Host(id).length(0) - 1, DefaultParams(),
                                        PageTable()),
                        id);
  }
  absl::StatusOr<v1::GetStatsResponse> after = client_->GetStats();
  ASSERT_TRUE(after.ok());
  const double launches = StatValue(*after, "indexer_backend_select_seconds", {}) - launches_before;
  EXPECT_GE(launches, 1);
  EXPECT_LE(launches, kClients / 2) << "16 concurrent calls should share launches";
  EXPECT_EQ(StatValue(*after, "indexer_batch_queue_seconds", {}),
            StatValue(*before, "indexer_batch_queue_seconds", {}) + kClients);
}

TEST_F(MetricsTest, MetricsAddressInUseStopsStartup) {
  server::ServerOptions second = options_;
  second.listen = "127.0.0.1:0";
  second.metrics_listen = absl::StrCat("127.0.0.1:", server_->metrics_port());
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(second);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--metrics_listen"));
}

// A server with two (simulated CPU) devices: one page series per device, ServerInfo totals, and
// answers from both devices.
class MultiDeviceMetricsTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.cpu_devices = 2;
    options_.engine.capacity_pages = 32;
    ServerTest::SetUp();
  }
};

TEST_F(MultiDeviceMetricsTest, PagesArePerDeviceAndSequencesSpreadOverBoth) {
  ASSERT_EQ(server_->engine().num_devices(), 2);
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));  // 3 pages, device 0
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 0, 100));  // 1 page, device 1
  EXPECT_EQ(server_->engine().Get("a")->device, 0);
  EXPECT_EQ(server_->engine().Get("b")->device, 1);
  v1::BatchRequest batch;
  std::vector<std::vector<float>> q(2);
  *batch.add_items() = RandomSelect("a", 0, 2, 1, &q[0]);
  *batch.add_items() = RandomSelect("b", 0, 2, 1, &q[1]);
  absl::StatusOr<v1::BatchResponse> answer = client_->Batch(batch);
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->results_size(), 2);
  const char* ids[] = {"a", "b"};
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(answer->results(i).code(), 0) << answer->results(i).message();
    absl::StatusOr<Selection> got = client::ParseSelection(answer->results(i).result());
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameSelection(*got,
                        Host(ids[i]).Select(0, q[i], 2, Host(ids[i]).length(0) - 1,
                                            DefaultParams(), PageTable()),
                        ids[i]);
  }
  absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(StatValue(*stats, "indexer_pages_capacity", {{"device", "cpu:0"}}), 32);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_capacity", {{"device", "cpu:1"}}), 32);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_used", {{"device", "cpu:0"}}), 3);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_used", {{"device", "cpu:1"}}), 1);
  EXPECT_EQ(StatValue(*stats, "indexer_batch_queued", {{"device", "cpu:1"}}), 0);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_used", {{"device", "cpu"}}), -1);
  // Two devices, one launch each.
  EXPECT_EQ(StatValue(*stats, "indexer_backend_select_seconds", {}), 2);
  absl::StatusOr<v1::ServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->total_pages(), 64u);
  EXPECT_EQ(info->free_pages(), 60u);
}

class IdleTtlTest : public ServerTest {
 protected:
  void SetUp() override {
    options_.idle_ttl = absl::Seconds(1);
    ServerTest::SetUp();
  }
};

TEST_F(IdleTtlTest, ReleasesOnlySequencesNoCallNamed) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("idle", 0, 300));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("busy", 0, 300));
  const int64_t free_before = FreePages();
  std::vector<float> q;
  // Keep "busy" in use for 2.5 s (every 200 ms); "idle" is never named again.
  const absl::Time end = absl::Now() + absl::Milliseconds(2500);
  while (absl::Now() < end) {
    ASSERT_TRUE(client_->SelectBlocks(RandomSelect("busy", 0, 1, 1, &q)).ok());
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(client_->GetSequence("idle").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(client_->GetSequence("busy").ok());
  EXPECT_EQ(FreePages(), free_before + 3) << "the idle sequence's 3 pages came back";
  absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(StatValue(*stats, "indexer_sequences_reclaimed_total", {}), 1);
}

// GetSequence is how a client settles a call in doubt, so reading a sequence keeps it alive.
TEST_F(IdleTtlTest, EveryCallNamingASequenceKeepsItAlive) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("read", 0, 300));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("forked", 0, 300));
  const absl::Time end = absl::Now() + absl::Milliseconds(2500);
  int round = 0;
  while (absl::Now() < end) {
    ASSERT_TRUE(client_->GetSequence("read").ok()) << "reclaimed while being read";
    // A fork names its source too; each fork is released again at once.
    const std::string target = "fork-" + std::to_string(round++);
    ASSERT_TRUE(client_->ForkSequence("forked", target).ok());
    ASSERT_TRUE(client_->ReleaseSequence(target).ok());
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(client_->GetSequence("read").ok());
  EXPECT_TRUE(client_->GetSequence("forked").ok());
}

TEST(Promtool, FindsWhatItShould) {
  // The check below means something only if promtool complains about a bad exposition.
  std::optional<Promtool> bad = CheckWithPromtool(
      "# HELP indexer_things_total Things.\n# TYPE indexer_things_total gauge\n"
      "indexer_things_total 1\n");
  ASSERT_TRUE(bad.has_value());
  EXPECT_THAT(bad->output, HasSubstr("non-counter metrics should not have \"_total\" suffix"));
}

TEST_F(MetricsTest, TheLiveEndpointPassesPromtool) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("p", 0, 300));
  std::vector<float> q;
  ASSERT_TRUE(client_->SelectBlocks(RandomSelect("p", 0, 2, 1, &q)).ok());
  EXPECT_EQ(client_->GetSequence("missing").status().code(), absl::StatusCode::kNotFound);
  ScrapeMetrics(server_->metrics_port());  // an earlier scrape: nothing of the endpoint's own
  const std::string text = ScrapeMetrics(server_->metrics_port());
  ASSERT_THAT(text, HasSubstr("indexer_requests_total"));
  std::optional<Promtool> check = CheckWithPromtool(text);
  ASSERT_TRUE(check.has_value());
  EXPECT_EQ(check->code, 0) << check->output << "\n" << text;
  EXPECT_EQ(check->output, "") << text;

  EXPECT_THAT(text, Not(HasSubstr("exposer_"))) << "the endpoint adds no series of its own";
  EXPECT_THAT(text, Not(HasSubstr("Nan")));
  EXPECT_THAT(text, Not(HasSubstr("indexer_pages_total"))) << "renamed indexer_pages_capacity";
  // Bucket bounds print as written: no 8.000000000000001e-05.
  const std::regex le("le=\"([^\"]*)\"");
  int buckets = 0;
  for (std::sregex_iterator it(text.begin(), text.end(), le), end; it != end; ++it, ++buckets) {
    const std::string bound = (*it)[1];
    EXPECT_TRUE(bound == "+Inf" || bound.size() <= 6) << "le=\"" << bound << "\"";
  }
  EXPECT_GT(buckets, 20);
  EXPECT_THAT(text, HasSubstr("indexer_backend_select_seconds_bucket{le=\"5e-05\"}"));
}

TEST_F(MetricsTest, BuildProcessAndKeyPoolSeries) {
  ASSERT_NO_FATAL_FAILURE(AppendRandom("k", 0, 300));  // 3 pages
  absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(StatValue(*stats, "indexer_build_info",
                      {{"version", flags::ProgramVersion()},
                       {"backend", "cpu"},
                       {"cuda_built", engine::BuiltWithCuda() ? "true" : "false"}}),
            1);
  const double page = static_cast<double>(options_.engine.BytesPerPage());
  EXPECT_EQ(StatValue(*stats, "indexer_key_pool_bytes", {{"device", "cpu"}}),
            page * static_cast<double>(options_.engine.capacity_pages));
  EXPECT_EQ(StatValue(*stats, "indexer_key_pool_used_bytes", {{"device", "cpu"}}), 3 * page);

  const double rss = StatValue(*stats, "process_resident_memory_bytes", {});
  EXPECT_GT(rss, 1 << 20);
  EXPECT_GE(StatValue(*stats, "process_virtual_memory_bytes", {}), rss);
  const double fds = StatValue(*stats, "process_open_fds", {});
  EXPECT_GE(fds, 3) << "stdin, stdout, stderr at least";
  EXPECT_LT(fds, StatValue(*stats, "process_max_fds", {}));
  EXPECT_GT(StatValue(*stats, "process_cpu_seconds_total", {}), 0);
  const double started = StatValue(*stats, "process_start_time_seconds", {});
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_LE(started, now + 1);
  EXPECT_GT(started, now - 24 * 3600) << "this test process started within the day";
}

// A probe answering for ordinals 0 (everything) and 1 (memory only, as a MIG instance does).
class FakeGpuProbe final : public server::GpuProbe {
 public:
  std::optional<server::GpuSample> Sample(int ordinal) const override {
    server::GpuSample s;
    if (ordinal > 1) return std::nullopt;
    s.memory_used_bytes = 1.5e9 + ordinal;
    s.memory_total_bytes = 150e9;
    if (ordinal == 0) {
      s.utilization = 0.25;
      s.memory_utilization = 0.5;
    }
    return s;
  }
};

TEST_F(MetricsTest, GpuSeriesComeFromTheProbePerDevice) {
  auto gpus = std::make_shared<server::GpuMetrics>(
      std::vector<server::GpuMetrics::Device>{{"cuda:0", 0}, {"cuda:1", 1}, {"cuda:2", 2}},
      std::make_unique<FakeGpuProbe>());
  server::ServiceMetrics metrics(&server_->engine(), "cpu");
  metrics.AddSource(gpus);
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("indexer_gpu_memory_used_bytes{device=\"cuda:0\"} 1500000000\n"));
  EXPECT_THAT(text, HasSubstr("indexer_gpu_memory_used_bytes{device=\"cuda:1\"} 1500000001\n"));
  EXPECT_THAT(text, HasSubstr("indexer_gpu_memory_total_bytes{device=\"cuda:1\"} 150000000000\n"));
  EXPECT_THAT(text, HasSubstr("indexer_gpu_utilization_ratio{device=\"cuda:0\"} 0.25\n"));
  EXPECT_THAT(text, HasSubstr("indexer_gpu_memory_utilization_ratio{device=\"cuda:0\"} 0.5\n"));
  EXPECT_THAT(text, Not(HasSubstr("indexer_gpu_utilization_ratio{device=\"cuda:1\"}")))
      << "a value the probe cannot read is left out";
  EXPECT_THAT(text, Not(HasSubstr("cuda:2"))) << "a device the probe cannot read is left out";
  std::optional<Promtool> check = CheckWithPromtool(text);
  ASSERT_TRUE(check.has_value());
  EXPECT_EQ(check->code, 0) << check->output;

  v1::GetStatsResponse stats;
  metrics.Fill(&stats);
  EXPECT_EQ(StatValue(stats, "indexer_gpu_memory_total_bytes", {{"device", "cuda:0"}}), 150e9);
  // A CPU-only build has no probe; the CPU server here none of these series.
  if (!engine::BuiltWithCuda()) {
    EXPECT_EQ(server::OpenGpuProbe(), nullptr);
  }
  EXPECT_THAT(server::MetricsEndpoint::Render({}), "");
  EXPECT_THAT(ScrapeMetrics(server_->metrics_port()), Not(HasSubstr("indexer_gpu_")));
}

}  // namespace
}  // namespace indexer::testing
