// MakeBackend: picks and builds the KeyCacheBackend a server runs on.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/key_cache_backend.h"

namespace indexer::engine {

// `device` is "cpu", "cuda" or "auto" (CUDA when this build has it and a GPU is visible, else
// CPU). Returns INVALID_ARGUMENT for an unknown device, FAILED_PRECONDITION when "cuda" is asked
// for and unavailable, RESOURCE_EXHAUSTED when the pool does not fit the device's memory.
absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeBackend(const EngineConfig& config,
                                                             absl::string_view device);

// Whether this build includes the CUDA backend.
bool BuiltWithCuda();

}  // namespace indexer::engine
