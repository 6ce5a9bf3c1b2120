// GpuMetrics: memory and utilisation of the GPUs the CUDA backend drives, read from a GpuProbe
// at every scrape, one series per device (labelled as the page gauges are: "cuda", or "cuda:1"
// when there are several):
//   indexer_gpu_memory_used_bytes         device memory in use, by every process
//   indexer_gpu_memory_total_bytes        device memory in all
//   indexer_gpu_utilization_ratio         fraction of the last sample period a kernel ran (0-1)
//   indexer_gpu_memory_utilization_ratio  fraction of it the memory was read or written (0-1)
// A device (or value) the probe cannot read at a scrape is left out of it. Thread-safe when the
// probe is.
//
// OpenGpuProbe reads NVML, loaded at run time from the driver (libnvidia-ml.so.1), so that the
// server starts on hosts without it; on builds without the CUDA backend it returns nullptr and
// the server has no GPU series.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

namespace indexer::server {

// What a probe could read of one device; a value it could not read (utilisation on a MIG
// instance, for one) is nullopt and left out of the exposition.
struct GpuSample {
  std::optional<double> memory_used_bytes;
  std::optional<double> memory_total_bytes;
  std::optional<double> utilization;         // 0 to 1
  std::optional<double> memory_utilization;  // 0 to 1
};

class GpuProbe {
 public:
  virtual ~GpuProbe() = default;
  // The device of CUDA ordinal `ordinal` (as this process numbers it), or nullopt when it cannot
  // be read. Called from several threads at once.
  virtual std::optional<GpuSample> Sample(int ordinal) const = 0;
};

// NVML on builds with the CUDA backend; nullptr without it, or when NVML cannot be loaded or
// initialised (the reason is logged once at warning level).
std::unique_ptr<GpuProbe> OpenGpuProbe();

class GpuMetrics final : public prometheus::Collectable {
 public:
  struct Device {
    std::string label;  // the `device` label
    int ordinal = 0;    // CUDA ordinal
  };
  GpuMetrics(std::vector<Device> devices, std::unique_ptr<GpuProbe> probe);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::vector<Device> devices_;
  const std::unique_ptr<GpuProbe> probe_;
};

}  // namespace indexer::server
