// Metrics (the Prometheus endpoint and GetStats, which read one registry) and the idle-sequence
// TTL, against an in-process server.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

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
  EXPECT_EQ(StatValue(*stats, "indexer_pages_total", {{"device", "cpu"}}), options_.engine.capacity_pages);
  EXPECT_EQ(StatValue(*stats, "indexer_live_sequences", {}), 3);

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
  EXPECT_EQ(StatValue(*stats, "indexer_pages_total", {{"device", "cpu:0"}}), 32);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_total", {{"device", "cpu:1"}}), 32);
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

}  // namespace
}  // namespace indexer::testing
