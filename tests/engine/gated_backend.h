// GatedBackend: a KeyCacheBackend for batching tests. It records every Select call (how many
// tasks, on which thread, how many ran at once) and can hold calls inside Select until the test
// opens the gate, so that what queues behind a held launch -- and so what the next launch
// merges -- is decided by the test, not by thread timing.
//
// With an inner backend every call is forwarded (selections are real); without one Select only
// records the call and returns `select_status()`. Thread-safe.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/key_cache_backend.h"

namespace indexer::testing {

class GatedBackend final : public engine::KeyCacheBackend {
 public:
  explicit GatedBackend(std::unique_ptr<engine::KeyCacheBackend> inner = nullptr)
      : inner_(std::move(inner)) {}

  std::string name() const override { return inner_ ? inner_->name() : "gated"; }
  std::string device() const override { return inner_ ? inner_->device() : "test"; }
  absl::Status WriteKeys(const engine::KeyWrite& w) override {
    return inner_ ? inner_->WriteKeys(w) : absl::OkStatus();
  }
  absl::Status CopyPage(int32_t src, int32_t dst) override {
    return inner_ ? inner_->CopyPage(src, dst) : absl::OkStatus();
  }
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override {
    return inner_ ? inner_->ReadPages(pages, dst) : absl::OkStatus();
  }
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override {
    return inner_ ? inner_->WritePages(pages, src) : absl::OkStatus();
  }

  absl::Status Select(std::span<const engine::SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override {
    std::unique_lock<std::mutex> lock(mu_);
    calls_.push_back(static_cast<int64_t>(tasks.size()));
    threads_.push_back(std::this_thread::get_id());
    max_running_ = std::max(max_running_, ++running_);
    cv_.notify_all();
    cv_.wait(lock, [this] { return !closed_; });
    lock.unlock();
    absl::Status status = inner_ ? inner_->Select(tasks, page_table) : absl::OkStatus();
    lock.lock();
    --running_;
    if (status.ok()) status = select_status_;
    return status;
  }

  // Calls entering Select from now on wait until Open().
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = false;
    cv_.notify_all();
  }
  // What every Select returns from now on (when the inner backend, if any, succeeded).
  void SetSelectStatus(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    select_status_ = std::move(s);
  }
  // Waits (up to `timeout`) until `n` calls have entered Select; returns whether they did.
  bool WaitForCalls(size_t n, absl::Duration timeout = absl::Seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] { return calls_.size() >= n; });
  }
  // Tasks per Select call, in the order the calls entered.
  std::vector<int64_t> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::vector<std::thread::id> threads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }
  int max_running() const {
    std::lock_guard<std::mutex> lock(mu_);
    return max_running_;
  }
  int64_t total_tasks() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (int64_t c : calls_) n += c;
    return n;
  }

 private:
  std::unique_ptr<engine::KeyCacheBackend> inner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  absl::Status select_status_;
  std::vector<int64_t> calls_;
  std::vector<std::thread::id> threads_;
  int running_ = 0;
  int max_running_ = 0;
};

// Waits (up to 30 s) until `done()` holds, polling; returns whether it did.
template <typename Done>
bool Eventually(Done done) {
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

}  // namespace indexer::testing
