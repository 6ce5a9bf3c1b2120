#include "engine/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace indexer::engine {

ThreadPool::ThreadPool(int threads) {
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void ThreadPool::Post(std::function<void()> task) {
  if (workers_.empty()) {
    task();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // Shared by the caller and the helpers it enqueues; helpers that start after the loop is done
  // find no index left and only touch this state, which they co-own.
  struct Loop {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto loop = std::make_shared<Loop>();
  const std::function<void(int64_t)>* fn = &body;
  const auto run = [loop, fn, n] {
    int64_t finished = 0;
    for (int64_t i; (i = loop->next.fetch_add(1)) < n;) {
      (*fn)(i);
      ++finished;
    }
    if (finished > 0 && loop->done.fetch_add(finished) + finished == n) {
      std::lock_guard<std::mutex> lock(loop->mu);
      loop->cv.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(n - 1, static_cast<int64_t>(workers_.size()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t h = 0; h < helpers; ++h) {
      // Helpers must not call `body` after ParallelFor returns: they only do so while indices
      // remain, and the caller waits until every index has finished.
      tasks_.emplace_back(run);
    }
  }
  cv_.notify_all();
  run();
  std::unique_lock<std::mutex> lock(loop->mu);
  loop->cv.wait(lock, [&] { return loop->done.load() == n; });
}

}  // namespace indexer::engine
