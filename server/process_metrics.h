// ProcessMetrics: the standard process_* series of Prometheus clients, read from the kernel at
// every scrape (Linux /proc, getrusage, getrlimit):
//   process_cpu_seconds_total        user + system CPU time (counter)
//   process_resident_memory_bytes    resident set size
//   process_virtual_memory_bytes     virtual memory size
//   process_open_fds                 open file descriptors
//   process_max_fds                  the soft limit on open file descriptors
//   process_start_time_seconds       when the process started, in seconds since the Unix epoch
// A value the kernel does not give is left out. Thread-safe (no state besides the start time).
#pragma once

#include <optional>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

namespace indexer::server {

class ProcessMetrics final : public prometheus::Collectable {
 public:
  ProcessMetrics();
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::optional<double> start_time_seconds_;
};

}  // namespace indexer::server
