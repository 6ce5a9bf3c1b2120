// DeviceHealthMonitor: turns a failed device into an operator-visible state. It watches the
// engine's devices (EngineStats::devices[d].health, no device access) and, for each device the
// first time it is seen failed, logs one error line naming the device and its error; on the
// first failure it also calls `on_failed` once (IndexerServer sets gRPC health NOT_SERVING). A
// failed device never recovers in-process, so neither does the monitor: restart the server.
//
// It looks every `period` on a thread of its own (a failure surfaces within one period however
// the failing call ended: a unary call, a Batch item, a stream message, a snapshot) and whenever
// Check() is called. Thread-safe; the destructor stops and joins the thread. `engine` must
// outlive the monitor, and `on_failed` must be safe to call until the destructor returns.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/engine.h"

namespace indexer::server {

class DeviceHealthMonitor {
 public:
  // `label(d)` names device d in the log line (as the metrics label it).
  DeviceHealthMonitor(const engine::Engine* engine, std::function<std::string(int)> label,
                      std::function<void(const absl::Status&)> on_failed, absl::Duration period);
  ~DeviceHealthMonitor();
  DeviceHealthMonitor(const DeviceHealthMonitor&) = delete;
  DeviceHealthMonitor& operator=(const DeviceHealthMonitor&) = delete;

  // Looks at every device now (logging and reporting what is new); returns Engine::Health().
  absl::Status Check();

 private:
  const engine::Engine* engine_;
  const std::function<std::string(int)> label_;
  const std::function<void(const absl::Status&)> on_failed_;
  std::mutex mu_;                  // one Check at a time; guards what follows
  std::vector<bool> logged_;       // per device: its failure was logged
  bool reported_ = false;          // on_failed_ was called
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;              // guarded by stop_mu_
  std::thread thread_;             // last: started once everything above is ready
};

}  // namespace indexer::server
