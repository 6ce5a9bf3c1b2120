// RequestRegion: with --shared_memory=system or cuda, the memory a worker's decode requests name
// instead of carrying bytes, as a scheduler beside the server would: keys and queries are
// written into it and the outputs are asked back into it (RegionRef, indexer.proto). One region
// per worker -- a shared memory object, or GPU memory shared by its CUDA IPC handle --
// registered on every server under one name and split into one slab per request the worker may
// have in flight; a slab is refilled only once its request has been answered. A CUDA region is
// filled through a host copy of it: Flush uploads the slab's inputs before the request is sent,
// Fetch downloads its outputs once it is answered (both outside the request's timing, as a
// scheduler's tensors would already be on the GPU).
//
// Threads: one worker's, like its SimulatedScheduler.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/bench/cuda_allocation.h"
#include "client/bench/workload.h"
#include "client/cpp/shared_memory.h"
#include "client/cpp/sharded_client.h"

namespace indexer::bench {

// The most bytes one decode request of `spec` puts in its slab: every item's queries, keys and
// outputs (page tables included with attention pages, and always for CUDA regions, which take
// all three outputs), each 16-byte aligned.
size_t SlabBytes(const WorkloadSpec& spec, const ServerShape& shape);

class RequestRegion {
 public:
  // Creates the object (`slabs` x `slab_bytes`) and registers it on every server of `servers`.
  // The servers' error when one refuses (FAILED_PRECONDITION for a server without regions,
  // NOT_FOUND for one on another host, which cannot see the object).
  // `kind` is kSystem or kCuda; a CUDA region is on this process's GPU `cuda_device`, which the
  // servers must see under the same ordinal.
  static absl::StatusOr<std::unique_ptr<RequestRegion>> Create(client::ShardedClient& servers,
                                                               size_t slab_bytes, int slabs,
                                                               const client::CallOptions& call,
                                                               SharedMemory kind = SharedMemory::kSystem,
                                                               int cuda_device = 0);
  // Unregisters it everywhere; a server that cannot be reached drops it when it stops.
  ~RequestRegion();
  RequestRegion(const RequestRegion&) = delete;
  RequestRegion& operator=(const RequestRegion&) = delete;

  // The next Put and Room fill slab `slab` from its start (its previous request was answered).
  void Begin(int slab);
  // Copies `bytes` into the slab: their reference; nullopt when the slab is full.
  std::optional<v1::RegionRef> Put(absl::string_view bytes);
  // Room for `values` int32 outputs in the slab; nullopt when it is full.
  std::optional<v1::RegionRef> Room(size_t values);
  // The int32 values at `ref` (an output the server wrote, once Fetch has run for a CUDA
  // region).
  const int32_t* At(const v1::RegionRef& ref) const;
  // CUDA regions: uploads what Put wrote into the current slab; downloads slab `slab`. Nothing
  // to do for system regions.
  absl::Status Flush();
  absl::Status Fetch(int slab);
  bool on_gpu() const { return gpu_ != nullptr; }

 private:
  RequestRegion(client::ShardedClient& servers, std::string name, size_t slab_bytes)
      : servers_(servers), name_(std::move(name)), slab_bytes_(slab_bytes) {}
  std::optional<uint64_t> Take(size_t bytes);
  uint8_t* host() const { return memory_ != nullptr ? memory_->data() : mirror_.get(); }

  client::ShardedClient& servers_;
  const std::string name_;
  std::unique_ptr<client::SharedMemoryRegion> memory_;  // system
  std::unique_ptr<CudaAllocation> gpu_;                 // cuda, with its host copy:
  std::unique_ptr<uint8_t[]> mirror_;
  uint64_t begin_ = 0;  // the current slab's start
  const size_t slab_bytes_;
  uint64_t next_ = 0;  // the next free byte of the current slab
  uint64_t end_ = 0;   // the current slab's end
};

}  // namespace indexer::bench
