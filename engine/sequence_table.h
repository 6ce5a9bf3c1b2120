// Sequence and SequenceTable: the sequences the cache holds, by tenant and caller-chosen id.
//
// Ids are scoped to their tenant: the table's key is (tenant, id), so a tenant can only ever
// find its own sequences, and another tenant's id looks exactly like an id that does not exist.
//
// A Sequence's fields are guarded by its own mutex `mu` (a SequenceMutex: a step may release it
// from the thread that completes the step); the table's map by the table's mutex.
// Lock order: never hold the table's mutex while waiting for a sequence's. A sequence removed
// from the table is marked `released` (under `mu`) so that callers that found it earlier see it
// is gone once they get its lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "engine/sequence_mutex.h"

namespace indexer::engine {

// Steady-clock nanoseconds: the clock of Sequence::last_used_ns.
inline int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Sequence {
  Sequence(std::string tenant_name, std::string sequence_id, int layers, int device_index = 0)
      : tenant(std::move(tenant_name)),
        id(std::move(sequence_id)),
        device(device_index),
        lengths(layers, 0),
        last_used_ns(SteadyNowNs()) {}

  const std::string tenant;
  const std::string id;
  const int device;  // where its pages live, chosen at creation; forks share it
  SequenceMutex mu;
  bool released = false;
  std::vector<int64_t> lengths;       // tokens per layer
  std::vector<int32_t> pages;         // cache page of each block
  bool attn_decided = false;          // the first append decided has_attn_pages
  bool has_attn_pages = false;
  std::vector<int32_t> attn_pages;    // attention page of each block, when has_attn_pages
  int64_t last_used_ns;               // SteadyNowNs of its creation or last use (idle TTL)

  int64_t MaxLength() const;
  bool Empty() const { return pages.empty() && MaxLength() == 0; }
};

class SequenceTable {
 public:
  // What Insert did.
  enum class InsertResult { kInserted, kTaken, kFull };

  // `max_size`: the most sequences the table holds at once, every tenant together (0: no limit).
  explicit SequenceTable(int64_t max_size = 0) : max_size_(max_size) {}

  // The sequence with this tenant and id, or nullptr.
  std::shared_ptr<Sequence> Find(absl::string_view tenant, absl::string_view id) const;
  // The sequence with this tenant and id, made (empty, on `device`) when absent; *created says
  // which. nullptr (and *created false) when it is absent and the table already holds max_size.
  std::shared_ptr<Sequence> FindOrCreate(absl::string_view tenant, absl::string_view id,
                                         int layers, bool* created, int device = 0);
  // Adds `seq` unless its tenant and id are taken or the table holds max_size.
  InsertResult Insert(std::shared_ptr<Sequence> seq);
  // Removes the entry for this tenant and id; returns it (nullptr when absent).
  std::shared_ptr<Sequence> Erase(absl::string_view tenant, absl::string_view id);
  // Removes `seq`'s entry only if the table still maps its tenant and id to this very object.
  bool EraseIfSame(const std::shared_ptr<Sequence>& seq);
  // Every sequence, ordered by tenant, then id.
  std::vector<std::shared_ptr<Sequence>> All() const;
  size_t size() const;

 private:
  const int64_t max_size_;
  mutable std::mutex mu_;
  // Key: tenant, '\0', id. Tenant names never hold '\0', so the key is unique per (tenant, id).
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> map_;
};

}  // namespace indexer::engine
