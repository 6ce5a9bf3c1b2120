// KeyCacheBackend: where the key pages live and where selections run (CPU or CUDA).
//
// The engine owns all bookkeeping (PagePool, SequenceTable) and calls a backend only with
// validated arguments for pages it has allocated. A backend may be called from many threads at
// once; the engine guarantees that concurrent calls never write a page another call reads or
// writes. Errors (for example a CUDA failure) are returned as INTERNAL statuses; a backend never
// aborts the process. A backend whose device can no longer be used (a fault that leaves the device
// unusable, such as a sticky CUDA error) says so in Health() and fails every later call at once
// with that status (UNAVAILABLE: engine/device_failure.h) without touching the device again.
//
// The engine's hot path is Run: one step's key writes and selections in one round trip to the
// device. The other calls are synchronous and serve copy-on-write, snapshots and tests.
#pragma once

#include <climits>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/wire_values.h"
#include "kernels/select_types.h"

namespace indexer::engine {

// Keys to store for one sequence (kernels/select_types.h): host memory, global page ids.
using KeyWrite = kernels::KeyWrite;

// Where a backend's pages live: device `ordinal`, holding global page ids
// [first_page, first_page + num_pages). Callers always pass global ids; the backend translates.
struct DeviceSlot { int ordinal = 0; int64_t first_page = 0; int64_t num_pages = 0; };

// One span selection against one layer. `span`'s pointers are host memory.
struct SelectTask {
  int layer = 0;
  kernels::SpanSelect span;

  int64_t Scores() const { return kernels::SpanScores(span); }
};

// One launch's work: every key write first, then every selection (which sees what the writes
// stored). Writes and selections of one step touch pages no concurrent step writes.
struct BackendStep {
  std::span<const KeyWrite> writes;
  std::span<const SelectTask> selects;
};

// Where a step's time went, for the server's breakdown (zero where a backend does not tell):
// waiting for the device (the group's wait in the SelectBatcher's queue, which the batcher adds,
// and any wait of the backend's own for a stream or lane), staging on the host,
// handing the step to the device (describing and enqueueing its copies and kernels), the
// device's work until its completion was seen, and the results' scatter into the callers'
// outputs.
struct StepTiming {
  absl::Duration queue;
  absl::Duration stage;
  absl::Duration launch;
  absl::Duration device;
  absl::Duration scatter;
};

// How a step ended: the writes' status, and the selections' (the writes' status when they
// failed, since the selections did not run then).
struct StepStatus {
  absl::Status writes;
  absl::Status selects;
  StepTiming timing;

  bool ok() const { return writes.ok() && selects.ok(); }
};

// A count a backend keeps of its own work, for the server's metrics: exported per device as
// indexer_backend_<name>, a counter when `monotonic` (the name then ends in _total), else a gauge.
struct BackendCounter {
  std::string name;
  std::string help;
  int64_t value = 0;
  bool monotonic = true;
};

// Called exactly once when a step has ended.
using StepDone = absl::AnyInvocable<void(StepStatus) &&>;

class KeyCacheBackend {
 public:
  virtual ~KeyCacheBackend() = default;

  // "cpu" or "cuda".
  virtual std::string name() const = 0;
  // Human-readable device description for ServerInfo and logs.
  virtual std::string device() const = 0;

  // OK while the device can serve calls. Otherwise the status every call now fails with
  // (UNAVAILABLE, naming the device and the first fatal error); once not OK it stays so for the
  // backend's life. Cheap (no device access) and callable from any thread at any time; the
  // engine reports it per device (Engine::Health, DeviceStats::health). The default: always OK.
  virtual absl::Status Health() const { return absl::OkStatus(); }
  // The backend's own counts (BackendCounter), the same names in the same order on every call;
  // callable from any thread. The default: none.
  virtual std::vector<BackendCounter> Counters() const { return {}; }

  // Shutdown, once the drain time is up: selections running or started from now on may stop
  // early and fail with CANCELLED (their steps are rolled back as for any failure), so that the
  // server does not compute answers nobody will receive. Writes, copies and page reads (the
  // snapshot) are not affected. Callable from any thread; for good. The default does nothing
  // (selections run to their end).
  virtual void AbandonSelections() {}

