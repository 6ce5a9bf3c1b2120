#include "server/gpu_metrics.h"

#include <utility>

namespace indexer::server {

GpuMetrics::GpuMetrics(std::vector<Device> devices, std::unique_ptr<GpuProbe> probe)
    : devices_(std::move(devices)), probe_(std::move(probe)) {}

std::vector<prometheus::MetricFamily> GpuMetrics::Collect() const {
  struct Series {
    const char* name;
    const char* help;
    std::optional<double> GpuSample::*value;
  };
  static constexpr Series kSeries[] = {
      {"indexer_gpu_memory_used_bytes", "Device memory in use on each GPU, by every process.",
       &GpuSample::memory_used_bytes},
      {"indexer_gpu_memory_total_bytes", "Device memory of each GPU.",
       &GpuSample::memory_total_bytes},
      {"indexer_gpu_utilization_ratio",
       "Fraction of the driver's last sample period in which a kernel ran on each GPU (0 to 1).",
       &GpuSample::utilization},
      {"indexer_gpu_memory_utilization_ratio",
       "Fraction of the driver's last sample period in which each GPU's memory was read or "
       "written (0 to 1).",
       &GpuSample::memory_utilization},
  };
  std::vector<prometheus::MetricFamily> out;
  if (probe_ == nullptr || devices_.empty()) return out;
  std::vector<std::pair<const Device*, GpuSample>> samples;
  for (const Device& d : devices_) {
    if (std::optional<GpuSample> s = probe_->Sample(d.ordinal)) samples.emplace_back(&d, *s);
  }
  if (samples.empty()) return out;
  for (const Series& series : kSeries) {
    prometheus::MetricFamily f;
    f.name = series.name;
    f.help = series.help;
    f.type = prometheus::MetricType::Gauge;
    for (const auto& [device, sample] : samples) {
      const std::optional<double>& value = sample.*series.value;
      if (!value.has_value()) continue;
      prometheus::ClientMetric m;
      m.gauge.value = *value;
      m.label.push_back({"device", device->label});
      f.metric.push_back(std::move(m));
    }
    if (!f.metric.empty()) out.push_back(std::move(f));
  }
  return out;
}

}  // namespace indexer::server
