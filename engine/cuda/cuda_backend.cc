#include "engine/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "engine/cuda/cuda_errors.h"
#include "engine/cuda/cuda_lane.h"
#include "engine/cuda/cuda_resources.h"
#include "engine/cuda/select_graph.h"
#include "engine/device_failure.h"
#include "engine/status_macros.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/select_batch.h"
#include "kernels/cuda/span_plan.h"
#include "kernels/cuda/step_copy.h"
#include "kernels/cuda/step_staging.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;
using kernels::cuda::SpanDesc;

// Device memory left free beside the pool for scratch, staging and the CUDA context.
constexpr int64_t kHeadroomBytes = int64_t{1} << 30;
// ReadPages/WritePages move pages through a lane's pinned staging this many bytes at a time, so
// a snapshot of the whole cache does not grow every lane's pinned buffers to its size.
constexpr int64_t kPageStagingBytes = int64_t{16} << 20;
constexpr int kMaxLanes = 8;
// A lane whose graphs failed this many times (built or updated) runs its steps without graphs.
constexpr int kMaxGraphFailures = 3;

// The range of `n` host values: what the engine's check found when it summed them up, else a
// scan of them.
kernels::cuda::Bf16Range HostRange(const kernels::Bf16Summary& summary, const uint16_t* values,
                                   int64_t n) {
  if (!summary.known) return kernels::cuda::ScanBf16(values, n);
  return kernels::cuda::Bf16Range{kernels::Bf16ToFloat(summary.max_magnitude), summary.fits_f16};
}

class CudaBackend final : public KeyCacheBackend {
 public:
  CudaBackend(const EngineConfig& config, const DeviceSlot& slot, const CudaBackendOptions& options)
      : config_(config),
        slot_(slot),
        options_(Normalized(options)),
        pages_(slot.num_pages > 0 ? slot.num_pages : config.capacity_pages),
        page_bytes_(kernels::PageBytes(config.key_storage, config.head_dim)),
        layer_bytes_(pages_ * page_bytes_),
        key_max_abs_(new std::atomic<float>[static_cast<size_t>(std::max(config.layers, 1))]) {
    for (int l = 0; l < std::max(config.layers, 1); ++l) key_max_abs_[l].store(0.0f);
  }
  ~CudaBackend() override {
    // A backend whose Init refused its slot never touched a device: setting an invalid ordinal
    // here would leave an error in this thread's CUDA error state for an unrelated later call.
    if (!entered_device_) return;
    // Free the streams, staging, graphs and pool on this backend's device.
    (void)cudaSetDevice(slot_.ordinal);
    lanes_.Clear();
    copy_lanes_.Clear();
    pool_.Reset();
    (void)cudaGetLastError();
  }

