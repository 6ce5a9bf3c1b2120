// PagePool: which page ids of the key cache are free and how many sequences reference each.
// It holds no key data (the backend does); it is the single source of truth for accounting.
//
// Thread-safe: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace indexer::engine {

class PagePool {
 public:
  explicit PagePool(int64_t num_pages);

  // Takes `n` free pages, each with one reference, or none at all: RESOURCE_EXHAUSTED when fewer
  // than `n` are free.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t n);

  // Adds one reference to each page (all must be allocated).
  void AddRef(std::span<const int32_t> pages);

  // Drops one reference from each page; returns how many pages became free.
  int64_t Release(std::span<const int32_t> pages);

  // References held on `page` (0 when free).
  int32_t RefCount(int32_t page) const;

  int64_t total_pages() const { return static_cast<int64_t>(refs_.size()); }
  int64_t free_pages() const;

 private:
  mutable std::mutex mu_;
  std::vector<int32_t> refs_;       // per page
  std::vector<int32_t> free_list_;  // stack of free page ids
};

}  // namespace indexer::engine
