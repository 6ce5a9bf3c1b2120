#include "server/idle_reaper.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

namespace indexer::server {

absl::Duration IdleReaper::Period(absl::Duration ttl) {
  return std::min(ttl / 4, absl::Seconds(10));
}

IdleReaper::IdleReaper(engine::Engine* engine, absl::Duration ttl,
                       std::function<void(int64_t)> on_reclaimed)
    : engine_(engine),
      ttl_(ttl),
      on_reclaimed_(std::move(on_reclaimed)),
      thread_([this] {
        const auto period = absl::ToChronoNanoseconds(Period(ttl_));
        std::unique_lock<std::mutex> lock(stop_mu_);
        while (!stop_cv_.wait_for(lock, period, [this] { return stop_; })) {
          lock.unlock();
          Reap();
          lock.lock();
        }
      }) {}

IdleReaper::~IdleReaper() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void IdleReaper::Reap() {
  const int64_t reclaimed = engine_->ReclaimIdle(ttl_);
  if (reclaimed <= 0) return;
  on_reclaimed_(reclaimed);
  spdlog::info("idle TTL {}: released {} sequences no call had named", absl::FormatDuration(ttl_),
               reclaimed);
}

}  // namespace indexer::server