  absl::Status Init();
  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  absl::Status Health() const override { return failure_.Check(); }
  bool RunsAsync() const override { return true; }
  bool TakesDeviceTensors(int place) const override {
    return place == slot_.ordinal || place == kMappedHostTensor;
  }
  int MaxConcurrentSteps() const override { return options_.lanes; }
  // A step: staged on the calling thread, launched there or by its lane's completion thread
  // (Lane::Launch), finished on the completion thread.
  void Run(const BackendStep& step, const kernels::PageTableParams& page_table,
           StepDone done) override;
  // The synchronous calls below run through Guarded: they fail fast once the device has failed,
  // and a sticky CUDA error in them marks the device failed. Key writes and selections are steps.
  absl::Status WriteKeys(const KeyWrite& write) override {
    return RunAndWait(*this, BackendStep{std::span<const KeyWrite>(&write, 1), {}}, {}).writes;
  }
  absl::Status WriteKeysBatch(std::span<const KeyWrite> writes) override {
    return RunAndWait(*this, BackendStep{writes, {}}, {}).writes;
  }
  absl::Status Select(std::span<const SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override {
    return RunAndWait(*this, BackendStep{{}, tasks}, page_table).selects;
  }
  absl::Status CopyPage(int32_t src, int32_t dst) override {
    return Guarded([&] { return CopyPageOnDevice(src, dst); });
  }
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override {
    return Guarded([&] { return TransferPages(pages, dst); });
  }
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override {
    return Guarded([&] { return WritePagesOnDevice(pages, src); });
  }

  CudaBackendCounters counters() const;
  std::vector<BackendCounter> Counters() const override;
  // Steps with selections that start from now on fail at once with CANCELLED; steps already on
  // the device run to their end (milliseconds), since their staging stays in use until then.
  void AbandonSelections() override { abandoned_.store(true, std::memory_order_relaxed); }

 private:
  static CudaBackendOptions Normalized(CudaBackendOptions o) {
    o.lanes = std::clamp(o.lanes, 1, kMaxLanes);
    o.graphs_per_lane = std::max(o.graphs_per_lane, 1);
    return o;
  }

  // Runs one call's `body`: refuses at once (the latched UNAVAILABLE status) once the device has
  // failed; when the body fails with a sticky CUDA error, latches failure_ and returns its status.
  template <typename Body>
  absl::Status Guarded(Body body) {
    INDEXER_RETURN_IF_ERROR(failure_.Check());
    return Latched(body());
  }
  // `status`, or the device's failure when it is a sticky CUDA error (latched by the first).
  absl::Status Latched(absl::Status status) {
    if (!status.ok() && IsStickyCudaError(CudaErrorOf(status))) {
      status = failure_.Fail(absl::StrFormat("CUDA device %d (%s)", slot_.ordinal, gpu_name_), status);
    }
    return status;
  }
  // Callers' threads vary: every call makes this backend's device current before its first CUDA
  // call, once it holds its lane; a call that waited for a lane while the device failed stops
  // here without touching it.
  absl::Status EnterDevice() const {
    INDEXER_RETURN_IF_ERROR(failure_.Check());
    return CudaStatus(cudaSetDevice(slot_.ordinal), "cudaSetDevice");
  }
  absl::Status CopyPageOnDevice(int32_t src, int32_t dst);
  absl::Status WritePagesOnDevice(std::span<const int32_t> pages, const uint8_t* src);
  // Run's parts: stage the step into the lane's buffers; enqueue it, on whichever thread
  // Lane::Launch picks (on failure nothing is left running on the lane's stream that reads the
  // staging, except as the status says); then, on the completion thread, scatter the outputs and
  // end the step.
  absl::Status Stage(Lane& lane, const BackendStep& step, const kernels::PageTableParams& page_table);
  // Stage's second half: lays out lane.spans and `writes` in the lane's buffers.
  absl::Status Place(Lane& lane, std::span<const KeyWrite> writes);
  // A step's launch on whichever thread runs it: this device made current, then Enqueue.
  absl::Status LaunchOnThisThread(Lane& lane, bool* enqueued);
  absl::Status Enqueue(Lane& lane, bool use_graphs, bool* enqueued);
  // Device inputs are planned before their values are known: as if every device query fit f16
  // and the step's device keys raised no layer's maximum. Once the step's copy has scanned them
  // (on the completion thread, outputs scattered), this raises the layers' maxima and runs again,
  // on the exact path and before the step ends, every span that choice got wrong.
  absl::Status RecheckDevicePaths(Lane& lane);
  // On the completion thread: the step's outputs scattered, its lane released, `done` told.
  // `timing` holds the queue and stage phases; `staged` is when staging ended.
  void Finish(Lane& lane, absl::Status synced, StepTiming timing, absl::Time staged,
              StepDone done);
  // Writes the `n` global page ids at `ids` to `dst` as this pool's page indices; INTERNAL
  // (naming the id) at the first one outside the slot.
  absl::Status ToLocal(const int32_t* ids, int64_t n, int32_t* dst, const char* what) const;
  absl::Status ToLocal(int32_t id, int64_t* local, const char* what) const;
  // Largest |key| ever written to a layer: decides when selections need the exact path.
  float KeyMax(int layer) const { return key_max_abs_[layer].load(std::memory_order_acquire); }
  void RaiseKeyMax(int layer, float m);
  // ReadPages (HostByte = uint8_t: pool to host) and WritePages (HostByte = const uint8_t: host
  // to pool): moves `pages` (global ids), every layer, between the pool and `host`, laid out
  // [pages][layers][page_bytes_], through the lane's pinned staging kPageStagingBytes at a time.
  template <typename HostByte>
  absl::Status TransferPages(std::span<const int32_t> pages, HostByte* host);

  const EngineConfig config_;
  const DeviceSlot slot_;
  const CudaBackendOptions options_;
  const int64_t pages_;
  const int64_t page_bytes_;  // one page of one layer
  const int64_t layer_bytes_;
  bool entered_device_ = false;  // Init made the device current (the slot is usable)
  int num_sms_ = 0;
  std::string gpu_name_;     // the product name (cudaDeviceProp::name)
  std::string device_name_;
  DeviceFailure failure_;    // set by the first sticky CUDA error (Guarded)
  DeviceBuffer pool_;  // allocated in Init, then only read and written through lanes' streams
  std::unique_ptr<std::atomic<float>[]> key_max_abs_;  // [layers]

  // Steps (key writes and selections together) take a lane of lanes_. Page copies and
  // transfers take the one lane of copy_lanes_: they are synchronous and may run on a lane's
  // completion thread (a wave that follows another applies its copy-on-write there), where
  // waiting for a step's lane could wait for that very thread.
  LanePool lanes_;
  LanePool copy_lanes_;

  std::atomic<bool> abandoned_{false};
  std::atomic<int64_t> steps_{0}, selects_{0}, graph_launches_{0}, graph_builds_{0},
      graph_node_updates_{0}, graph_fallbacks_{0}, buffer_growths_{0}, exact_reruns_{0};
};

absl::Status CudaBackend::Init() {
  const int count = CudaDeviceCount();
  if (slot_.ordinal < 0 || slot_.ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CUDA device %d was asked for, but %d CUDA devices are visible", slot_.ordinal, count));
  }
  if (slot_.first_page < 0 || pages_ <= 0 || slot_.first_page + pages_ > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "device slot of pages [%d, %d) is not usable: page ids are non-negative int32",
        slot_.first_page, slot_.first_page + pages_));
  }
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  entered_device_ = true;
  cudaDeviceProp prop{};
  INDEXER_RETURN_IF_ERROR(
      CudaStatus(cudaGetDeviceProperties(&prop, slot_.ordinal), "cudaGetDeviceProperties"));
  num_sms_ = prop.multiProcessorCount;
  gpu_name_ = prop.name;
  const int64_t topk_smem = kernels::cuda::TopkSharedBytes(
      static_cast<int32_t>(std::min<int64_t>(config_.MaxBlocksPerSequence(), 1 << 30)));
  const int64_t prefill_smem = kernels::cuda::PrefillSharedBytes(config_.head_dim, config_.key_storage);
  if (prefill_smem > static_cast<int64_t>(prop.sharedMemPerBlockOptin)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "head_dim %d with %s keys needs %d bytes of shared memory per block for the prefill scorer; "
        "%s offers %d (an H100/H200 offers 232448)",
        config_.head_dim, kernels::KeyStorageName(config_.key_storage), prefill_smem, prop.name,
        prop.sharedMemPerBlockOptin));
  }
  if (topk_smem > static_cast<int64_t>(prop.sharedMemPerBlockOptin)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_tokens_per_sequence %d needs %d bytes of shared memory per block for top-k; %s offers "
        "%d; lower max_tokens_per_sequence (2097152 fits an H100/H200)",
        config_.max_tokens_per_sequence, topk_smem, prop.name, prop.sharedMemPerBlockOptin));
  }
  size_t free_bytes = 0, total_bytes = 0;
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  const int64_t pool_bytes = layer_bytes_ * config_.layers;
  if (pool_bytes + kHeadroomBytes > static_cast<int64_t>(free_bytes)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%d pages need %.2f GiB of GPU memory plus %.2f GiB headroom, but %s (device %d) has "
        "%.2f GiB free of %.2f GiB; lower --capacity",
        pages_, pool_bytes / 1073741824.0, kHeadroomBytes / 1073741824.0, prop.name, slot_.ordinal,
        free_bytes / 1073741824.0, total_bytes / 1073741824.0));
  }
  INDEXER_RETURN_IF_ERROR(pool_.Allocate(static_cast<size_t>(pool_bytes)));
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaMemset(pool_.get(), 0, pool_bytes), "cudaMemset(pool)"));
  int least_priority = 0, greatest_priority = 0;
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
                                     "cudaDeviceGetStreamPriorityRange"));
  for (int i = 0; i < options_.lanes; ++i) {
    INDEXER_RETURN_IF_ERROR(lanes_.Add(slot_.ordinal, options_.graphs_per_lane, least_priority));
  }
  INDEXER_RETURN_IF_ERROR(copy_lanes_.Add(slot_.ordinal, 1, greatest_priority));
  device_name_ = absl::StrFormat(
      "%s (device %d, sm_%d%d, %d SMs, %.0f GiB, pool %.2f GiB of pages [%d, %d), %d lanes, "
      "graphs %s)",
      prop.name, slot_.ordinal, prop.major, prop.minor, prop.multiProcessorCount,
      total_bytes / 1073741824.0, pool_bytes / 1073741824.0, slot_.first_page,
      slot_.first_page + pages_, options_.lanes, options_.use_graphs ? "on" : "off");
  return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

