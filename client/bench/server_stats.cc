#include "client/bench/server_stats.h"

#include <string_view>

#include "absl/strings/str_cat.h"
#include "client/cpp/sharded_client.h"
#include "indexer/v1/indexer.pb.h"

namespace indexer::bench {
namespace {

HistogramTotals Totals(const v1::MetricFamily& family) {
  HistogramTotals t;
  for (const v1::Metric& m : family.metrics()) {
    t.count += static_cast<int64_t>(m.count());
    t.sum += m.sum();
  }
  return t;
}

HistogramTotals Plus(const HistogramTotals& a, const HistogramTotals& b) {
  return HistogramTotals{a.count + b.count, a.sum + b.sum};
}

HistogramTotals Minus(const HistogramTotals& a, const HistogramTotals& b) {
  return HistogramTotals{a.count - b.count, a.sum - b.sum};
}

// A family's histograms summed by the value of `label` (metrics without it under "").
void AddByLabel(const v1::MetricFamily& f, const std::string& label, const std::string& skip,
                std::map<std::string, HistogramTotals>* out) {
  for (const v1::Metric& m : f.metrics()) {
    const auto it = m.labels().find(label);
    const std::string value = it == m.labels().end() ? "" : it->second;
    if (!skip.empty() && value == skip) continue;
    HistogramTotals& t = (*out)[value];
    t.count += static_cast<int64_t>(m.count());
    t.sum += m.sum();
  }
}

void PlusEach(const std::map<std::string, HistogramTotals>& b,
              std::map<std::string, HistogramTotals>* a) {
  for (const auto& [key, t] : b) (*a)[key] = Plus((*a)[key], t);
}

// later - earlier per key, keeping only keys observed in the window.
std::map<std::string, HistogramTotals> MinusEach(
    const std::map<std::string, HistogramTotals>& later,
    const std::map<std::string, HistogramTotals>& earlier) {
  std::map<std::string, HistogramTotals> out;
  for (const auto& [key, t] : later) {
    const auto before = earlier.find(key);
    const HistogramTotals d = before == earlier.end() ? t : Minus(t, before->second);
    if (d.count != 0) out[key] = d;
  }
  return out;
}

// later - earlier per key, keeping only keys that moved in the window.
std::map<std::string, double> MinusEach(const std::map<std::string, double>& later,
                                        const std::map<std::string, double>& earlier) {
  std::map<std::string, double> out;
  for (const auto& [key, v] : later) {
    const auto before = earlier.find(key);
    const double d = before == earlier.end() ? v : v - before->second;
    if (d != 0) out[key] = d;
  }
  return out;
}

constexpr std::string_view kBackendPrefix = "indexer_backend_";

}  // namespace

ServerCounters CountersFromStats(const v1::GetStatsResponse& stats) {
  ServerCounters c;
  for (const v1::MetricFamily& f : stats.families()) {
    if (f.name() == "indexer_backend_select_seconds") {
      c.has_backend = true;
      c.select_seconds = Totals(f);
    } else if (f.name() == "indexer_select_spans") {
      c.select_spans = Totals(f);
    } else if (f.name() == "indexer_queue_seconds") {
      c.queue_seconds = Totals(f);
    } else if (f.name() == "indexer_batch_items") {
      c.batch_items = Totals(f);
    } else if (f.name() == "indexer_batch_calls") {
      c.batch_calls = Totals(f);
    } else if (f.name() == "indexer_batch_queue_seconds") {
      c.batch_queue_seconds = Totals(f);
    } else if (f.name() == "indexer_request_seconds") {
      AddByLabel(f, "rpc", "GetStats", &c.request_seconds);  // not indexer-bench's own reads
    } else if (f.name() == "indexer_step_phase_seconds") {
      c.has_phases = true;
      AddByLabel(f, "phase", "", &c.phases);
    } else if (f.type() == "counter" && f.name().starts_with(kBackendPrefix)) {
      double& total = c.backend_counts[f.name().substr(kBackendPrefix.size())];
      for (const v1::Metric& m : f.metrics()) total += m.value();
    }
  }
  return c;
}

ServerCounters Sum(const ServerCounters& a, const ServerCounters& b) {
  ServerCounters c = a;
  c.has_backend = a.has_backend || b.has_backend;
  c.select_seconds = Plus(a.select_seconds, b.select_seconds);
  c.select_spans = Plus(a.select_spans, b.select_spans);
  c.queue_seconds = Plus(a.queue_seconds, b.queue_seconds);
  c.batch_items = Plus(a.batch_items, b.batch_items);
  c.batch_calls = Plus(a.batch_calls, b.batch_calls);
  c.batch_queue_seconds = Plus(a.batch_queue_seconds, b.batch_queue_seconds);
  PlusEach(b.request_seconds, &c.request_seconds);
  c.has_phases = a.has_phases || b.has_phases;
  PlusEach(b.phases, &c.phases);
  for (const auto& [name, v] : b.backend_counts) c.backend_counts[name] += v;
  return c;
}

ServerCounters Difference(const ServerCounters& later, const ServerCounters& earlier) {
  ServerCounters c = later;
  c.select_seconds = Minus(later.select_seconds, earlier.select_seconds);
  c.select_spans = Minus(later.select_spans, earlier.select_spans);
  c.queue_seconds = Minus(later.queue_seconds, earlier.queue_seconds);
  c.batch_items = Minus(later.batch_items, earlier.batch_items);
  c.batch_calls = Minus(later.batch_calls, earlier.batch_calls);
  c.batch_queue_seconds = Minus(later.batch_queue_seconds, earlier.batch_queue_seconds);
  c.request_seconds = MinusEach(later.request_seconds, earlier.request_seconds);
  c.phases = MinusEach(later.phases, earlier.phases);
  c.backend_counts = MinusEach(later.backend_counts, earlier.backend_counts);
  return c;
}

absl::StatusOr<ServerCounters> ReadServerCounters(client::ShardedClient& client,
                                                  const client::CallOptions& call) {
  ServerCounters total;
  for (size_t s = 0; s < client.size(); ++s) {
    absl::StatusOr<v1::GetStatsResponse> stats = client.client(s).GetStats(call);
    if (!stats.ok()) {
      return absl::Status(stats.status().code(), absl::StrCat(client.targets()[s], ": GetStats: ",
                                                              stats.status().message()));
    }
    total = Sum(total, CountersFromStats(*stats));
  }
  return total;
}

}  // namespace indexer::bench
