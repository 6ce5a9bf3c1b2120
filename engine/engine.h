// Engine: the index-K cache service without any transport. It validates requests, keeps the
// page accounting and the sequence table, and runs selections on a KeyCacheBackend.
//
// Every method is thread-safe and may be called concurrently; calls on different sequences run
// in parallel, calls on one sequence are applied one at a time. Every failed request leaves the
// engine exactly as it found it. Errors are absl::Status values with a message naming the field
// and the limit: INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED,
// FAILED_PRECONDITION, DEADLINE_EXCEEDED, CANCELLED, or INTERNAL from the backend; UNAVAILABLE
// from a device that has failed for good (KeyCacheBackend::Health), whatever the call.
//
// Devices: an engine drives one or more devices (a KeyCacheBackend and a SelectBatcher each);
// device d owns page ids [d * capacity_pages, (d + 1) * capacity_pages), so capacity_pages is
// per device. A sequence is placed on a device when it is created -- the one with the most free
// pages, ties to the lower index, skipping failed devices while any other is healthy -- and
// stays there: its pages all lie on that device, forks go
// to their source's device, and a full device refuses appends (RESOURCE_EXHAUSTED) only to the
// sequences placed on it. A Batch spanning devices selects on all of them in parallel.
//
// Tenants: every request names its tenant (kDefaultTenant unless the caller authenticates as
// another). Sequence ids are scoped to the tenant, so a request reaches only its own tenant's
// sequences; another tenant's id answers exactly as an id that does not exist. New pages are
// charged to the tenant, up to its page quota (PageQuotas, given at construction).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/call_control.h"
#include "engine/call_gate.h"
#include "engine/config.h"
#include "engine/engine_observer.h"
#include "engine/key_cache_backend.h"
#include "engine/page_pool.h"
#include "engine/select_batcher.h"
#include "engine/sequence_table.h"
#include "engine/wire_values.h"

namespace indexer::engine {

// Keys to append to one sequence (SPEC.md "Append"). Views into the caller's request.
struct AppendRequest {
  absl::string_view sequence_id;
  int64_t layer = 0;
  bool all_layers = false;  // keys are [n][layers][head_dim] instead of [n][head_dim]
  WireDtype dtype = WireDtype::kUnspecified;
  absl::string_view keys;
  std::span<const int32_t> attention_pages;  // one per block the append opens, or none
  // The caller's tenant (last, so that positional initialisers need not name it). Inside a
  // StepRequest the step's tenant counts and this one is ignored.
  absl::string_view tenant = kDefaultTenant;
};

// One step for one sequence: an optional append, then a selection when `queries` is non-empty.
struct StepRequest {
  absl::string_view sequence_id;
  int64_t layer = 0;
  std::optional<AppendRequest> append;  // its sequence_id must be empty or equal
  std::optional<int64_t> start_position;
  int64_t num_heads = 0;
  WireDtype query_dtype = WireDtype::kUnspecified;
  absl::string_view queries;  // [n][H][head_dim]
  std::optional<int64_t> topk, init_blocks, local_blocks;
  absl::string_view tenant = kDefaultTenant;  // the caller's tenant
};

struct StepResult {
  bool created = false;        // the append created the sequence
  std::vector<int64_t> lengths;  // per layer, after the append
  int64_t num_blocks = 0;
  // The selection, when the step had queries.
  int num_tokens = 0;
  int num_heads = 0;
  int topk = 0;
  int64_t start_position = 0;
  std::vector<int32_t> block_ids;     // [n][H][topk]
  std::vector<int32_t> page_table;    // [n][H][topk * pages_per_block], with attention pages
  std::vector<int32_t> context_lens;  // [n][H], with attention pages
};

struct SequenceInfo {
  int device = 0;  // index of the device holding its pages
  std::vector<int64_t> lengths;
  std::vector<int32_t> pages;
  std::vector<int32_t> attention_pages;
  int64_t shared_pages = 0;
};

struct TruncateResult {
  std::vector<int64_t> lengths;
  int64_t num_blocks = 0;
  int64_t pages_freed = 0;
};

struct ForkResult {
  std::vector<int64_t> lengths;
  int64_t num_blocks = 0;
  int64_t pages_shared = 0;
};

// One device's share of EngineStats.
struct DeviceStats {
  DeviceSlot slot;
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int64_t queued_selects = 0;
  // OK, or why the device can no longer serve (its backend's Health()): every call touching a
  // sequence placed on it fails with this status.
  absl::Status health;
};

// Every device together, and per device (in device order).
struct EngineStats {
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int64_t live_sequences = 0;
  int64_t queued_selects = 0;  // span selections waiting in the select queues for a launch
  std::vector<DeviceStats> devices;
};

struct TenantUsage {
  int64_t pages = 0;       // pages charged to the tenant now
  int64_t page_quota = 0;  // 0: no quota
};

// What a snapshot held (written or restored).
struct SnapshotStats {
  int64_t sequences = 0;
  int64_t pages = 0;  // distinct pages: a page shared by forks counts once
  int64_t bytes = 0;  // file size
};

class Engine {
 public:
  // One device. `config` must have passed Validate(). The backend must have been built for
  // `config` (pages [0, capacity_pages)). `quotas`: the most pages each tenant may hold (none by
  // default).
  Engine(const EngineConfig& config, std::unique_ptr<KeyCacheBackend> backend,
         PageQuotas quotas = {});
  // Several devices (at least one): devices[d].backend must have been built for `config` and
  // the slot {any ordinal, d * capacity_pages, capacity_pages} (MakeBackends builds them so),
  // and devices * capacity_pages must fit int32 page ids.
  Engine(const EngineConfig& config, std::vector<DeviceBackend> devices, PageQuotas quotas = {});
  ~Engine();