absl::Status CudaBackend::ToLocal(int32_t id, int64_t* local, const char* what) const {
  *local = int64_t{id} - slot_.first_page;
  if (*local >= 0 && *local < pages_) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "%s: page id %d is outside this backend's slot (pages [%d, %d) on CUDA device %d)", what, id,
      slot_.first_page, slot_.first_page + pages_, slot_.ordinal));
}

absl::Status CudaBackend::ToLocal(const int32_t* ids, int64_t n, int32_t* dst, const char* what) const {
  const int64_t first = slot_.first_page;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = int64_t{ids[i]} - first;
    if (local < 0 || local >= pages_) {
      int64_t ignored = 0;
      return ToLocal(ids[i], &ignored, what);
    }
    dst[i] = static_cast<int32_t>(local);
  }
  return absl::OkStatus();
}

void CudaBackend::RaiseKeyMax(int layer, float m) {
  std::atomic<float>& a = key_max_abs_[layer];
  float cur = a.load(std::memory_order_relaxed);
  while (m > cur && !a.compare_exchange_weak(cur, m, std::memory_order_acq_rel)) {
  }
}

CudaBackendCounters CudaBackend::counters() const {
  CudaBackendCounters c;
  c.lanes = options_.lanes;
  c.peak_busy_lanes = lanes_.peak_busy();
  c.steps = steps_.load();
  c.selects = selects_.load();
  c.graph_launches = graph_launches_.load();
  c.graph_builds = graph_builds_.load();
  c.graph_node_updates = graph_node_updates_.load();
  c.graph_fallbacks = graph_fallbacks_.load();
  c.buffer_growths = buffer_growths_.load();
  c.exact_reruns = exact_reruns_.load();
  return c;
}

