#include "engine/engine.h"

#include <algorithm>
#include <future>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/request_validation.h"
#include "engine/status_macros.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;

int64_t BlocksFor(int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }

std::vector<DeviceBackend> OneDevice(const EngineConfig& config,
                                     std::unique_ptr<KeyCacheBackend> backend) {
  std::vector<DeviceBackend> devices;
  devices.push_back(DeviceBackend{DeviceSlot{0, 0, config.capacity_pages}, std::move(backend)});
  return devices;
}

}  // namespace

absl::Status CallControl::Check() const {
  if (cancelled && cancelled()) return absl::CancelledError("the call was cancelled");
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError("the call's deadline passed before it was applied");
  }
  return absl::OkStatus();
}

EngineCore::EngineCore(const EngineConfig& c, std::vector<DeviceBackend> backends, PageQuotas quotas)
    : config(c),
      pool(c.capacity_pages, std::move(quotas), static_cast<int>(backends.size())),
      sequences(c.max_sequences, c.tenant_max_sequences) {
  for (DeviceBackend& d : backends) {
    EngineDevice& device = devices.emplace_back();
    device.slot = d.slot;
    device.backend = std::move(d.backend);
    device.batcher = std::make_unique<SelectBatcher>(*device.backend, config);
  }
}

int EngineCore::PlaceNew(std::vector<int64_t>& free, std::vector<int64_t>& planned) const {
  if (devices.size() == 1) return 0;
  if (free.empty()) {
    free = pool.FreePagesPerDevice();
    planned.assign(free.size(), 0);
  }
  // A failed device would refuse every call on the sequence: place it elsewhere while we can.
  int best = -1;
  for (int d = 0; d < static_cast<int>(free.size()); ++d) {
    if (!devices[d].backend->Health().ok()) continue;
    if (best < 0 || free[d] - planned[d] > free[best] - planned[best]) best = d;
  }
  return best < 0 ? 0 : best;
}

Engine::Engine(const EngineConfig& config, std::unique_ptr<KeyCacheBackend> backend,
               PageQuotas quotas)
    : Engine(config, OneDevice(config, std::move(backend)), std::move(quotas)) {}

Engine::Engine(const EngineConfig& config, std::vector<DeviceBackend> devices, PageQuotas quotas)
    : core_(std::make_unique<EngineCore>(config, std::move(devices), std::move(quotas))) {}

Engine::~Engine() {
  // Calls still running end first (their steps hold sequences and device work); then each
  // device's batcher drains and joins before its backend goes (EngineDevice's member order).
  CallGate::Paused drained(gate_);
}

void Engine::SetObserver(EngineObserver* observer) {
  observer_.store(observer);
  for (EngineDevice& d : core_->devices) d.batcher->SetObserver(observer);
}

