// CudaBackend: the key cache in GPU memory (one cudaMalloc at start) and the CUDA selectors.
// What `--device cuda` (or auto, on a machine with a GPU) runs on.
//
// Thread-safe: calls are serialised on one stream (the decode batcher of a later issue merges
// concurrent selections before they get here). CUDA failures come back as INTERNAL statuses
// carrying CUDA's message; nothing aborts the process.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/key_cache_backend.h"

namespace indexer::engine {

// OK when a CUDA device can be used; otherwise why not (no driver, no device, ...).
absl::Status CudaDeviceAvailable();

// Builds the backend on device 0: allocates and clears the whole pool. RESOURCE_EXHAUSTED when
// the pool does not fit the free device memory; INVALID_ARGUMENT when the configuration needs
// more shared memory than the device has (max_tokens_per_sequence too large).
absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config);

}  // namespace indexer::engine
