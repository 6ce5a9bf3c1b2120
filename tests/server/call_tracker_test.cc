// CallTracker: admits calls until StopAdmitting, counts them until Done, and WaitUntilIdle waits
// for exactly the admitted ones, with a deadline; many threads at once (also under TSan).
#include "server/call_tracker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"

namespace indexer::server {
namespace {

TEST(CallTrackerTest, AdmitsUntilStoppedAndCountsUntilDone) {
  CallTracker calls;
  EXPECT_EQ(calls.in_flight(), 0);
  EXPECT_EQ(calls.last_done(), absl::InfinitePast());
  EXPECT_TRUE(calls.WaitUntilIdle(absl::Now())) << "nothing admitted: idle at once";
  ASSERT_TRUE(calls.Admit());
  ASSERT_TRUE(calls.Admit());
  EXPECT_EQ(calls.in_flight(), 2);
  calls.StopAdmitting();
  EXPECT_FALSE(calls.Admit()) << "admitted after StopAdmitting";
  EXPECT_EQ(calls.in_flight(), 2) << "a refused call must not be counted";
  const absl::Time before = absl::Now();
  calls.Done();
  EXPECT_GE(calls.last_done(), before);
  EXPECT_EQ(calls.in_flight(), 1);
  EXPECT_FALSE(calls.WaitUntilIdle(absl::Now() + absl::Milliseconds(20))) << "one call is in flight";
  calls.Done();
  EXPECT_TRUE(calls.WaitUntilIdle(absl::Now()));
  EXPECT_FALSE(calls.Admit()) << "StopAdmitting is for good";
}

TEST(CallTrackerTest, WaitEndsWhenTheLastCallIsDoneNotAtTheDeadline) {
  CallTracker calls;
  ASSERT_TRUE(calls.Admit());
  calls.StopAdmitting();
  const absl::Time t0 = absl::Now();
  std::thread finisher([&] {
    absl::SleepFor(absl::Milliseconds(100));
    calls.Done();
  });
  EXPECT_TRUE(calls.WaitUntilIdle(t0 + absl::Seconds(60)));
  const absl::Duration waited = absl::Now() - t0;
  finisher.join();
  EXPECT_GE(waited, absl::Milliseconds(90)) << "returned before the call was done";
  EXPECT_LT(waited, absl::Seconds(30)) << "waited for the deadline, not for the call";
}

TEST(CallTrackerTest, ManyThreadsAdmittingWhileShutdownBeginsLeaveNoCallUncounted) {
  for (int round = 0; round < 20; ++round) {
    CallTracker calls;
    std::atomic<int64_t> admitted{0}, refused{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        for (int i = 0; i < 2000; ++i) {
          if (!calls.Admit()) {
            refused.fetch_add(1);
            continue;
          }
          admitted.fetch_add(1);
          calls.Done();
        }
      });
    }
    go.store(true);
    std::this_thread::yield();
    calls.StopAdmitting();
    EXPECT_TRUE(calls.WaitUntilIdle(absl::Now() + absl::Seconds(60)));
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(calls.in_flight(), 0);
    EXPECT_EQ(admitted.load() + refused.load(), 8 * 2000);
    // Once WaitUntilIdle has returned, no call is admitted any more.
    const int64_t admitted_then = admitted.load();
    EXPECT_FALSE(calls.Admit());
    EXPECT_EQ(admitted.load(), admitted_then);
  }
}

}  // namespace
}  // namespace indexer::server
