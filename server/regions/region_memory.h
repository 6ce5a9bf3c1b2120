// RegionMemory: the memory behind a registered region (RegionRegistry), whatever holds it: a
// mapping of a POSIX shared memory object (SystemRegion, host memory) or a CUDA allocation of
// another process opened by its IPC handle (CudaRegion, memory of one GPU). The memory stays
// usable until the object is destroyed; `data()` is a host address or a device address as
// `device()` says.
#pragma once

#include <cstdint>

namespace indexer::server {

class RegionMemory {
 public:
  virtual ~RegionMemory() = default;

  // The region's first byte and its size.
  virtual uint8_t* data() const = 0;
  virtual uint64_t size() const = 0;
  // -1 for host memory; else the CUDA device (the server's ordinal) the memory is on, which
  // only that device's kernels may touch.
  virtual int device() const { return -1; }
};

}  // namespace indexer::server
