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

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // One KeyCacheBackend::Select call: how many span selections it ran and how long it took.
  virtual void OnBackendSelect(int64_t tasks, absl::Duration took) = 0;
  // One backend launch of the SelectBatcher: how many groups (one per call's wave chunk) it
  // merged. Not called with batching off.
  virtual void OnBatchLaunched(int64_t /*groups*/) {}
  // One group left the select queue for a launch after waiting `waited`.
  virtual void OnBatchQueued(absl::Duration /*waited*/) {}
  // One group was refused or dropped before its launch: RESOURCE_EXHAUSTED (the queue bound),
  // DEADLINE_EXCEEDED, CANCELLED or UNAVAILABLE (shutting down).
  virtual void OnBatchDropped(absl::StatusCode /*why*/) {}
};

}  // namespace indexer::engine