  // Runs `step` and calls `done` once its writes are stored (visible to every later call, on any
  // thread) and its selections' outputs are written, or once it failed. `done` runs on any
  // thread, possibly before Run returns; Run never blocks for the device's work when
  // RunsAsync() (the call's thread is free while the device works). The step's spans and
  // everything they point to must stay valid, and the outputs untouched, until `done` is called.
  // At most MaxConcurrentSteps() steps may be running at once (the SelectBatcher keeps to it).
  // The default runs WriteKeysBatch, then Select, on the calling thread.
  virtual void Run(const BackendStep& step, const kernels::PageTableParams& page_table,
                   StepDone done);
  // Whether Run returns while the device still works on the step (so that launching costs the
  // caller's thread only the staging): the SelectBatcher then launches on any thread, never
  // handing a step to a thread of its own.
  virtual bool RunsAsync() const { return false; }
  // Whether Run takes keys, queries and outputs that a device reads in place (KeyWrite::
  // keys_on_device, SpanSelect::queries_on_device and outputs_on_device) in memory `place`
  // (wire_values.h: a CUDA device's ordinal, or kMappedHostTensor): a CUDA backend does for its
  // own device and for mapped host memory. The engine never passes them to a backend that
  // does not.
  virtual bool TakesDeviceTensors(int /*ordinal*/) const { return false; }
  virtual int MaxConcurrentSteps() const { return INT_MAX; }

  // Stores keys, converting bf16 to the cache's storage type.
  virtual absl::Status WriteKeys(const KeyWrite& write) = 0;

  // Several writes at once, each to its own pages. On failure any of them may have been partly
  // applied. The default writes them one by one.
  virtual absl::Status WriteKeysBatch(std::span<const KeyWrite> writes);

  // Copies page `src` to page `dst` in every layer (copy-on-write of a shared page).
  virtual absl::Status CopyPage(int32_t src, int32_t dst) = 0;

  // Copies the stored bytes (bf16 or fp8, exactly as the cache holds them) of `pages`, every
  // layer, to host memory: dst receives [pages.size()][layers][kBlockSize][head_dim] elements.
  // For snapshots. The default says the backend cannot (UNIMPLEMENTED).
  virtual absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst);

  // The reverse: stores raw bytes laid out as ReadPages returns them into `pages`, every layer,
  // with no conversion. For restoring snapshots. The default says the backend cannot.
  virtual absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src);

  // Runs every task and fills its outputs, on the calling thread's time. Tasks are independent;
  // results must not depend on how tasks are grouped into calls.
  virtual absl::Status Select(std::span<const SelectTask> tasks,
                              const kernels::PageTableParams& page_table) = 0;
};

// Run, waiting for its end: for callers that have a thread to spare (tests, tools).
StepStatus RunAndWait(KeyCacheBackend& backend, const BackendStep& step,
                      const kernels::PageTableParams& page_table);

// One device of a server: its slot and the backend built for it (MakeBackends; the Engine takes
// a list of them, device d owning pages [d * capacity_pages, (d + 1) * capacity_pages)).
struct DeviceBackend {
  DeviceSlot slot;
  std::unique_ptr<KeyCacheBackend> backend;
};

inline void KeyCacheBackend::Run(const BackendStep& step, const kernels::PageTableParams& page_table,
                                 StepDone done) {
  StepStatus status;
  if (!step.writes.empty()) status.writes = WriteKeysBatch(step.writes);
  if (!status.writes.ok()) {
    status.selects = status.writes;
  } else if (!step.selects.empty()) {
    status.selects = Select(step.selects, page_table);
  }
  std::move(done)(std::move(status));
}

// Inline (like the defaults above): the CUDA backend's library uses it and sits below the engine's.
inline StepStatus RunAndWait(KeyCacheBackend& backend, const BackendStep& step,
                             const kernels::PageTableParams& page_table) {
  std::promise<StepStatus> ended;
  std::future<StepStatus> result = ended.get_future();
  backend.Run(step, page_table, [&ended](StepStatus s) { ended.set_value(std::move(s)); });
  return result.get();
}

inline absl::Status KeyCacheBackend::WriteKeysBatch(std::span<const KeyWrite> writes) {
  for (const KeyWrite& w : writes) {
    const absl::Status status = WriteKeys(w);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

inline absl::Status KeyCacheBackend::ReadPages(std::span<const int32_t> /*pages*/,
                                               uint8_t* /*dst*/) {
  return absl::UnimplementedError("backend " + name() + " cannot read pages back (snapshots)");
}

inline absl::Status KeyCacheBackend::WritePages(std::span<const int32_t> /*pages*/,
                                                const uint8_t* /*src*/) {
  return absl::UnimplementedError("backend " + name() + " cannot restore pages (snapshots)");
}

}  // namespace indexer::engine
