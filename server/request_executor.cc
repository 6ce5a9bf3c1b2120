#include "server/request_executor.h"

#include <chrono>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace indexer::server {
namespace {

void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

RequestExecutor::RequestExecutor(int threads, int spin_us, int max_spinners)
    : spin_us_(spin_us < 0 ? 0 : spin_us), max_spinners_(max_spinners < 0 ? 0 : max_spinners) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
}

bool RequestExecutor::Spin(std::function<void()>* task) {
  if (spin_us_ == 0) return false;
  if (spinners_.fetch_add(1, std::memory_order_acq_rel) >= max_spinners_) {
    spinners_.fetch_sub(1, std::memory_order_acq_rel);
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
  for (int i = 0;; ++i) {
    if (queued_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!queue_.empty()) {
        *task = std::move(queue_.front());
        queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
        // Counted out before the lock is released: a Submit that takes the lock next must not
        // count this thread, now busy, as a spinner that will take its task (it would not wake
        // a sleeper, and its task would wait for this one to finish).
        spinners_.fetch_sub(1, std::memory_order_acq_rel);
        return true;
      }
      if (stopping_) break;
    }
    CpuRelax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= deadline) break;
  }
  spinners_.fetch_sub(1, std::memory_order_acq_rel);
  return false;
}

void RequestExecutor::Work() {
  for (;;) {
    std::function<void()> task;
    if (!Spin(&task)) {
      // The wait re-checks the queue under the lock first, so a task submitted while this thread
      // was spinning (and not notified for it) is taken here.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    task();
  }
}

void RequestExecutor::Submit(std::function<void()> task) {
  int queued = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    queued = queued_.fetch_add(1, std::memory_order_acq_rel) + 1;
  }
  // A spinning thread takes the task without a wake-up; wake a sleeper only for the tasks the
  // spinners cannot cover. A spinner that gives up re-checks the queue under the lock before it
  // sleeps, so nothing is left behind.
  if (queued > spinners_.load(std::memory_order_acquire)) cv_.notify_one();
}

void RequestExecutor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

}  // namespace indexer::server
