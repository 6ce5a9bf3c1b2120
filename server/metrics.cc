#include "server/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/gauge.h>
#include <prometheus/metric_family.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backend_factory.h"
#include "flags/command_line.h"
#include "server/process_metrics.h"

namespace indexer::server {
namespace {

// Seconds, from 10 µs to 20 s in steps of 1, 2, 5 per decade: written as decimal literals so
// that every `le` label prints as written (a computed 2^k x 20e-6 prints 8.000000000000001e-05).
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
          20e-3, 50e-3, 0.1,   0.2,    0.5,    1,      2,    5,    10,   20};
}

// Seconds of one phase of a call, from 1 µs to 10 s: 1, 2, 5 per decade, written out so that
// the bucket labels print exactly.
prometheus::Histogram::BucketBoundaries PhaseBuckets() {
  return {1e-06, 2e-06, 5e-06, 1e-05, 2e-05, 5e-05, 0.0001, 0.0002, 0.0005, 0.001, 0.002,
          0.005, 0.01,  0.02,  0.05,  0.1,   0.2,   0.5,   1,      2,      5,      10};
}

// The phases of indexer_step_phase_seconds, in the order ServiceMetrics::phase_ holds them.
constexpr const char* kPhaseNames[] = {"parse",  "validate", "wave",    "lock",
                                       "apply",  "queue",    "stage",   "launch",
                                       "device", "scatter",  "complete", "respond"};
enum Phase {
  kParse, kValidate, kWave, kLock, kApply, kQueue, kStage, kLaunch, kDevice, kScatter, kComplete,
  kRespond
};

// Counts from 1 to 4096, doubling.
prometheus::Histogram::BucketBoundaries CountBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double n = 1; n <= 4096; n *= 2) b.push_back(n);
  return b;
}

const char* CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "UNKNOWN";
}

prometheus::ClientMetric Value(double v) {
  prometheus::ClientMetric m;
  m.gauge.value = v;
  return m;
}

// indexer_build_info: 1, labelled with what the server is (the usual _info pattern, for joins).
void RegisterBuildInfo(prometheus::Registry& registry, const std::string& backend) {
  prometheus::BuildGauge()
      .Name("indexer_build_info")
      .Help("Always 1; the labels say which server this is: its version, the backend it runs and "
            "whether the build has the CUDA backend.")
      .Register(registry)
      .Add({{"version", flags::ProgramVersion()},
            {"backend", backend},
            {"cuda_built", engine::BuiltWithCuda() ? "true" : "false"}})
      .Set(1);
}

}  // namespace

// Pages, key-pool bytes, sequences and device health, read from the engine at every collection.
class ServiceMetrics::EngineGauges final : public prometheus::Collectable {
 public:
  EngineGauges(const engine::Engine* engine, std::string device)
      : engine_(engine), device_(std::move(device)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const engine::EngineStats s = engine_->Stats();
    // One series per device: labelled with the backend's name on a one-device server ("cpu",
    // "cuda"), with name:ordinal ("cuda:0", "cuda:1") when there are several.
    const auto family = [](const char* name, const char* help) {
      prometheus::MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = prometheus::MetricType::Gauge;
      return f;
    };
    const auto per_device = [&](const char* name, const char* help, auto value) {
      prometheus::MetricFamily f = family(name, help);
      for (size_t d = 0; d < s.devices.size(); ++d) {
        prometheus::ClientMetric m = Value(static_cast<double>(value(s.devices[d])));
        m.label.push_back({"device", Label(static_cast<int>(d))});
        f.metric.push_back(std::move(m));
      }
      return f;
    };
    prometheus::MetricFamily live = family("indexer_live_sequences", "Sequences the server holds.");
    live.metric.push_back(Value(static_cast<double>(s.live_sequences)));
    std::vector<prometheus::MetricFamily> out = {
        per_device("indexer_pages_capacity",
                   "Pages in the key pool of each device (one 128-token block of every layer).",
                   [](const engine::DeviceStats& d) { return d.total_pages; }),
        per_device("indexer_pages_free", "Free pages in the key pool of each device.",
                   [](const engine::DeviceStats& d) { return d.free_pages; }),
        per_device("indexer_pages_used", "Pages holding keys, per device.",
                   [](const engine::DeviceStats& d) { return d.total_pages - d.free_pages; }),
        per_device("indexer_batch_queued",
                   "Span selections waiting in each device's select queue for a launch.",
                   [](const engine::DeviceStats& d) { return d.queued_selects; }),
        per_device("indexer_device_failed",
                   "1 when the device has failed for good (a sticky CUDA error such as an illegal "
                   "address or an uncorrectable ECC error): calls on its sequences answer "
                   "UNAVAILABLE and health is NOT_SERVING until the server is restarted; else 0.",
                   [](const engine::DeviceStats& d) { return d.health.ok() ? 0 : 1; }),
        std::move(live),
    };
    for (prometheus::MetricFamily& f : PoolBytes(s, per_device)) out.push_back(std::move(f));
    for (prometheus::MetricFamily& f : BackendCounters()) out.push_back(std::move(f));
    return out;
  }

