// CudaBackend: the key cache in GPU memory (one cudaMalloc at start) and the CUDA selectors, on
// one device slot: device `slot.ordinal`, holding global page ids
// [slot.first_page, slot.first_page + slot.num_pages). What `--device cuda` (or auto, on a
// machine with a GPU) runs on; a server with several GPUs builds one backend per device.
//
// Thread-safe and concurrent. A step (Run: a wave's key writes and selections, merged by the
// SelectBatcher) takes one of the backend's lanes (engine/cuda/cuda_lane.h: a stream, pinned and
// device staging, score scratch, counters and a graph cache each), is staged on the calling
// thread and launched as one graph -- a copy kernel that reads the staging, the append kernel,
// the selectors, a copy kernel that writes the results back -- by the lane's completion thread
// while that one spins for work (else by the calling thread), and finishes on the completion
// thread, which scatters the results and calls back: no caller's thread waits for the GPU. The
// synchronous calls (WriteKeys, Select, CopyPage, ReadPages, WritePages) take a lane too and
// return once their work on the device is complete, so what one call wrote is visible to any
// later call, whatever lane it takes. Every call makes
// the backend's device current on the calling thread once it holds its lane (it does not restore
// the previous device: callers mixing devices set theirs before each CUDA call).
//
// Page ids are global everywhere: KeyWrite and SelectTask block tables, CopyPage, ReadPages,
// WritePages. The backend subtracts slot.first_page while staging; an id outside the slot is a
// caller's bug and comes back INTERNAL before any device memory is touched. Attention pages are
// not ids of this pool and pass through unchanged.
//
// A step that selects (input copy, append kernel, selector kernels, result copy) runs as one CUDA
// graph launch when graphs are on (select_graph.h), else as separate enqueues; answers are
// identical.
// CUDA failures come back as INTERNAL statuses carrying CUDA's message; nothing aborts.
//
// A sticky CUDA error (IsStickyCudaError, engine/cuda/cuda_errors.h: a faulting kernel, an
// uncorrectable ECC error, ...) poisons the device's context for the rest of the process. The
// call that meets one marks the backend failed (DeviceFailure) and returns UNAVAILABLE, naming
// the device and carrying CUDA's message; from then on Health() returns that status and every
// call returns it at once without touching the GPU. Only a restart makes the device usable.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/key_cache_backend.h"

namespace indexer::engine {

// OK when a CUDA device can be used; otherwise why not (no driver, no device, ...).
absl::Status CudaDeviceAvailable();

// Visible CUDA devices; 0 when there are none or CUDA cannot be initialised (never fails loudly).
int CudaDeviceCount();

// How a CudaBackend runs; EngineConfig does not carry these (they change no answer).
struct CudaBackendOptions {
  int lanes = 2;             // steps in flight on the device at once (1 to 8)
  bool use_graphs = true;    // one graph launch per selection step
  int graphs_per_lane = 64;  // LRU bound of each lane's graph cache

  // The defaults, overridden by INDEXER_CUDA_GRAPHS (0 or 1) and INDEXER_CUDA_LANES (1 to 8).
  // The environment is read once per process; values out of range are ignored.
  static CudaBackendOptions FromEnvironment();
};

// What FromEnvironment does with the two variables' values (nullptr: not set).
CudaBackendOptions ParseCudaBackendOptions(const char* graphs, const char* lanes);

// Builds the backend on device slot.ordinal with slot.num_pages pages (config.capacity_pages
// when slot.num_pages is 0), allocated and cleared. INVALID_ARGUMENT for a slot that is not
// usable (ordinal not visible, negative first_page, ids past int32) or a configuration that
// needs more shared memory than the device has (max_tokens_per_sequence too large);
// RESOURCE_EXHAUSTED when the pool does not fit the device's free memory. Options come from
// CudaBackendOptions::FromEnvironment() unless given.
absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config,
                                                                 const DeviceSlot& slot);
absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config,
                                                                 const DeviceSlot& slot,
                                                                 const CudaBackendOptions& options);

// Monotonic counts of what a CudaBackend did, for tests and diagnostics.
struct CudaBackendCounters {
  int lanes = 0;
  int peak_busy_lanes = 0;         // most lanes ever held at once (key-write lanes not counted)
  int64_t steps = 0;               // steps that ran kernels (key writes, selections or both)
  int64_t selects = 0;             // ... of which with selections
  int64_t graph_launches = 0;      // steps that reached the device as one graph launch
  int64_t graph_builds = 0;        // graphs instantiated
  int64_t graph_node_updates = 0;  // node parameter updates of cached graphs
  int64_t graph_fallbacks = 0;     // steps run without a graph after a graph build/update failed
  int64_t buffer_growths = 0;      // lanes' buffers allocated anew, seen by a Select (drops graphs)
  int64_t exact_reruns = 0;        // spans run again on the exact path (device inputs' scans)
};

// The counters of a backend that MakeCudaBackend built; nullopt for any other backend.
std::optional<CudaBackendCounters> GetCudaBackendCounters(const KeyCacheBackend& backend);

}  // namespace indexer::engine
