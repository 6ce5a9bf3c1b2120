// ThreadPool: a fixed set of worker threads for data-parallel loops.
//
// ParallelFor may be called from any thread, concurrently, and from inside a ParallelFor body:
// the caller always works on its own loop too, so nested or concurrent loops cannot deadlock.
// Destruction joins the workers; loops still running must have returned first.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace indexer::engine {

class ThreadPool {
 public:
  // `threads` workers besides the callers; 0 means run every loop on the calling thread.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Calls body(i) for every i in [0, n), in any order and on any threads, and returns when all
  // calls have returned.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& body);
  // Runs `task` on a worker, later (on the calling thread, now, when there are no workers).
  // Destruction runs every task posted before it.
  void Post(std::function<void()> task);

  int size() const { return static_cast<int>(workers_.size()); }

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace indexer::engine
