// CpuBackend: the key cache in host memory and the reference selector run on a thread pool.
// Serves real traffic on machines without a GPU, and is what `--device cpu` selects.
//
// Thread-safe as KeyCacheBackend requires.
#pragma once

#include <memory>
#include <vector>

#include "engine/config.h"
#include "engine/key_cache_backend.h"
#include "engine/thread_pool.h"

namespace indexer::engine {

class CpuBackend final : public KeyCacheBackend {
 public:
  // Reserves (but does not touch) the whole pool: config.capacity_pages pages of every layer.
  explicit CpuBackend(const EngineConfig& config);

  std::string name() const override { return "cpu"; }
  std::string device() const override;
  absl::Status WriteKeys(const KeyWrite& write) override;
  absl::Status CopyPage(int32_t src, int32_t dst) override;
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override;
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override;
  absl::Status Select(std::span<const SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override;

 private:
  kernels::KeyPoolView LayerView(int layer) const;

  EngineConfig config_;
  int64_t layer_bytes_;                   // bytes of one layer's pool
  std::unique_ptr<uint8_t[]> storage_;    // [layers][pages][128][head_dim] elements
  ThreadPool pool_;
};

}  // namespace indexer::engine
