// PagePool: which page ids of the key cache are free, how many sequences reference each, and
// which tenant each allocated page is charged to. It holds no key data (the backends do); it is
// the single source of truth for accounting, page quotas included.
//
// Devices: the pool may be split into `devices` equal partitions, one per device of the server.
// Page ids are global: device d owns [d * pages_per_device, (d + 1) * pages_per_device). An
// allocation takes pages of one device only; references and quotas work on global ids across
// every device (a tenant's quota counts its pages on all devices together).
//
// Tenants are names (the engine's default tenant is ""). A tenant may have a page quota: the
// most pages charged to it at once. A page is charged to the tenant that allocated it until it
// is free again, however many of that tenant's sequences share it.
//
// Thread-safe: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"

namespace indexer::engine {

// Page quotas: `per_tenant` names tenants with a quota of their own; every other tenant gets
// `default_pages`. 0 means no quota.
struct PageQuotas {
  int64_t default_pages = 0;
  absl::flat_hash_map<std::string, int64_t> per_tenant;

  int64_t For(absl::string_view tenant) const;
};

class PagePool {
 public:
  // `pages_per_device` pages on each of `devices` devices (devices * pages_per_device must fit
  // int32 ids).
  explicit PagePool(int64_t pages_per_device, PageQuotas quotas = {}, int devices = 1);

  // Takes `n` free pages of `device`, each with one reference, charged to `tenant`, or none at
  // all: RESOURCE_EXHAUSTED when fewer than `n` are free on the device, or when `enforce_quota`
  // and the tenant would hold more than its quota (the message names the quota).
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t n, absl::string_view tenant = "",
                                                bool enforce_quota = true, int device = 0);

  // Adds one reference to each page (all must be allocated).
  void AddRef(std::span<const int32_t> pages);

  // Drops one reference from each page; returns how many pages became free.
  int64_t Release(std::span<const int32_t> pages);

  // References held on `page` (0 when free), read without the pool's lock: every append checks
  // the pages it writes for sharing. A 1 read by the caller holding the lock of the sequence
  // that holds the page stays 1 while it holds that lock (only a fork adds a reference, and a
  // fork locks its source); a larger count may be stale, as another holder lets go, which costs
  // at most a copy that was not needed.
  int32_t RefCount(int32_t page) const;

  // Every device together.
  int64_t total_pages() const { return static_cast<int64_t>(refs_.size()); }
  int64_t free_pages() const;
  // One device.
  int devices() const { return static_cast<int>(free_lists_.size()); }
  int64_t pages_per_device() const { return pages_per_device_; }
  int64_t free_pages(int device) const;
  // Free pages of every device, in device order.
  std::vector<int64_t> FreePagesPerDevice() const;
  // The device that owns `page`.
  int DeviceOf(int32_t page) const { return static_cast<int>(page / pages_per_device_); }
  // Pages charged to `tenant` now, and its quota (0: none).
  int64_t TenantPages(absl::string_view tenant) const;
  int64_t TenantQuota(absl::string_view tenant) const { return quotas_.For(tenant); }

 private:
  // The index of `tenant` in tenant_pages_, added on first use. Needs mu_.
  int32_t TenantIndexLocked(absl::string_view tenant);

  const PageQuotas quotas_;
  const int64_t pages_per_device_;
  mutable std::mutex mu_;
  // Per page; changed under mu_, read by RefCount without it.
  std::vector<std::atomic<int32_t>> refs_;
  std::vector<int32_t> owner_;      // per allocated page: index into tenant_pages_
  std::vector<std::vector<int32_t>> free_lists_;  // per device: stack of free page ids
  absl::flat_hash_map<std::string, int32_t> tenant_index_;
  std::vector<int64_t> tenant_pages_;  // pages charged, per tenant index
};

}  // namespace indexer::engine