std::vector<BackendCounter> CudaBackend::Counters() const {
  const CudaBackendCounters c = counters();
  return {
      {"lanes", "Selection lanes (streams with their own staging) of each device.", c.lanes, false},
      {"lanes_peak_busy", "The most selection lanes held at once.", c.peak_busy_lanes, false},
      {"steps_total", "Steps that ran kernels (key writes, selections or both).", c.steps},
      {"select_steps_total", "Steps that ran kernels with selections.", c.selects},
      {"graph_launches_total", "Steps that reached the device as one CUDA graph launch.",
       c.graph_launches},
      {"graph_builds_total", "CUDA graphs instantiated (a step of a new kernel topology, or "
       "after a staging buffer grew).", c.graph_builds},
      {"graph_node_updates_total", "Node parameters of cached graphs set for a step.",
       c.graph_node_updates},
      {"graph_fallbacks_total", "Steps run without a graph after building or updating one "
       "failed.", c.graph_fallbacks},
      {"buffer_growths_total", "Lanes' staging or scratch buffers allocated anew (each drops "
       "the lane's cached graphs).", c.buffer_growths},
      {"exact_reruns_total", "Spans run again on the exact path once their device-resident "
       "inputs (CUDA regions) turned out to need it.", c.exact_reruns},
  };
}

