// RegionRegistry: the shared-memory regions clients have registered, by tenant and name, for
// tensors passed by reference (the RegisterSystemRegion, UnregisterRegion and ListRegions RPCs;
// CallRegions resolves a call's references). A tenant sees only its own regions: another
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
#include "server/regions/system_region.h"

namespace indexer::server {

// Region names are 1 to this many bytes.
inline constexpr size_t kMaxRegionNameBytes = 128;

// What a region is, as ListRegions answers.
struct RegionInfo {
  std::string name;
  std::string kind;  // "system"
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

// A registered region: its description and its memory (byte_size bytes, read-write).
struct Region {
  RegionInfo info;
  std::unique_ptr<SystemRegion> memory;

  uint8_t* data() const { return memory->data(); }
  uint64_t size() const { return memory->size(); }
};

class RegionRegistry {
 public:
  // `max_per_tenant`: the most regions one tenant holds at once; 0 refuses every registration.
  explicit RegionRegistry(int max_per_tenant) : max_per_tenant_(max_per_tenant) {}

  int max_per_tenant() const { return max_per_tenant_; }

  // Maps and registers a system region (SystemRegion::Map's errors; INVALID_ARGUMENT for a bad
  // name, ALREADY_EXISTS for a name the tenant holds, RESOURCE_EXHAUSTED past max_per_tenant,
  // FAILED_PRECONDITION when that is 0).
  absl::Status RegisterSystem(absl::string_view tenant, absl::string_view name,
                              absl::string_view key, uint64_t offset, uint64_t byte_size);
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
  int CountLocked(absl::string_view tenant) const;

  const int max_per_tenant_;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<const Region>, std::less<>> regions_;
};

}  // namespace indexer::server