template <typename Move>
absl::Status Engine::ForEachDeviceRun(std::span<const int32_t> pages, Move move) {
  for (size_t begin = 0; begin < pages.size();) {
    const int device = core_->pool.DeviceOf(pages[begin]);
    size_t end = begin + 1;
    while (end < pages.size() && core_->pool.DeviceOf(pages[end]) == device) ++end;
    INDEXER_RETURN_IF_ERROR(
        move(*core_->devices[device].backend, pages.subspan(begin, end - begin), begin));
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status Engine::ReadPagesAnyDevice(std::span<const int32_t> pages, uint8_t* dst) {
  const int64_t page_bytes = core_->config.BytesPerPage();
  return ForEachDeviceRun(pages, [&](KeyCacheBackend& b, std::span<const int32_t> run, size_t at) {
    return b.ReadPages(run, dst + static_cast<int64_t>(at) * page_bytes);
  });
}

absl::Status Engine::WritePagesAnyDevice(std::span<const int32_t> pages, const uint8_t* src) {
  const int64_t page_bytes = core_->config.BytesPerPage();
  return ForEachDeviceRun(pages, [&](KeyCacheBackend& b, std::span<const int32_t> run, size_t at) {
    return b.WritePages(run, src + static_cast<int64_t>(at) * page_bytes);
  });
}

std::vector<int> Engine::DeviceTensorOrdinals() const {
  std::vector<int> out;
  for (const EngineDevice& d : core_->devices) {
    if (d.backend->TakesDeviceTensors(d.slot.ordinal)) out.push_back(d.slot.ordinal);
  }
  return out;
}

bool Engine::TakesMappedHostTensors() const {
  for (const EngineDevice& d : core_->devices) {
    if (!d.backend->TakesDeviceTensors(kMappedHostTensor)) return false;
  }
  return !core_->devices.empty();
}

void Engine::BatchAsync(std::span<const StepRequest> items, const CallControl& control,
                        OutputSink* sink, BatchDone done) {
  BatchCall::Start(*core_, gate_, items, control, sink, observer_.load(), std::move(done));
}

std::vector<absl::StatusOr<StepResult>> Engine::Batch(std::span<const StepRequest> items,
                                                      const CallControl& control) {
  std::promise<std::vector<absl::StatusOr<StepResult>>> answered;
  std::future<std::vector<absl::StatusOr<StepResult>>> results = answered.get_future();
  BatchAsync(items, control, nullptr,
             [&answered](absl::Status /*call*/, std::vector<absl::StatusOr<StepResult>> r) {
               answered.set_value(std::move(r));  // a whole-call failure is in every item
             });
  return results.get();
}

absl::StatusOr<StepResult> Engine::Append(const AppendRequest& request,
                                          const CallControl& control) {
  StepRequest step;
  step.tenant = request.tenant;
  step.sequence_id = request.sequence_id;
  step.layer = request.all_layers ? 0 : request.layer;
  step.append = request;
  return std::move(Batch(std::span<const StepRequest>(&step, 1), control)[0]);
}

absl::StatusOr<StepResult> Engine::Select(const StepRequest& request, const CallControl& control) {
  if (request.queries.empty()) {
    return absl::InvalidArgumentError("queries is empty; a selection needs at least one token");
  }
  return std::move(Batch(std::span<const StepRequest>(&request, 1), control)[0]);
}

absl::StatusOr<int64_t> Engine::Release(absl::string_view sequence_id, absl::string_view tenant) {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(sequence_id, "sequence_id"));
  std::shared_ptr<Sequence> seq = core_->sequences.Erase(tenant, sequence_id);
  if (seq == nullptr) {
    return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' does not exist"));
  }
  std::lock_guard<SequenceMutex> lock(seq->mu);
  seq->released = true;
  const int64_t freed = core_->pool.Release(seq->pages);
  seq->pages.clear();
  return freed;
}

absl::StatusOr<TruncateResult> Engine::Truncate(absl::string_view sequence_id, int64_t length,
                                                absl::string_view tenant) {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(sequence_id, "sequence_id"));
  INDEXER_RETURN_IF_ERROR(CheckRange("length", length, 0, std::numeric_limits<int64_t>::max()));
  std::shared_ptr<Sequence> seq = core_->sequences.Find(tenant, sequence_id);
  if (seq != nullptr) {
    std::lock_guard<SequenceMutex> lock(seq->mu);
    if (!seq->released) {
      seq->last_used_ns = SteadyNowNs();
      for (int64_t& len : seq->lengths) len = std::min(len, length);
      const size_t keep = static_cast<size_t>(BlocksFor(seq->MaxLength()));
      TruncateResult r;
      if (seq->pages.size() > keep) {
        r.pages_freed = core_->pool.Release(
            std::span<const int32_t>(seq->pages.data() + keep, seq->pages.size() - keep));
        seq->pages.resize(keep);
      }
      if (seq->attn_pages.size() > keep) seq->attn_pages.resize(keep);
      r.lengths = seq->lengths;
      r.num_blocks = static_cast<int64_t>(keep);
      return r;
    }
  }
  return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' does not exist"));
}

