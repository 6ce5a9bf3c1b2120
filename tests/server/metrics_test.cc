// Metrics (the Prometheus endpoint and GetStats, which read one registry) and the idle-sequence
// TTL, against an in-process server.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/server/server_fixture.h"

namespace indexer::testing {
namespace {

using ::testing::HasSubstr;

// GET http://127.0.0.1:port/metrics, plain sockets: the response body, or "" on failure.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    }
  }
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

// Counter or gauge value of `family` with exactly these labels in a GetStats answer (-1: none).
double StatValue(const v1::GetStatsResponse& stats, const std::string& family,
                 const std::map<std::string, std::string>& labels) {
  for (const auto& f : stats.families()) {
    if (f.name() != family) continue;
    for (const auto& m : f.metrics()) {
      if (std::map<std::string, std::string>(m.labels().begin(), m.labels().end()) == labels) {
        return f.type() == "histogram" ? static_cast<double>(m.count()) : m.value();
      }
    }
  }
  return -1;
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
  const int64_t used = options_.engine.capacity_pages - FreePages();
  EXPECT_EQ(used, 5);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_used", {{"device", "cpu"}}), used);
  EXPECT_EQ(StatValue(*stats, "indexer_pages_total", {{"device", "cpu"}}), options_.engine.capacity_pages);
  EXPECT_EQ(StatValue(*stats, "indexer_live_sequences", {}), 3);

  // The Prometheus endpoint serves the same registry.
  ASSERT_GT(server_->metrics_port(), 0);
  const std::string text = Scrape(server_->metrics_port());
  EXPECT_THAT(text, HasSubstr("indexer_requests_total{code=\"OK\",rpc=\"SelectBlocks\"} 2"));
  EXPECT_THAT(text, HasSubstr("indexer_requests_total{code=\"NOT_FOUND\",rpc=\"GetSequence\"} 1"));
  EXPECT_THAT(text, HasSubstr("indexer_live_sequences 3"));
  EXPECT_THAT(text, HasSubstr("indexer_pages_used{device=\"cpu\"} 5"));
  EXPECT_THAT(text, HasSubstr("# TYPE indexer_backend_select_seconds histogram"));
}

TEST_F(MetricsTest, MetricsAddressInUseStopsStartup) {
  server::ServerOptions second = options_;
  second.listen = "127.0.0.1:0";
  second.metrics_listen = absl::StrCat("127.0.0.1:", server_->metrics_port());
  absl::StatusOr<std::unique_ptr<server::IndexerServer>> s = server::IndexerServer::Start(second);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--metrics_listen"));
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