  // Appends keys, creating the sequence on its first append.
  absl::StatusOr<StepResult> Append(const AppendRequest& request, const CallControl& control = {});

  // One append-and-select step; `queries` must be non-empty.
  absl::StatusOr<StepResult> Select(const StepRequest& request, const CallControl& control = {});

  // Many steps. Results are in item order, one status each. Items on different sequences are
  // selected together in one backend call; items on the same sequence apply in item order.
  std::vector<absl::StatusOr<StepResult>> Batch(std::span<const StepRequest> items,
                                                const CallControl& control = {});

  // Removes a sequence; returns the pages returned to the pool.
  absl::StatusOr<int64_t> Release(absl::string_view sequence_id,
                                  absl::string_view tenant = kDefaultTenant);
  absl::StatusOr<TruncateResult> Truncate(absl::string_view sequence_id, int64_t length,
                                          absl::string_view tenant = kDefaultTenant);
  // Source and target are both the tenant's: a fork never crosses tenants.
  absl::StatusOr<ForkResult> Fork(absl::string_view source_id, absl::string_view target_id,
                                  std::optional<int64_t> length,
                                  absl::string_view tenant = kDefaultTenant);
  absl::StatusOr<SequenceInfo> Get(absl::string_view sequence_id,
                                   absl::string_view tenant = kDefaultTenant) const;

  // Releases every sequence no call has named for at least `idle` (the idle-sequence TTL, for
  // schedulers that died without releasing); returns how many.
  int64_t ReclaimIdle(absl::Duration idle);

  // `observer` (may be null) sees every backend selection and the select queue from now on; it
  // must outlive the engine. Call before serving.
  void SetObserver(EngineObserver* observer);

  EngineStats Stats() const;
  // OK while every device can serve calls; otherwise the Health() status of the first device
  // that cannot (UNAVAILABLE, naming it and its first fatal error). Once not OK it stays so
  // (a failed device never recovers in-process). Cheap: no device is touched. For health
  // checks; Stats() has every device's.
  absl::Status Health() const;
  TenantUsage Usage(absl::string_view tenant) const;

  // Writes every sequence of every tenant (lengths, block tables, attention pages and the key
  // pages' stored bytes) to a snapshot file at `path` (format: snapshot_file.h). Every other
  // call waits while it runs, so the file is one consistent instant. Atomic: the file is
  // written as PATH.tmp and renamed over PATH only when complete and synced; on any failure PATH
  // is left as it was and PATH.tmp is removed. Errors: INTERNAL with the system's reason (the
  // file cannot be created, the disk is full, ...) or the backend's.
  absl::Status WriteSnapshot(const std::string& path, SnapshotStats* stats = nullptr);

