// The reports (client/bench/report.h) of a synthetic run: the JSON parses back (with protobuf's
// JSON parser) with the right figures, the CSV has one well-formed row per stage, the text
// summary names every percentile, and the HTML is self-contained and holds every chart.
#include "client/bench/report.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/bench/svg_chart.h"
#include "tests/bench/json_fields.h"
#include "tests/bench/sample_report.h"

namespace indexer::bench {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(ReportTest, JsonParsesBackWithTheFigures) {
  const BenchReport report = SampleReport(3);
  const Struct json = ParseJson(JsonReport(report));
  EXPECT_EQ(Field(json, "tool").string_value(), "indexer-bench");
  EXPECT_EQ(Field(json, "command_line").string_value(), report.command_line);  // escapes round-trip
  EXPECT_EQ(Field(json, "servers").list_value().values_size(), 1);
  EXPECT_EQ(Field(Field(json, "sweep").struct_value(), "kind").string_value(), "concurrency");
  const auto& stages = Field(json, "stages").list_value();
  ASSERT_EQ(stages.values_size(), 3);
  for (int i = 0; i < 3; ++i) {
    const Struct& st = stages.values(i).struct_value();
    const StageResult& want = report.stages[i];
    EXPECT_EQ(Field(st, "label").string_value(), want.setup.label);
    EXPECT_EQ(Field(st, "mode").string_value(), "closed");
    const Struct& requests = Field(st, "requests").struct_value();
    EXPECT_EQ(Field(requests, "ok").number_value(), static_cast<double>(want.decode().ok));
    EXPECT_EQ(Field(requests, "errors").number_value(), static_cast<double>(want.decode().errors));
    EXPECT_NEAR(Field(st, "throughput_rps").number_value(), want.throughput(), 1e-6);
    const Struct& latency = Field(st, "latency_ms").struct_value();
    for (const PercentileSpec& p : ReportedPercentiles()) {
      std::string key = p.label;
      std::replace(key.begin(), key.end(), '.', '_');
      EXPECT_NEAR(Field(latency, key).number_value(),
                  static_cast<double>(want.decode().latency.Percentile(p.q)) / 1e6, 1e-6)
          << key;
    }
    EXPECT_NEAR(Field(latency, "max").number_value(),
                static_cast<double>(want.decode().latency.max()) / 1e6, 1e-6);
    // The coarse histogram and the full buckets both add up to the request count.
    double coarse = 0, fine = 0;
    for (const Value& b : Field(st, "histogram").list_value().values())
      coarse += Field(b.struct_value(), "count").number_value();
    for (const Value& b : Field(st, "buckets_ns").list_value().values()) {
      ASSERT_EQ(b.list_value().values_size(), 3);
      fine += b.list_value().values(2).number_value();
    }
    EXPECT_EQ(coarse, static_cast<double>(want.decode().latency.count()));
    EXPECT_EQ(fine, static_cast<double>(want.decode().latency.count()));
    EXPECT_EQ(Field(st, "timeline").list_value().values_size(),
              static_cast<int>(want.timeline.size()));
    const Struct& codes = Field(st, "status_codes").struct_value();
    EXPECT_EQ(Field(codes, "OK").number_value(), static_cast<double>(want.decode().ok));
    if (i == 2) {
      EXPECT_EQ(Field(codes, "DEADLINE_EXCEEDED").number_value(), 5);
      EXPECT_EQ(Field(codes, "UNAVAILABLE").number_value(), 2);
      EXPECT_TRUE(Field(st, "over_threshold").bool_value());
    }
    const Struct& check = Field(st, "correctness").struct_value();
    EXPECT_EQ(Field(check, "mismatches").number_value(), 0);
    EXPECT_EQ(Field(check, "responses").number_value(), static_cast<double>(want.check.responses));
    EXPECT_EQ(
        Field(Field(Field(st, "operations").struct_value(), "prefill").struct_value(), "tokens")
            .number_value(),
        32 * 2048);
    // The servers' phases, per observation and per decode request.
    const Struct& server = Field(st, "server_stats").struct_value();
    EXPECT_TRUE(Field(server, "phases_available").bool_value());
    const Struct& device =
        Field(Field(server, "phases").struct_value(), "device").struct_value();
    EXPECT_NEAR(Field(device, "mean_us").number_value(), 400, 1e-6);
    const double calls = static_cast<double>(want.decode().ok + want.decode().errors);
    EXPECT_NEAR(Field(device, "us_per_request").number_value(),
                static_cast<double>(want.decode().ok) * 400 / calls, 1e-6);
    const Struct& stability = Field(st, "stability").struct_value();
    EXPECT_TRUE(Field(stability, "checked").bool_value());
    EXPECT_EQ(Field(stability, "stable").bool_value(), i < 2);
    EXPECT_EQ(Field(stability, "windows").list_value().values_size(), 3);
    EXPECT_EQ(Field(st, "first_errors").list_value().values_size(), i == 2 ? 1 : 0);
    EXPECT_EQ(Field(st, "stop_reason").string_value(), "");
  }
  EXPECT_EQ(Field(json, "warnings").list_value().values_size(), 1);
}

TEST(ReportTest, CsvHasOneRowPerStage) {
  const BenchReport report = SampleReport(3);
  const std::string csv = CsvReport(report);
  std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  EXPECT_EQ(header[0], "stage");
  const auto column = [&](const std::string& name) {
    return static_cast<size_t>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  ASSERT_LT(column("p99_9_ms"), header.size());
  ASSERT_LT(column("throughput_rps"), header.size());
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> row = absl::StrSplit(lines[i], ',');
    ASSERT_EQ(row.size(), header.size()) << lines[i];
    double p99 = 0, rps = 0;
    ASSERT_TRUE(absl::SimpleAtod(row[column("p99_ms")], &p99)) << lines[i];
    ASSERT_TRUE(absl::SimpleAtod(row[column("throughput_rps")], &rps));
    const StageResult& want = report.stages[i - 1];
    EXPECT_NEAR(p99, static_cast<double>(want.decode().latency.Percentile(0.99)) / 1e6, 1e-3);
    EXPECT_NEAR(rps, want.throughput(), 1e-3);
    EXPECT_EQ(row[column("label")], want.setup.label);
  }
}

TEST(ReportTest, TextSummaryNamesEverything) {
  const BenchReport report = SampleReport(3);
  const std::string text = TextSummary(report);
  for (const char* want :
       {"p50", "p90", "p95", "p99", "p99.9", "max", "histogram", "OK 2,000", "DEADLINE_EXCEEDED 5",
        "UNAVAILABLE 2", "correctness", "0 mismatches", "sweep stopped", "req/s", "prefill",
        "server phases    device 400.0, parse 30.0, queue 20.0, respond 15.0", "stability",
        "NOT STABLE", "warning: the stage (concurrency 4) did not settle",
        "error            UNAVAILABLE: 127.0.0.1:50051: connection refused"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
  // The sweep table: one row per stage.
  EXPECT_EQ(Count(text, "concurrency 4"), 3);  // its stage heading, its table row, its warning
}

TEST(ReportTest, HtmlIsSelfContainedAndHasTheCharts) {
  const BenchReport report = SampleReport(3);
  const std::string html = HtmlReport(report);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  EXPECT_EQ(Count(html, "<svg"), 6);
  EXPECT_EQ(Count(html, "</svg>"), 6);
  for (const char* title : {"Latency over time", "Throughput over time", "Latency CDF",
                            "Latency histogram", "Throughput against latency across the sweep",
                            "Server time per decode request, by phase", "Server-side breakdown",
                            "handler queue us", "backend us / request", "device us",
                            "Warning: the stage (concurrency 4) did not settle",
                            "Stopped early: stage 3", "connection refused", "NO (±"}) {
    EXPECT_NE(html.find(title), std::string::npos) << title;
  }
  EXPECT_GE(Count(html, "class=\"series\""), 6);  // lines were drawn
  EXPECT_GE(Count(html, "class=\"bar\""), 5);     // bars were drawn
  EXPECT_NE(html.find("threshold 8 ms"), std::string::npos);
  // No script, no remote resources: the only URL is the SVG namespace.
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(Count(html, "http://") + Count(html, "https://"),
            Count(html, "http://www.w3.org/2000/svg"));
  // Text from the command line is escaped.
  EXPECT_NE(html.find("&quot;quoted&quot; &lt;tag&gt;"), std::string::npos);
  EXPECT_EQ(html.find("<tag>"), std::string::npos);
  // A single stage and an empty report render too.
  EXPECT_EQ(Count(HtmlReport(SampleReport(1)), "<svg"), 6);
  BenchReport empty;
  const std::string none = HtmlReport(empty);
  EXPECT_NE(none.find("no data"), std::string::npos);
}

// Open-loop stages show their send lag (and what was not sent); trace stages their admission wait.
TEST(ReportTest, HtmlShowsSendLagAndAdmission) {
  BenchReport report = SampleReport(1);
  StageResult& st = report.stages[0];
  st.setup.open_loop = true;
  st.setup.target_rate = 400;
  st.setup.label = "rate 400/s";
  st.send_lag.Record(500'000, 99);  // 0.5 ms
  st.send_lag.Record(4'000'000);
  st.not_sent = 3;
  st.admission_wait.Record(2'500'000);
  const std::string html = HtmlReport(report);
  for (const char* want : {"Open-loop send lag", "lag p99 ms", "Trace admission", "2.500"}) {
    EXPECT_NE(html.find(want), std::string::npos) << want;
  }
  const std::string row = html.substr(html.find("<th>not sent</th>"));
  EXPECT_NE(row.find("<td class=\"n\">400.0</td>"), std::string::npos);
  EXPECT_NE(row.find("<td class=\"n\">0.50"), std::string::npos);  // the median lag, 0.5 ms
  EXPECT_NE(row.find("<td class=\"n\">3</td>"), std::string::npos);
  const std::string text = TextSummary(report);
  EXPECT_NE(text.find("send lag (ms)    p50 0.50"), std::string::npos) << text;
  EXPECT_NE(text.find("admission (ms)   p50 2.500"), std::string::npos) << text;
  // Without server figures the breakdown says why.
  report.stages[0].server = ServerStatsWindow{false, "the servers report no backend figures", {}};
  EXPECT_NE(HtmlReport(report).find("No server figures: the servers report no backend figures"),
            std::string::npos);
}

// Nothing is drawn outside its chart: every coordinate of every path, circle, rectangle and text
// of every chart lies within the chart's own width and height.
TEST(ReportTest, ChartsDrawInsideThemselves) {
  BenchReport report = SampleReport(3);
  // A spike far above the rest of the timeline.
  report.stages[1].timeline[5].max_ns *= 40;
  const std::string html = HtmlReport(report);
  const std::regex svg_re(R"svg(<svg [^>]*width="(\d+)" height="(\d+)")svg");
  const std::regex coord_re(R"re((?:\b(x|cx|x1|x2)="(-?[\d.]+)")|(?:\b(y|cy|y1|y2)="(-?[\d.]+)"))re");
  const std::regex path_re(R"re(d="([^"]+)")re");
  int charts = 0;
  for (size_t at = html.find("<svg "); at != std::string::npos; at = html.find("<svg ", at + 1)) {
    const std::string svg = html.substr(at, html.find("</svg>", at) - at);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(svg, m, svg_re));
    const double width = std::stod(m[1]), height = std::stod(m[2]);
    ++charts;
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), coord_re);
         it != std::sregex_iterator(); ++it) {
      const bool is_x = (*it)[1].matched;
      const double v = std::stod(is_x ? (*it)[2].str() : (*it)[4].str());
      EXPECT_GE(v, 0) << (*it)[0];
      EXPECT_LE(v, is_x ? width : height) << (*it)[0];
    }
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), path_re);
         it != std::sregex_iterator(); ++it) {
      for (absl::string_view point : absl::StrSplit((*it)[1].str(), absl::ByAnyChar("ML "),
                                                    absl::SkipEmpty())) {
        const std::vector<std::string> xy = absl::StrSplit(point, ',');
        ASSERT_EQ(xy.size(), 2u) << point;
        EXPECT_GE(std::stod(xy[0]), 0);
        EXPECT_LE(std::stod(xy[0]), width);
        EXPECT_GE(std::stod(xy[1]), 0);
        EXPECT_LE(std::stod(xy[1]), height);
      }
    }
  }
  EXPECT_EQ(charts, 6);
}

