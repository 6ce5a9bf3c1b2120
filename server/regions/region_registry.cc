#include "server/regions/region_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/regions/cuda_region.h"
#include "spdlog/spdlog.h"
#include "server/regions/system_region.h"

namespace indexer::server {
namespace {

absl::Status CheckName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxRegionNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region name has ", name.size(), " bytes; it must have 1 to ", kMaxRegionNameBytes));
  }
  return absl::OkStatus();
}

absl::Status Unknown(absl::string_view name) {
  return absl::NotFoundError(absl::StrCat("region \"", name.substr(0, kMaxRegionNameBytes),
                                          "\" is not registered"));
}

}  // namespace

int RegionRegistry::CountLocked(absl::string_view tenant) const {
  int n = 0;
  for (auto it = regions_.lower_bound(Key(tenant, ""));
       it != regions_.end() && it->first.first == tenant; ++it) {
    ++n;
  }
  return n;
}

absl::Status RegionRegistry::CheckRoom(absl::string_view tenant) const {
  if (max_per_tenant_ == 0) {
    return absl::FailedPreconditionError(
        "this server takes no shared-memory regions (--max_regions=0)");
  }
  if (CountLocked(tenant) >= max_per_tenant_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the tenant holds ", max_per_tenant_, " regions, --max_regions; unregister one first"));
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::CheckRegistrable(absl::string_view tenant,
                                              absl::string_view name) const {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  return CheckRoom(tenant);
}

absl::Status RegionRegistry::Keep(absl::string_view tenant, absl::string_view name,
                                  std::shared_ptr<const Region> region) {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.count(Key(tenant, name)) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("region \"", name, "\" is already registered"));
  }
  if (absl::Status s = CheckRoom(tenant); !s.ok()) return s;
  regions_.emplace(Key(tenant, name), std::move(region));
  return absl::OkStatus();
}

absl::Status RegionRegistry::RegisterSystem(absl::string_view tenant, absl::string_view name,
                                            absl::string_view key, uint64_t offset,
                                            uint64_t byte_size) {
  if (absl::Status s = CheckRegistrable(tenant, name); !s.ok()) return s;
  // Mapped outside the lock (system calls); the checks are made again before it is kept.
  absl::StatusOr<std::unique_ptr<SystemRegion>> memory = SystemRegion::Map(key, offset, byte_size);
  if (!memory.ok()) return memory.status();
  auto region = std::make_shared<Region>();
  region->info = RegionInfo{std::string(name), "system", std::string(key), offset, byte_size};
  region->memory = *std::move(memory);
  if (pin_system_) {
    absl::StatusOr<std::unique_ptr<HostPinning>> pinning =
        HostPinning::Pin(region->memory->data(), byte_size);
    if (pinning.ok()) {
      region->pinning = *std::move(pinning);
      region->info.pinned = true;
    } else {
      spdlog::warn("system region \"{}\" ({} bytes) is read on the host: {}", std::string(name),
                   byte_size, std::string(pinning.status().message()));
    }
  }
  return Keep(tenant, name, std::move(region));
}

absl::Status RegionRegistry::RegisterCuda(absl::string_view tenant, absl::string_view name,
                                          absl::string_view raw_handle, int device,
                                          uint64_t offset, uint64_t byte_size) {
  if (absl::Status s = CheckRegistrable(tenant, name); !s.ok()) return s;
  if (std::find(cuda_devices_.begin(), cuda_devices_.end(), device) == cuda_devices_.end()) {
    return absl::FailedPreconditionError(
        cuda_devices_.empty()
            ? std::string("this server's backend reads no GPU memory: it takes no CUDA regions")
            : absl::StrCat("device_id ", device, " is not one of this server's GPUs (",
                           absl::StrJoin(cuda_devices_, ", "), ")"));
  }
  // Opened outside the lock (driver calls); the checks are made again before it is kept.
  absl::StatusOr<std::unique_ptr<CudaRegion>> memory =
      CudaRegion::Open(raw_handle, device, offset, byte_size);
  if (!memory.ok()) return memory.status();
  auto region = std::make_shared<Region>();
  region->info = RegionInfo{std::string(name), "cuda", "", offset, byte_size, device};
  region->memory = *std::move(memory);
  return Keep(tenant, name, std::move(region));
}

absl::StatusOr<int> RegionRegistry::Unregister(absl::string_view tenant, absl::string_view name) {
  std::vector<std::shared_ptr<const Region>> dropped;  // unmapped after the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (!name.empty()) {
    auto it = regions_.find(Key(tenant, name));
    if (it == regions_.end()) return Unknown(name);
    dropped.push_back(std::move(it->second));
    regions_.erase(it);
    return 1;
  }
  auto it = regions_.lower_bound(Key(tenant, ""));
  while (it != regions_.end() && it->first.first == tenant) {
    dropped.push_back(std::move(it->second));
    it = regions_.erase(it);
  }
  return static_cast<int>(dropped.size());
}

absl::StatusOr<std::vector<RegionInfo>> RegionRegistry::List(absl::string_view tenant,
                                                             absl::string_view name) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionInfo> out;
  if (!name.empty()) {
    auto it = regions_.find(Key(tenant, name));
    if (it == regions_.end()) return Unknown(name);
    out.push_back(it->second->info);
    return out;
  }
  for (auto it = regions_.lower_bound(Key(tenant, ""));
       it != regions_.end() && it->first.first == tenant; ++it) {
    out.push_back(it->second->info);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::Find(absl::string_view tenant,
                                                                   absl::string_view name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(Key(tenant, name));
  if (it == regions_.end()) return Unknown(name);
  return it->second;
}

}  // namespace indexer::server
