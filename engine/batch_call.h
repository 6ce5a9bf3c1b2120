// BatchCall: one Batch (or Select, or Append) call run without holding a thread: every item is
// checked first (request_validation.h), then the call's waves -- maximal runs of items on
// distinct sequences, so a sequence's steps apply in item order -- run one after the other
// (engine/wave.h), then the call's callback gets every item's result.
//
// The answer budget: each prepared item reserves the bytes of the error it may end with, every
// item that failed its checks takes its error's bytes, and a success takes what its results need
// beyond its reservation. So the answer of a call never exceeds max_response_bytes, however its
// items end, and a call whose errors alone would exceed it fails whole, applying nothing.
//
// Internal to the engine (Engine::BatchAsync starts one). Deletes itself after its callback.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/call_control.h"
#include "engine/call_gate.h"
#include "engine/engine_core.h"
#include "engine/engine_observer.h"
#include "engine/request_validation.h"
#include "engine/step_request.h"
#include "engine/wave.h"

namespace indexer::engine {

// A call's end: `call` is OK unless the call failed whole (then nothing of it was applied and
// `results` holds that status for every item); otherwise one result per item, in item order.
using BatchDone = absl::AnyInvocable<void(absl::Status call,
                                          std::vector<absl::StatusOr<StepResult>> results) &&>;

class BatchCall {
 public:
  // Runs the call; `done` runs once, on any thread, possibly before Start returns. `items`, what
  // they view and `sink` must outlive the call (until `done` has run). `observer` may be null.
  static void Start(EngineCore& core, CallGate& gate, std::span<const StepRequest> items,
                    const CallControl& control, OutputSink* sink, EngineObserver* observer,
                    BatchDone done);

 private:
  BatchCall(EngineCore& core, CallGate& gate, std::span<const StepRequest> items,
            const CallControl& control, OutputSink* sink, EngineObserver* observer,
            BatchDone done);
  // Checks every item and reserves the answer; false when the call ended (Finish ran).
  bool Prepare();
  // Runs waves until one is left running on another thread, or the call ends.
  void RunWaves();
  void OnWaveDone();
  void Finish(absl::Status call);

  CallGate::Pass pass_;  // held until the call has answered: snapshots wait for it
  EngineCore& core_;
  const std::span<const StepRequest> items_;
  const CallControl control_;
  OutputSink* const sink_;
  EngineObserver* const observer_;
  BatchDone done_;
  std::vector<PreparedStep> steps_;
  std::vector<PreparedStep*> ready_;  // items that passed their checks, in item order
  std::vector<absl::StatusOr<StepResult>> results_;
  AnswerBudget budget_;
  CallPhases phases_;
  size_t next_ = 0;  // first ready item of the next wave
  std::unique_ptr<Wave> wave_;
  // Hand-off between the thread starting a wave and the one ending it, so that waves that end
  // while they start run the next wave in a loop rather than by recursion.
  enum WaveState : int { kIdle, kStarting, kEnded };
  std::atomic<int> wave_state_{kIdle};
};

}  // namespace indexer::engine
