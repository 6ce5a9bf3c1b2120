// The servers' own figures over a stage's measured window: indexer-bench reads every server's
// GetStats (the registry its Prometheus endpoint serves) when the warm-up ends and when the stage
// ends, and reports the differences: backend selections (the kernels with their copies on a GPU,
// the reference on the CPU) and their time, spans per selection (the batch the kernels see), time
// calls waited for a handler thread, Batch sizes, the server-side latency of each RPC and, from
// servers that export it, the time of each phase of a step. Next to the client's latency this
// splits a decode step into kernel time and everything else.
//
// Pure values and functions except ReadServerCounters (RPCs); any thread may call them. The
// values are light (recorder.h holds one per stage); the .cc holds the protobuf and gRPC side.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace indexer::v1 {
class GetStatsResponse;
}
namespace indexer::client {
class ShardedClient;
struct CallOptions;
}

namespace indexer::bench {

// A histogram's observation count and their sum (seconds, or items).
struct HistogramTotals {
  int64_t count = 0;
  double sum = 0;
  double mean() const { return count > 0 ? sum / static_cast<double>(count) : 0.0; }
};

// The cumulative figures of one or more servers at one moment.
struct ServerCounters {
  bool has_backend = false;       // the servers report indexer_backend_select_seconds
  HistogramTotals select_seconds;  // indexer_backend_select_seconds
  HistogramTotals select_spans;    // indexer_select_spans
  HistogramTotals queue_seconds;   // indexer_queue_seconds
  HistogramTotals batch_items;     // indexer_batch_items
  HistogramTotals batch_calls;     // indexer_batch_calls: calls merged per launch (--batching)
  HistogramTotals batch_queue_seconds;  // indexer_batch_queue_seconds (--batching)
  // indexer_request_seconds by rpc, without GetStats (the reads of these figures).
  std::map<std::string, HistogramTotals> request_seconds;
  // indexer_step_phase_seconds by phase: where the server's time per step goes (parse,
  // validate, lock, apply, stage, queue, device, finish, respond, ...; the set is the server's,
  // read as it comes). has_phases: the servers export the family at all.
  bool has_phases = false;
  std::map<std::string, HistogramTotals> phases;
  // The backends' own counters (indexer_backend_*_total, every device summed) by name without
  // the prefix: steps, graph builds, buffer growths, ...
  std::map<std::string, double> backend_counts;
};

// The figures of one GetStats answer (families it lacks stay zero).
ServerCounters CountersFromStats(const v1::GetStatsResponse& stats);
// a + b (two servers' figures together).
ServerCounters Sum(const ServerCounters& a, const ServerCounters& b);
// later - earlier (a window); has_backend from `later`.
ServerCounters Difference(const ServerCounters& later, const ServerCounters& earlier);

// Every server of `client` summed. The first failure fails the call, its message naming the
// server (UNIMPLEMENTED from a server without GetStats).
absl::StatusOr<ServerCounters> ReadServerCounters(client::ShardedClient& client,
                                                  const client::CallOptions& call);

// What a stage reports: the window's figures, or why there are none.
struct ServerStatsWindow {
  bool available = false;
  std::string note;  // why not available ("" when available)
  ServerCounters delta;
};

}  // namespace indexer::bench