  std::string Label(int d) const {
    if (engine_->num_devices() == 1) return device_;
    return absl::StrCat(engine_->backend(d).name(), ":", engine_->slot(d).ordinal);
  }

 private:
  // The key pool in bytes, per device: the page gauges times the bytes of one page.
  template <typename PerDevice>
  std::vector<prometheus::MetricFamily> PoolBytes(const engine::EngineStats&,
                                                  const PerDevice& per_device) const {
    const int64_t page = engine_->config().BytesPerPage();
    return {
        per_device("indexer_key_pool_bytes", "Bytes of the key pool of each device.",
                   [page](const engine::DeviceStats& d) { return d.total_pages * page; }),
        per_device("indexer_key_pool_used_bytes", "Bytes of each device's key pool holding keys.",
                   [page](const engine::DeviceStats& d) {
                     return (d.total_pages - d.free_pages) * page;
                   }),
    };
  }

  // Each device's KeyCacheBackend::Counters, one family per name (every device's backend is of
  // one kind, so the names agree).
  std::vector<prometheus::MetricFamily> BackendCounters() const {
    std::vector<prometheus::MetricFamily> out;
    for (int d = 0; d < engine_->num_devices(); ++d) {
      const std::vector<engine::BackendCounter> counters = engine_->backend(d).Counters();
      if (out.empty()) {
        for (const engine::BackendCounter& c : counters) {
          prometheus::MetricFamily f;
          f.name = absl::StrCat("indexer_backend_", c.name);
          f.help = c.help;
          f.type = c.monotonic ? prometheus::MetricType::Counter : prometheus::MetricType::Gauge;
          out.push_back(std::move(f));
        }
      }
      for (size_t i = 0; i < counters.size() && i < out.size(); ++i) {
        prometheus::ClientMetric m;
        if (counters[i].monotonic) {
          m.counter.value = static_cast<double>(counters[i].value);
        } else {
          m.gauge.value = static_cast<double>(counters[i].value);
        }
        m.label.push_back({"device", Label(d)});
        out[i].metric.push_back(std::move(m));
      }
    }
    return out;
  }

  const engine::Engine* engine_;
  const std::string device_;
};

