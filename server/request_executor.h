// RequestExecutor: the threads that run request handlers, so gRPC's own callback threads never
// block on the engine. Submit from any thread; Stop() runs what was queued, then joins.
//
// Waking a sleeping thread costs tens of microseconds on a large host (PERF.md: 30 to 50 µs of
// queue time per call on the H200 machines). With spin_us > 0 (--handler_spin_us), up to
// `max_spinners` idle threads poll for spin_us microseconds after their last task before they
// sleep: a call arriving within that window starts without a wake-up. spin_us = 0 (the server's
// default) turns it off.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace indexer::server {

class RequestExecutor {
 public:
  explicit RequestExecutor(int threads, int spin_us = 0, int max_spinners = 2);
  ~RequestExecutor() { Stop(); }
  RequestExecutor(const RequestExecutor&) = delete;
  RequestExecutor& operator=(const RequestExecutor&) = delete;

  void Submit(std::function<void()> task);
  // Finishes every queued task, then joins the threads. Idempotent.
  void Stop();

 private:
  void Work();
  // Polls for up to spin_us_ for a task; true with *task set when one was taken.
  bool Spin(std::function<void()>* task);

  const int spin_us_;
  const int max_spinners_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stopping_ = false;                     // guarded by mu_
  std::atomic<int> queued_{0};                // queue_.size(), readable without mu_
  std::atomic<int> spinners_{0};              // threads in Spin
  std::vector<std::thread> threads_;
};

}  // namespace indexer::server
