// Wave: the steps of one Batch call on distinct sequences, applied together, and the phases
// they go through:
//
//   Lock     resolve the sequences (creating those an append starts) and lock them all in
//            address order; a wave that finds one busy parks until it is unlocked instead of
//            holding a thread (SequenceMutex::TryLockOrNotify) and then tries again;
//   Charge   check each selection's span against its sequence and take its answer bytes from
//            the call's AnswerBudget;
//   Apply    apply the appends (pages, copy-on-write, lengths) and prepare each step's key write
//            and select task, with its outputs where the call wants them (OutputSink);
//   Submit   hand each device's writes and selections to its SelectBatcher, in chunks of at most
//            max_select_scores raw scores (one chunk per device for decode-sized waves), every
//            chunk before any has ended, so devices run in parallel;
//   Complete once every chunk has ended: commit each step whose work succeeded, Rollback the
//            others (nothing of a failed step stays), unlock, and report.
//
// The sequences stay locked from Lock to Complete, so a later call on the same sequence sees
// this step's append (read-your-own-writes) and a failed step can be taken back whole. Complete
// runs on whichever thread ends the last chunk (possibly the device's completion thread, or
// inside Run). Internal to the engine: BatchCall (engine/batch_call.h) runs a call's waves one
// after the other.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/call_control.h"
#include "engine/engine_core.h"
#include "engine/engine_observer.h"
#include "engine/request_validation.h"
#include "engine/step_request.h"

namespace indexer::engine {

// What a wave shares with its call: the results it fills (results[step.index]), the answer
// budget, the call's control and outputs, and where its time goes.
struct CallContext {
  std::vector<absl::StatusOr<StepResult>>& results;
  AnswerBudget& budget;
  const CallControl& control;
  OutputSink* sink;  // null: outputs into StepResult's vectors
  CallPhases& phases;
};

class Wave {
 public:
  // Runs once the wave has ended: every step's result set and every sequence unlocked.
  using Done = absl::AnyInvocable<void() &&>;

  // `steps` point into the call's prepared items, on distinct (tenant, sequence) pairs.
  Wave(EngineCore& core, std::span<PreparedStep* const> steps, CallContext call, Done done);
  Wave(const Wave&) = delete;
  Wave& operator=(const Wave&) = delete;

  // Starts the wave; `done` runs when it has ended, possibly before Start returns.
  void Start();

 private:
  // The sequence's state before a step's append, to take the append back.
  struct AppendUndo {
    absl::InlinedVector<int64_t, 4> lengths;
    size_t pages = 0;
    size_t attn_pages = 0;
    bool attn_decided = false;
    absl::InlinedVector<std::pair<int64_t, int32_t>, 2> replaced;  // copied-on-write: block, original
  };
  // One step of the wave, from its prepared request to its result.
  struct Step {
    PreparedStep* request = nullptr;
    std::shared_ptr<Sequence> seq;
    bool created = false;   // this call created the sequence
    bool failed = false;    // its result is an error already
    bool applied = false;   // its append (if any) is in the sequence: commit or roll back
    int64_t start_pos = 0;
    int64_t charged = 0;    // answer bytes taken beyond the item's reservation
    AppendUndo undo;
    bool writes = false;
    KeyWrite write;
    absl::InlinedVector<int64_t, 4> write_starts;  // write.layer_start points here
    bool selects = false;
    SelectTask task;
    // Set by the backend for device-resident keys and queries: 1 when a value was not finite.
    int32_t keys_nonfinite = 0;
    int32_t queries_nonfinite = 0;
    int chunk = -1;
  };
  // One SelectBatcher group: a device's share (or part) of the wave.
  struct Chunk {
    int device = 0;
    std::vector<KeyWrite> writes;
    std::vector<SelectTask> selects;
    std::vector<Step*> steps;
    StepStatus status;
  };

  // Lock, then every later phase; returns early when parked.
  void Proceed();
  // Lock: true with every live step's sequence locked; false when parked (Proceed runs again
  // once the busy sequence is unlocked).
  bool Lock();
  void Resolve(std::vector<int64_t>& free, std::vector<int64_t>& planned);
  void Charge(Step& s);
  void Apply(Step& s);
  // FAILED_PRECONDITION when a tensor of the step is device memory that its sequence's backend
  // cannot read (another GPU's, or any for a backend without device tensors).
  absl::Status CheckDeviceTensors(const Step& s) const;
  absl::Status ApplyAppend(Step& s);
  void PrepareSelect(Step& s);
  void Submit();
  void OnChunkDone(size_t chunk, StepStatus status);
  void Complete();
  // Takes back everything of a step (its append, its answer bytes, a sequence it created) and
  // makes `status` its result.
  void Rollback(Step& s, const absl::Status& status);
  // Records a step that failed before anything of it was applied.
  void Fail(Step& s, const absl::Status& status);
  void Unlock();

  EngineCore& core_;
  CallContext call_;
  Done done_;
  std::vector<Step> steps_;
  std::vector<Step*> live_;   // steps with a sequence, in address order: locked together
  std::vector<Step*> unresolved_;  // Resolve's: steps whose sequence it looks up
  std::vector<Chunk> chunks_;
  std::atomic<size_t> pending_{0};
  int stale_retries_ = 0;
  absl::Time phase_start_;
};

}  // namespace indexer::engine