absl::Status CudaBackend::CopyPageOnDevice(int32_t src, int32_t dst) {
  int64_t s = 0, t = 0;
  INDEXER_RETURN_IF_ERROR(ToLocal(src, &s, "page copy"));
  INDEXER_RETURN_IF_ERROR(ToLocal(dst, &t, "page copy"));
  LaneLease lease(copy_lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  char* base = pool_.get<char>();
  absl::Status status;
  for (int l = 0; l < config_.layers && status.ok(); ++l) {
    char* layer = base + l * layer_bytes_;
    status = CudaStatus(cudaMemcpyAsync(layer + t * page_bytes_, layer + s * page_bytes_, page_bytes_,
                                        cudaMemcpyDeviceToDevice, lane.stream.get()),
                        "cudaMemcpyAsync(page copy)");
  }
  const absl::Status finished = lane.Sync("page copy");
  INDEXER_RETURN_IF_ERROR(status);
  return finished;
}

template <typename HostByte>
absl::Status CudaBackend::TransferPages(std::span<const int32_t> pages, HostByte* host) {
  constexpr bool kToHost = !std::is_const_v<HostByte>;
  constexpr cudaMemcpyKind kKind = kToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  const char* const what = kToHost ? "read pages" : "write pages";
  const char* const copy_what = kToHost ? "cudaMemcpyAsync(read page)" : "cudaMemcpyAsync(write page)";
  if (pages.empty()) return absl::OkStatus();
  std::vector<int32_t> local(pages.size());
  INDEXER_RETURN_IF_ERROR(ToLocal(pages.data(), static_cast<int64_t>(pages.size()), local.data(), what));
  LaneLease lease(copy_lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  const int64_t bytes_per_page = config_.layers * page_bytes_;
  const int64_t chunk = std::max<int64_t>(1, kPageStagingBytes / bytes_per_page);
  PinnedBuffer& staging = kToHost ? lane.h_out : lane.h_in;
  INDEXER_RETURN_IF_ERROR(
      lane.Reserve(staging, std::min<int64_t>(chunk, static_cast<int64_t>(pages.size())) * bytes_per_page));
  char* h = staging.get<char>();
  char* pool = pool_.get<char>();
  for (size_t first = 0; first < local.size(); first += chunk) {
    const size_t n = std::min<size_t>(chunk, local.size() - first);
    HostByte* host_chunk = host + static_cast<int64_t>(first) * bytes_per_page;
    if constexpr (!kToHost) std::memcpy(h, host_chunk, n * bytes_per_page);
    absl::Status status;
    for (size_t i = 0; i < n && status.ok(); ++i) {
      for (int l = 0; l < config_.layers && status.ok(); ++l) {
        char* staged = h + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes_;
        char* page = pool + l * layer_bytes_ + local[first + i] * page_bytes_;
        status = CudaStatus(cudaMemcpyAsync(kToHost ? staged : page, kToHost ? page : staged,
                                            page_bytes_, kKind, lane.stream.get()),
                            copy_what);
      }
    }
    // Wait even after a failed enqueue: copies already queued still use the staging buffer.
    const absl::Status finished = lane.Sync(what);
    INDEXER_RETURN_IF_ERROR(status);
    INDEXER_RETURN_IF_ERROR(finished);
    if constexpr (kToHost) std::memcpy(host_chunk, h, n * bytes_per_page);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::WritePagesOnDevice(std::span<const int32_t> pages, const uint8_t* src) {
  INDEXER_RETURN_IF_ERROR(TransferPages(pages, src));
  // Selections pick their path from the largest key written (see KeyMax).
  const int64_t elems = int64_t{kBlockSize} * config_.head_dim;
  std::vector<float> key(static_cast<size_t>(config_.head_dim));
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int l = 0; l < config_.layers; ++l) {
      const uint8_t* page = src + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes_;
      float m = 0.0f;
      if (config_.key_storage == kernels::KeyStorage::kBf16) {
        m = kernels::cuda::ScanBf16(reinterpret_cast<const uint16_t*>(page), elems).max_abs;
      } else if (config_.key_storage == kernels::KeyStorage::kFp8E4M3) {
        for (int64_t e = 0; e < elems; ++e) {
          m = std::max(m, std::fabs(kernels::Fp8E4M3ToFloat(page[e])));
        }
      } else {
        for (int slot = 0; slot < kBlockSize; ++slot) {
          kernels::LoadKey(page, config_.key_storage, config_.head_dim, 0, slot, key.data());
          for (float v : key) m = std::max(m, std::fabs(v));
        }
      }
      RaiseKeyMax(l, m);
    }
  }
  return absl::OkStatus();
}

void CudaBackend::Run(const BackendStep& step, const kernels::PageTableParams& page_table,
                      StepDone done) {
  if (absl::Status failed = failure_.Check(); !failed.ok()) {
    std::move(done)(StepStatus{failed, failed, {}});
    return;
  }
  if (!step.selects.empty() && abandoned_.load(std::memory_order_relaxed)) {
    const absl::Status cancelled =
        absl::CancelledError("the selection was abandoned: the server is shutting down");
    std::move(done)(StepStatus{cancelled, cancelled, {}});
    return;
  }
  const absl::Time start = absl::Now();
  // The SelectBatcher runs at most MaxConcurrentSteps() steps at once, so a lane is free here
  // unless a synchronous transfer holds one for a moment.
  Lane* lane = lanes_.Acquire();
  const absl::Time acquired = absl::Now();
  absl::Status status = EnterDevice();
  if (status.ok()) status = Stage(*lane, step, page_table);
  const absl::Time staged = absl::Now();
  if (!status.ok()) {
    lanes_.Release(lane);  // Stage leaves nothing on the stream that reads the staging
    status = Latched(status);
    std::move(done)(StepStatus{status, status, {}});
    return;
  }
  // A wait for a lane is a wait in the queue; the batcher adds its own queue time.
  const StepTiming timing{acquired - start, staged - acquired, absl::ZeroDuration(),
                          absl::ZeroDuration(), absl::ZeroDuration()};
  lane->Launch(
      [this, lane](bool* enqueued) {
        absl::Status launched = LaunchOnThisThread(*lane, enqueued);
        lane->launched = absl::Now();
        return launched;
      },
      [this, lane, timing, staged, done = std::move(done)](absl::Status synced) mutable {
        Finish(*lane, std::move(synced), timing, staged, std::move(done));
      });
}

absl::Status CudaBackend::Stage(Lane& lane, const BackendStep& step,
                                const kernels::PageTableParams& page_table) {
  const int d = config_.head_dim;
  // Selections take their path from the largest key written, this step's writes included:
  // raising the maximum before the keys land can only choose the exact path more often. Keys in
  // device memory are scanned on the device (RecheckDevicePaths).
  lane.staged_writes = step.writes;
  for (const KeyWrite& w : step.writes) {
    if (w.keys_on_device) continue;
    const float m = HostRange(w.keys_summary, w.keys, w.num_tokens * w.layer_count * d).max_abs;
    for (int l = 0; l < w.layer_count; ++l) RaiseKeyMax(w.layer_begin + l, m);
  }
  lane.page_table = page_table;
  lane.spans.resize(step.selects.size());
  lane.query_ranges.resize(step.selects.size());
  lane.span_layers.resize(step.selects.size());
  for (size_t i = 0; i < step.selects.size(); ++i) {
    const SelectTask& task = step.selects[i];
    kernels::cuda::StagedSpan& staged = lane.spans[i];
    staged.host = task.span;
    staged.keys = pool_.get<char>() + task.layer * layer_bytes_;
    const int rows = task.span.num_tokens * task.span.num_heads;
    lane.query_ranges[i] =
        task.span.queries_on_device
            ? kernels::cuda::Bf16Range{}
            : HostRange(task.span.queries_summary, task.span.queries, int64_t{rows} * d);
    lane.span_layers[i] = task.layer;
    staged.path = kernels::cuda::ChoosePath(rows, d, config_.key_storage, lane.query_ranges[i],
                                            KeyMax(task.layer));
  }
  return Place(lane, step.writes);
}

absl::Status CudaBackend::Place(Lane& lane, std::span<const KeyWrite> writes) {
  kernels::cuda::StepStaging& staging = lane.staging;
  staging.Plan(writes, lane.spans, config_.head_dim, config_.key_storage, lane.page_table);
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.h_in, staging.input_bytes()));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_in, staging.device_input_bytes()));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.h_out, std::max<int64_t>(staging.output_bytes(), 4)));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_out, std::max<int64_t>(staging.output_bytes(), 4)));
  if (const std::optional<int32_t> bad = staging.WriteInputs(
          lane.h_in.get<char>(), lane.d_in.get<char>(), lane.d_out.get<char>(),
          kernels::cuda::PageRange{slot_.first_page, pages_},
          kernels::cuda::WriteTarget{pool_.get(), layer_bytes_}, num_sms_)) {
    int64_t ignored = 0;
    return ToLocal(*bad, &ignored, "step block table");
  }
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_scores, staging.ScoreFloats() * 4));
  const size_t counter_bytes = staging.DecodeCounters() * sizeof(int);
  if (lane.d_counters.bytes() < counter_bytes) {
    INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_counters, counter_bytes));
    const absl::Status zeroed = CudaStatus(
        cudaMemsetAsync(lane.d_counters.get(), 0, lane.d_counters.bytes(), lane.stream.get()),
        "cudaMemsetAsync");
    if (!zeroed.ok()) {
      // Counters that were never zeroed must not be used: the next step allocates them again.
      lane.d_counters.Reset();
      return zeroed;
    }
  }
  if (lane.graphs_generation != lane.generation) {
    // A buffer (this step's or an earlier one's on this lane) was allocated anew: cached graphs
    // point into the old one.
    buffer_growths_.fetch_add(1, std::memory_order_relaxed);
    lane.graphs.Clear();
    lane.graphs_generation = lane.generation;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::RecheckDevicePaths(Lane& lane) {
  INDEXER_RETURN_IF_ERROR(EnterDevice());  // on the completion thread: see LaunchOnThisThread
  const kernels::cuda::StepStaging& staging = lane.staging;
  const char* host_out = lane.h_out.get<char>();
  for (size_t i = 0; i < lane.staged_writes.size(); ++i) {
    if (const std::optional<kernels::cuda::Bf16Range> scan = staging.WriteScan(i, host_out)) {
      const KeyWrite& w = lane.staged_writes[i];
      for (int l = 0; l < w.layer_count; ++l) RaiseKeyMax(w.layer_begin + l, scan->max_abs);
    }
  }
  const bool device_keys = std::any_of(lane.staged_writes.begin(), lane.staged_writes.end(),
                                       [](const KeyWrite& w) { return w.keys_on_device; });
  std::vector<kernels::cuda::StagedSpan> again;
  for (size_t i = 0; i < lane.spans.size(); ++i) {
    const kernels::cuda::StagedSpan& s = lane.spans[i];
    const std::optional<kernels::cuda::Bf16Range> scan = staging.SpanScan(i, host_out);
    if (s.path == kernels::cuda::SpanPath::kExact || (!scan && !device_keys)) continue;
    if (scan && s.host.queries_nonfinite != nullptr && *s.host.queries_nonfinite != 0) {
      continue;  // the item fails
    }
    const int rows = s.host.num_tokens * s.host.num_heads;
    const kernels::cuda::SpanPath needed =
        kernels::cuda::ChoosePath(rows, config_.head_dim, config_.key_storage,
                                  scan ? *scan : lane.query_ranges[i], KeyMax(lane.span_layers[i]));
    if (needed != kernels::cuda::SpanPath::kExact) continue;
    again.push_back(s);
    again.back().path = kernels::cuda::SpanPath::kExact;
  }
  if (again.empty()) return absl::OkStatus();
  exact_reruns_.fetch_add(static_cast<int64_t>(again.size()), std::memory_order_relaxed);
  lane.spans = std::move(again);
  lane.staged_writes = {};
  INDEXER_RETURN_IF_ERROR(Place(lane, {}));
  bool enqueued = false;
  absl::Status status = Enqueue(lane, /*use_graphs=*/false, &enqueued);
  if (enqueued) {
    const absl::Status synced = lane.Sync("exact re-run");
    if (status.ok()) status = synced;
  }
  if (status.ok()) lane.staging.Scatter(lane.h_out.get<char>());
  return status;
}

absl::Status CudaBackend::LaunchOnThisThread(Lane& lane, bool* enqueued) {
  // The completion thread runs other devices' callbacks too, which may leave their device
  // current; graphs and launches need this backend's.
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  try {
    return Enqueue(lane, /*use_graphs=*/true, enqueued);
  } catch (const std::exception& e) {
    // Caching a graph allocates; nothing escapes onto the completion thread.
    return absl::InternalError(absl::StrCat("the step's launch failed: ", e.what()));
  }
}

absl::Status CudaBackend::Enqueue(Lane& lane, bool use_graphs, bool* enqueued) {
  const kernels::cuda::StepStaging& staging = lane.staging;
  char* din = lane.d_in.get<char>();
  char* dout = lane.d_out.get<char>();
  cudaStream_t st = lane.stream.get();
  // The step's inputs come out of the lane's mapped pinned buffer and its outputs go back into
  // it by kernels at both ends of the list: the whole step is one graph launch.
  kernels::cuda::LaunchList launches;
  INDEXER_RETURN_IF_ERROR(CudaStatus(
      kernels::cuda::DescribeStepCopy(lane.h_in.get(), din, staging.input_bytes(), &launches),
      "step input copy"));
  INDEXER_RETURN_IF_ERROR(CudaStatus(staging.Describe(din, dout, lane.d_scores.get<float>(),
                                                      lane.d_counters.get<int>(), &launches),
                                     "step launch"));
  INDEXER_RETURN_IF_ERROR(CudaStatus(
      kernels::cuda::DescribeStepCopy(dout, lane.h_out.get(), staging.output_bytes(), &launches),
      "step result copy"));
  if (launches.size == 0) return absl::OkStatus();
  if (use_graphs && options_.use_graphs && lane.graph_failures < kMaxGraphFailures) {
    const GraphLaunchResult r = lane.graphs.Launch(launches, st);
    graph_builds_.fetch_add(r.built ? 1 : 0, std::memory_order_relaxed);
    graph_node_updates_.fetch_add(r.updated_nodes, std::memory_order_relaxed);
    if (r.enqueued) {
      *enqueued = true;
      graph_launches_.fetch_add(1, std::memory_order_relaxed);
      return CudaStatus(r.error, "step graph launch");
    }
    // Nothing was enqueued: run the step without a graph below.
    ++lane.graph_failures;
    graph_fallbacks_.fetch_add(1, std::memory_order_relaxed);
  }
  *enqueued = true;
  return CudaStatus(launches.Enqueue(st), "step launch");
}

void CudaBackend::Finish(Lane& lane, absl::Status synced, StepTiming timing, absl::Time staged,
                         StepDone done) {
  const absl::Time seen = absl::Now();
  const absl::Time launched = lane.launched;
  if (synced.ok()) {
    lane.staging.Scatter(lane.h_out.get<char>());
    steps_.fetch_add(1, std::memory_order_relaxed);
    if (lane.staging.has_spans()) selects_.fetch_add(1, std::memory_order_relaxed);
    if (lane.staging.has_device_inputs()) synced = RecheckDevicePaths(lane);
  }
  lanes_.Release(&lane);  // before `done`: the batcher may start the next step on this lane
  StepStatus status;
  status.writes = Latched(std::move(synced));
  status.selects = status.writes;
  status.timing = timing;
  status.timing.launch = launched - staged;
  status.timing.device = seen - launched;
  status.timing.scatter = absl::Now() - seen;
  std::move(done)(std::move(status));
}
}  // namespace

