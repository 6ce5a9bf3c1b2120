// The stability check (client/bench/stability.h), the recorder's windows it judges, the warnings
// about identical sweep stages that disagree (runner.h), and the back-off and outage tracking of
// unreachable servers (backoff.h).
#include "client/bench/stability.h"

#include <gtest/gtest.h>

#include "client/bench/backoff.h"
#include "client/bench/recorder.h"
#include "client/bench/runner.h"

namespace indexer::bench {
namespace {

WindowFigures Window(double rps, double p50_ms, double seconds = 1) {
  WindowFigures w;
  w.seconds = seconds;
  w.ok = static_cast<int64_t>(rps * seconds);
  w.p50_ns = static_cast<int64_t>(p50_ms * 1e6);
  return w;
}

TEST(StabilityTest, WindowsWithinThePercentageAreStable) {
  StabilityVerdict v =
      JudgeStability({Window(100, 2.0), Window(104, 2.1), Window(97, 1.95)}, 10, 3);
  EXPECT_TRUE(v.checked);
  EXPECT_TRUE(v.stable);
  // Mean throughput 100.33: the farthest window (104) is 3.65% away; p50 mean 2.0167 ms.
  EXPECT_NEAR(v.throughput_spread, (104 - 301.0 / 3) / (301.0 / 3), 1e-9);
  EXPECT_NEAR(v.p50_spread, (2.1 - 6.05 / 3) / (6.05 / 3), 1e-6);
  EXPECT_NE(DescribeStability(v).find(": stable"), std::string::npos) << DescribeStability(v);

  // Throughput steady, latency not: unstable, and the same numbers at 40% are fine.
  v = JudgeStability({Window(100, 2.0), Window(100, 3.0), Window(100, 2.0)}, 10, 3);
  EXPECT_TRUE(v.checked);
  EXPECT_FALSE(v.stable);
  EXPECT_NE(DescribeStability(v).find("NOT STABLE"), std::string::npos);
  EXPECT_TRUE(JudgeStability(v.windows, 40, 3).stable);
  // A stall (a window without answers) is never stable.
  EXPECT_FALSE(JudgeStability({Window(100, 2), Window(0, 0), Window(100, 2)}, 50, 3).stable);
}

TEST(StabilityTest, TooFewWindowsOrNoSuccessIsUnchecked) {
  StabilityVerdict v = JudgeStability({Window(100, 2.0), Window(50, 1.0)}, 10, 3);
  EXPECT_FALSE(v.checked);
  EXPECT_TRUE(v.stable);  // not judged: no warning
  EXPECT_NE(v.note.find("2 of the 3 windows"), std::string::npos) << v.note;
  v = JudgeStability({Window(0, 0), Window(0, 0), Window(0, 0)}, 10, 3);
  EXPECT_FALSE(v.checked);
  EXPECT_FALSE(JudgeStability({Window(1, 1), Window(9, 9), Window(1, 1)}, 0, 3).checked);  // off
}

// The recorder's windows: whole timeline intervals after the warm-up, the last ending at the last
// complete interval, with each window's own p50.
TEST(StabilityTest, RecorderCutsTheMeasuredTimeIntoWindows) {
  Recorder recorder(/*warmup_s=*/0.5, /*interval_s=*/0.1);
  const Clock::time_point start = Clock::now();
  recorder.Begin(start);
  const auto at = [&](double s) {
    return start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  // 2 s of requests: 10 per interval, latency 1 ms, then 3 ms from 1.5 s on.
  for (int i = 0; i < 200; ++i) {
    const double t = 0.005 + 0.01 * i;
    DecodeRecord r;
    r.done = at(t);
    r.intended = r.done - std::chrono::microseconds(t >= 1.5 ? 3000 : 1000);
    r.sent = r.intended;
    r.measured = t >= 0.5;
    recorder.RecordDecode(r);
  }
  std::vector<WindowFigures> w = recorder.Windows(3, 0.5, at(2.0));
  ASSERT_EQ(w.size(), 3u);
  EXPECT_NEAR(w[0].start_s, 0.5, 1e-9);
  EXPECT_NEAR(w[2].start_s, 1.5, 1e-9);
  for (const WindowFigures& f : w) {
    EXPECT_NEAR(f.seconds, 0.5, 1e-9);
    EXPECT_EQ(f.ok, 50);
  }
  EXPECT_NEAR(static_cast<double>(w[0].p50_ns), 1e6, 5e4);
  EXPECT_NEAR(static_cast<double>(w[2].p50_ns), 3e6, 1.5e5);
  EXPECT_FALSE(JudgeStability(w, 10, 3).stable);
  // 1.5 s measured by 2.0 s: two windows of 0.7 s fit after the warm-up.
  EXPECT_EQ(recorder.Windows(3, 0.7, at(2.0)).size(), 2u);
  // Up to 1.0 s: one window of 0.5 s, before the latency changed.
  w = recorder.Windows(3, 0.5, at(1.04));
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NEAR(w[0].start_s, 0.5, 1e-9);
}

StageResult Stage(const std::string& label, int64_t ok, double seconds, int64_t p50_ns) {
  StageResult r;
  r.setup.label = label;
  r.measured_s = seconds;
  OpTotals& d = r.ops[static_cast<int>(Op::kDecode)];
  d.ok = ok;
  d.latency.Record(p50_ns, ok);
  return r;
}

TEST(StabilityTest, IdenticalStagesThatDisagreeAreWarnedAbout) {
  const std::vector<StageResult> stages = {
      Stage("concurrency 1", 1000, 1, 2'000'000), Stage("concurrency 2", 1500, 1, 3'000'000),
      Stage("concurrency 1", 700, 1, 2'050'000), Stage("concurrency 2", 1510, 1, 3'010'000)};
  std::vector<std::string> w = IdenticalStageWarnings(stages, 10);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("stages 1, 3 (concurrency 1)"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("700.0 to 1000.0 req/s (43%)"), std::string::npos) << w[0];
  EXPECT_TRUE(IdenticalStageWarnings(stages, 50).empty());
  EXPECT_TRUE(IdenticalStageWarnings(stages, 0).empty());  // the check is off

  std::vector<StageResult> one = {stages[0]};
  one[0].stability = JudgeStability({Window(100, 2), Window(150, 2), Window(100, 2)}, 10, 3);
  w = RunWarnings(one, 10);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("did not settle"), std::string::npos) << w[0];
}

TEST(BackoffTest, DoublesToASecondAndResets) {
  Backoff b;
  EXPECT_EQ(b.Next(), std::chrono::milliseconds(10));
  EXPECT_EQ(b.Next(), std::chrono::milliseconds(20));
  for (int i = 0; i < 20; ++i) b.Next();
  EXPECT_EQ(b.Next(), std::chrono::seconds(1));
  b.Reset();
  EXPECT_EQ(b.Next(), std::chrono::milliseconds(10));
}

TEST(BackoffTest, OutageLastsFromTheFirstFailureToASuccess) {
  OutageMonitor m;
  const Clock::time_point t0 = Clock::now();
  EXPECT_FALSE(m.Current(t0).has_value());
  m.Failed(t0, "first");
  m.Failed(t0 + std::chrono::seconds(2), "connection refused");
  std::optional<OutageMonitor::Outage> o = m.Current(t0 + std::chrono::seconds(3));
  ASSERT_TRUE(o.has_value());
  EXPECT_DOUBLE_EQ(o->seconds, 3.0);
  EXPECT_EQ(o->message, "connection refused");
  m.Succeeded();
  EXPECT_FALSE(m.Current(t0 + std::chrono::seconds(4)).has_value());
  m.Failed(t0 + std::chrono::seconds(5), "again");
  EXPECT_DOUBLE_EQ(m.Current(t0 + std::chrono::seconds(6))->seconds, 1.0);
}

}  // namespace
}  // namespace indexer::bench
