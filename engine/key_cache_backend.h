// KeyCacheBackend: where the key pages live and where selections run (CPU or CUDA).
//
// The engine owns all bookkeeping (PagePool, SequenceTable) and calls a backend only with
// validated arguments for pages it has allocated. A backend may be called from many threads at
// once; the engine guarantees that concurrent calls never write a page another call reads or
// writes. Errors (for example a CUDA failure) are returned as INTERNAL statuses; a backend never
// aborts the process. A backend whose device can no longer be used (a fault that leaves the device
// unusable, such as a sticky CUDA error) says so in Health() and fails every later call at once
// with that status (UNAVAILABLE: engine/device_failure.h) without touching the device again.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "kernels/select_types.h"

namespace indexer::engine {

// Keys for `num_tokens` tokens of layers [layer_begin, layer_begin + layer_count) of one
// sequence, as bf16 bits laid out [num_tokens][layer_count][head_dim]. Layer layer_begin + l
// receives them at positions [layer_start[l], layer_start[l] + num_tokens); position t goes to
// page block_table[t / 128], slot t % 128.
struct KeyWrite {
  const int32_t* block_table = nullptr;
  int64_t num_tokens = 0;
  int layer_begin = 0;
  int layer_count = 1;
  const int64_t* layer_start = nullptr;  // [layer_count]
  const uint16_t* keys = nullptr;
};

// Where a backend's pages live: device `ordinal`, holding global page ids
// [first_page, first_page + num_pages). Callers always pass global ids; the backend translates.
struct DeviceSlot { int ordinal = 0; int64_t first_page = 0; int64_t num_pages = 0; };

// One span selection against one layer. `span`'s pointers are host memory.
struct SelectTask {
  int layer = 0;
  kernels::SpanSelect span;
};

class KeyCacheBackend {
 public:
  virtual ~KeyCacheBackend() = default;

  // "cpu" or "cuda".
  virtual std::string name() const = 0;
  // Human-readable device description for ServerInfo and logs.
  virtual std::string device() const = 0;

  // OK while the device can serve calls. Otherwise the status every call now fails with
  // (UNAVAILABLE, naming the device and the first fatal error); once not OK it stays so for the
  // backend's life. Cheap (no device access) and callable from any thread at any time; the
  // engine reports it per device (Engine::Health, DeviceStats::health). The default: always OK.
  virtual absl::Status Health() const { return absl::OkStatus(); }

  // Stores keys, converting bf16 to the cache's storage type.
  virtual absl::Status WriteKeys(const KeyWrite& write) = 0;

  // Several writes at once (the appends of one wave of a Batch, each to its own pages), so that
  // a decode step of many sequences costs one device round trip instead of one each. On failure
  // any of them may have been partly applied. The default writes them one by one.
  virtual absl::Status WriteKeysBatch(std::span<const KeyWrite> writes);

  // Copies page `src` to page `dst` in every layer (copy-on-write of a shared page).
  virtual absl::Status CopyPage(int32_t src, int32_t dst) = 0;

  // Copies the stored bytes (bf16 or fp8, exactly as the cache holds them) of `pages`, every
  // layer, to host memory: dst receives [pages.size()][layers][kBlockSize][head_dim] elements.
  // For snapshots. The default says the backend cannot (UNIMPLEMENTED).
  virtual absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst);

  // The reverse: stores raw bytes laid out as ReadPages returns them into `pages`, every layer,
  // with no conversion. For restoring snapshots. The default says the backend cannot.
  virtual absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src);

  // Runs every task and fills its outputs. Tasks are independent; results must not depend on
  // how tasks are grouped into calls.
  virtual absl::Status Select(std::span<const SelectTask> tasks,
                              const kernels::PageTableParams& page_table) = 0;
};

// One device of a server: its slot and the backend built for it (MakeBackends; the Engine takes
// a list of them, device d owning pages [d * capacity_pages, (d + 1) * capacity_pages)).
struct DeviceBackend {
  DeviceSlot slot;
  std::unique_ptr<KeyCacheBackend> backend;
};

inline absl::Status KeyCacheBackend::WriteKeysBatch(std::span<const KeyWrite> writes) {
  for (const KeyWrite& w : writes) {
    const absl::Status status = WriteKeys(w);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

inline absl::Status KeyCacheBackend::ReadPages(std::span<const int32_t> /*pages*/,
                                               uint8_t* /*dst*/) {
  return absl::UnimplementedError("backend " + name() + " cannot read pages back (snapshots)");
}

inline absl::Status KeyCacheBackend::WritePages(std::span<const int32_t> /*pages*/,
                                                const uint8_t* /*src*/) {
  return absl::UnimplementedError("backend " + name() + " cannot restore pages (snapshots)");
}

}  // namespace indexer::engine
