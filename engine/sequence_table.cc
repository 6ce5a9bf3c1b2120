#include "engine/sequence_table.h"

#include <algorithm>

namespace indexer::engine {

int64_t Sequence::MaxLength() const {
  return lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
}

std::shared_ptr<Sequence> SequenceTable::Find(absl::string_view id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(id);
  return it == map_.end() ? nullptr : it->second;
}

std::shared_ptr<Sequence> SequenceTable::FindOrCreate(absl::string_view id, int layers,
                                                      bool* created) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = map_.try_emplace(id, nullptr);
  if (inserted) it->second = std::make_shared<Sequence>(std::string(id), layers);
  *created = inserted;
  return it->second;
}

bool SequenceTable::Insert(std::shared_ptr<Sequence> seq) {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.try_emplace(seq->id, std::move(seq)).second;
}

std::shared_ptr<Sequence> SequenceTable::Erase(absl::string_view id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(id);
  if (it == map_.end()) return nullptr;
  auto seq = std::move(it->second);
  map_.erase(it);
  return seq;
}

bool SequenceTable::EraseIfSame(const std::shared_ptr<Sequence>& seq) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(seq->id);
  if (it == map_.end() || it->second != seq) return false;
  map_.erase(it);
  return true;
}

size_t SequenceTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

}  // namespace indexer::engine
