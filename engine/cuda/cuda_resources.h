// RAII owners of CUDA resources (device memory, pinned host memory, streams, graphs). Their
// errors come back through CudaStatus (engine/cuda/cuda_errors.h).
// Not thread-safe; each owner belongs to one lane of a CudaBackend (or to the backend itself),
// used by one call at a time. Owners free their resource on whatever device is current: the
// backend makes its own device current before it destroys them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "engine/cuda/cuda_errors.h"

namespace indexer::engine {

// The two kinds of memory a CudaMemory owns: device memory from cudaMalloc (never managed) and
// page-locked host memory, mapped into every device's address space at its host address, which
// kernels read and write in place (a step's copies are kernels: kernels/cuda/step_copy.h) and
// copies use as a fast asynchronous source or target.
struct DeviceMemoryKind {
  static cudaError_t Alloc(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
  static void Free(void* p) { (void)cudaFree(p); }
  static constexpr const char* kAllocName = "cudaMalloc";
};
struct PinnedMemoryKind {
  static cudaError_t Alloc(void** p, size_t bytes) {
    cudaError_t err = cudaHostAlloc(p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return err;
    // Unified addressing (every 64-bit platform CUDA supports) maps it at the same address.
    void* device = nullptr;
    err = cudaHostGetDevicePointer(&device, *p, 0);
    if (err == cudaSuccess && device == *p) return cudaSuccess;
    (void)cudaFreeHost(*p);
    *p = nullptr;
    return err != cudaSuccess ? err : cudaErrorNotSupported;
  }
  static void Free(void* p) { (void)cudaFreeHost(p); }
  static constexpr const char* kAllocName = "cudaHostAlloc(mapped, at its host address)";
};

// Owns one allocation of `Kind`; movable, not copyable.
template <typename Kind>
class CudaMemory {
 public:
  CudaMemory() = default;
  ~CudaMemory() { Reset(); }
  CudaMemory(CudaMemory&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  CudaMemory& operator=(CudaMemory&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;

  // Exactly `bytes` (the old contents are freed first; 0 leaves it empty).
  absl::Status Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return absl::OkStatus();
    void* p = nullptr;
    const cudaError_t err = Kind::Alloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the (non-sticky) allocation error
      return CudaStatus(err, Kind::kAllocName);
    }
    ptr_ = p;
    bytes_ = bytes;
    return absl::OkStatus();
  }
  // Grows (contents not kept) to at least `bytes`, with headroom so growth is rare.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    return Allocate(bytes + bytes / 2);
  }
  void Reset() {
    if (ptr_ != nullptr) Kind::Free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

using DeviceBuffer = CudaMemory<DeviceMemoryKind>;
using PinnedBuffer = CudaMemory<PinnedMemoryKind>;

// Owns a non-blocking stream.
class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  // `priority`: cudaStreamCreateWithPriority's (0 the default; lower numbers run first).
  absl::Status Create(int priority = 0) {
    return CudaStatus(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority),
                      "cudaStreamCreateWithPriority");
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Owns a graph (its nodes' handles stay valid while it lives) and, once instantiated, its
// executable graph. Movable, so caches can hold them by value.
class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph() { Reset(); }
  CudaGraph(CudaGraph&& o) noexcept
      : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)) {}
  CudaGraph& operator=(CudaGraph&& o) noexcept {
    if (this != &o) {
      Reset();
      graph_ = std::exchange(o.graph_, nullptr);
      exec_ = std::exchange(o.exec_, nullptr);
    }
    return *this;
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  cudaError_t Create() {
    Reset();
    return cudaGraphCreate(&graph_, 0);
  }
  cudaError_t Instantiate() { return cudaGraphInstantiate(&exec_, graph_, 0); }
  void Reset() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }
  cudaGraph_t graph() const { return graph_; }
  cudaGraphExec_t exec() const { return exec_; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace indexer::engine
