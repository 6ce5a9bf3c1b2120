// EngineObserver: watches the engine's backend launches and its select queues, for metrics
// (server/metrics.h implements it). Set with Engine::SetObserver before serving.
//
// Called from request threads and from the SelectBatcher's threads, concurrently: every method
// must be thread-safe and quick (no I/O, no waiting). The batching methods have empty defaults.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace indexer::engine {

// Where one Batch call's time went in the engine (Engine::Batch and its async form), summed
// over its waves: checking the items, forming each wave (items on distinct sequences) and its
// per-step state, taking the sequences' locks (waiting for busy ones included), applying
// appends and staging the groups for the batchers, waiting in the select queue, the backend's
// staging and launch, the device's work and the results' scatter (StepTiming, the slowest group
// of each wave), and committing or rolling back and answering.
struct CallPhases {
  absl::Duration validate;
  absl::Duration wave;
  absl::Duration lock;
  absl::Duration apply;
  absl::Duration queue;
  absl::Duration stage;
  absl::Duration launch;
  absl::Duration device;
  absl::Duration scatter;
  absl::Duration complete;
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // One backend step that selected (KeyCacheBackend::Run, or Select): how many span selections
  // it ran and how long it took, its key writes included. Steps of key writes alone are not
  // reported, nor are their groups below.
  virtual void OnBackendSelect(int64_t tasks, absl::Duration took) = 0;
  // One backend launch of the SelectBatcher: how many groups (one per call's wave chunk) it
  // merged. Not called with batching off.
  virtual void OnBatchLaunched(int64_t /*groups*/) {}
  // One group left the select queue for a launch after waiting `waited`.
  virtual void OnBatchQueued(absl::Duration /*waited*/) {}
  // One group was refused or dropped before its launch: RESOURCE_EXHAUSTED (the queue bound),
  // DEADLINE_EXCEEDED, CANCELLED or UNAVAILABLE (shutting down).
  virtual void OnBatchDropped(absl::StatusCode /*why*/) {}
  // One Batch, Select or Append call ended: where its time went.
  virtual void OnCallPhases(const CallPhases& /*phases*/) {}
};

}  // namespace indexer::engine
