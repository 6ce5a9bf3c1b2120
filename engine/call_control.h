// CallControl: the deadline and cancellation of the call a request belongs to, as the engine
// sees them. The server fills one per gRPC call; tests fill them directly.
//
// Checked before anything of a request is applied and again by the SelectBatcher before a queued
// selection is launched; a request that has started applying runs to completion. `cancelled` is
// called from request threads and from the batcher's threads, so it must be thread-safe.
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace indexer::engine {

struct CallControl {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
  // CANCELLED when the call was cancelled, DEADLINE_EXCEEDED when its deadline passed, else OK.
  absl::Status Check() const;
};

}  // namespace indexer::engine
