#include "engine/sequence_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace indexer::engine {
namespace {

std::string Key(absl::string_view tenant, absl::string_view id) {
  return absl::StrCat(tenant, absl::string_view("\0", 1), id);
}

// The key of (tenant, id) in a buffer of the calling thread's, reused: lookups, which every step
// of every call makes, allocate nothing.
const std::string& LookupKey(absl::string_view tenant, absl::string_view id) {
  thread_local std::string key;
  key.assign(tenant.data(), tenant.size());
  key.push_back('\0');
  key.append(id.data(), id.size());
  return key;
}

// Asks for the lines of `seq` that finding and locking it read, and the one before it, where
// make_shared puts the reference count.
void PrefetchSequence(const Sequence* seq) {
  const char* p = reinterpret_cast<const char*>(seq);
  __builtin_prefetch(p - 16, 1);
  for (size_t at = 0; at < sizeof(Sequence); at += 64) __builtin_prefetch(p + at, 1);
}

}  // namespace

void Sequence::PrefetchState() const {
  __builtin_prefetch(lengths.data(), 1);
  if (!pages.empty()) __builtin_prefetch(&pages.back(), 1);
  if (!attn_pages.empty()) __builtin_prefetch(&attn_pages.back());
}

int64_t Sequence::MaxLength() const {
  return lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
}

std::shared_ptr<Sequence> SequenceTable::Find(absl::string_view tenant,
                                              absl::string_view id) const {
  const std::string& key = LookupKey(tenant, id);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : it->second;
}

void SequenceTable::FindAll(size_t n, absl::FunctionRef<Name(size_t)> name,
                            absl::FunctionRef<void(size_t, std::shared_ptr<Sequence>)> found) const {
  // Small enough that a group's lines stay cached between its passes and that other callers
  // wait for the lock only briefly; large enough for many misses in flight at once.
  constexpr size_t kGroup = 32;
  thread_local std::string keys;  // a group's keys, back to back: lookups allocate nothing
  size_t ends[kGroup];
  const std::shared_ptr<Sequence>* hits[kGroup];
  for (size_t begin = 0; begin < n; begin += kGroup) {
    const size_t count = std::min(kGroup, n - begin);
    keys.clear();
    for (size_t i = 0; i < count; ++i) {
      const Name key = name(begin + i);
      keys.append(key.tenant.data(), key.tenant.size());
      keys.push_back('\0');
      keys.append(key.id.data(), key.id.size());
      ends[i] = keys.size();
    }
    const auto key_of = [&](size_t i) {
      const size_t start = i == 0 ? 0 : ends[i - 1];
      return absl::string_view(keys).substr(start, ends[i] - start);
    };
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < count; ++i) map_.prefetch(key_of(i));
    for (size_t i = 0; i < count; ++i) {
      auto it = map_.find(key_of(i));
      hits[i] = it == map_.end() ? nullptr : &it->second;
      // The sequence and its reference count (beside it, from make_shared): copying the
      // pointer below is an atomic increment, which would wait for each miss in turn.
      if (hits[i] != nullptr) PrefetchSequence(hits[i]->get());
    }
    for (size_t i = 0; i < count; ++i) found(begin + i, hits[i] ? *hits[i] : nullptr);
  }
}

SequenceTable::InsertResult SequenceTable::RoomLocked(absl::string_view tenant) const {
  if (max_size_ > 0 && static_cast<int64_t>(map_.size()) >= max_size_) return InsertResult::kFull;
  if (max_per_tenant_ > 0) {
    auto it = tenant_sizes_.find(tenant);
    if (it != tenant_sizes_.end() && it->second >= max_per_tenant_) {
      return InsertResult::kTenantFull;
    }
  }
  return InsertResult::kInserted;
}

void SequenceTable::AddedLocked(absl::string_view tenant) {
  auto it = tenant_sizes_.find(tenant);
  if (it == tenant_sizes_.end()) it = tenant_sizes_.emplace(std::string(tenant), 0).first;
  ++it->second;
}

void SequenceTable::RemovedLocked(absl::string_view tenant) {
  auto it = tenant_sizes_.find(tenant);
  if (it != tenant_sizes_.end() && --it->second == 0) tenant_sizes_.erase(it);
}

std::shared_ptr<Sequence> SequenceTable::FindOrCreate(absl::string_view tenant,
                                                      absl::string_view id, int layers,
                                                      bool* created, int device,
                                                      InsertResult* refused) {
  std::string key = Key(tenant, id);
  std::lock_guard<std::mutex> lock(mu_);
  *created = false;
  if (auto it = map_.find(key); it != map_.end()) return it->second;
  if (const InsertResult room = RoomLocked(tenant); room != InsertResult::kInserted) {
    if (refused != nullptr) *refused = room;
    return nullptr;
  }
  auto seq = std::make_shared<Sequence>(std::string(tenant), std::string(id), layers, device);
  map_.emplace(std::move(key), seq);
  AddedLocked(tenant);
  *created = true;
  return seq;
}

SequenceTable::InsertResult SequenceTable::Insert(std::shared_ptr<Sequence> seq) {
  std::string key = Key(seq->tenant, seq->id);
  std::lock_guard<std::mutex> lock(mu_);
  if (map_.contains(key)) return InsertResult::kTaken;
  if (const InsertResult room = RoomLocked(seq->tenant); room != InsertResult::kInserted) {
    return room;
  }
  AddedLocked(seq->tenant);
  map_.emplace(std::move(key), std::move(seq));
  return InsertResult::kInserted;
}

absl::Status SequenceTable::RefusalStatus(InsertResult why, absl::string_view id) const {
  if (why == InsertResult::kTenantFull) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", id, "' cannot be created: the tenant holds tenant_max_sequences ",
        max_per_tenant_, " sequences; release some first"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "sequence '", id, "' cannot be created: the server holds max_sequences ", max_size_,
      " sequences; release some first"));
}

int64_t SequenceTable::TenantSize(absl::string_view tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tenant_sizes_.find(tenant);
  return it == tenant_sizes_.end() ? 0 : it->second;
}

std::shared_ptr<Sequence> SequenceTable::Erase(absl::string_view tenant, absl::string_view id) {
  const std::string& key = LookupKey(tenant, id);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return nullptr;
  auto seq = std::move(it->second);
  map_.erase(it);
  RemovedLocked(seq->tenant);
  return seq;
}

bool SequenceTable::EraseIfSame(const std::shared_ptr<Sequence>& seq) {
  const std::string& key = LookupKey(seq->tenant, seq->id);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second != seq) return false;
  map_.erase(it);
  RemovedLocked(seq->tenant);
  return true;
}

std::vector<std::shared_ptr<Sequence>> SequenceTable::All() const {
  std::vector<std::pair<std::string, std::shared_ptr<Sequence>>> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.assign(map_.begin(), map_.end());
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::shared_ptr<Sequence>> all;
  all.reserve(entries.size());
  for (auto& e : entries) all.push_back(std::move(e.second));
  return all;
}

size_t SequenceTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

}  // namespace indexer::engine
