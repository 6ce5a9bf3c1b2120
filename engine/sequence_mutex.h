// SequenceMutex: the lock that serialises the calls on one sequence. Unlike std::mutex it may be
// unlocked by a thread other than the one that locked it, because a step holds its sequences from
// the moment it applies its appends until the device has answered its selections, and that answer
// arrives on the device's completion thread.
//
// Besides lock/try_lock/unlock (so std::lock_guard and std::unique_lock work), a caller that must
// not block can ask to be told when the mutex is next unlocked (TryLockOrNotify): the engine
// parks a wave that finds a sequence busy that way instead of holding a thread for it.
// Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"

namespace indexer::engine {

class SequenceMutex {
 public:
  using Wake = absl::AnyInvocable<void() &&>;

  SequenceMutex() = default;
  SequenceMutex(const SequenceMutex&) = delete;
  SequenceMutex& operator=(const SequenceMutex&) = delete;

  bool try_lock() {
    int free = kFree;
    return state_.compare_exchange_strong(free, kHeld, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }

  void lock() {
    if (try_lock()) return;
    std::unique_lock<std::mutex> guard(mu_);
    while (!LockOrMarkLocked()) cv_.wait(guard);
  }

  // Locks and returns true when the mutex is free. Otherwise keeps `wake` and returns false:
  // `wake` runs once, on the thread of the next unlock, after the mutex was released; whoever
  // it resumes must try again (another caller may have taken the mutex first).
  bool TryLockOrNotify(Wake& wake) {
    if (try_lock()) return true;
    std::lock_guard<std::mutex> guard(mu_);
    if (LockOrMarkLocked()) return true;
    waiters_.push_back(std::move(wake));
    return false;
  }

  void unlock() {
    // Uncontended: nobody waits or is parked, nothing else to do.
    if (state_.exchange(kFree, std::memory_order_release) == kHeld) return;
    std::vector<Wake> woken;
    {
      std::lock_guard<std::mutex> guard(mu_);
      woken.swap(waiters_);
    }
    cv_.notify_all();
    for (Wake& w : woken) std::move(w)();
  }

 private:
  enum State : int { kFree, kHeld, kHeldWithWaiters };

  // Under mu_: takes the mutex when free (marking it contended: others may wait), else marks it
  // contended so that its unlock takes the slow path and wakes the waiters. True when taken.
  bool LockOrMarkLocked() {
    int s = state_.load(std::memory_order_relaxed);
    for (;;) {
      if (s == kFree) {
        if (state_.compare_exchange_weak(s, kHeldWithWaiters, std::memory_order_acquire,
                                         std::memory_order_relaxed)) {
          return true;
        }
      } else if (s == kHeldWithWaiters ||
                 state_.compare_exchange_weak(s, kHeldWithWaiters, std::memory_order_relaxed)) {
        return false;
      }
    }
  }

  // kFree, kHeld, or kHeldWithWaiters: held, and someone waits on cv_ or is parked in
  // waiters_ (or was: a slow unlock finds out). Changes to kHeldWithWaiters happen under mu_, so
  // an unlock that sees it, and then takes mu_, finds every waiter registered.
  std::atomic<int> state_{kFree};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Wake> waiters_;  // parked callers, woken by the next slow unlock
};

}  // namespace indexer::engine