absl::StatusOr<ForkResult> Engine::Fork(absl::string_view source_id, absl::string_view target_id,
                                        std::optional<int64_t> length,
                                        absl::string_view tenant) {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(source_id, "source_id"));
  INDEXER_RETURN_IF_ERROR(CheckId(target_id, "target_id"));
  if (source_id == target_id) {
    return absl::InvalidArgumentError("target_id must differ from source_id");
  }
  if (length) {
    INDEXER_RETURN_IF_ERROR(CheckRange("length", *length, 0, std::numeric_limits<int64_t>::max()));
  }
  std::shared_ptr<Sequence> src = core_->sequences.Find(tenant, source_id);
  if (src == nullptr) {
    return absl::NotFoundError(absl::StrCat("sequence '", source_id, "' does not exist"));
  }
  // A fork shares its source's pages, so it lives on its source's device.
  auto fork = std::make_shared<Sequence>(std::string(tenant), std::string(target_id),
                                         core_->config.layers, src->device);
  {
    std::lock_guard<SequenceMutex> lock(src->mu);
    src->last_used_ns = SteadyNowNs();
    if (src->released) {
      return absl::NotFoundError(absl::StrCat("sequence '", source_id, "' does not exist"));
    }
    for (int l = 0; l < core_->config.layers; ++l) {
      fork->lengths[l] = std::min(src->lengths[l], length.value_or(src->lengths[l]));
    }
    const size_t keep = static_cast<size_t>(BlocksFor(fork->MaxLength()));
    fork->pages.assign(src->pages.begin(), src->pages.begin() + keep);
    fork->attn_decided = src->attn_decided;
    fork->has_attn_pages = src->has_attn_pages;
    if (src->has_attn_pages) {
      fork->attn_pages.assign(src->attn_pages.begin(), src->attn_pages.begin() + keep);
    }
    // References are taken under the source's lock, so its pages cannot be freed meanwhile.
    core_->pool.AddRef(fork->pages);
  }
  const SequenceTable::InsertResult inserted = core_->sequences.Insert(fork);
  if (inserted != SequenceTable::InsertResult::kInserted) {
    core_->pool.Release(fork->pages);
    if (inserted != SequenceTable::InsertResult::kTaken) {
      return core_->sequences.RefusalStatus(inserted, target_id);
    }
    return absl::AlreadyExistsError(absl::StrCat("sequence '", target_id, "' already exists"));
  }
  ForkResult r;
  r.lengths = fork->lengths;
  r.num_blocks = static_cast<int64_t>(fork->pages.size());
  r.pages_shared = r.num_blocks;
  return r;
}

absl::StatusOr<SequenceInfo> Engine::Get(absl::string_view sequence_id,
                                         absl::string_view tenant) const {
  CallGate::Pass pass(gate_);
  INDEXER_RETURN_IF_ERROR(CheckId(sequence_id, "sequence_id"));
  std::shared_ptr<Sequence> seq = core_->sequences.Find(tenant, sequence_id);
  if (seq != nullptr) {
    std::lock_guard<SequenceMutex> lock(seq->mu);
    if (!seq->released) {
      // Reading a sequence is using it: clients settle calls in doubt with Get.
      seq->last_used_ns = SteadyNowNs();
      SequenceInfo info;
      info.device = seq->device;
      info.lengths = seq->lengths;
      info.pages = seq->pages;
      info.attention_pages = seq->attn_pages;
      for (int32_t p : seq->pages) info.shared_pages += core_->pool.RefCount(p) > 1 ? 1 : 0;
      return info;
    }
  }
  return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' does not exist"));
}

int64_t Engine::ReclaimIdle(absl::Duration idle) {
  CallGate::Pass pass(gate_);
  const int64_t now = SteadyNowNs();
  const int64_t limit = absl::ToInt64Nanoseconds(idle);
  int64_t reclaimed = 0;
  for (const std::shared_ptr<Sequence>& seq : core_->sequences.All()) {
    std::lock_guard<SequenceMutex> lock(seq->mu);
    if (seq->released || now - seq->last_used_ns < limit) continue;
    if (!core_->sequences.EraseIfSame(seq)) continue;
    seq->released = true;
    core_->pool.Release(seq->pages);
    seq->pages.clear();
    ++reclaimed;
  }
  return reclaimed;
}

void Engine::AbandonSelections() {
  for (EngineDevice& d : core_->devices) d.backend->AbandonSelections();
}

EngineStats Engine::Stats() const {
  EngineStats s;
  s.live_sequences = static_cast<int64_t>(core_->sequences.size());
  const std::vector<int64_t> free = core_->pool.FreePagesPerDevice();
  for (size_t d = 0; d < core_->devices.size(); ++d) {
    DeviceStats& ds = s.devices.emplace_back();
    ds.slot = core_->devices[d].slot;
    ds.total_pages = core_->pool.pages_per_device();
    ds.free_pages = free[d];
    ds.queued_selects = core_->devices[d].batcher->queued_tasks();
    ds.health = core_->devices[d].backend->Health();
    s.total_pages += ds.total_pages;
    s.free_pages += ds.free_pages;
    s.queued_selects += ds.queued_selects;
  }
  return s;
}

absl::Status Engine::Health() const {
  for (const EngineDevice& d : core_->devices) {
    absl::Status health = d.backend->Health();
    if (!health.ok()) return health;
  }
  return absl::OkStatus();
}

TenantUsage Engine::Usage(absl::string_view tenant) const {
  return TenantUsage{core_->pool.TenantPages(tenant), core_->pool.TenantQuota(tenant),
                     core_->sequences.TenantSize(tenant), core_->sequences.max_per_tenant()};
}

}  // namespace indexer::engine
