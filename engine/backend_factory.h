// MakeBackend / MakeBackends: pick and build the KeyCacheBackend(s) a server runs on -- one per
// device, each with its slot of the global page ids. Called once at start (IndexerServer, tests).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/key_cache_backend.h"

namespace indexer::engine {

// What the server's --device, --devices and --cpu_devices ask for.
struct DeviceChoice {
  std::string kind = "auto";  // "cpu", "cuda" or "auto" (CUDA when usable, else CPU)
  // CUDA ordinals to drive; empty: every visible GPU (--devices=all).
  std::vector<int> cuda_devices;
  int cpu_devices = 1;        // simulated devices of the CPU backend
};

// One backend per device: device d gets DeviceSlot{ordinal, d * capacity_pages, capacity_pages}
// (capacity_pages is per device). For the CPU, `cpu_devices` backends with ordinals 0..N-1, each
// with config.cpu_threads threads (or, when 0, an equal share of the hardware threads).
// Errors: INVALID_ARGUMENT for an unknown kind, a GPU ordinal that is not visible, a repeated
// ordinal, or more pages in all than int32 ids can name; FAILED_PRECONDITION when "cuda" is asked
// for and unavailable; RESOURCE_EXHAUSTED when a pool does not fit its device's memory.
absl::StatusOr<std::vector<DeviceBackend>> MakeBackends(const EngineConfig& config,
                                                        const DeviceChoice& choice);

// One backend, device 0, pages [0, capacity_pages): MakeBackends with the defaults of `device`
// ("cpu", "cuda" or "auto"), for callers that drive one device.
absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeBackend(const EngineConfig& config,
                                                             absl::string_view device);

// Whether this build includes the CUDA backend.
bool BuiltWithCuda();

}  // namespace indexer::engine
