// EngineCore: the state an Engine and its calls share -- the configuration, the devices (each a
// backend and its SelectBatcher), the page pool and the sequence table -- and the decisions that
// need more than one of them. Engine owns one; BatchCall and Wave (engine/batch_call.h,
// engine/wave.h) run a call's steps against it. Internal to the engine.
#pragma once

#include <memory>
#include <vector>

#include "engine/config.h"
#include "engine/key_cache_backend.h"
#include "engine/page_pool.h"
#include "engine/select_batcher.h"
#include "engine/sequence_table.h"
#include "engine/thread_pool.h"

namespace indexer::engine {

struct EngineDevice {
  DeviceSlot slot;
  std::unique_ptr<KeyCacheBackend> backend;
  // After backend: destroyed (drained and joined) before the backend it launches on.
  std::unique_ptr<SelectBatcher> batcher;
};

struct EngineCore {
  EngineCore(const EngineConfig& config, std::vector<DeviceBackend> backends, PageQuotas quotas);

  // The device for a new sequence: the most free pages net of `planned` (pages new sequences of
  // the wave being placed will take, per device; the caller adds a sequence's pages once it was
  // created), skipping failed devices while any other is healthy, ties to the lower index.
  // `free` and `planned` are filled on first use.
  int PlaceNew(std::vector<int64_t>& free, std::vector<int64_t>& planned) const;

  KeyCacheBackend& BackendOf(const Sequence& seq) const { return *devices[seq.device].backend; }

  const EngineConfig config;
  std::vector<EngineDevice> devices;
  PagePool pool;
  SequenceTable sequences;
  // Resumes waves that found a sequence busy, once it is unlocked (off the unlocking thread, which
  // may be a device's completion thread). Last: destroyed, running what was posted, first.
  ThreadPool resume{2};
};

}  // namespace indexer::engine