ServiceMetrics::ServiceMetrics(const engine::Engine* engine, std::string device)
    : engine_(engine),
      registry_(std::make_shared<prometheus::Registry>()),
      gauges_(std::make_shared<EngineGauges>(engine, std::move(device))),
      requests_(prometheus::BuildCounter()
                    .Name("indexer_requests_total")
                    .Help("Calls answered, by RPC and gRPC status code (BatchStream: messages).")
                    .Register(*registry_)),
      latency_(prometheus::BuildHistogram()
                   .Name("indexer_request_seconds")
                   .Help("Time from a call's arrival to its answer, by RPC.")
                   .Register(*registry_)),
      queued_(prometheus::BuildHistogram()
                  .Name("indexer_queue_seconds")
                  .Help("Time calls waited for a handler thread.")
                  .Register(*registry_)
                  .Add({}, SecondsBuckets())),
      batch_items_(prometheus::BuildHistogram()
                       .Name("indexer_batch_items")
                       .Help("Items per Batch call or BatchStream message.")
                       .Register(*registry_)
                       .Add({}, CountBuckets())),
      select_spans_(prometheus::BuildHistogram()
                        .Name("indexer_select_spans")
                        .Help("Span selections per backend launch (the batch size the kernels see).")
                        .Register(*registry_)
                        .Add({}, CountBuckets())),
      select_seconds_(prometheus::BuildHistogram()
                          .Name("indexer_backend_select_seconds")
                          .Help("Time of one backend selection: on the GPU the kernels with their "
                                "copies, on the CPU the reference on the thread pool.")
                          .Register(*registry_)
                          .Add({}, SecondsBuckets())),
      reclaimed_(prometheus::BuildCounter()
                     .Name("indexer_sequences_reclaimed_total")
                     .Help("Sequences released by the idle TTL (--idle_ttl).")
                     .Register(*registry_)
                     .Add({})),
      batch_groups_(prometheus::BuildHistogram()
                        .Name("indexer_batch_calls")
                        .Help("Calls' selection groups (one per call's wave) merged into one "
                              "backend launch by the select batcher (--batching).")
                        .Register(*registry_)
                        .Add({}, CountBuckets())),
      batch_queue_(prometheus::BuildHistogram()
                       .Name("indexer_batch_queue_seconds")
                       .Help("Time a call's selections waited in the select queue for a backend "
                             "launch (--batching).")
                       .Register(*registry_)
                       .Add({}, SecondsBuckets())),
      batch_dropped_(prometheus::BuildCounter()
                         .Name("indexer_batch_dropped_total")
                         .Help("Selection groups not launched, by reason: queue_full "
                               "(--batch_queue_bound), deadline, cancelled, shutdown.")
                         .Register(*registry_)),
      dropped_queue_full_(batch_dropped_.Add({{"reason", "queue_full"}})),
      dropped_deadline_(batch_dropped_.Add({{"reason", "deadline"}})),
      dropped_cancelled_(batch_dropped_.Add({{"reason", "cancelled"}})),
      dropped_shutdown_(batch_dropped_.Add({{"reason", "shutdown"}})),
      phases_(prometheus::BuildHistogram()
                  .Name("indexer_step_phase_seconds")
                  .Help("Where append-and-select calls spend their time, by phase: parse (request "
                        "bytes to messages), validate, lock (the sequences, waits included), "
                        "apply (appends and staging for the batcher), queue (the select queue), "
                        "stage (the backend's staging), launch (copies and kernels handed to the "
                        "device), device (until the device's completion is "
                        "seen), scatter (results to the answer), complete (commit or roll back), "
                        "respond (the answer built and serialized).")
                  .Register(*registry_)) {
  for (const char* name : kPhaseNames) phase_.push_back(&phases_.Add({{"phase", name}}, PhaseBuckets()));
  RegisterBuildInfo(*registry_, engine->backend().name());
  AddSource(std::make_shared<ProcessMetrics>());
  AddGpuSource();
}

void ServiceMetrics::OnCallPhases(const engine::CallPhases& p) {
  const auto observe = [this](Phase phase, absl::Duration d) {
    phase_[phase]->Observe(absl::ToDoubleSeconds(d));
  };
  observe(kValidate, p.validate);
  observe(kWave, p.wave);
  observe(kLock, p.lock);
  observe(kApply, p.apply);
  observe(kQueue, p.queue);
  observe(kStage, p.stage);
  observe(kLaunch, p.launch);
  observe(kDevice, p.device);
  observe(kScatter, p.scatter);
  observe(kComplete, p.complete);
}

void ServiceMetrics::RecordServerPhases(absl::Duration parse, absl::Duration respond) {
  phase_[kParse]->Observe(absl::ToDoubleSeconds(parse));
  phase_[kRespond]->Observe(absl::ToDoubleSeconds(respond));
}

ServiceMetrics::~ServiceMetrics() = default;

void ServiceMetrics::AddGpuSource() {
  std::vector<GpuMetrics::Device> gpus;
  for (int d = 0; d < engine_->num_devices(); ++d) {
    if (engine_->backend(d).name() == "cuda") gpus.push_back({DeviceLabel(d), engine_->slot(d).ordinal});
  }
  if (gpus.empty()) return;
  std::unique_ptr<GpuProbe> probe = OpenGpuProbe();
  if (probe != nullptr) AddSource(std::make_shared<GpuMetrics>(std::move(gpus), std::move(probe)));
}

void ServiceMetrics::AddSource(std::shared_ptr<prometheus::Collectable> source) {
  extra_sources_.push_back(std::move(source));
}

MetricsEndpoint::Sources ServiceMetrics::Sources() const {
  MetricsEndpoint::Sources sources = {registry_, gauges_};
  sources.insert(sources.end(), extra_sources_.begin(), extra_sources_.end());
  return sources;
}

