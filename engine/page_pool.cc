#include "engine/page_pool.h"

#include <cassert>

#include "absl/strings/str_cat.h"

namespace indexer::engine {

int64_t PageQuotas::For(absl::string_view tenant) const {
  auto it = per_tenant.find(tenant);
  return it == per_tenant.end() ? default_pages : it->second;
}

PagePool::PagePool(int64_t pages_per_device, PageQuotas quotas, int devices)
    : quotas_(std::move(quotas)),
      pages_per_device_(pages_per_device),
      refs_(static_cast<size_t>(pages_per_device * devices)),
      owner_(pages_per_device * devices, 0),
      free_lists_(devices) {
  for (int d = 0; d < devices; ++d) {
    std::vector<int32_t>& free = free_lists_[d];
    free.reserve(pages_per_device);
    // Low ids on top of the stack: handed out first, which keeps small tests readable.
    for (int64_t p = (d + 1) * pages_per_device - 1; p >= d * pages_per_device; --p) {
      free.push_back(static_cast<int32_t>(p));
    }
  }
}

int32_t PagePool::TenantIndexLocked(absl::string_view tenant) {
  auto [it, inserted] = tenant_index_.try_emplace(tenant, 0);
  if (inserted) {
    it->second = static_cast<int32_t>(tenant_pages_.size());
    tenant_pages_.push_back(0);
  }
  return it->second;
}

absl::StatusOr<std::vector<int32_t>> PagePool::Allocate(int64_t n, absl::string_view tenant,
                                                        bool enforce_quota, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t>& free_list = free_lists_[device];
  if (n > static_cast<int64_t>(free_list.size())) {
    if (free_lists_.size() == 1) {
      return absl::ResourceExhaustedError(
          absl::StrCat("key cache is full: the request needs ", n, " new pages and ",
                       free_list.size(), " of ", refs_.size(), " are free"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "key cache is full on device ", device, ": the request needs ", n, " new pages and ",
        free_list.size(), " of its ", pages_per_device_,
        " are free (a sequence stays on the device it was created on)"));
  }
  const int32_t owner = TenantIndexLocked(tenant);
  const int64_t quota = quotas_.For(tenant);
  if (enforce_quota && quota > 0 && tenant_pages_[owner] + n > quota) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "page quota exceeded: the request needs ", n, " new pages and ",
        TenantLabel(tenant), " holds ", tenant_pages_[owner], " of its quota of ", quota, " pages"));
  }
  std::vector<int32_t> pages(free_list.end() - n, free_list.end());
  free_list.resize(free_list.size() - n);
  for (int32_t p : pages) {
    refs_[p].store(1, std::memory_order_relaxed);
    owner_[p] = owner;
  }
  tenant_pages_[owner] += n;
  return pages;
}

void PagePool::AddRef(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t p : pages) {
    assert(refs_[p].load(std::memory_order_relaxed) > 0);
    refs_[p].fetch_add(1, std::memory_order_relaxed);
  }
}

int64_t PagePool::Release(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t freed = 0;
  for (int32_t p : pages) {
    assert(refs_[p].load(std::memory_order_relaxed) > 0);
    if (refs_[p].fetch_sub(1, std::memory_order_relaxed) == 1) {
      free_lists_[DeviceOf(p)].push_back(p);
      --tenant_pages_[owner_[p]];
      ++freed;
    }
  }
  return freed;
}

int32_t PagePool::RefCount(int32_t page) const {
  return refs_[page].load(std::memory_order_relaxed);
}

int64_t PagePool::free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const std::vector<int32_t>& free : free_lists_) n += static_cast<int64_t>(free.size());
  return n;
}

int64_t PagePool::free_pages(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_lists_[device].size());
}

std::vector<int64_t> PagePool::FreePagesPerDevice() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> n;
  n.reserve(free_lists_.size());
  for (const std::vector<int32_t>& free : free_lists_) n.push_back(static_cast<int64_t>(free.size()));
  return n;
}

int64_t PagePool::TenantPages(absl::string_view tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tenant_index_.find(tenant);
  return it == tenant_index_.end() ? 0 : tenant_pages_[it->second];
}

}  // namespace indexer::engine
