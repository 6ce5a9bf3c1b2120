#include "server/regions/region_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"

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

absl::Status RegionRegistry::RegisterSystem(absl::string_view tenant, absl::string_view name,
                                            absl::string_view key, uint64_t offset,
                                            uint64_t byte_size) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = CheckRoom(tenant); !s.ok()) return s;
  }
  // Mapped outside the lock (system calls); the checks are made again before it is kept.
  absl::StatusOr<std::unique_ptr<SystemRegion>> memory = SystemRegion::Map(key, offset, byte_size);
  if (!memory.ok()) return memory.status();
  auto region = std::make_shared<Region>();
  region->info = RegionInfo{std::string(name), "system", std::string(key), offset, byte_size};
  region->memory = *std::move(memory);
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.count(Key(tenant, name)) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("region \"", name, "\" is already registered"));
  }
  if (absl::Status s = CheckRoom(tenant); !s.ok()) return s;
  regions_.emplace(Key(tenant, name), std::move(region));
  return absl::OkStatus();
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