// No text runs past its chart's edges: each label's extent, estimated at 0.6 em per character
// (wider than the average glyph of a sans-serif face, bold included), fits the chart's width.
TEST(ReportTest, ChartTextFitsTheChart) {
  const std::regex svg_re(R"svg(<svg [^>]*width="(\d+)"[^>]*font-size="(\d+)")svg");
  const std::regex text_re(R"re(<text ([^>]*)>([^<]*)<)re");
  const std::regex x_re(R"re(\bx="(-?[\d.]+)")re");
  const std::regex size_re(R"re(font-size="(\d+)")re");
  const std::regex anchor_re(R"re(text-anchor="(\w+)")re");
  for (int stages : {1, 3}) {
    const std::string html = HtmlReport(SampleReport(stages));
    int texts = 0;
    for (size_t at = html.find("<svg "); at != std::string::npos;
         at = html.find("<svg ", at + 1)) {
      const std::string svg = html.substr(at, html.find("</svg>", at) - at);
      std::smatch m;
      ASSERT_TRUE(std::regex_search(svg, m, svg_re));
      const double width = std::stod(m[1]);
      const double base_size = std::stod(m[2]);
      for (auto it = std::sregex_iterator(svg.begin(), svg.end(), text_re);
           it != std::sregex_iterator(); ++it) {
        const std::string attrs = (*it)[1].str();
        if (attrs.find("rotate(") != std::string::npos) continue;  // the vertical axis label
        std::smatch a;
        ASSERT_TRUE(std::regex_search(attrs, a, x_re)) << attrs;
        const double x = std::stod(a[1]);
        const double size = std::regex_search(attrs, a, size_re) ? std::stod(a[1]) : base_size;
        const std::string anchor =
            std::regex_search(attrs, a, anchor_re) ? a[1].str() : std::string("start");
        const std::string text = absl::StrReplaceAll(
            (*it)[2].str(), {{"&amp;", "&"}, {"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}});
        const double extent = 0.6 * size * static_cast<double>(text.size());
        const double left = anchor == "end" ? x - extent : anchor == "middle" ? x - extent / 2 : x;
        EXPECT_GE(left, 0) << stages << " stages: " << text;
        EXPECT_LE(left + extent, width) << stages << " stages: " << text;
        ++texts;
      }
    }
    EXPECT_GT(texts, 50);
  }
}

TEST(SvgChartTest, TicksAreNice) {
  EXPECT_EQ(LinearTicks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(LinearTicks(0, 1, 4), (std::vector<double>{0, 0.5, 1}));
  const std::vector<double> t = LinearTicks(3, 97, 5);
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t.front(), 20);
  EXPECT_EQ(t.back(), 80);
  EXPECT_EQ(LogTicks(0.5, 20), (std::vector<double>{0.5, 1, 2, 5, 10, 20}));
  EXPECT_EQ(LogTicks(1, 1e6), (std::vector<double>{1, 10, 100, 1000, 1e4, 1e5, 1e6}));
  EXPECT_EQ(EscapeXml("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
}

}  // namespace
}  // namespace indexer::bench
