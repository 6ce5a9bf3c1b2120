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
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
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
  // Asks the CPU for the memory a step reads of this sequence besides the object itself (its
  // lengths, its last pages), so that a call's many sequences fetch theirs at once.
  void PrefetchState() const;
};

class SequenceTable {
 public:
  // What Insert did: inserted, or refused because the id is taken, the table holds max_size, or
  // the tenant holds max_per_tenant.
  enum class InsertResult { kInserted, kTaken, kFull, kTenantFull };

  // `max_size`: the most sequences the table holds at once, every tenant together;
  // `max_per_tenant`: the most one tenant holds. 0: no limit.
  explicit SequenceTable(int64_t max_size = 0, int64_t max_per_tenant = 0)
      : max_size_(max_size), max_per_tenant_(max_per_tenant) {}

  // The sequence with this tenant and id, or nullptr.
  std::shared_ptr<Sequence> Find(absl::string_view tenant, absl::string_view id) const;
  // A sequence's name, for FindAll.
  struct Name {
    absl::string_view tenant;
    absl::string_view id;
  };
  // What Find answers for name(0) .. name(n - 1), handed to found(i, sequence or nullptr) in
  // order. For a call's many sequences: the lookups of a group share one hold of the table's
  // lock, and the memory each needs (the map's slots, the sequences found) is fetched for the
  // whole group before any is read, so that their cache misses overlap. `found` runs with the
  // table's lock held: it must not call the table.
  void FindAll(size_t n, absl::FunctionRef<Name(size_t)> name,
               absl::FunctionRef<void(size_t, std::shared_ptr<Sequence>)> found) const;
  // The sequence with this tenant and id, made (empty, on `device`) when absent; *created says
  // which. nullptr (and *created false) when it is absent and a limit is reached; then
  // *refused (when given) says which (kFull or kTenantFull).
  std::shared_ptr<Sequence> FindOrCreate(absl::string_view tenant, absl::string_view id,
                                         int layers, bool* created, int device = 0,
                                         InsertResult* refused = nullptr);
  // Adds `seq` unless its tenant and id are taken or a limit is reached.
  InsertResult Insert(std::shared_ptr<Sequence> seq);
  // Why sequence `id` could not be created (kFull or kTenantFull): RESOURCE_EXHAUSTED naming
  // the limit (max_sequences or tenant_max_sequences, as the flags call them).
  absl::Status RefusalStatus(InsertResult why, absl::string_view id) const;
  // Sequences `tenant` holds now.
  int64_t TenantSize(absl::string_view tenant) const;
  int64_t max_per_tenant() const { return max_per_tenant_; }
  // Removes the entry for this tenant and id; returns it (nullptr when absent).
  std::shared_ptr<Sequence> Erase(absl::string_view tenant, absl::string_view id);
  // Removes `seq`'s entry only if the table still maps its tenant and id to this very object.
  bool EraseIfSame(const std::shared_ptr<Sequence>& seq);
  // Every sequence, ordered by tenant, then id.
  std::vector<std::shared_ptr<Sequence>> All() const;
  size_t size() const;

 private:
  // kInserted when one more sequence of `tenant` fits, else the limit it would pass.
  InsertResult RoomLocked(absl::string_view tenant) const;
  void AddedLocked(absl::string_view tenant);
  void RemovedLocked(absl::string_view tenant);

  const int64_t max_size_;
  const int64_t max_per_tenant_;
  mutable std::mutex mu_;
  // Key: tenant, '\0', id. Tenant names never hold '\0', so the key is unique per (tenant, id).
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> map_;
  // Entries of map_ per tenant; tenants holding none are absent.
  absl::flat_hash_map<std::string, int64_t> tenant_sizes_;
};

}  // namespace indexer::engine
