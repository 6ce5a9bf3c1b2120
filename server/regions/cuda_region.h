// CudaRegion: a CUDA allocation of another process on the server's host, opened once by its IPC
// handle (cudaIpcGetMemHandle in the client) for tensors passed by reference (RegionRegistry):
// `byte_size` bytes at `offset` of the allocation, which the kernels of the device it lives on
// read and write in place. Closed (cudaIpcCloseMemHandle) when destroyed.
//
// What the client must guarantee (the proto says it too): the allocation stays alive while the
// region is registered. The server's mapping keeps the memory mapped if the client frees it
// first (a selection reading it then still runs, on whatever the memory holds, and the server
// keeps serving: tests/gpu/cuda_region_test.cc).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/regions/region_memory.h"

namespace indexer::server {

// Bytes of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

class CudaRegion final : public RegionMemory {
 public:
  // Opens `raw_handle` (kCudaIpcHandleBytes bytes) on CUDA device `device`. INVALID_ARGUMENT for
  // a handle of the wrong size, an empty range or one past the allocation's size;
  // FAILED_PRECONDITION when the allocation is on another device or the server has no CUDA;
  // INVALID_ARGUMENT with CUDA's reason when the handle cannot be opened (not a live allocation
  // of another process, or one of this process).
  static absl::StatusOr<std::unique_ptr<CudaRegion>> Open(absl::string_view raw_handle, int device,
                                                          uint64_t offset, uint64_t byte_size);
  ~CudaRegion() override;
  CudaRegion(const CudaRegion&) = delete;
  CudaRegion& operator=(const CudaRegion&) = delete;

  uint8_t* data() const override { return base_ + offset_; }
  uint64_t size() const override { return size_; }
  int device() const override { return device_; }

 private:
  CudaRegion(uint8_t* base, uint64_t offset, uint64_t size, int device)
      : base_(base), offset_(offset), size_(size), device_(device) {}

  uint8_t* const base_;  // the allocation, as cudaIpcOpenMemHandle mapped it
  const uint64_t offset_;
  const uint64_t size_;
  const int device_;
};

// HostPinning: host memory (a system region's mapping) registered with the CUDA driver and
// mapped for every GPU at its host address, so that the server's kernels read and write the
// region in place. Unregistered when destroyed, which must happen before the memory is unmapped.
class HostPinning {
 public:
  // FAILED_PRECONDITION when the memory cannot be pinned, or (a platform without it) a GPU
  // would see it at another address; the server then reads the region on the host.
  static absl::StatusOr<std::unique_ptr<HostPinning>> Pin(void* data, uint64_t bytes);
  ~HostPinning();
  HostPinning(const HostPinning&) = delete;
  HostPinning& operator=(const HostPinning&) = delete;

 private:
  explicit HostPinning(void* begin) : begin_(begin) {}
  [[maybe_unused]] void* const begin_;  // the page-aligned start registered (CUDA builds)
};

}  // namespace indexer::server
