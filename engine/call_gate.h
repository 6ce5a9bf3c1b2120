// CallGate: lets the engine stop every call for a moment (a snapshot must see all sequences and
// pages as of one instant) without slowing calls down the rest of the time.
//
// Calls hold a CallGate::Pass while they run; Pause() waits for the running calls to finish
// and keeps new ones waiting until it is resumed. A waiting Pause wins over new calls, so a
// busy server cannot starve it. Thread-safe. A thread must not Pause while it holds a Pass.
#pragma once

#include <condition_variable>
#include <mutex>

namespace indexer::engine {

class CallGate {
 public:
  // Held by a call for as long as it runs.
  class Pass {
   public:
    explicit Pass(CallGate& gate) : gate_(gate) { gate_.Enter(); }
    ~Pass() { gate_.Leave(); }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

   private:
    CallGate& gate_;
  };

  // Held while every call is stopped.
  class Paused {
   public:
    explicit Paused(CallGate& gate) : gate_(gate) { gate_.Pause(); }
    ~Paused() { gate_.Resume(); }
    Paused(const Paused&) = delete;
    Paused& operator=(const Paused&) = delete;

   private:
    CallGate& gate_;
  };

 private:
  void Enter() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return pausers_ == 0; });
    ++running_;
  }
  void Leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--running_ == 0) cv_.notify_all();
  }
  void Pause() {
    std::unique_lock<std::mutex> lock(mu_);
    ++pausers_;  // from here on, new calls wait
    cv_.wait(lock, [this] { return running_ == 0 && !paused_; });
    paused_ = true;
  }
  void Resume() {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
    --pausers_;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0;      // calls holding a Pass
  int pausers_ = 0;      // Pause calls waiting or holding the gate
  bool paused_ = false;  // one Pause holds the gate
};

}  // namespace indexer::engine
