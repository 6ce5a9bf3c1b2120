// The servers' own figures as indexer-bench reads them (client/bench/server_stats.h): totals of
// the families it uses from a GetStats answer, two servers summed, and a window's differences.
#include "client/bench/server_stats.h"

#include <gtest/gtest.h>

#include "indexer/v1/indexer.pb.h"

namespace indexer::bench {
namespace {

void AddHistogram(v1::GetStatsResponse* stats, const std::string& name, uint64_t count,
                  double sum, const std::string& rpc = "", const std::string& label = "rpc") {
  v1::MetricFamily* family = nullptr;
  for (v1::MetricFamily& f : *stats->mutable_families()) {
    if (f.name() == name) family = &f;
  }
  if (family == nullptr) {
    family = stats->add_families();
    family->set_name(name);
    family->set_type("histogram");
  }
  v1::Metric* m = family->add_metrics();
  if (!rpc.empty()) (*m->mutable_labels())[label] = rpc;
  m->set_count(count);
  m->set_sum(sum);
}

v1::GetStatsResponse Stats(uint64_t selects, double select_s, uint64_t batch_calls) {
  v1::GetStatsResponse s;
  AddHistogram(&s, "indexer_backend_select_seconds", selects, select_s);
  AddHistogram(&s, "indexer_select_spans", selects, 4.0 * static_cast<double>(selects));
  AddHistogram(&s, "indexer_queue_seconds", batch_calls + 2, 1e-6 * static_cast<double>(batch_calls + 2));
  AddHistogram(&s, "indexer_batch_items", batch_calls, 8.0 * static_cast<double>(batch_calls));
  AddHistogram(&s, "indexer_batch_calls", selects, 2.0 * static_cast<double>(selects));
  AddHistogram(&s, "indexer_batch_queue_seconds", batch_calls, 3e-6 * static_cast<double>(batch_calls));
  AddHistogram(&s, "indexer_request_seconds", batch_calls, 1e-4 * static_cast<double>(batch_calls),
               "Batch");
  AddHistogram(&s, "indexer_request_seconds", 2, 2e-5, "ServerInfo");
  AddHistogram(&s, "indexer_request_seconds", 7, 1e-5, "GetStats");
  v1::MetricFamily* pages = s.add_families();  // gauges and counters are not read
  pages->set_name("indexer_pages_total");
  pages->set_type("gauge");
  pages->add_metrics()->set_value(1000);
  return s;
}

TEST(ServerStatsTest, ReadsTheFamiliesItUses) {
  const ServerCounters c = CountersFromStats(Stats(10, 0.005, 20));
  EXPECT_TRUE(c.has_backend);
  EXPECT_EQ(c.select_seconds.count, 10);
  EXPECT_DOUBLE_EQ(c.select_seconds.sum, 0.005);
  EXPECT_DOUBLE_EQ(c.select_seconds.mean(), 0.0005);
  EXPECT_DOUBLE_EQ(c.select_spans.mean(), 4.0);
  EXPECT_DOUBLE_EQ(c.batch_items.mean(), 8.0);
  EXPECT_EQ(c.queue_seconds.count, 22);
  EXPECT_DOUBLE_EQ(c.batch_calls.mean(), 2.0);
  EXPECT_NEAR(c.batch_queue_seconds.mean(), 3e-6, 1e-15);
  ASSERT_EQ(c.request_seconds.count("Batch"), 1u);
  EXPECT_EQ(c.request_seconds.at("Batch").count, 20);
  EXPECT_EQ(c.request_seconds.count("GetStats"), 0u);  // indexer-bench's own reads
  EXPECT_EQ(c.request_seconds.count("ServerInfo"), 1u);

  const ServerCounters none = CountersFromStats(v1::GetStatsResponse());
  EXPECT_FALSE(none.has_backend);
  EXPECT_EQ(none.select_seconds.count, 0);
  EXPECT_DOUBLE_EQ(none.select_seconds.mean(), 0.0);  // no division by zero
}

TEST(ServerStatsTest, SumsServersAndDifferencesAWindow) {
  const ServerCounters a = CountersFromStats(Stats(10, 0.005, 20));
  const ServerCounters b = CountersFromStats(Stats(30, 0.015, 40));
  const ServerCounters both = Sum(a, b);
  EXPECT_EQ(both.select_seconds.count, 40);
  EXPECT_DOUBLE_EQ(both.select_seconds.sum, 0.02);
  EXPECT_EQ(both.request_seconds.at("Batch").count, 60);
  EXPECT_EQ(both.request_seconds.at("ServerInfo").count, 4);

  const ServerCounters window = Difference(b, a);
  EXPECT_TRUE(window.has_backend);
  EXPECT_EQ(window.select_seconds.count, 20);
  EXPECT_DOUBLE_EQ(window.select_seconds.sum, 0.01);
  EXPECT_EQ(window.request_seconds.at("Batch").count, 20);
  EXPECT_NEAR(window.request_seconds.at("Batch").mean(), 1e-4, 1e-12);
  // ServerInfo was not called in the window: it is left out.
  EXPECT_EQ(window.request_seconds.count("ServerInfo"), 0u);
  EXPECT_EQ(window.batch_items.count, 20);
  EXPECT_EQ(window.batch_calls.count, 20);
  EXPECT_DOUBLE_EQ(window.batch_calls.sum, 40.0);
}

// indexer_step_phase_seconds: every phase the servers export is read, whatever its name, summed
// over servers (and over other labels), and differenced over a window; phases not observed in the
// window are left out; servers without the family say so.
TEST(ServerStatsTest, ReadsEveryStepPhase) {
  const auto with_phases = [](double scale) {
    v1::GetStatsResponse s = Stats(10, 0.005, 20);
    AddHistogram(&s, "indexer_step_phase_seconds", 10, 1e-5 * scale, "parse", "phase");
    AddHistogram(&s, "indexer_step_phase_seconds", 10, 2e-5 * scale, "device", "phase");
    AddHistogram(&s, "indexer_step_phase_seconds", 5, 1e-5 * scale, "device", "phase");
    AddHistogram(&s, "indexer_step_phase_seconds", 3, 3e-6, "a_new_phase", "phase");
    return s;
  };
  const ServerCounters a = CountersFromStats(with_phases(1));
  EXPECT_TRUE(a.has_phases);
  ASSERT_EQ(a.phases.size(), 3u);
  EXPECT_EQ(a.phases.at("device").count, 15);
  EXPECT_NEAR(a.phases.at("device").sum, 3e-5, 1e-15);
  EXPECT_EQ(a.phases.at("a_new_phase").count, 3);

  // Two servers, each with three times the phase time of `a`.
  const ServerCounters later =
      Sum(CountersFromStats(with_phases(3)), CountersFromStats(with_phases(3)));
  EXPECT_EQ(later.phases.at("parse").count, 20);
  const ServerCounters window = Difference(later, a);
  EXPECT_EQ(window.phases.at("parse").count, 10);
  EXPECT_NEAR(window.phases.at("parse").sum, 6e-5 - 1e-5, 1e-15);
  EXPECT_EQ(window.phases.at("device").count, 15);
  EXPECT_EQ(window.phases.at("a_new_phase").count, 3);  // 6 after (two servers), 3 before

  const ServerCounters none = CountersFromStats(Stats(10, 0.005, 20));
  EXPECT_FALSE(none.has_phases);
  EXPECT_TRUE(Difference(none, none).phases.empty());
  const ServerCounters unchanged = Difference(a, a);
  EXPECT_TRUE(unchanged.has_phases);
  EXPECT_TRUE(unchanged.phases.empty());  // nothing observed in an empty window
}

}  // namespace
}  // namespace indexer::bench