absl::Status CudaDeviceAvailable() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaStatus(err, "cudaGetDeviceCount");
  }
  if (count == 0) return absl::NotFoundError("no CUDA device is visible");
  return absl::OkStatus();
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return std::max(count, 0);
}

CudaBackendOptions ParseCudaBackendOptions(const char* graphs, const char* lanes) {
  CudaBackendOptions o;
  if (graphs != nullptr) {
    const absl::string_view g(graphs);
    if (g == "0") o.use_graphs = false;
    if (g == "1") o.use_graphs = true;
  }
  int n = 0;
  if (lanes != nullptr && absl::SimpleAtoi(lanes, &n) && n >= 1 && n <= kMaxLanes) o.lanes = n;
  return o;
}

CudaBackendOptions CudaBackendOptions::FromEnvironment() {
  static const CudaBackendOptions options =
      ParseCudaBackendOptions(std::getenv("INDEXER_CUDA_GRAPHS"), std::getenv("INDEXER_CUDA_LANES"));
  return options;
}

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config,
                                                                 const DeviceSlot& slot,
                                                                 const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>(config, slot, options);
  INDEXER_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<KeyCacheBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config,
                                                                 const DeviceSlot& slot) {
  return MakeCudaBackend(config, slot, CudaBackendOptions::FromEnvironment());
}

std::optional<CudaBackendCounters> GetCudaBackendCounters(const KeyCacheBackend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  if (cuda == nullptr) return std::nullopt;
  return cuda->counters();
}

}  // namespace indexer::engine
