// RegionRegistry: the shared-memory regions clients have registered, by tenant and name, for
// tensors passed by reference (the RegisterSystemRegion, RegisterCudaRegion, UnregisterRegion
// and ListRegions RPCs; CallRegions resolves a call's references). A region is host memory (a
// system region) or memory of one of the server's GPUs (a CUDA region). A tenant sees only its own regions: another
// tenant's name answers as a name never registered.
//
// Regions are shared: a call that resolved one keeps its memory mapped until the call ends, even
// if the region is unregistered meanwhile. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/wire_values.h"
#include "server/regions/cuda_region.h"
#include "server/regions/region_memory.h"

namespace indexer::server {

// Region names are 1 to this many bytes.
inline constexpr size_t kMaxRegionNameBytes = 128;

// What a region is, as ListRegions answers.
struct RegionInfo {
  std::string name;
  std::string kind;  // "system" or "cuda"
  std::string key;   // a system region's object name
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  int device = -1;   // a CUDA region's device
  bool pinned = false;  // a system region the GPUs read and write in place
};

// A registered region: its description, its memory (byte_size bytes, read-write) and, for a
// system region the GPUs may use in place, its pinning (released before the memory).
struct Region {
  RegionInfo info;
  std::unique_ptr<RegionMemory> memory;
  std::unique_ptr<HostPinning> pinning;

  uint8_t* data() const { return memory->data(); }
  uint64_t size() const { return memory->size(); }
  // Where the memory is, as engine::StepRequest places tensors: host memory (kHostTensor),
  // pinned host memory every GPU maps (kMappedHostTensor), or the CUDA device.
  int device() const {
    return pinning != nullptr ? engine::kMappedHostTensor : memory->device();
  }
};

class RegionRegistry {
 public:
  // `max_per_tenant`: the most regions one tenant holds at once; 0 refuses every registration.
  // `cuda_devices`: the GPUs whose memory the server's backend reads in place (none for the CPU
  // backend): CUDA regions may live only there. `pin_system`: system regions are pinned (where
  // the driver allows) so that the backend's kernels read and write them in place.
  explicit RegionRegistry(int max_per_tenant, std::vector<int> cuda_devices = {},
                          bool pin_system = false)
      : max_per_tenant_(max_per_tenant),
        cuda_devices_(std::move(cuda_devices)),
        pin_system_(pin_system) {}

  int max_per_tenant() const { return max_per_tenant_; }

  // Maps and registers a system region (SystemRegion::Map's errors; INVALID_ARGUMENT for a bad
  // name, ALREADY_EXISTS for a name the tenant holds, RESOURCE_EXHAUSTED past max_per_tenant,
  // FAILED_PRECONDITION when that is 0).
  absl::Status RegisterSystem(absl::string_view tenant, absl::string_view name,
                              absl::string_view key, uint64_t offset, uint64_t byte_size);
  // Opens and registers a CUDA region (CudaRegion::Open's errors; the same name and room errors;
  // FAILED_PRECONDITION for a device that is not one of cuda_devices).
  absl::Status RegisterCuda(absl::string_view tenant, absl::string_view name,
                            absl::string_view raw_handle, int device, uint64_t offset,
                            uint64_t byte_size);
  // Unregisters `name`, or every region of the tenant for an empty name; how many. NOT_FOUND
  // for a name the tenant does not hold.
  absl::StatusOr<int> Unregister(absl::string_view tenant, absl::string_view name);
  // One region by name, or all of the tenant's (by name) for an empty name.
  absl::StatusOr<std::vector<RegionInfo>> List(absl::string_view tenant,
                                               absl::string_view name) const;
  // The region, held by the caller for as long as it keeps the pointer. NOT_FOUND.
  absl::StatusOr<std::shared_ptr<const Region>> Find(absl::string_view tenant,
                                                     absl::string_view name) const;

 private:
  using Key = std::pair<std::string, std::string>;  // tenant, name
  absl::Status CheckRoom(absl::string_view tenant) const;  // under mu_
  // Keeps `region` under `name` once the name and room are checked again (under mu_).
  absl::Status Keep(absl::string_view tenant, absl::string_view name,
                    std::shared_ptr<const Region> region);
  // CheckName and CheckRoom, before a region is opened.
  absl::Status CheckRegistrable(absl::string_view tenant, absl::string_view name) const;
  int CountLocked(absl::string_view tenant) const;

  const int max_per_tenant_;
  const std::vector<int> cuda_devices_;
  const bool pin_system_;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<const Region>, std::less<>> regions_;
};

}  // namespace indexer::server
