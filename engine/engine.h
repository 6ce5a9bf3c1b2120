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

#include <atomic>
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
#include "engine/batch_call.h"
#include "engine/call_control.h"
#include "engine/call_gate.h"
#include "engine/config.h"
#include "engine/engine_core.h"
#include "engine/engine_observer.h"
#include "engine/key_cache_backend.h"
#include "engine/page_pool.h"
#include "engine/step_request.h"

namespace indexer::engine {

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
  int64_t pages = 0;          // pages charged to the tenant now
  int64_t page_quota = 0;     // 0: no quota
  int64_t sequences = 0;      // sequences the tenant holds now
  int64_t max_sequences = 0;  // EngineConfig::tenant_max_sequences (0: no limit)
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

  // Batch without holding the calling thread: the call's work is staged on the calling thread
  // (and on the threads that end its device steps) and `done` runs once it has ended, on any
  // thread, possibly before BatchAsync returns. What the sync forms answer per item, `done` gets
  // the same way; its `call` status is not OK only when the call failed whole (its answer could
  // not fit max_response_bytes even as errors), and then nothing was applied. `items`, what they
  // view, `control` and `sink` must stay valid until `done` runs; with `sink`, selection outputs
  // are written where it says instead of into StepResult's vectors. A sequence another call is
  // using makes this call wait, without a thread, until that call has answered.
  void BatchAsync(std::span<const StepRequest> items, const CallControl& control, OutputSink* sink,
                  BatchDone done);

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
  // schedulers that died without releasing); returns how many. Every call that finds a sequence
  // counts as naming it: appends and selections, Truncate, Fork (its source) and Get.
  int64_t ReclaimIdle(absl::Duration idle);

  // `observer` (may be null) sees every backend selection and the select queue from now on; it
  // must outlive the engine. Call before serving.
  void SetObserver(EngineObserver* observer);

  EngineStats Stats() const;
  // For shutdown, once the drain time is up: every device's selections that run now or start
  // later may stop early with CANCELLED (KeyCacheBackend::AbandonSelections), their steps rolled
  // back, so that the last calls end at once and a snapshot can follow. For good.
  void AbandonSelections();
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
  const EngineConfig& config() const { return core_->config; }
  // Device 0's backend (the only one of a one-device engine).
  const KeyCacheBackend& backend() const { return *core_->devices[0].backend; }
  int num_devices() const { return static_cast<int>(core_->devices.size()); }
  // The CUDA devices whose memory some device's backend reads in place (KeyCacheBackend::
  // TakesDeviceTensors): where clients' CUDA regions may live. Empty for the CPU backend.
  std::vector<int> DeviceTensorOrdinals() const;
  // Whether every device's backend takes tensors in mapped host memory (kMappedHostTensor):
  // then the server pins system regions and lets the kernels read them in place.
  bool TakesMappedHostTensors() const;
  const KeyCacheBackend& backend(int device) const { return *core_->devices[device].backend; }
  const DeviceSlot& slot(int device) const { return core_->devices[device].slot; }

 private:
  // ReadPages / WritePages for global page ids on any devices: `move(backend, run, offset)`
  // for each run of consecutive pages on one device, `offset` its first page's index in `pages`.
  template <typename Move>
  absl::Status ForEachDeviceRun(std::span<const int32_t> pages, Move move);
  absl::Status ReadPagesAnyDevice(std::span<const int32_t> pages, uint8_t* dst);
  absl::Status WritePagesAnyDevice(std::span<const int32_t> pages, const uint8_t* src);

  std::unique_ptr<EngineCore> core_;
  std::atomic<EngineObserver*> observer_{nullptr};
  // Every call holds a pass; snapshots pause it, and destruction waits for the calls in flight.
  // Mutable: Get() is const but must wait too.
  mutable CallGate gate_;
};

}  // namespace indexer::engine
