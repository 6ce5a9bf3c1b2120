// RequestExecutor: the threads that run request handlers, so gRPC's own callback threads never
// block on the engine. Submit from any thread; Stop() runs what was queued, then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace indexer::server {

class RequestExecutor {
 public:
  explicit RequestExecutor(int threads);
  ~RequestExecutor() { Stop(); }
  RequestExecutor(const RequestExecutor&) = delete;
  RequestExecutor& operator=(const RequestExecutor&) = delete;

  void Submit(std::function<void()> task);
  // Finishes every queued task, then joins the threads. Idempotent.
  void Stop();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace indexer::server
