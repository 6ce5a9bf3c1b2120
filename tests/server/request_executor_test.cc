// RequestExecutor: every submitted task runs exactly once, with and without idle threads spinning
// for the next task; a task submitted just as a spinner gives up is not left behind; tasks that
// need two threads at once get them; Stop() runs what was queued.
#include "server/request_executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <thread>
#include <vector>

namespace indexer::server {
namespace {

using std::chrono::microseconds;
using std::chrono::seconds;

TEST(RequestExecutorTest, RunsEveryTaskOnceWithAndWithoutSpinning) {
  for (int spin_us : {0, 50, 2000}) {
    std::atomic<int> ran{0};
    {
      RequestExecutor executor(4, spin_us);
      std::vector<std::thread> submitters;
      for (int t = 0; t < 4; ++t) {
        submitters.emplace_back([&] {
          for (int i = 0; i < 2500; ++i) executor.Submit([&] { ran.fetch_add(1); });
        });
      }
      for (auto& s : submitters) s.join();
      executor.Stop();
    }
    EXPECT_EQ(ran.load(), 10000) << "spin_us " << spin_us;
  }
}

TEST(RequestExecutorTest, TaskSubmittedAsTheSpinnerGivesUpStillRuns) {
  // One thread, one spinner: submissions land before, during and just after its 100 µs window.
  RequestExecutor executor(1, 100, 1);
  std::mt19937 rng(7);
  for (int i = 0; i < 1500; ++i) {
    std::promise<void> done;
    std::future<void> f = done.get_future();
    executor.Submit([&done] { done.set_value(); });
    ASSERT_EQ(f.wait_for(seconds(5)), std::future_status::ready) << "task " << i << " was not run";
    std::this_thread::sleep_for(microseconds(rng() % 250));
  }
}

TEST(RequestExecutorTest, TwoTasksThatNeedTwoThreadsGetThem) {
  // Each task waits for the other to start: with one thread spinning and one asleep, the second
  // submission must wake the sleeper.
  for (int spin_us : {0, 100, 5000}) {
    RequestExecutor executor(2, spin_us, 1);
    for (int round = 0; round < 200; ++round) {
      std::atomic<int> started{0};
      std::atomic<bool> stuck{false};
      std::promise<void> a, b;
      const auto task = [&](std::promise<void>* done) {
        started.fetch_add(1);
        const auto until = std::chrono::steady_clock::now() + seconds(5);
        while (started.load() < 2) {
          if (std::chrono::steady_clock::now() > until) {
            stuck = true;
            break;
          }
          std::this_thread::yield();
        }
        done->set_value();
      };
      executor.Submit([&] { task(&a); });
      executor.Submit([&] { task(&b); });
      a.get_future().wait();
      b.get_future().wait();
      ASSERT_FALSE(stuck.load()) << "spin_us " << spin_us << " round " << round
                                 << ": the second task found no thread";
      std::this_thread::sleep_for(microseconds(round % 7 * 30));
    }
  }
}

TEST(RequestExecutorTest, StopRunsWhatWasQueued) {
  std::atomic<int> ran{0};
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  RequestExecutor executor(1, 1000);
  executor.Submit([gate] { gate.wait(); });
  for (int i = 0; i < 100; ++i) executor.Submit([&] { ran.fetch_add(1); });
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release.set_value();
  });
  executor.Stop();
  releaser.join();
  EXPECT_EQ(ran.load(), 100);
}

}  // namespace
}  // namespace indexer::server
