#include "engine/page_pool.h"

#include <cassert>

#include "absl/strings/str_cat.h"

namespace indexer::engine {

PagePool::PagePool(int64_t num_pages) : refs_(num_pages, 0) {
  free_list_.reserve(num_pages);
  // Low ids on top of the stack: handed out first, which keeps small tests readable.
  for (int64_t p = num_pages - 1; p >= 0; --p) free_list_.push_back(static_cast<int32_t>(p));
}

absl::StatusOr<std::vector<int32_t>> PagePool::Allocate(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n > static_cast<int64_t>(free_list_.size())) {
    return absl::ResourceExhaustedError(
        absl::StrCat("key cache is full: the request needs ", n, " new pages and ",
                     free_list_.size(), " of ", refs_.size(), " are free"));
  }
  std::vector<int32_t> pages(free_list_.end() - n, free_list_.end());
  free_list_.resize(free_list_.size() - n);
  for (int32_t p : pages) refs_[p] = 1;
  return pages;
}

void PagePool::AddRef(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t p : pages) {
    assert(refs_[p] > 0);
    ++refs_[p];
  }
}

int64_t PagePool::Release(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t freed = 0;
  for (int32_t p : pages) {
    assert(refs_[p] > 0);
    if (--refs_[p] == 0) {
      free_list_.push_back(p);
      ++freed;
    }
  }
  return freed;
}

int32_t PagePool::RefCount(int32_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  return refs_[page];
}

int64_t PagePool::free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_list_.size());
}

}  // namespace indexer::engine
