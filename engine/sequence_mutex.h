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

  void lock() {
    std::unique_lock<std::mutex> guard(mu_);
    cv_.wait(guard, [this] { return !held_; });
    held_ = true;
  }

  bool try_lock() {
    std::lock_guard<std::mutex> guard(mu_);
    if (held_) return false;
    held_ = true;
    return true;
  }

  // Locks and returns true when the mutex is free. Otherwise keeps `wake` and returns false:
  // `wake` runs once, on the thread of the next unlock, after the mutex was released; whoever
  // it resumes must try again (another caller may have taken the mutex first).
  bool TryLockOrNotify(Wake& wake) {
    std::lock_guard<std::mutex> guard(mu_);
    if (!held_) {
      held_ = true;
      return true;
    }
    waiters_.push_back(std::move(wake));
    return false;
  }

  void unlock() {
    std::vector<Wake> woken;
    {
      std::lock_guard<std::mutex> guard(mu_);
      held_ = false;
      woken.swap(waiters_);
    }
    cv_.notify_one();
    for (Wake& w : woken) std::move(w)();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  std::vector<Wake> waiters_;  // parked callers, woken by the next unlock
};

}  // namespace indexer::engine
