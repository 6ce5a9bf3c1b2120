// CpuBackend: the key cache in host memory and the reference selector run on a thread pool.
// Serves real traffic on machines without a GPU, and is what `--device cpu` selects; with
// `--cpu_devices N` the server builds N of them, one per simulated device (own pool, own
// threads), so that multi-device placement runs and is tested without GPUs.
//
// Page ids are global, as the engine passes them: the backend holds pages
// [slot.first_page, slot.first_page + num_pages) and subtracts slot.first_page itself; an id
// outside the slot is the caller's bug and answers INTERNAL (nothing written).
//
// Thread-safe as KeyCacheBackend requires.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "engine/config.h"
#include "engine/key_cache_backend.h"
#include "engine/thread_pool.h"

namespace indexer::engine {

class CpuBackend final : public KeyCacheBackend {
 public:
  // Reserves (but does not touch) the whole pool: slot.num_pages pages (config.capacity_pages
  // when 0) of every layer. The default slot is device 0 from page 0.
  explicit CpuBackend(const EngineConfig& config, const DeviceSlot& slot = {});

  std::string name() const override { return "cpu"; }
  std::string device() const override;
  absl::Status WriteKeys(const KeyWrite& write) override;
  absl::Status CopyPage(int32_t src, int32_t dst) override;
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override;
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override;
  absl::Status Select(std::span<const SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override;
  // Selections check it between units of work (about a million multiply-adds each).
  void AbandonSelections() override { abandoned_.store(true, std::memory_order_relaxed); }

 private:
  kernels::KeyPoolView LayerView(int layer) const;
  // The slot-local index of global page `page`, or INTERNAL naming it when outside the slot.
  absl::Status Local(int64_t page, int64_t* local) const;

  EngineConfig config_;
  DeviceSlot slot_;
  int64_t pages_;                         // pages this backend holds
  int64_t layer_bytes_;                   // bytes of one layer's pool
  std::unique_ptr<uint8_t[]> storage_;    // [layers][pages][128][head_dim] elements
  ThreadPool pool_;
  std::atomic<bool> abandoned_{false};
};

}  // namespace indexer::engine
