#include "client/bench/server_stats.h"

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
      for (const v1::Metric& m : f.metrics()) {
        const auto label = m.labels().find("rpc");
        const std::string rpc = label == m.labels().end() ? "" : label->second;
        if (rpc == "GetStats") continue;  // indexer-bench's own reads
        HistogramTotals& t = c.request_seconds[rpc];
        t.count += static_cast<int64_t>(m.count());
        t.sum += m.sum();
      }
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
  for (const auto& [rpc, t] : b.request_seconds) c.request_seconds[rpc] = Plus(c.request_seconds[rpc], t);
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
  for (auto& [rpc, t] : c.request_seconds) {
    const auto before = earlier.request_seconds.find(rpc);
    if (before != earlier.request_seconds.end()) t = Minus(t, before->second);
  }
  // RPCs not called in the window.
  for (auto it = c.request_seconds.begin(); it != c.request_seconds.end();) {
    it = it->second.count == 0 ? c.request_seconds.erase(it) : std::next(it);
  }
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
