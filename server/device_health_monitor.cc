#include "server/device_health_monitor.h"

#include <spdlog/spdlog.h>

#include <utility>

namespace indexer::server {

DeviceHealthMonitor::DeviceHealthMonitor(const engine::Engine* engine,
                                         std::function<std::string(int)> label,
                                         std::function<void(const absl::Status&)> on_failed,
                                         absl::Duration period)
    : engine_(engine),
      label_(std::move(label)),
      on_failed_(std::move(on_failed)),
      logged_(static_cast<size_t>(engine->num_devices()), false),
      thread_([this, period] {
        std::unique_lock<std::mutex> lock(stop_mu_);
        do {
          lock.unlock();
          (void)Check();
          lock.lock();
        } while (!stop_cv_.wait_for(lock, absl::ToChronoNanoseconds(period), [this] { return stop_; }));
      }) {}

DeviceHealthMonitor::~DeviceHealthMonitor() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

absl::Status DeviceHealthMonitor::Check() {
  const absl::Status health = engine_->Health();
  if (health.ok()) return health;  // the common case: one atomic load per device
  std::lock_guard<std::mutex> lock(mu_);
  const engine::EngineStats stats = engine_->Stats();
  for (size_t d = 0; d < stats.devices.size() && d < logged_.size(); ++d) {
    const absl::Status& device = stats.devices[d].health;
    if (device.ok() || logged_[d]) continue;
    logged_[d] = true;
    spdlog::error("device {} failed, health is NOT_SERVING, calls on its sequences answer {}: {}",
                  label_(static_cast<int>(d)), absl::StatusCodeToString(device.code()),
                  std::string(device.message()));
  }
  if (!reported_) {
    reported_ = true;
    on_failed_(health);
  }
  return health;
}

}  // namespace indexer::server