  // Loads a snapshot written by WriteSnapshot into this engine, which must hold no sequences
  // (FAILED_PRECONDITION otherwise). The whole file is checked before anything is applied:
  // DATA_LOSS when it is truncated, malformed or fails its checksum; FAILED_PRECONDITION when it
  // was written with another head_dim, key storage, layer count or block size, or holds
  // sequences this configuration refuses (longer than max_tokens_per_sequence, attention page
  // ids out of range, placed on a device this engine does not have); RESOURCE_EXHAUSTED when its
  // pages on some device exceed that device's capacity. Each sequence goes back to the device
  // (index) it was on. On any error the engine is left empty. Page quotas are not enforced on
  // restored pages (they are charged).
  absl::Status RestoreSnapshot(const std::string& path, SnapshotStats* stats = nullptr);
  const EngineConfig& config() const { return config_; }
  // Device 0's backend (the only one of a one-device engine).
  const KeyCacheBackend& backend() const { return *devices_[0].backend; }
  int num_devices() const { return static_cast<int>(devices_.size()); }
  const KeyCacheBackend& backend(int device) const { return *devices_[device].backend; }
  const DeviceSlot& slot(int device) const { return devices_[device].slot; }

 private:
  struct PreparedAppend;
  struct PreparedStep;

  absl::Status PrepareAppend(const AppendRequest& request, absl::string_view step_sequence_id,
                             PreparedAppend* out) const;
  absl::Status PrepareStep(const StepRequest& request, PreparedStep* out) const;
  // Applies `append`. Pages it copied on write stay referenced in *replaced as (block, original
  // page): the caller releases them once the step has succeeded, or swaps them back.
  // With `deferred`, the keys are not written: the write is added to *deferred (its block table
  // points into seq.pages, valid while the sequence stays locked and unchanged) for the caller to
  // issue with others in one WriteKeysBatch, and to undo the append if that fails.
  struct DeferredWrite {
    KeyWrite write;
    std::vector<int64_t> starts;  // write.layer_start points here
  };
  absl::Status ApplyAppend(Sequence& seq, const PreparedAppend& append,
                           std::vector<std::pair<int64_t, int32_t>>* replaced,
                           DeferredWrite* deferred = nullptr);
  absl::Status CheckSpan(const Sequence& seq, PreparedStep& step) const;
  // `budget`: bytes of answer the call may still return (negative: no limit).
  // Selections go through the batcher, which checks `control` again before it launches them.
  void RunWave(std::span<PreparedStep*> wave, std::vector<absl::StatusOr<StepResult>>& results,
               int64_t& budget, const CallControl& control);
  int64_t AnswerBytes(const PreparedStep& step, bool attn_pages) const;
  void ReleaseReplaced(const std::vector<std::pair<int64_t, int32_t>>& replaced);
  // The device for a new sequence that will first need `blocks` pages: the most free pages net
  // of `planned` (pages this wave's new sequences will take, per device: the caller adds a
  // sequence's pages once it was created), ties to the lower index. `free` and `planned` are
  // filled on first use.
  int PlaceNew(int64_t blocks, std::vector<int64_t>& free, std::vector<int64_t>& planned) const;
  // ReadPages / WritePages for global page ids on any devices (split into runs per device).
  absl::Status ReadPagesAnyDevice(std::span<const int32_t> pages, uint8_t* dst);
  absl::Status WritePagesAnyDevice(std::span<const int32_t> pages, const uint8_t* src);
  KeyCacheBackend& BackendOf(const Sequence& seq) { return *devices_[seq.device].backend; }

  struct Device {
    DeviceSlot slot;
    std::unique_ptr<KeyCacheBackend> backend;
    // After backend: destroyed (drained and joined) before the backend it launches on.
    std::unique_ptr<SelectBatcher> batcher;
  };

  const EngineConfig config_;
  std::vector<Device> devices_;
  PagePool pool_;
  SequenceTable sequences_;
  // Every call holds a pass; snapshots pause it. Mutable: Get() is const but must wait too.
  mutable CallGate gate_;
};

}  // namespace indexer::engine