std::string ServiceMetrics::Render() const { return MetricsEndpoint::Render(Sources()); }

std::string ServiceMetrics::DeviceLabel(int device) const { return gauges_->Label(device); }

absl::Status ServiceMetrics::Serve(const std::string& bind_address) {
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
      MetricsEndpoint::Start(bind_address, Sources());
  if (!endpoint.ok()) return endpoint.status();
  endpoint_ = *std::move(endpoint);
  return absl::OkStatus();
}

prometheus::Counter& ServiceMetrics::RequestCounter(absl::string_view rpc, grpc::StatusCode code) {
  const std::string key = absl::StrCat(rpc, "/", static_cast<int>(code));
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = request_counters_.try_emplace(key, nullptr);
  if (inserted) it->second = &requests_.Add({{"rpc", std::string(rpc)}, {"code", CodeName(code)}});
  return *it->second;
}

prometheus::Histogram& ServiceMetrics::LatencyHistogram(absl::string_view rpc) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = latency_histograms_.try_emplace(std::string(rpc), nullptr);
  if (inserted) it->second = &latency_.Add({{"rpc", std::string(rpc)}}, SecondsBuckets());
  return *it->second;
}

void ServiceMetrics::RecordRequest(absl::string_view rpc, grpc::StatusCode code,
                                   absl::Duration latency, absl::Duration queued) {
  RequestCounter(rpc, code).Increment();
  LatencyHistogram(rpc).Observe(absl::ToDoubleSeconds(latency));
  queued_.Observe(absl::ToDoubleSeconds(queued));
}

void ServiceMetrics::RecordBatchItems(int64_t items) { batch_items_.Observe(static_cast<double>(items)); }

void ServiceMetrics::RecordReclaimed(int64_t sequences) {
  reclaimed_.Increment(static_cast<double>(sequences));
}

void ServiceMetrics::OnBackendSelect(int64_t tasks, absl::Duration took) {
  select_spans_.Observe(static_cast<double>(tasks));
  select_seconds_.Observe(absl::ToDoubleSeconds(took));
}

void ServiceMetrics::OnBatchLaunched(int64_t groups) {
  batch_groups_.Observe(static_cast<double>(groups));
}

void ServiceMetrics::OnBatchQueued(absl::Duration waited) {
  batch_queue_.Observe(absl::ToDoubleSeconds(waited));
}

void ServiceMetrics::OnBatchDropped(absl::StatusCode why) {
  switch (why) {
    case absl::StatusCode::kResourceExhausted: dropped_queue_full_.Increment(); break;
    case absl::StatusCode::kDeadlineExceeded: dropped_deadline_.Increment(); break;
    case absl::StatusCode::kCancelled: dropped_cancelled_.Increment(); break;
    default: dropped_shutdown_.Increment(); break;
  }
}

void ServiceMetrics::Fill(v1::GetStatsResponse* out) const {
  std::vector<prometheus::MetricFamily> families;
  for (const std::weak_ptr<prometheus::Collectable>& source : Sources()) {
    for (auto& f : source.lock()->Collect()) families.push_back(std::move(f));
  }
  for (const prometheus::MetricFamily& f : families) {
    v1::MetricFamily* pf = out->add_families();
    pf->set_name(f.name);
    pf->set_help(f.help);
    pf->set_type(f.type == prometheus::MetricType::Counter     ? "counter"
                 : f.type == prometheus::MetricType::Histogram ? "histogram"
                                                               : "gauge");
    for (const prometheus::ClientMetric& m : f.metric) {
      v1::Metric* pm = pf->add_metrics();
      for (const auto& l : m.label) (*pm->mutable_labels())[l.name] = l.value;
      switch (f.type) {
        case prometheus::MetricType::Counter:
          pm->set_value(m.counter.value);
          break;
        case prometheus::MetricType::Histogram:
          pm->set_count(m.histogram.sample_count);
          pm->set_sum(m.histogram.sample_sum);
          for (const auto& b : m.histogram.bucket) {
            v1::HistogramBucket* pb = pm->add_buckets();
            pb->set_upper_bound(b.upper_bound);
            pb->set_cumulative_count(b.cumulative_count);
          }
          break;
        default:
          pm->set_value(m.gauge.value);
          break;
      }
    }
  }
}

}  // namespace indexer::server
