// CudaAllocation: GPU memory of indexer-bench's own, shared with a server on the same host by
// its CUDA IPC handle, for --shared_memory=cuda (RequestRegion): the bench plays a scheduler
// whose tensors are already on the GPU. Builds without CUDA answer FAILED_PRECONDITION.
//
// Thread-safe: each call makes the allocation's device current on the calling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace indexer::bench {

class CudaAllocation {
 public:
  // `bytes` of device memory on CUDA device `device` (this process's ordinal).
  static absl::StatusOr<std::unique_ptr<CudaAllocation>> Create(size_t bytes, int device);
  ~CudaAllocation();
  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;

  // cudaIpcGetMemHandle's 64 bytes (RegisterCudaRegion's raw_handle).
  const std::string& ipc_handle() const { return handle_; }
  void* data() const { return data_; }  // a device address
  size_t size() const { return bytes_; }
  int device() const { return device_; }
  // Synchronous copies between host memory and [at, at + n) of the allocation.
  absl::Status Upload(uint64_t at, const void* src, size_t n);
  absl::Status Download(uint64_t at, void* dst, size_t n) const;

 private:
  CudaAllocation(void* data, size_t bytes, int device, std::string handle)
      : data_(data), bytes_(bytes), device_(device), handle_(std::move(handle)) {}

  void* const data_;
  const size_t bytes_;
  const int device_;
  const std::string handle_;
};

}  // namespace indexer::bench
