// The reports (client/bench/report.h) of a synthetic run: the JSON parses back (with protobuf's
// JSON parser) with the right figures, the CSV has one well-formed row per stage, the text
// summary names every percentile, and the HTML is self-contained and holds every chart.
#include "client/bench/report.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/bench/svg_chart.h"
#include "tests/bench/sample_report.h"

namespace indexer::bench {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

Struct ParseJson(const std::string& text) {
  Struct s;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &s);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << text.substr(0, 2000);
  return s;
}

const Value& Field(const Struct& s, const std::string& key) {
  static const Value kMissing;
  const auto it = s.fields().find(key);
  EXPECT_TRUE(it != s.fields().end()) << "no field " << key;
  return it == s.fields().end() ? kMissing : it->second;
}

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
  }
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
        "UNAVAILABLE 2", "correctness", "0 mismatches", "sweep stopped", "req/s", "prefill"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
  // The sweep table: one row per stage.
  EXPECT_EQ(Count(text, "concurrency 4"), 2);  // its stage heading and its table row
}

TEST(ReportTest, HtmlIsSelfContainedAndHasTheCharts) {
  const BenchReport report = SampleReport(3);
  const std::string html = HtmlReport(report);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  EXPECT_EQ(Count(html, "<svg"), 5);
  EXPECT_EQ(Count(html, "</svg>"), 5);
  for (const char* title : {"Latency over time", "Throughput over time", "Latency CDF",
                            "Latency histogram", "Throughput against latency across the sweep"}) {
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
  EXPECT_EQ(Count(HtmlReport(SampleReport(1)), "<svg"), 5);
  BenchReport empty;
  const std::string none = HtmlReport(empty);
  EXPECT_NE(none.find("no data"), std::string::npos);
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
