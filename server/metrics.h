// ServiceMetrics: what the server counts and measures, served in Prometheus' text format on
// --metrics_listen (MetricsEndpoint) and returned by the GetStats RPC from the same sources:
// the registry of counters and histograms, gauges read from the engine (pages, key-pool bytes,
// sequences, failed devices), indexer_build_info, the process_* series (ProcessMetrics) and, on
// the CUDA backend, the GPUs' memory and utilisation (GpuMetrics). docs/DEPLOY.md lists them.
//
// Thread-safe: every method may be called from any thread. Recording is lock-free counters and
// histograms; the gauges are read when collected.
#pragma once

#include <grpcpp/support/status.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <vector>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "indexer/v1/indexer.pb.h"
#include "server/gpu_metrics.h"
#include "server/metrics_endpoint.h"

namespace indexer::server {

class ServiceMetrics final : public engine::EngineObserver {
 public:
  // `engine` must outlive this object; `device` labels the per-device gauges of a one-device
  // engine (several devices are labelled backend:ordinal, e.g. cuda:1).
  ServiceMetrics(const engine::Engine* engine, std::string device);
  ~ServiceMetrics() override;

  // Serves /metrics on `bind_address` ("host:port"; port 0 picks one). FAILED_PRECONDITION when
  // the address cannot be bound.
  absl::Status Serve(const std::string& bind_address);
  // The bound port, once serving (0 otherwise).
  int port() const { return endpoint_ == nullptr ? 0 : endpoint_->port(); }
  // What a scrape of /metrics answers, without serving it.
  std::string Render() const;

  // One finished call of `rpc` (a string literal): its status, the time from arrival to answer,
  // and the part of it spent waiting for a handler thread.
  void RecordRequest(absl::string_view rpc, grpc::StatusCode code, absl::Duration latency,
                     absl::Duration queued);
  // Items in one Batch call or BatchStream message.
  void RecordBatchItems(int64_t items);
  // Sequences the idle TTL reclaimed.
  void RecordReclaimed(int64_t sequences);
  // engine::EngineObserver: one backend selection (the kernels and their copies on the GPU),
  // and the select batcher's launches, queue waits and drops.
  void OnBackendSelect(int64_t tasks, absl::Duration took) override;
  void OnBatchLaunched(int64_t groups) override;
  void OnBatchQueued(absl::Duration waited) override;
  void OnBatchDropped(absl::StatusCode why) override;
  // Where calls' time goes, by phase: the engine's (engine::CallPhases: validate, wave, lock,
  // apply, queue, stage, launch, device, scatter, complete) and the server's own (parse: the
  // request's bytes into messages; respond: the answer built and serialized).
  // indexer_step_phase_seconds{phase}.
  void OnCallPhases(const engine::CallPhases& phases) override;
  void RecordServerPhases(absl::Duration parse, absl::Duration respond);

  // Every metric family, for GetStats.
  void Fill(v1::GetStatsResponse* out) const;

  // Adds a source of families to the exposition and GetStats (the constructor adds the process
  // series and, for CUDA devices, the GPU series). Call before Serve and before other threads
  // use this object.
  void AddSource(std::shared_ptr<prometheus::Collectable> source);

  // The `device` label of device d's per-device series ("cpu", "cuda", or "cuda:1" when there
  // are several), for log lines that should name a device as the metrics do.
  std::string DeviceLabel(int device) const;

 private:
  class EngineGauges;

  prometheus::Counter& RequestCounter(absl::string_view rpc, grpc::StatusCode code);
  prometheus::Histogram& LatencyHistogram(absl::string_view rpc);

  // Every source of families, in exposition order (registry_ first).
  MetricsEndpoint::Sources Sources() const;
  // The GPU series of the engine's CUDA devices, when there are any and NVML can be read.
  void AddGpuSource();

  const engine::Engine* engine_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<EngineGauges> gauges_;
  std::vector<std::shared_ptr<prometheus::Collectable>> extra_sources_;  // process, GPUs
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Histogram& queued_;
  prometheus::Histogram& batch_items_;
  prometheus::Histogram& select_spans_;
  prometheus::Histogram& select_seconds_;
  prometheus::Counter& reclaimed_;
  prometheus::Histogram& batch_groups_;
  prometheus::Histogram& batch_queue_;
  prometheus::Family<prometheus::Counter>& batch_dropped_;
  prometheus::Counter& dropped_queue_full_;
  prometheus::Counter& dropped_deadline_;
  prometheus::Counter& dropped_cancelled_;
  prometheus::Counter& dropped_shutdown_;
  prometheus::Family<prometheus::Histogram>& phases_;
  // indexer_step_phase_seconds' children, one per phase, in kPhaseNames order.
  std::vector<prometheus::Histogram*> phase_;
  // Children are created on first use; the families own them, these maps find them fast.
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, prometheus::Counter*> request_counters_;
  absl::flat_hash_map<std::string, prometheus::Histogram*> latency_histograms_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
};

}  // namespace indexer::server
