// A device that fails for good, seen from outside (FatalFaultBackend stands in for a CUDA backend
// after a sticky error): calls answer UNAVAILABLE with the device's error, gRPC health turns
// NOT_SERVING for the server and the indexer service, indexer_device_failed shows the device in
// GetStats and on /metrics, and one error line names the device and the error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/cpu_backend.h"
#include "tests/testing/fatal_fault_backend.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::HealthStatus;
using ::testing::HasSubstr;

class DeviceFailureTest : public ServerTest {
 protected:
  // Devices of CpuBackends; the last one can be failed (faulty_).
  void StartWithDevices(int devices) {
    options_.metrics_listen = "127.0.0.1:0";
    make_backends_ = [this, devices] {
      const engine::EngineConfig& c = options_.engine;
      std::vector<engine::DeviceBackend> backends;
      for (int d = 0; d < devices; ++d) {
        const engine::DeviceSlot slot{d, d * c.capacity_pages, c.capacity_pages};
        std::unique_ptr<engine::KeyCacheBackend> b = std::make_unique<engine::CpuBackend>(c, slot);
        if (d == devices - 1) {
          auto faulty = std::make_unique<FatalFaultBackend>(std::move(b), absl::StrCat("test device ", d));
          faulty_ = faulty.get();
          b = std::move(faulty);
        }
        backends.push_back(engine::DeviceBackend{slot, std::move(b)});
      }
      return backends;
    };
    Restart();
  }
  void SetUp() override {
    log_ = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256);
    spdlog::default_logger()->sinks().push_back(log_);
  }
  void TearDown() override {
    ServerTest::TearDown();
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), log_), sinks.end());
  }

  HealthStatus Health(const char* service) {
    absl::StatusOr<HealthStatus> h = client_->Health(service);
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : HealthStatus::kUnknown;
  }
  // Waits (up to 10 s, polling) until both health answers are NOT_SERVING.
  bool EventuallyNotServing() {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      if (Health("") == HealthStatus::kNotServing &&
          Health("indexer.v1.Indexer") == HealthStatus::kNotServing) {
        return true;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }
  double Stat(const std::string& family, const std::map<std::string, std::string>& labels) {
    absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? StatValue(*stats, family, labels) : -2;
  }
  // Error lines logged so far that contain `text`.
  int ErrorLines(absl::string_view text) {
    int n = 0;
    for (const std::string& line : log_->last_formatted()) {
      if (absl::StrContains(line, "[error]") && absl::StrContains(line, text)) ++n;
    }
    return n;
  }

  FatalFaultBackend* faulty_ = nullptr;
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> log_;
};

void ExpectDeviceFailed(const absl::Status& s) {
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(kIllegalAddress));
}

TEST_F(DeviceFailureTest, HealthTurnsNotServingAndTheMetricShowsTheDevice) {
  ASSERT_NO_FATAL_FAILURE(StartWithDevices(1));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));
  std::vector<float> q;
  ASSERT_TRUE(client_->SelectBlocks(RandomSelect("a", 0, 2, 1, &q)).ok());
  EXPECT_EQ(Health(""), HealthStatus::kServing);
  EXPECT_EQ(Health("indexer.v1.Indexer"), HealthStatus::kServing);
  EXPECT_EQ(Stat("indexer_device_failed", {{"device", "cpu"}}), 0);
  EXPECT_THAT(ScrapeMetrics(server_->metrics_port()), HasSubstr("indexer_device_failed{device=\"cpu\"} 0"));
  // Healthy polls log nothing.
  absl::SleepFor(3 * server::IndexerServer::kDeviceHealthPeriod);
  EXPECT_EQ(Health(""), HealthStatus::kServing);
  EXPECT_EQ(ErrorLines("failed"), 0);

  faulty_->FailNextCall();
  ExpectDeviceFailed(client_->SelectBlocks(RandomSelect("a", 0, 2, 1, &q)).status());
  ASSERT_TRUE(EventuallyNotServing());
  EXPECT_EQ(Stat("indexer_device_failed", {{"device", "cpu"}}), 1);
  EXPECT_EQ(Stat("indexer_requests_total", {{"rpc", "SelectBlocks"}, {"code", "UNAVAILABLE"}}), 1);
  EXPECT_THAT(ScrapeMetrics(server_->metrics_port()), HasSubstr("indexer_device_failed{device=\"cpu\"} 1"));

  // Later calls fail fast with the same error, without reaching the device; what needs no
  // device still answers.
  const int64_t calls = faulty_->device_calls();
  ExpectDeviceFailed(client_->SelectBlocks(RandomSelect("a", 0, 2, 1, &q)).status());
  ExpectDeviceFailed(client_->AppendKeys(client::MakeAppend("a", 0, IntValues(rng_, head_dim()))).status());
  v1::BatchRequest batch;
  *batch.add_items() = RandomSelect("a", 0, 1, 1, &q);
  absl::StatusOr<v1::BatchResponse> answered = client_->Batch(batch);
  ASSERT_TRUE(answered.ok()) << answered.status();
  ASSERT_EQ(answered->results_size(), 1);
  EXPECT_EQ(answered->results(0).code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_THAT(answered->results(0).message(), HasSubstr(kIllegalAddress));
  EXPECT_EQ(faulty_->device_calls(), calls);
  absl::StatusOr<v1::GetSequenceResponse> a = client_->GetSequence("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->lengths(0), 300u);

  // One error line for the failure, however many calls and polls saw it; health stays down.
  absl::SleepFor(3 * server::IndexerServer::kDeviceHealthPeriod);
  EXPECT_EQ(Health(""), HealthStatus::kNotServing);
  EXPECT_EQ(ErrorLines("device cpu failed"), 1);
  EXPECT_EQ(ErrorLines(kIllegalAddress), 1);
}

TEST_F(DeviceFailureTest, OneFailedDeviceOfTwoIsNamedAndTheOtherServes) {
  ASSERT_NO_FATAL_FAILURE(StartWithDevices(2));
  ASSERT_NO_FATAL_FAILURE(AppendRandom("a", 0, 300));  // device 0
  ASSERT_NO_FATAL_FAILURE(AppendRandom("b", 0, 100));  // device 1
  ASSERT_EQ(server_->engine().Get("b")->device, 1);
  EXPECT_EQ(Stat("indexer_device_failed", {{"device", "cpu:1"}}), 0);

  faulty_->FailNextCall();
  std::vector<float> q;
  ExpectDeviceFailed(client_->SelectBlocks(RandomSelect("b", 0, 1, 1, &q)).status());
  ASSERT_TRUE(EventuallyNotServing());
  EXPECT_EQ(Stat("indexer_device_failed", {{"device", "cpu:0"}}), 0);
  EXPECT_EQ(Stat("indexer_device_failed", {{"device", "cpu:1"}}), 1);
  EXPECT_EQ(ErrorLines("device cpu:1 failed"), 1);
  EXPECT_EQ(ErrorLines("device cpu:0 failed"), 0);
  // Sequences on the healthy device are still answered exactly while the server drains.
  absl::StatusOr<Selection> got = client_->Select(RandomSelect("a", 0, 2, 1, &q));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameSelection(*got, Host("a").Select(0, q, 2, 299, DefaultParams(), PageTable()), "device 0");
}

}  // namespace
}  // namespace indexer::testing
